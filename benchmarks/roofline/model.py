"""The model the GPU benchmarks run: a ~1.5B dense GraniteMoeHybrid with random bf16 weights,
written as config.json + safetensors, the engine config sized for a run, and scheduled chunks
built by hand the way the scheduler would."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import torch

from engine.engine_config import EngineConfig
from engine.interfaces.sampling_params import SamplingParams
from engine.interfaces.step_io import ScheduledChunk

BLOCK_SIZE = 16
CONFIG_1P5B = {
    "architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid",
    "hidden_size": 2048, "num_hidden_layers": 24,
    "layer_types": ["attention" if i % 6 == 5 else "mamba" for i in range(24)],
    "num_attention_heads": 16, "num_key_value_heads": 4, "attention_bias": False,
    "attention_multiplier": 0.0078125, "attention_dropout": 0.0,
    "mamba_n_heads": 64, "mamba_d_head": 64, "mamba_d_state": 128, "mamba_n_groups": 1,
    "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 256, "mamba_conv_bias": True,
    "mamba_proj_bias": False, "shared_intermediate_size": 5632, "intermediate_size": 5632,
    "num_local_experts": 0, "num_experts_per_tok": 0, "vocab_size": 49152,
    "max_position_embeddings": 16384, "position_embedding_type": "nope",
    "embedding_multiplier": 12.0, "residual_multiplier": 0.22, "logits_scaling": 8.0,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "hidden_act": "silu",
    "eos_token_id": 0, "pad_token_id": 1, "bos_token_id": None, "torch_dtype": "bfloat16",
}


def write_random_checkpoint(model_dir: Path) -> None:
    """config.json + one safetensors file of random bf16 weights (fp32 for A_log, D, dt_bias),
    drawn on the GPU from seed 0."""
    from safetensors.torch import save_file

    from engine.model_config import HybridModelConfig
    from engine.models.registry import build_model, load_model_config

    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(CONFIG_1P5B))
    config: HybridModelConfig = load_model_config(model_dir)
    with torch.device("meta"):
        shapes = build_model(config, dtype=torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(0)
    tensors = {}
    for name, p in shapes.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "A_log":
            t = torch.log(torch.empty(p.shape, device="cuda").uniform_(1, 16, generator=g))
        elif leaf == "dt_bias":
            dt = torch.exp(torch.empty(p.shape, device="cuda").uniform_(math.log(1e-3), math.log(1e-1), generator=g))
            t = dt + torch.log(-torch.expm1(-dt))  # inverse softplus
        elif leaf == "D" or "norm" in name:
            t = torch.ones(p.shape, device="cuda")
        elif leaf == "bias":
            t = torch.zeros(p.shape, device="cuda")
        else:
            t = torch.randn(p.shape, device="cuda", generator=g) * 0.02
        tensors["model." + name] = t.to(p.dtype).cpu().contiguous()
    save_file(tensors, str(model_dir / "model.safetensors"))


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def write_serving_checkpoint(model_dir: Path) -> None:
    """write_random_checkpoint with the tiny model's tokenizer beside it and the vocabulary cut
    to the tokenizer's (shrink_vocab): the 1.5B model the serving benchmarks (bench_gpu.py,
    spec_decode.py, fp8_kv.py) run through the engine, whose replies decode to text."""
    import shutil

    from engine.engine_config import DEFAULT_MODEL_DIR

    write_random_checkpoint(model_dir)
    for name in TOKENIZER_FILES:
        shutil.copy(DEFAULT_MODEL_DIR / name, model_dir / name)
    shrink_vocab(model_dir, json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())["vocab_size"])


def shrink_vocab(model_dir: Path, vocab: int) -> None:
    """Keep the first `vocab` rows of every vocabulary-sized tensor (the tied embedding) and
    say so in config.json: the random model then samples only ids the tokenizer can decode,
    so replies have text and TTFT is taken at the first non-empty text, as over HTTP. The
    body (24 layers, 2,048 wide) is unchanged; only the LM head's row count shrinks."""
    from safetensors.torch import load_file, save_file

    config = json.loads((model_dir / "config.json").read_text())
    tensors = load_file(str(model_dir / "model.safetensors"))
    tensors = {name: t[:vocab].contiguous() if t.shape[0] == config["vocab_size"] else t
               for name, t in tensors.items()}
    save_file(tensors, str(model_dir / "model.safetensors"))
    (model_dir / "config.json").write_text(json.dumps({**config, "vocab_size": vocab}))


def parameter_counts(model: torch.nn.Module) -> dict[str, int]:
    """Parameters in all, in the embedding, and in the body (all but the embedding)."""
    total = sum(p.numel() for p in model.parameters())
    embed = model.embed_tokens.weight.numel()
    return {"total": total, "embedding": embed, "body": total - embed}


def sized_config(config: EngineConfig, num_requests: int, blocks_per_seq: int) -> EngineConfig:
    """The engine config with KV and state budgets for num_requests sequences of
    blocks_per_seq blocks each (counted as the worker counts them, engine/parallel/cache_capacity.py
    size_caches: the MTP drafter's KV layer included), and 8,192 tokens a step."""
    from engine.parallel import cache_capacity
    from engine.models.registry import load_model_config
    from engine.parallel.tensor_parallel import TensorParallel

    model_config = load_model_config(config.model_dir)
    layout = cache_capacity.rank_shard_layout(model_config, TensorParallel.single())
    dtype = getattr(torch, config.dtype)
    block_bytes = cache_capacity.kv_bytes_per_block(
        model_config, layout, cache_capacity.kv_storage_dtype(config), config.block_size,
        len(cache_capacity.drafter_kv_layers(config, model_config)))
    return replace(
        config,
        max_num_seqs=num_requests,
        max_num_batched_tokens=8192,
        kv_cache_bytes=block_bytes * blocks_per_seq * num_requests,
        state_cache_bytes=cache_capacity.state_bytes_per_slot(model_config, layout, dtype) * num_requests,
    )


def chunk(request: int, tokens, start: int, blocks_per_seq: int, reset: bool, sample: bool = True) -> ScheduledChunk:
    """A greedy chunk of request `request` ("r<request>"): state slot `request`, blocks
    [request * blocks_per_seq, (request + 1) * blocks_per_seq)."""
    first = request * blocks_per_seq
    return ScheduledChunk(
        request_id=f"r{request}", token_ids=tuple(int(t) for t in tokens), start_position=start,
        block_table=tuple(range(first, first + blocks_per_seq)), state_slot=request,
        reset_state=reset, sample=sample, sampling=SamplingParams(temperature=0.0, max_tokens=4096),
    )
