"""How the KV blocks store keys and values (EngineConfig.kv_cache_dtype), and the scales of FP8.

    auto       K/V in the model dtype, as the layers compute them.
    fp8_e4m3   K/V as torch.float8_e4m3fn (one byte an element: half of bf16), each divided by
               a static fp32 scale of its KV head and attention layer when written and
               multiplied by it when read (engine/kernels/attention_reference.py quantize_kv,
               dequantize_kv; the Triton kernels do the same). CUDA only, compute capability
               8.9 or later (Triton converts to and from FP8 E4M3 there).

The scales are static: read from SCALES_FILE in the model directory when it is there, else 1.0
(as vLLM does without calibrated scales), and never changed while the engine runs. That is what
keeps checkpoints exact: the bytes stored for a token depend on its K/V and its head's scale
only, never on what else ran before, so a request restored from a checkpoint reads the same
bytes a request computed from scratch writes. Scales measured from the traffic (running
maxima) would make them depend on the batch history, and are not offered.

SCALES_FILE (JSON): {"k_scale": {LAYER: S, ...}, "v_scale": {LAYER: S, ...}}, LAYER a decoder
layer index that is an attention layer (as a string; the MTP drafter's layer is
num_hidden_layers), S one positive number for every KV head of the layer or a list of
num_key_value_heads of them. Layers or kinds left out get 1.0. A checkpoint calibrated elsewhere
(llm-compressor's k_scale / v_scale tensors, per tensor or per KV head) converts to this file
one number or list per layer; a scale is amax / 448 of what the head stores (448 is FP8 E4M3's
largest value; a larger |K / scale| saturates there).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.engine_config import EngineConfig
from engine.model_config import HybridModelConfig
from engine.parallel.shard_layout import RankShardLayout

SCALES_FILE = "kv_cache_scales.json"
FP8_MIN_CAPABILITY = (8, 9)


@dataclass(frozen=True)
class KvCacheFormat:
    """One engine's KV storage: `dtype` of the blocks (None: the model dtype) and, for FP8,
    `scales` (2, L, Hkv) fp32, the key [0] and value [1] scale of every KV head of the model
    (all ranks') in each of its L attention layers, in increasing layer order (the order of
    ModelCaches.kv_stack, drafter layers last)."""

    name: str  # EngineConfig.kv_cache_dtype
    dtype: torch.dtype | None = None
    scales: torch.Tensor | None = None

    @property
    def quantized(self) -> bool:
        return self.scales is not None

    @property
    def dtype_name(self) -> str | None:
        """The blocks' dtype as torch names it ("float8_e4m3fn"), None for the model dtype."""
        return None if self.dtype is None else str(self.dtype).removeprefix("torch.")

    def storage_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype of the KV blocks of a model run in model_dtype."""
        return self.dtype if self.dtype is not None else model_dtype

    def identity(self) -> str:
        """What two engines must share to exchange checkpoints' K/V bytes: "auto", or the FP8
        format with a digest of its scales (another scale of any head stores other bytes)."""
        if self.scales is None:
            return self.name
        digest = hashlib.sha256(self.scales.to(torch.float32).contiguous().numpy().tobytes()).hexdigest()
        return f"{self.name}:{digest[:16]}"

    def rank_scales(self, layout: RankShardLayout) -> torch.Tensor | None:
        """(2, L, Hkv of the rank) fp32: the scales of the KV heads the rank holds
        (layout.kv_heads), or None for unquantized blocks."""
        if self.scales is None:
            return None
        first, end = layout.kv_heads
        return self.scales[:, :, first:end].contiguous()


def kv_storage_dtype(config: EngineConfig) -> torch.dtype:
    """The dtype of the KV blocks config asks for (sizing needs no scales)."""
    return torch.float8_e4m3fn if config.kv_cache_dtype == "fp8_e4m3" else getattr(torch, config.dtype)


def kv_cache_format(
    config: EngineConfig, model_config: HybridModelConfig, drafter_layers: tuple[int, ...] = (),
) -> KvCacheFormat:
    """The KV format of config for the model: for fp8_e4m3 its scales over the attention
    layers and drafter_layers (load_kv_scales). ValueError naming the file for a bad scales
    file."""
    if config.kv_cache_dtype == "auto":
        return KvCacheFormat("auto")
    layers = (*model_config.attention_layers, *drafter_layers)
    scales = load_kv_scales(Path(config.model_dir), layers, model_config.num_key_value_heads)
    return KvCacheFormat(config.kv_cache_dtype, torch.float8_e4m3fn, scales)


def load_kv_scales(model_dir: Path, layers: tuple[int, ...], num_kv_heads: int) -> torch.Tensor:
    """(2, len(layers), num_kv_heads) fp32 from model_dir/SCALES_FILE (format in the module
    doc), 1.0 where it gives none or when there is no such file. ValueError naming the file
    and the entry for anything else: another key, a layer that is not one of `layers`, a
    scale that is not a positive finite number, a list of another length."""
    scales = torch.ones(2, len(layers), num_kv_heads, dtype=torch.float32)
    path = model_dir / SCALES_FILE
    if not path.is_file():
        return scales
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a JSON file: {exc}") from exc
    if not isinstance(raw, dict) or set(raw) - {"k_scale", "v_scale"}:
        raise ValueError(f"{path}: expected an object with k_scale and/or v_scale, got "
                         f"{sorted(raw) if isinstance(raw, dict) else type(raw).__name__}")
    position = {str(layer): j for j, layer in enumerate(layers)}
    for index, kind in enumerate(("k_scale", "v_scale")):
        entries = raw.get(kind, {})
        if not isinstance(entries, dict):
            raise ValueError(f"{path}: {kind} must map layer indices to scales")
        for layer, value in entries.items():
            if layer not in position:
                raise ValueError(f"{path}: {kind} of layer {layer!r}, which is not an attention layer "
                                 f"of this model (those are {list(layers)})")
            values = value if isinstance(value, list) else [value] * num_kv_heads
            if len(values) != num_kv_heads or not all(_positive(v) for v in values):
                raise ValueError(f"{path}: {kind} of layer {layer} must be a positive number or a list of "
                                 f"{num_kv_heads} (num_key_value_heads), got {value!r}")
            scales[index, position[layer]] = torch.tensor([float(v) for v in values], dtype=torch.float32)
    return scales


def check_kv_cache_device(config: EngineConfig, device: torch.device) -> None:
    """ValueError when `device` cannot hold config's KV format: FP8 needs a CUDA device of
    compute capability FP8_MIN_CAPABILITY or later."""
    if config.kv_cache_dtype == "auto":
        return
    if device.type != "cuda":
        raise ValueError(f"kv_cache_dtype {config.kv_cache_dtype} runs on cuda only, not {device}")
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_MIN_CAPABILITY:
        raise ValueError(f"kv_cache_dtype {config.kv_cache_dtype} needs compute capability "
                         f"{FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]} or later (Hopper, Ada); "
                         f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}: "
                         "use kv_cache_dtype auto")


def _positive(value: object) -> bool:
    return (not isinstance(value, bool) and isinstance(value, (int, float))
            and math.isfinite(value) and value > 0)
