"""Roofline rows for every supported model family (issue 22), on one GPU, in one process.

For each family: a ~1-3B configuration written by transformers' own config class (so
config.json is spelled as transformers writes it) with random bf16 weights named as
transformers names them, loaded by the engine's loader into engine.worker.Worker, then

  * decode tokens/s at batch 1 and 64 with 1,024 tokens of context, through the worker's CUDA
    graphs, against the bytes a step must move at the device-to-device copy rate, with one
    more step's torch.profiler summary (its top kernels: where a low ratio goes);
  * a cold prefill of 4,096 tokens (time to the sampled token) against its matmul FLOPs at the
    bf16 matmul rate: the linear layers' active parameters (a routed expert's weights count
    top_k / num_experts times) and causal attention; the recurrent scans are left out of the
    floor, so the ratio understates the prefill's efficiency a little.

The floors are measured in the same run (roofline/floors.py); the ratio is floor / measured
(1.0: at the hardware's limit). A family that fails to load or run is reported with its error
and the next one runs.

    python benchmarks/family_roofline.py --out benchmarks/results/family_roofline.json
    python benchmarks/family_roofline.py --out /tmp/f.json --families nemotron_h bamba
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
import traceback
from pathlib import Path

import torch

from engine.engine_config import EngineConfig
from engine.execution.worker import Worker
from harness import add_out_argument, write_result
from roofline.decode_rows import decode_row
from roofline.floors import measure_copy_bandwidth, measure_matmul_rate
from roofline.model import BLOCK_SIZE, sized_config
from roofline.prefill_rows import bench_prefill

DECODE_BATCHES = (1, 64)
CONTEXT = 1024
PREFILL_TOKENS = 4096
VOCAB = 49152


def _every(n: int, period: int, hit: str, miss: str) -> list[str]:
    return [hit if i % period == period - 1 else miss for i in range(n)]


def family_configs() -> dict[str, tuple[str, dict]]:
    """Family -> (transformers config class name, its keyword arguments): ~1-3B each."""
    common = dict(vocab_size=VOCAB, hidden_size=2048, num_attention_heads=16, num_key_value_heads=4,
                  max_position_embeddings=16384, tie_word_embeddings=True, eos_token_id=0,
                  pad_token_id=1, bos_token_id=None)
    mamba = dict(mamba_n_heads=64, mamba_d_head=64, mamba_d_state=128, mamba_n_groups=1,
                 mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=256)
    return {
        "granitemoehybrid (experts)": ("GraniteMoeHybridConfig", dict(
            common, hidden_size=1536, num_attention_heads=12, num_key_value_heads=4,
            num_hidden_layers=24, layer_types=_every(24, 6, "attention", "mamba"),
            num_local_experts=32, num_experts_per_tok=6, intermediate_size=512,
            shared_intermediate_size=1024, mamba_n_heads=48, mamba_d_head=64, mamba_d_state=128,
            mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=256,
            position_embedding_type="nope")),
        "nemotron_h": ("NemotronHConfig", dict(  # transformers' Nemotron-H never ties them
            common, tie_word_embeddings=False, head_dim=128, intermediate_size=8192,
            layers_block_type=["mamba", "mlp"] * 4 + ["mamba", "attention", "mamba", "mlp"] * 4,
            mamba_num_heads=64, mamba_head_dim=64, ssm_state_size=128, n_groups=8, expand=2,
            conv_kernel=4, chunk_size=256)),
        "bamba": ("BambaConfig", dict(
            common, num_hidden_layers=24, intermediate_size=5632,
            attn_layer_indices=[5, 11, 17, 23], **mamba)),
        "falcon_h1": ("FalconH1Config", dict(
            common, num_hidden_layers=20, intermediate_size=4096, mamba_d_ssm=4096, **mamba)),
        "qwen3_next": ("Qwen3NextConfig", dict(
            common, num_hidden_layers=24, num_key_value_heads=2, head_dim=128,
            layer_types=_every(24, 4, "full_attention", "linear_attention"),
            linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=64,
            linear_value_head_dim=64, linear_conv_kernel_dim=4, num_experts=32,
            num_experts_per_tok=4, moe_intermediate_size=512, shared_expert_intermediate_size=1024,
            intermediate_size=4096, decoder_sparse_step=1)),
    }


def write_family_checkpoint(config_class: str, kwargs: dict, model_dir: Path) -> None:
    """The family's transformers model built on the GPU in bf16, its weights redrawn from seed
    0 (log-uniform A, dt_bias the inverse softplus of a log-uniform dt, norms at 1, biases at
    0, the rest N(0, 0.02)), saved with save_pretrained: config.json and tensor names exactly
    as transformers writes them."""
    import transformers

    config = getattr(transformers, config_class)(**kwargs)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "A_log":
                t = torch.log(torch.empty(p.shape, device="cuda").uniform_(1, 16, generator=g))
            elif leaf == "dt_bias":
                dt = torch.exp(torch.empty(p.shape, device="cuda").uniform_(math.log(1e-3), math.log(1e-1), generator=g))
                t = dt + torch.log(-torch.expm1(-dt))
            elif leaf == "D" or "norm" in name:
                t = torch.ones(p.shape, device="cuda")
            elif leaf == "bias":
                t = torch.zeros(p.shape, device="cuda")
            else:
                t = torch.randn(p.shape, device="cuda", generator=g) * 0.02
            p.copy_(t)
    model.save_pretrained(model_dir)
    del model
    torch.cuda.empty_cache()


def active_body_parameters(model: torch.nn.Module, kwargs: dict) -> int:
    """Parameters a token multiplies by, outside the embedding and LM head: routed experts'
    weights (names with "experts", not the shared expert's) count top_k / num_experts of them."""
    experts = kwargs.get("num_local_experts") or kwargs.get("num_experts") or 0
    share = kwargs.get("num_experts_per_tok", 0) / experts if experts else 1.0
    total = 0
    for name, p in model.named_parameters():
        if "embed" in name or "lm_head" in name:
            continue
        routed = "shared" not in name and (".experts." in name or (p.dim() >= 3 and p.shape[0] == experts))
        total += int(p.numel() * (share if routed else 1.0))
    return total


def prefill_flops(model: torch.nn.Module, active: int, num_tokens: int) -> float:
    """Linear layers over the active parameters, causal attention (QK^T and PV, half each),
    one LM-head row; the recurrent scans are not counted."""
    config = model.config
    attention = len(config.attention_layers) * 2 * num_tokens**2 * config.num_attention_heads * config.head_dim
    return 2 * num_tokens * active + attention + 2 * config.hidden_size * config.vocab_size


def family_rows(name: str, config_class: str, kwargs: dict, copy_bw: float, matmul: float, tmp: Path) -> dict:
    started = time.perf_counter()
    model_dir = tmp / name.split()[0]
    write_family_checkpoint(config_class, kwargs, model_dir)
    num_requests = 1 + sum(DECODE_BATCHES)
    blocks_per_seq = -(-max(PREFILL_TOKENS, CONTEXT + 512) // BLOCK_SIZE)
    probe = EngineConfig(model_dir=str(model_dir), dtype="bfloat16", device="cuda")
    worker = Worker(sized_config(probe, num_requests, blocks_per_seq))
    parameters = sum(p.numel() for p in worker.model.parameters())
    active = active_body_parameters(worker.model, kwargs)
    ttft, _ = bench_prefill(worker, PREFILL_TOKENS, slot=0, blocks_per_seq=blocks_per_seq)
    flops = prefill_flops(worker.model, active, PREFILL_TOKENS)
    rows = [{"name": f"cold prefill {PREFILL_TOKENS} (TTFT)", "seconds": ttft, "flops": flops,
             "floor_seconds": flops / matmul, "ratio_to_floor": flops / matmul / ttft,
             "tokens_per_s": PREFILL_TOKENS / ttft}]
    first = 1
    for batch in DECODE_BATCHES:
        row = decode_row(worker, "graphs", first, batch, CONTEXT, blocks_per_seq, copy_bw)
        rows.append({k: row[k] for k in ("name", "seconds", "floor_seconds", "ratio_to_floor", "bytes", "tokens_per_s",
                                         "profile")})
        first += batch
    del worker
    torch.cuda.empty_cache()
    return {"family": name, "parameters": parameters, "active_body_parameters": active,
            "rows": rows, "seconds": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_out_argument(parser, "family_roofline")
    parser.add_argument("--families", nargs="+", default=None, help="family names (default: all)")
    args = parser.parse_args()
    copy_bw, matmul = measure_copy_bandwidth(), measure_matmul_rate()
    report: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "floors": {"copy_bytes_per_s": copy_bw, "matmul_flop_per_s": matmul}, "families": []}
    print(f"copy {copy_bw / 1e12:.2f} TB/s (read+write)  matmul {matmul / 1e12:.0f} TFLOP/s", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name, (config_class, kwargs) in family_configs().items():
            if args.families and name.split()[0] not in args.families:
                continue
            try:
                result = family_rows(name, config_class, kwargs, copy_bw, matmul, Path(tmp))
            except Exception as exc:  # reported; the next family still runs
                traceback.print_exc()
                result = {"family": name, "error": f"{type(exc).__name__}: {exc}"}
            report["families"].append(result)
            write_result(args.out, "family_roofline", report)
            for row in result.get("rows", []):
                print(f"{name:28s} {row['name']:32s} {row['seconds'] * 1e3:9.3f} ms  "
                      f"ratio to floor {row['ratio_to_floor']:.2f}  {row['tokens_per_s']:,.0f} tok/s", flush=True)
            if "error" in result:
                print(f"{name:28s} ERROR {result['error']}", flush=True)


if __name__ == "__main__":
    main()
