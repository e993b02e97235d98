"""GPU kernels (Triton) for the model's CUDA path.

Each kernel has a pure-PyTorch reference in engine/kernels/*_reference.py and a device test in
tests/gpu/. Nothing here is imported on the CPU path: layers reach these modules only when the
model's forward pass runs on CUDA tensors (see engine/kernels/gpu/batch_plan.py).
"""
