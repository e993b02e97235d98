"""The numerical kernels: pure-PyTorch references here (*_reference.py, the CPU path and what
the device tests compare against), Triton kernels and the per-step GPU batch plan in gpu/.

May import interfaces/ and parallel/ only: never layers/, models/, speculation or execution.
"""
