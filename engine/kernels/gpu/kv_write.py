"""Storing a step's K/V into the paged cache on the GPU: `write_kv`, one Triton launch for
every token of a step (the PyTorch reference, engine/kernels/attention_reference.py:write_kv,
takes one per cache), and the checks of an FP8 cache's kv_scale that the attention kernels
(paged_attention.py) share.

FP8 caches (a kv_scale given): each element is quantized as attention_reference.quantize_kv
does (fp32 division correctly rounded, saturated at +-448, rounded to nearest even). Without
kv_scale the kernel compiles as for any cache dtype (KV_SCALED is a constexpr).

Shapes: T tokens, Hkv KV heads, D head dim.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.attention_reference import FP8_E4M3_MAX
from engine.kernels.gpu.pdl import launch_options, release_next, wait_for_previous


def check_kv_scale(kv_scale: torch.Tensor | None, key_cache: torch.Tensor) -> bool:
    """Whether the kernels run on FP8 caches: kv_scale given, (2, Hkv) fp32 with a unit head
    stride, and the cache float8_e4m3fn; without kv_scale the cache must not be FP8."""
    if kv_scale is None:
        assert key_cache.dtype != torch.float8_e4m3fn, "FP8 caches need their kv_scale"
        return False
    assert key_cache.dtype == torch.float8_e4m3fn, f"kv_scale given for a {key_cache.dtype} cache"
    assert kv_scale.dtype == torch.float32 and kv_scale.shape == (2, key_cache.shape[2]) and kv_scale.stride(1) == 1
    return True


def kv_scale_args(kv_scale: torch.Tensor | None, key_cache: torch.Tensor) -> tuple:
    """(pointer, stride) of kv_scale for a kernel; without one, the cache as a pointer the
    kernel never reads (KV_SCALED False)."""
    return (key_cache, 0) if kv_scale is None else (kv_scale, kv_scale.stride(0))


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, stride_kt, stride_vt,  # (T, Hkv, D), each token's Hkv * D contiguous
    key_cache_ptr, value_cache_ptr,  # (num_blocks * block_size, Hkv * D) contiguous
    slots_ptr,  # (T,)
    kv_scale_ptr, stride_kv_scale,  # (2, Hkv) fp32, unit Hkv stride: key [0], value [1] scales
    WIDTH: tl.constexpr, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
    KV_SCALED: tl.constexpr, FP8_MAX: tl.constexpr, USE_PDL: tl.constexpr,
):
    release_next(USE_PDL)
    wait_for_previous(USE_PDL)
    t = tl.program_id(0)
    e = tl.arange(0, BLOCK)
    mask = e < WIDTH
    slot = tl.load(slots_ptr + t).to(tl.int64)
    k = tl.load(key_ptr + t * stride_kt + e, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + e, mask=mask)
    if KV_SCALED:  # quantize_kv: x / scale of its head in fp32, saturated, nearest-even to FP8
        head = e // HEAD_DIM
        k_scale = tl.load(kv_scale_ptr + head, mask=mask, other=1.0)
        v_scale = tl.load(kv_scale_ptr + stride_kv_scale + head, mask=mask, other=1.0)
        k = tl.clamp(tl.math.div_rn(k.to(tl.float32), k_scale), -FP8_MAX, FP8_MAX,
                     propagate_nan=tl.PropagateNan.ALL)
        v = tl.clamp(tl.math.div_rn(v.to(tl.float32), v_scale), -FP8_MAX, FP8_MAX,
                     propagate_nan=tl.PropagateNan.ALL)
    tl.store(key_cache_ptr + slot * WIDTH + e, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + slot * WIDTH + e, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    key_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D) contiguous, written in place
    value_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D) contiguous, written in place
    slot_mapping: torch.Tensor,  # (T,) int flat slots (block * block_size + offset); distinct
    # except for graph padding rows, which may share a scratch slot (whose content is unused)
    key: torch.Tensor,  # (T, Hkv, D), each token's heads contiguous
    value: torch.Tensor,  # (T, Hkv, D)
    kv_scale: torch.Tensor | None = None,  # (2, Hkv) fp32 for FP8 caches, else None
) -> None:
    """attention_reference.write_kv in one launch (PyTorch takes one per cache): each token's
    K/V stored at its slot, cast to the cache dtype, or with kv_scale quantized to FP8 (the
    same bytes as attention_reference.quantize_kv)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    width = num_kv_heads * head_dim
    assert key_cache.is_contiguous() and value_cache.is_contiguous() and key_cache.shape == value_cache.shape
    assert key_cache.shape[2:] == key.shape[1:] and value.shape == key.shape
    assert key.stride(1) == head_dim and key.stride(2) == 1 and value.stride(1) == head_dim and value.stride(2) == 1
    scaled = check_kv_scale(kv_scale, key_cache)
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key, value, key.stride(0), value.stride(0), key_cache, value_cache, slot_mapping,
        *kv_scale_args(kv_scale, key_cache),
        WIDTH=width, BLOCK=triton.next_power_of_2(width), HEAD_DIM=head_dim,
        KV_SCALED=scaled, FP8_MAX=FP8_E4M3_MAX, **launch_options(),
    )
