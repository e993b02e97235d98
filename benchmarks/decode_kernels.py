"""Decode-step kernels of the 1.5B config on one GPU, each over a sweep of its launch shape.

The SSD decode update (engine/kernels/gpu/ssd.py:ssd_decode_update) reads and writes every
sequence's fp32 state (64 heads x 64 x 128 = 2 MiB per layer): at batch 64 it is the largest
kernel of a decode step. A Mamba layer's decode step runs either the conv pair and that update
(three launches) or the fused conv + SSD kernel and the conv window shift
(engine/kernels/gpu/mamba_decode.py, two launches): both are timed, the fused one over its
tile and warp counts. Paged decode attention
(engine/kernels/gpu/paged_attention.py:paged_attention_decode) over 1,024 keys is latency bound
at small batches. For each batch size this prints the time of each launch shape and, for the
SSD update, the bytes it must move over that time as a share of the device-to-device copy
bandwidth measured in the same run. Times are the median of CUDA-graph replays of 20
back-to-back calls (launch gaps as in the engine's decode graphs), divided by 20. The Mamba
layer rows give each of the 20 calls its own conv and SSD state, as the model's 20 Mamba
layers have: the fused kernel loads its old state before its PDL wait, which
engine/kernels/gpu/pdl.py allows only because no kernel ahead of it in a forward pass writes
that state, so back-to-back calls on one state would race.

    python benchmarks/decode_kernels.py --out benchmarks/results/decode_kernels.json
"""

from __future__ import annotations

import argparse

import torch

from gpu_timing import graph_seconds
from harness import add_out_argument, write_result
from roofline.floors import measure_copy_bandwidth

H, P, N, G = 64, 64, 128, 1  # Mamba2 heads, head dim, state size, groups
Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 16, 4, 128, 16
BATCHES = (1, 16, 64)
CONTEXT = 1024
CALLS = 20  # back-to-back calls in each timed graph, one Mamba layer's state each


def ssd_rows(copy_bw: float) -> list[dict]:
    from engine.kernels.gpu.ssd import decode_block_p, ssd_decode_update

    rows = []
    for batch in BATCHES:
        x = torch.randn(batch, H, P, device="cuda", dtype=torch.bfloat16)
        dt = torch.randn(batch, H, device="cuda", dtype=torch.bfloat16)
        bc = torch.randn(batch, 2, G, N, device="cuda", dtype=torch.bfloat16)
        dt_bias, a_log = torch.zeros(H, device="cuda"), torch.zeros(H, device="cuda")
        state = torch.randn(batch + 1, H, P, N, device="cuda")
        y = torch.empty(batch, H, P, device="cuda")
        rows_t = torch.arange(batch, device="cuda")
        reset = torch.zeros(batch, dtype=torch.int64, device="cuda")
        moved = 2 * batch * H * P * N * 4  # state read and written
        for block_p in (8, 16, 32, 64):
            for warps in (1, 2, 4, 8):
                seconds = graph_seconds(lambda _: ssd_decode_update(
                    x, dt, dt_bias, a_log, (0.0, float("inf")), bc[:, 0], bc[:, 1], state, y,
                    rows_t, rows_t, reset, block_p=block_p, num_warps=warps), calls=CALLS)
                rows.append({"kernel": "ssd_decode_update", "batch": batch, "block_p": block_p,
                             "num_warps": warps, "default": block_p == decode_block_p(P) and warps == 4,
                             "seconds": seconds, "share_of_copy_rate": moved / seconds / copy_bw})
    return rows


def mamba_decode_rows(copy_bw: float) -> list[dict]:
    """One Mamba layer's decode step before the gated norm: the unfused three launches vs the
    fused conv + SSD kernel and the conv window shift, per batch size."""
    from engine.kernels.gpu.conv import advance_conv_states, causal_conv1d_varlen
    from engine.kernels.gpu.mamba_decode import conv_ssd_decode
    from engine.kernels.gpu.ssd import decode_block_p, ssd_decode_update
    from engine.kernels.gpu.batch_plan import FUSED_DECODE_MAX_ROWS

    conv_dim, width = H * P + 2 * G * N, 4
    rows = []
    for batch in BATCHES:
        xbc = torch.randn(batch, conv_dim, device="cuda", dtype=torch.bfloat16)
        dt = torch.randn(batch, H, device="cuda", dtype=torch.bfloat16)
        weight = torch.randn(conv_dim, width, device="cuda", dtype=torch.bfloat16)
        bias = torch.randn(conv_dim, device="cuda", dtype=torch.bfloat16)
        dt_bias, a_log = torch.zeros(H, device="cuda"), torch.zeros(H, device="cuda")
        # one (conv, SSD) state per call of a graph, as one per Mamba layer (module docstring)
        layers = [(torch.randn(batch + 1, conv_dim, width - 1, device="cuda", dtype=torch.bfloat16),
                   torch.randn(batch + 1, H, P, N, device="cuda")) for _ in range(CALLS)]
        conv_out = torch.empty_like(xbc)
        x_out = torch.empty(batch, H, P, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(batch, H, P, device="cuda")
        rows_t = torch.arange(batch, device="cuda")
        cu = torch.arange(batch + 1, device="cuda")
        reset = torch.zeros(batch, dtype=torch.int64, device="cuda")
        moved = 2 * batch * H * P * N * 4
        limits = (0.0, float("inf"))

        def unfused(layer):
            conv_state, state = layers[layer]
            causal_conv1d_varlen(xbc, conv_state, weight, bias, cu, rows_t, reset, rows_t,
                                 apply_silu=True, out=conv_out)
            x, b, c = conv_out.split([H * P, G * N, G * N], dim=-1)
            ssd_decode_update(x.view(batch, H, P), dt, dt_bias, a_log, limits, b.view(batch, G, N),
                              c.view(batch, G, N), state, y, rows_t, rows_t, reset)

        seconds = graph_seconds(unfused, calls=CALLS)
        fused_here = batch <= FUSED_DECODE_MAX_ROWS  # what the engine runs at this batch size
        rows.append({"kernel": "mamba decode, unfused", "batch": batch, "block_p": decode_block_p(P),
                     "num_warps": 4, "default": not fused_here, "seconds": seconds,
                     "share_of_copy_rate": moved / seconds / copy_bw})
        for block_p in (16, 32, 64):
            for warps in (4, 8):
                def fused(layer):
                    conv_state, state = layers[layer]
                    conv_ssd_decode(xbc, dt, conv_state, weight, bias, dt_bias, a_log, limits, state,
                                    x_out, y, rows_t, rows_t, reset, block_p=block_p, num_warps=warps)
                    advance_conv_states(xbc, conv_state, cu, rows_t, reset)

                seconds = graph_seconds(fused, calls=CALLS)
                rows.append({"kernel": "mamba decode, fused", "batch": batch, "block_p": block_p,
                             "num_warps": warps,
                             "default": fused_here and block_p == decode_block_p(P) and warps == 4,
                             "seconds": seconds, "share_of_copy_rate": moved / seconds / copy_bw})
    return rows


def attention_rows() -> list[dict]:
    from engine.kernels.gpu.paged_attention import decode_splits, paged_attention_decode

    rows = []
    for batch in BATCHES:
        blocks = CONTEXT // BLOCK_SIZE
        cache = torch.randn(2, batch * blocks + 1, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device="cuda",
                            dtype=torch.bfloat16)
        table = torch.randperm(batch * blocks, device="cuda").view(batch, blocks)
        query = torch.randn(batch, Q_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(query)
        rows_t = torch.arange(batch, device="cuda")
        lens = torch.full((batch,), CONTEXT, device="cuda")
        auto = decode_splits(batch, KV_HEADS)
        for splits in sorted({1, 2, 4, 8, 16, auto}):
            seconds = graph_seconds(lambda _: paged_attention_decode(
                query, cache[0], cache[1], out, rows_t, lens, table, HEAD_DIM**-0.5, num_splits=splits),
                calls=CALLS)
            rows.append({"kernel": "paged_attention_decode", "batch": batch, "num_splits": splits,
                         "default": splits == auto, "seconds": seconds})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_out_argument(parser, "decode_kernels")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_kernels.py needs a CUDA device")
    copy_bw = measure_copy_bandwidth()
    rows = ssd_rows(copy_bw) + mamba_decode_rows(copy_bw) + attention_rows()
    print(f"copy {copy_bw / 1e12:.2f} TB/s (read+write)")
    print(f"{'kernel':<24}{'batch':>6}{'shape':>22}{'us':>10}{'copy share':>12}")
    for r in rows:
        shape = (f"block_p {r['block_p']} warps {r['num_warps']}" if "block_p" in r
                 else f"splits {r['num_splits']}")
        share = f"{r['share_of_copy_rate']:>12.2f}" if "share_of_copy_rate" in r else f"{'-':>12}"
        mark = " *" if r["default"] else ""
        print(f"{r['kernel']:<24}{r['batch']:>6}{shape:>22}{r['seconds'] * 1e6:>10.1f}{share}{mark}")
    report = {"device": torch.cuda.get_device_name(), "copy_bytes_per_s": copy_bw, "rows": rows}
    out = write_result(args.out, "decode_kernels", report)
    print(f"wrote {out} (* = the engine's default)")


if __name__ == "__main__":
    main()
