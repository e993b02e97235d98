"""Speculative decoding with exact state rollback (docs/design.md section 10).

    checks.py          whether a configuration can speculate on a model
    ngram.py           the n-gram prompt-lookup drafter (no extra weights, every family)
    mtp.py             the MTP drafter, the worker's side (its head is engine/models/mtp_head.py)
    draft_graphs.py    CUDA graphs of the MTP draft depths
    scheduling.py      the scheduler's side: which requests draft, the greedy acceptance rule,
                       the commits of kept positions, trimming at stops, the counters
    verify.py          the worker's side on the CPU: the verification route, scratch state slots,
                       the commit of the kept position
    verify_gpu.py      the verification route on one CUDA device
    verify_graphs.py   CUDA graphs of steps whose every chunk verifies
    worker_setup.py    what speculation adds to a Worker

May import routes/, checkpoints/, models/ and everything below; execution/ and core/ import it.
"""
