"""The H200's limits the roofline divides by, measured in the same run, the formulas that turn
a workload into a floor time, and the targets each row is held to.

A row's ratio to its floor is floor time / measured time (1.0: at the hardware's limit): a
cold prefill against its matmul FLOPs at the bf16 matmul rate, a decode step against the bytes
it must move at the device-to-device copy rate.
"""

from __future__ import annotations

import torch

from gpu_timing import cuda_seconds

# The targets of issue 5. Ratios to the floor (at least): the cold prefill, and decode at
# batch 1 and 64 (no target for the other batch sizes).
COLD_PREFILL_TARGET = 0.40
DECODE_TARGETS = {1: 0.60, 64: 0.50}
# Restore + prefill of the user message: speed-up over the cold prefill of all its tokens
# (at least). Capture during the prefill: time over the same prefill without it (at most).
RESTORE_SPEEDUP_TARGET = 15.0
CAPTURE_OVERHEAD_TARGET = 1.03


def measure_copy_bandwidth(num_bytes: int = 2 << 30) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read plus bytes written."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    return 2 * num_bytes / cuda_seconds(lambda: dst.copy_(src), repeats=10)


def measure_matmul_rate(n: int = 8192) -> float:
    """FLOP/s of an n x n x n bf16 matmul on random data."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    return 2 * n**3 / cuda_seconds(lambda: a @ b, repeats=10)


def prefill_flops(config: dict, params_body: int, num_tokens: int) -> float:
    """Matmul FLOPs of a cold prefill: linear layers, causal attention, SSD chunk scan, one LM row."""
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    n_attn = sum(t == "attention" for t in config["layer_types"])
    n_mamba = len(config["layer_types"]) - n_attn
    heads_dim = config["num_attention_heads"] * (hidden // config["num_attention_heads"])
    linear = 2 * num_tokens * params_body
    attention = n_attn * 2 * num_tokens**2 * heads_dim  # QK^T and PV, causal half each
    H, P, N, L = config["mamba_n_heads"], config["mamba_d_head"], config["mamba_d_state"], 64
    ssd = n_mamba * num_tokens * H * (2 * L * (N + P) + 4 * P * N)
    return linear + attention + ssd + 2 * hidden * vocab


def decode_bytes(model, batch: int, context: int, block_size: int) -> float:
    """Bytes one decode step must move: every weight once, each sequence's state read and
    written, its KV read (`context` tokens)."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    state = 2 * model.state_bytes_per_slot()
    kv = model.kv_bytes_per_block(block_size) / block_size * context
    return weights + batch * (state + kv)


def decode_target(batch: int) -> dict:
    """{"target": ratio} for the batch sizes that have one, else {}."""
    return {"target": DECODE_TARGETS[batch]} if batch in DECODE_TARGETS else {}
