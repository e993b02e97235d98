"""Whether a configuration's speculative decoding can run on a model, decided from the parsed
config.json (and whether the model dir holds a trained MTP head): what the worker refuses when
it starts (engine/execution/worker.py), callable at deploy time (deployments/app.py
check_engine_config), so that Serve never restarts a replica that can only fail. Config-only
refusals (k out of range, a random head without the mtp drafter) are EngineConfig's own.
"""

from __future__ import annotations

from pathlib import Path

from engine.engine_config import EngineConfig
from engine.model_config import HybridModelConfig
from engine.models import bamba, granite_moe_hybrid
from engine.speculative.policy import TRAINED_HEAD_FILE
from engine.speculative.verify import check_verifiable

# The families random_mtp_head_seed builds a random MTP head for: those whose model is
# GraniteMoeHybridModel (its random_mtp_head).
RANDOM_MTP_HEAD_FAMILIES = (granite_moe_hybrid.MODEL_TYPE, bamba.MODEL_TYPE)


def check_speculation(config: EngineConfig, model_config: HybridModelConfig) -> None:
    """ValueError naming the key when config's speculative decoding cannot run on this model:
    a layer kind that cannot verify drafts (the same kinds on the CPU and on CUDA), or the mtp
    drafter without exactly one MTP layer to run. Nothing to check with speculation off."""
    if not config.num_speculative_tokens:
        return
    check_verifiable(model_config.layer_types)
    if config.speculative_drafter == "mtp":
        check_mtp_head(config, model_config)


def check_mtp_head(config: EngineConfig, model_config: HybridModelConfig) -> None:
    """ValueError naming the key unless the mtp drafter has one MTP layer to run: the
    checkpoint's own (mtp.* weights), a random head from random_mtp_head_seed, or a trained
    head in the model dir (TRAINED_HEAD_FILE, benchmarks/train_mtp_head.py), the last two on a
    family that builds one and has none of its own."""
    own_layers = model_config.num_mtp_layers
    trained = (Path(config.model_dir) / TRAINED_HEAD_FILE).exists()
    if config.random_mtp_head_seed is not None or (trained and not own_layers):
        key = "random_mtp_head_seed" if config.random_mtp_head_seed is not None else TRAINED_HEAD_FILE
        if own_layers:
            raise ValueError(f"{key}: this model has its own MTP head (mtp.* weights); unset it")
        if model_config.model_type not in RANDOM_MTP_HEAD_FAMILIES:
            raise ValueError(f"{key}: MTP heads of this kind are built for GraniteMoeHybrid and "
                             f"Bamba models only, not {model_config.model_type}")
        return
    if not own_layers:
        raise ValueError(
            "speculative_drafter mtp: this model has no multi-token-prediction head (no mtp.* "
            "weights); use speculative_drafter ngram (or random_mtp_head_seed for benchmarks)")
    if own_layers != 1:
        raise ValueError(f"speculative_drafter mtp runs one MTP layer; this model has {own_layers}")
