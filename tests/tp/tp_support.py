"""Shared pieces of the tensor-parallel tests: a random checkpoint whose head counts do not
divide by 4, the per-rank program run under torch.distributed (gloo, spawned processes) with
the shared paged driver (tests/paged_runner.py), and the per-rank parameter count the sharding
rules allow, computed from the config alone."""

from __future__ import annotations

import json
import os
import socket
from datetime import timedelta
from pathlib import Path

import torch

from engine.model_config import HybridModelConfig
from engine.models.registry import parse_model_config
from paged_runner import PagedRunner, Request

EMBEDDED_MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "tiny-granite-hybrid"

# 2 KV heads and 2 Mamba groups: split at tp=2, replicated (one per rank) at tp=4, so the
# gated RMSNorm's groups span ranks at tp=4. Vocabulary 97 splits unevenly. Biases everywhere,
# RoPE, tied embeddings.
RANDOM_CONFIG = dict(
    model_type="granitemoehybrid",
    vocab_size=97,
    hidden_size=64,
    num_hidden_layers=4,
    layer_types=["attention", "mamba", "mamba", "attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    attention_bias=True,
    attention_multiplier=0.15,
    position_embedding_type="rope",
    rope_parameters={"rope_type": "default", "rope_theta": 500.0},
    shared_intermediate_size=96,
    num_local_experts=0,
    mamba_n_heads=8,
    mamba_n_groups=2,
    mamba_d_state=16,
    mamba_d_conv=3,
    mamba_expand=2,
    mamba_chunk_size=16,
    mamba_proj_bias=True,
    mamba_conv_bias=True,
    embedding_multiplier=6.0,
    residual_multiplier=0.5,
    logits_scaling=2.5,
    tie_word_embeddings=True,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)

NUM_PROMPTS = 24
DECODE_STEPS = 4
BLOCK_SIZE = 8


def write_random_checkpoint(directory: Path, raw: dict, seed: int = 0) -> Path:
    """config.json and model.safetensors of a seeded random model with `raw`'s architecture."""
    from safetensors.torch import save_file

    from engine.models.registry import build_model

    directory.mkdir(parents=True, exist_ok=True)
    model = build_model(parse_model_config(raw))
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=generator)
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            value = 1.0 + 0.3 * noise
        elif name.endswith("dt_bias"):
            value = 0.7 * noise
        elif name.endswith("A_log"):
            value = torch.log(torch.rand(param.shape, generator=generator) * 8 + 0.5)
        elif name.endswith(".D"):
            value = noise
        else:
            value = 0.1 * noise
        tensors[name if name == "lm_head.weight" else f"model.{name}"] = value.contiguous()
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(raw))
    return directory


def prompts(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1234)
    lengths = torch.randint(2, 15, (NUM_PROMPTS,), generator=generator).tolist()
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def greedy(model, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """All prompts batched: one prefill step, then DECODE_STEPS decode steps, greedy.
    Returns tokens (steps, R) and the last-token logits (steps, R, vocab)."""
    batch_prompts = prompts(vocab_size)
    runner = PagedRunner(model, num_blocks=4 * NUM_PROMPTS, block_size=BLOCK_SIZE, num_slots=NUM_PROMPTS)
    requests = [Request(state_slot=i) for i in range(NUM_PROMPTS)]
    work = list(zip(requests, batch_prompts))
    all_logits, all_tokens = [], []
    for _ in range(1 + DECODE_STEPS):
        last = torch.stack([chunk[-1] for chunk in runner.step(work)])  # (R, V)
        tokens = last.argmax(-1)
        all_logits.append(last)
        all_tokens.append(tokens)
        work = [(request, [int(t)]) for request, t in zip(requests, tokens)]
    return torch.stack(all_tokens), torch.stack(all_logits)


def stop_and_continue(model, vocab_size: int, stop: int = 13) -> dict:
    """One prompt run whole; and run to `stop`, then continued from a copied slot and from a
    captured-then-restored state (this rank's shard). Returns the three (len, vocab) logits
    and the captured per-layer state shapes."""
    generator = torch.Generator().manual_seed(99)
    prompt = torch.randint(0, vocab_size, (30,), generator=generator).tolist()
    runner = PagedRunner(model, num_blocks=16, block_size=BLOCK_SIZE, num_slots=4)
    whole = runner.step([(Request(state_slot=0), prompt)])[0]
    first = Request(state_slot=1)
    head = runner.step([(first, prompt[:stop])])[0]
    runner.caches.copy_state_slot(1, 2)
    captured = runner.caches.read_state_slot(1)
    for layer in runner.caches.conv_state:  # scribble the source: continuations read copies only
        runner.caches.conv_state[layer][1].normal_()
        runner.caches.ssm_state[layer][1].normal_()
    copied = Request(state_slot=2, block_table=list(first.block_table), num_computed=stop)
    tail_copied = runner.step([(copied, prompt[stop:])])[0]
    runner.caches.write_state_slot(3, captured)
    restored = Request(state_slot=3, block_table=list(first.block_table), num_computed=stop)
    tail_restored = runner.step([(restored, prompt[stop:])])[0]
    return {
        "whole": whole,
        "copied": torch.cat([head, tail_copied]),
        "restored": torch.cat([head, tail_restored]),
        "state_shapes": {layer: (tuple(c.shape), tuple(s.shape)) for layer, (c, s) in captured.items()},
    }


def run_model(model_dir: Path, tp) -> dict:
    """Everything one rank reports for one model."""
    from engine.execution.loader import load_model

    model, config = load_model(model_dir, tp=tp)
    tokens, logits = greedy(model, config.vocab_size)
    return {
        "num_elements": sum(p.numel() for p in model.parameters()),
        "kv_bytes_per_block": model.kv_bytes_per_block(BLOCK_SIZE),
        "state_bytes_per_slot": model.state_bytes_per_slot(),
        "tokens": tokens,
        "logits": logits,
        **stop_and_continue(model, config.vocab_size),
    }


def run_rank(rank: int, world_size: int, port: int, model_dirs: dict[str, str], out_dir: str) -> None:
    """Entry point of one spawned rank: join the gloo group, run every model, save results."""
    import torch.distributed as dist

    from engine.parallel.tensor_parallel import TensorParallel

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
        timeout=timedelta(seconds=120),
    )
    try:
        tp = TensorParallel(rank=rank, world_size=world_size)
        for name, model_dir in model_dirs.items():
            torch.save(run_model(Path(model_dir), tp), os.path.join(out_dir, f"{name}.rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(world_size: int, model_dirs: dict[str, Path], out_dir: Path) -> dict[str, list[dict]]:
    """Spawn world_size ranks; model name -> every rank's results."""
    import torch.multiprocessing as mp

    out_dir.mkdir(parents=True, exist_ok=True)
    dirs = {name: str(path) for name, path in model_dirs.items()}
    mp.start_processes(
        run_rank, args=(world_size, free_port(), dirs, str(out_dir)), nprocs=world_size,
        join=True, start_method="spawn",
    )
    return {
        name: [torch.load(out_dir / f"{name}.rank{r}.pt") for r in range(world_size)]
        for name in model_dirs
    }


def expected_rank_elements(config: HybridModelConfig, world: int, rank: int) -> int:
    """Parameter elements rank `rank` of `world` may hold, from the config alone: split pieces
    divided by world; replicated ones counted whole (RMSNorm weights, row-parallel biases, and
    one KV head / Mamba group per rank when there are fewer than ranks)."""
    c, D = config, config.hidden_size
    per_rank = -(-c.vocab_size // world)
    vocab_rows = min(c.vocab_size, (rank + 1) * per_rank) - min(c.vocab_size, rank * per_rank)
    total = vocab_rows * D * (1 if c.tie_word_embeddings else 2) + D  # embeddings, final norm
    for kind in c.layer_types:
        total += 2 * D + 3 * D * (c.shared_intermediate_size // world)  # norms, MLP
        if kind == "attention":
            q = c.num_attention_heads // world * c.head_dim
            kv_heads = c.num_key_value_heads // world if c.num_key_value_heads % world == 0 else 1
            kv = kv_heads * c.head_dim
            total += 2 * q * D + 2 * kv * D
            if c.attention_bias:
                total += q + 2 * kv + D  # q, k, v bias split; o bias replicated
        else:
            heads = c.mamba_n_heads // world
            groups = c.mamba_n_groups // world if c.mamba_n_groups % world == 0 else 1
            inner, bc = heads * c.mamba_d_head, 2 * groups * c.mamba_d_state
            projection = 2 * inner + bc + heads
            total += projection * D + inner * D  # in_proj, out_proj
            total += (inner + bc) * c.mamba_d_conv + 3 * heads + inner  # conv, dt/A/D, norm
            if c.mamba_conv_bias:
                total += inner + bc
            if c.mamba_proj_bias:
                total += projection + D  # in_proj bias split; out_proj bias replicated
    return total
