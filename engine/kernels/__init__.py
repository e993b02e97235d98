"""The numerical kernels: pure-PyTorch references here (*_reference.py, the CPU path and what
the device tests compare against; cpu_attention.py, the CPU's fused prefill attention), Triton
kernels and the per-step GPU batch plan in gpu/.

May import interfaces/ and parallel/ only: never layers/, models/, speculation or execution.
"""
