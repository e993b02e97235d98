"""The building blocks of every model: Mamba2 and gated delta-net mixers, paged attention,
MLPs and routed experts, norms, rotary embedding, tensor-parallel linear layers and vocabulary
split, the recurrent mixers' shared PyTorch path over a batch of chunks (recurrent_chunks.py)
and their part of verifying drafts (verification.py). Each layer runs the
pure-PyTorch path on the CPU and the Triton kernels on CUDA.

May import kernels/, parallel/, interfaces/ and the config modules.
"""
