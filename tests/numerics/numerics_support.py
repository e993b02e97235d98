"""Shared pieces of the numerics tests: tiny random GraniteMoeHybrid references built with
transformers, and a small driver that runs our model the way the engine does (paged KV blocks
from a shuffled pool, one state slot per request, chunks of any size in one ForwardBatch)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

from engine.execution.loader import load_model
from paged_runner import PagedRunner, Request  # noqa: F401  (re-exported for the tests)
from engine.model_config import HybridModelConfig
from engine.models.granite_moe_hybrid import GraniteMoeHybridModel

# Non-trivial multipliers everywhere, so a multiplier applied in the wrong place shows.
_COMMON = dict(
    vocab_size=97,
    hidden_size=64,
    shared_intermediate_size=96,
    num_local_experts=0,
    mamba_d_state=16,
    mamba_chunk_size=16,
    embedding_multiplier=6.0,
    residual_multiplier=0.5,
    logits_scaling=2.5,
    initializer_range=0.1,
    max_position_embeddings=256,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)

TINY_CONFIGS: dict[str, dict] = {
    "nope_mamba_heavy": dict(
        _COMMON,
        num_hidden_layers=5,
        layer_types=["mamba", "mamba", "attention", "mamba", "mamba"],
        position_embedding_type=None,
        num_attention_heads=4,
        num_key_value_heads=4,
        attention_multiplier=0.2,
        mamba_n_heads=8,
        mamba_n_groups=1,
        mamba_d_conv=4,
    ),
    "rope_gqa": dict(
        _COMMON,
        num_hidden_layers=4,
        layer_types=["attention", "mamba", "attention", "mamba"],
        position_embedding_type="rope",
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_multiplier=0.15,
        attention_bias=True,
        mamba_n_heads=4,
        mamba_n_groups=2,
        mamba_d_conv=3,
        mamba_proj_bias=True,
        tie_word_embeddings=True,
    ),
}

# Only for one-chunk logits: transformers clamps dt in its chunked scan but not in its
# single-token decode step, so a binding time_step_limit is not compared through generate().
CLAMPED_DT_CONFIG = dict(TINY_CONFIGS["nope_mamba_heavy"], time_step_limit=(0.05, 0.6))


@dataclass
class Case:
    """A reference model and the same weights loaded into ours."""

    name: str
    reference: GraniteMoeHybridForCausalLM
    model: GraniteMoeHybridModel
    config: HybridModelConfig
    model_dir: Path

    def prompt(self, length: int, seed: int) -> list[int]:
        generator = torch.Generator().manual_seed(seed)
        return torch.randint(0, self.config.vocab_size, (length,), generator=generator).tolist()

    @torch.no_grad()
    def reference_logits(self, token_ids: list[int]) -> torch.Tensor:
        """(len, vocab) fp32 logits of one full forward of transformers' model."""
        return self.reference(torch.tensor([token_ids])).logits[0].float()


def build_random_case(name: str, hf_kwargs: dict, directory: Path, seed: int = 0) -> Case:
    """A seeded random transformers model (fp32, eager attention) saved as safetensors and loaded."""
    torch.manual_seed(seed)
    config = GraniteMoeHybridConfig(**hf_kwargs, attn_implementation="eager")
    reference = GraniteMoeHybridForCausalLM(config).eval()
    _perturb_constant_init(reference, seed)
    reference.save_pretrained(directory)
    model, model_config = load_model(directory)
    return Case(name, reference, model, model_config, Path(directory))


def load_case(name: str, directory: Path) -> Case:
    """A checkpoint directory loaded both by transformers (fp32, eager) and by us (fp32)."""
    reference = GraniteMoeHybridForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    model, model_config = load_model(directory)
    return Case(name, reference, model, model_config, Path(directory))


@torch.no_grad()
def _perturb_constant_init(reference: GraniteMoeHybridForCausalLM, seed: int) -> None:
    """transformers initialises norms to 1, dt_bias and D to 1 and A_log to log(1..H); randomise
    them so that per-head or per-channel mistakes change the output."""
    generator = torch.Generator().manual_seed(seed + 1)
    for name, param in reference.named_parameters():
        noise = torch.randn(param.shape, generator=generator)
        if name.endswith("norm.weight"):
            param.copy_(1.0 + 0.3 * noise)
        elif name.endswith("dt_bias"):
            param.copy_(0.7 * noise)
        elif name.endswith("A_log"):
            param.copy_(torch.log(torch.rand(param.shape, generator=generator) * 8 + 0.5))
        elif name.endswith(".D"):
            param.copy_(noise)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max|a - b| / max|b|."""
    return float((actual.float() - expected.float()).abs().max() / expected.float().abs().max())


