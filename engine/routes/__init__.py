"""How one step's batch reaches the model: eager passes, captured passes and CUDA graphs.

    forward_routes.py  the passes (eager, capturing) and the choice of route for a step
    decode_graphs.py   CUDA graphs of decode-only steps, by batch size
    prefill_graphs.py  CUDA graphs of single-prefill steps, by chunk size
    graph_routes.py    capturing both kinds of graph routes when a worker starts
    cpu_decode.py      decode-only steps on the CPU through the model compiled by torch.compile

May import interfaces/, kernels/ and models/; never execution/ or speculative/.
"""
