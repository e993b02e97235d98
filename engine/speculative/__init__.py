"""Speculative decoding with exact state rollback (docs/design.md section 10).

    ngram.py       the n-gram prompt-lookup drafter (no extra weights, every family)
    scheduling.py  the scheduler's side: which requests draft, the greedy acceptance rule,
                   the commits of kept positions, trimming at stops, the counters
    verify.py      the worker's side: the verification route, the per-position states of
                   the recurrent mixers in scratch state slots, the commit of the kept one
"""
