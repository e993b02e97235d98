"""Paged attention on the GPU: a Triton decode kernel (one query per sequence over its block
table), a Triton prefill kernel (every chunk with cached keys, or every chunk of a CUDA graph, in
one launch over its block table) and, for a chunk that starts its sequence outside a graph,
torch SDPA over the chunk's own K/V.

GPU counterparts of engine/kernels/attention_reference.py:paged_attention. KV layout as there:
(num_blocks, block_size, Hkv, D); query head h reads KV head h // (H / Hkv). The decode kernel
gives each program one (sequence, KV head) pair and all the query heads that share it, so each
K/V byte is read once per step; softmax is online, in fp32. When the pairs are too few to fill
the GPU (small batches), each pair's keys are also split over several programs and a second
launch combines their partial results. The prefill kernel gives each
program BLOCK_M queries of one chunk and HEADS_PER_PROGRAM (G) query heads that share one KV
head, stacked as one (G * BLOCK_M, D) tile, and walks the keys up to its last query's position
BLOCK_N at a time: each K/V tile is loaded once for all G heads (G = 1: one head a program;
G, BLOCK_M and the rest default as prefill_launch.py says).
A step's K/V reaches the cache through kv_write.py's write_kv.

FP8 caches (a kv_scale given, engine/kernels/attention_reference.py; write_kv quantizes on
write): both attention kernels dequantize each K/V tile as dequantize_kv does
(fp32 product with the program's KV-head scale, rounded to the query dtype) before their dots,
which accumulate in fp32 as for any cache dtype. Without kv_scale the kernels compile as before
(KV_SCALED is a constexpr).

Both attention kernels take first_key, the first key position any query reads (0; 1 for the
MTP drafter's layer, whose position 0 holds no key: engine/speculative/mtp.py), and split the
keys first_key .. over their programs, so split 0 always holds a key and no tile is empty.

Integer arguments that change with the batch or the layer (lengths, split counts, first_key,
the partials' and block tables' strides) are marked do_not_specialize: Triton otherwise
compiles a variant for each new combination of their divisibility by 16 and equality to 1,
which in a burst of mixed chunks kept compiling for seconds mid-serving
(benchmarks/ttft_anatomy.py, its compile count).

Shapes: T tokens, H heads, Hkv KV heads, D head dim, Bd decode sequences.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
import triton
import triton.language as tl

from engine.kernels.gpu.kv_write import check_kv_scale, kv_scale_args
from engine.kernels.gpu.pdl import launch_options, release_next, wait_for_previous
from engine.kernels.gpu.prefill_launch import prefill_launch

# The SDPA backends causal_attention_from_start allows (torch picks the first that takes the
# inputs): none of them builds anything per shape, unlike cuDNN's.
FROM_START_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@triton.jit(do_not_specialize=["stride_split", "stride_ml_split", "stride_ml_t", "stride_table", "num_splits",
                             "first_key"])
def _paged_decode_kernel(
    q_ptr, stride_qt, stride_qh,  # (T, H, D), unit D stride
    k_ptr, v_ptr, stride_kb, stride_ko, stride_kh,  # (blocks, block_size, Hkv, D), K and V alike
    out_ptr, stride_ot, stride_oh,  # (T, H, D): the output, or (splits, Bd, H, D) fp32 partials
    stride_split,  # of the partials' split axis
    ml_ptr, stride_ml_split, stride_ml_t,  # (splits, Bd, H, 2) fp32: max and sum of each partial
    rows_ptr, seq_lens_ptr, table_ptr, stride_table,  # (Bd,), (Bd,), (Bd, max_blocks)
    scale_log2,  # softmax scale * log2(e)
    num_splits,
    first_key,  # keys first_key .. seq_len - 1 are read (first_key < every seq_len)
    kv_scale_ptr, stride_kv_scale,  # (2, Hkv) fp32 FP8 scales (read only with KV_SCALED)
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
    KV_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
    KV_SCALED: tl.constexpr, USE_PDL: tl.constexpr,
):
    release_next(USE_PDL)
    wait_for_previous(USE_PDL)
    i, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row = tl.load(rows_ptr + i)
    seq_len = tl.load(seq_lens_ptr + i)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + g
    g_mask = g < GROUP
    q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None], other=0.0)  # (BLOCK_G, D)
    if KV_SCALED:
        k_scale = tl.load(kv_scale_ptr + kv_head)
        v_scale = tl.load(kv_scale_ptr + stride_kv_scale + kv_head)
    # this split's share of keys first_key .. seq_len - 1, in whole BLOCK_N tiles (a split
    # past seq_len has none)
    span = tl.cdiv(tl.cdiv(seq_len - first_key, num_splits), BLOCK_N) * BLOCK_N
    key_end = tl.minimum(first_key + (split + 1) * span, seq_len)
    m = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, HEAD_DIM), dtype=tl.float32)
    for start in range(first_key + split * span, key_end, BLOCK_N):
        tok = start + tl.arange(0, BLOCK_N)
        t_mask = tok < key_end
        block = tl.load(table_ptr + i * stride_table + tok // KV_BLOCK, mask=t_mask, other=0)
        offsets = block * stride_kb + (tok % KV_BLOCK) * stride_ko + kv_head * stride_kh
        k = tl.load(k_ptr + offsets[:, None] + d[None, :], mask=t_mask[:, None], other=0.0)
        v = tl.load(v_ptr + offsets[:, None] + d[None, :], mask=t_mask[:, None], other=0.0)
        if KV_SCALED:  # dequantize_kv
            k = (k.to(tl.float32) * k_scale).to(q.dtype)
            v = (v.to(tl.float32) * v_scale).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # (BLOCK_G, BLOCK_N) fp32, log2 units
        s = tl.where(t_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))  # finite: every tile holds a key
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    if SPLIT:  # unnormalised partial; a split with no keys leaves m = -inf, l = 0, acc = 0
        part = out_ptr + split * stride_split + i * stride_ot
        tl.store(part + heads[:, None] * stride_oh + d[None, :], acc, mask=g_mask[:, None])
        ml = ml_ptr + split * stride_ml_split + i * stride_ml_t + heads * 2
        tl.store(ml, m, mask=g_mask)
        tl.store(ml + 1, l, mask=g_mask)
    else:
        tl.store(out_ptr + row * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 (acc / l[:, None]).to(out_ptr.dtype.element_ty), mask=g_mask[:, None])


@triton.jit(do_not_specialize=['stride_split', 'stride_ml_split', 'stride_ml_t', 'num_splits'])
def _decode_combine_kernel(
    part_ptr, stride_split, stride_pt,  # (splits, Bd, H, D) fp32, unit D stride, H stride D
    ml_ptr, stride_ml_split, stride_ml_t,  # (splits, Bd, H, 2) fp32
    out_ptr, stride_ot, stride_oh,  # (T, H, D)
    rows_ptr,  # (Bd,)
    num_splits,
    HEAD_DIM: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    release_next(USE_PDL)
    wait_for_previous(USE_PDL)
    i, head = tl.program_id(0), tl.program_id(1)
    d = tl.arange(0, HEAD_DIM)
    ml = ml_ptr + i * stride_ml_t + head * 2
    m_max = tl.load(ml)  # split 0 holds key first_key: finite
    for split in range(1, num_splits):
        m_max = tl.maximum(m_max, tl.load(ml + split * stride_ml_split))
    total = tl.zeros((1,), dtype=tl.float32)
    acc = tl.zeros((HEAD_DIM,), dtype=tl.float32)
    for split in range(num_splits):
        weight = tl.exp2(tl.load(ml + split * stride_ml_split) - m_max)  # 0 for an empty split
        total += weight * tl.load(ml + split * stride_ml_split + 1)
        acc += weight * tl.load(part_ptr + split * stride_split + i * stride_pt + head * HEAD_DIM + d)
    row = tl.load(rows_ptr + i)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + d, (acc / total).to(out_ptr.dtype.element_ty))


def decode_splits(num_decode: int, num_kv_heads: int, num_sms: int = 132) -> int:
    """Key splits per (sequence, KV head) so that a decode launch has about two programs per SM
    (a batch of few sequences is otherwise a handful of programs walking long contexts): 1 when
    the pairs alone give that many, at most 16."""
    return max(1, min(16, (2 * num_sms) // max(num_decode * num_kv_heads, 1)))


def paged_attention_decode(
    query: torch.Tensor,  # (T, H, D)
    key_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    value_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    out: torch.Tensor,  # (T, H, D), rows written
    rows: torch.Tensor,  # (Bd,) int, token row of each sequence's one query
    seq_lens: torch.Tensor,  # (Bd,) int >= 1, keys each query attends to (its own included)
    block_table: torch.Tensor,  # (Bd, max_blocks) int
    scale: float,
    num_splits: int | None = None,  # key splits per (sequence, KV head); None: decode_splits()
    first_key: int = 0,  # first key position read, < every seq_lens[i] (1: the MTP layer)
    kv_scale: torch.Tensor | None = None,  # (2, Hkv) fp32 for FP8 caches, else None
) -> None:
    """For each i: out[rows[i]] = attention of query[rows[i]] over the keys at positions
    first_key .. seq_lens[i] - 1 of its blocks (K/V already written; the keys before first_key
    are never read). Equal to paged_attention(..., first_key=first_key, kv_scale=kv_scale)
    with n = 1 within bf16 rounding. Touches no other row of out.

    The launches depend on Bd and the head counts only, never on seq_lens or first_key, so a
    CUDA graph replays them for any context length. With num_splits > 1 each sequence's keys
    (from first_key on) are split over that many programs, whose fp32 partials a second launch
    combines; a split past the last key contributes nothing."""
    num_decode = rows.shape[0]
    if num_decode == 0:
        return
    _, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    assert key_cache.stride() == value_cache.stride() and key_cache.stride(3) == 1
    assert query.stride(2) == 1 and out.stride(2) == 1 and head_dim == triton.next_power_of_2(head_dim)
    scaled = check_kv_scale(kv_scale, key_cache)
    if num_splits is None:
        num_splits = decode_splits(num_decode, num_kv_heads)
    split = num_splits > 1
    if split:  # (splits, Bd, H, D) partials and (splits, Bd, H, 2) max/sum, fp32
        partial = query.new_empty(num_splits, num_decode, num_heads, head_dim, dtype=torch.float32)
        ml = query.new_empty(num_splits, num_decode, num_heads, 2, dtype=torch.float32)
        target, strides = partial, (partial.stride(1), partial.stride(2), partial.stride(0))
        ml_strides = (ml.stride(0), ml.stride(1))
    else:  # the output directly; no partials
        ml, target, strides, ml_strides = out, out, (out.stride(0), out.stride(1), 0), (0, 0)
    group = num_heads // num_kv_heads
    _paged_decode_kernel[(num_decode, num_kv_heads, num_splits)](
        query, query.stride(0), query.stride(1),
        key_cache, value_cache, key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        target, *strides, ml, *ml_strides,
        rows, seq_lens, block_table, block_table.stride(0),
        scale * 1.4426950408889634, num_splits, first_key, *kv_scale_args(kv_scale, key_cache),
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        KV_BLOCK=block_size, BLOCK_N=64, SPLIT=split,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",  # as the prefill kernel
        KV_SCALED=scaled, **launch_options(),
    )
    if split:
        _decode_combine_kernel[(num_decode, num_heads)](
            partial, partial.stride(0), partial.stride(1), ml, ml.stride(0), ml.stride(1),
            out, out.stride(0), out.stride(1), rows, num_splits, HEAD_DIM=head_dim, **launch_options(),
        )


@triton.jit
def _attend_key_tile(
    q, q_pos, m, l, acc,  # (R, D) queries, (R,) their positions; the online softmax's (R,), (R,), (R, D) fp32
    tile_start, key_end,  # keys tile_start .. tile_start + BLOCK_N - 1, those before key_end real
    table, k_head, v_head, stride_kb, stride_ko,  # the chunk's block table; K/V at the program's KV head
    scale_log2,
    k_scale, v_scale,  # the KV head's FP8 scales (fp32; read only with KV_SCALED)
    HEAD_DIM: tl.constexpr, KV_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    MASKED: tl.constexpr,  # False: every key of the tile is real and visible to every row
    KV_SCALED: tl.constexpr,
):
    """One key tile of _prefill_kernel's online softmax: returns the updated (m, l, acc). A row
    that has seen no visible key yet keeps m = -inf (possible in a split after the first)."""
    tok = tile_start + tl.arange(0, BLOCK_N)
    d = tl.arange(0, HEAD_DIM)
    if MASKED:
        t_mask = tok < key_end
        block = tl.load(table + tok // KV_BLOCK, mask=t_mask, other=0)
        offsets = block * stride_kb + (tok % KV_BLOCK) * stride_ko
        k = tl.load(k_head + offsets[:, None] + d[None, :], mask=t_mask[:, None], other=0.0)
        v = tl.load(v_head + offsets[:, None] + d[None, :], mask=t_mask[:, None], other=0.0)
    else:
        block = tl.load(table + tok // KV_BLOCK)
        offsets = block * stride_kb + (tok % KV_BLOCK) * stride_ko
        k = tl.load(k_head + offsets[:, None] + d[None, :])
        v = tl.load(v_head + offsets[:, None] + d[None, :])
    if KV_SCALED:  # dequantize_kv
        k = (k.to(tl.float32) * k_scale).to(q.dtype)
        v = (v.to(tl.float32) * v_scale).to(q.dtype)
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # log2 units
    if MASKED:
        visible = (tok[None, :] <= q_pos[:, None]) & t_mask[None, :]
        scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(scores - m_safe[:, None])
    alpha = tl.exp2(m - m_safe)
    l = l * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l, acc


@triton.jit(do_not_specialize=['stride_split', 'stride_ml_split', 'stride_ml_t', 'stride_table', 'num_splits', 'max_len',
                               'first_key'])
def _prefill_kernel(
    q_ptr, stride_qt, stride_qh,  # (T, H, D), unit D stride
    k_ptr, v_ptr, stride_kb, stride_ko, stride_kh,  # (blocks, block_size, Hkv, D), K and V alike
    out_ptr, stride_ot, stride_oh,  # (T, H, D): the output, or (splits, Sp * max_len, H, D) fp32 partials
    stride_split,  # of the partials' split axis
    ml_ptr, stride_ml_split, stride_ml_t,  # (splits, Sp * max_len, H, 2) fp32: max and sum of each partial
    rows_ptr, lens_ptr, positions_ptr, table_ptr, stride_table,  # (Sp,) x 3, (Sp, max_blocks)
    scale_log2,  # softmax scale * log2(e)
    num_splits, max_len,  # partial row of query j of chunk s: s * max_len + j
    first_key,  # keys from first_key on are read (first_key <= every query's position)
    kv_scale_ptr, stride_kv_scale,  # (2, Hkv) fp32 FP8 scales (read only with KV_SCALED)
    GROUP: tl.constexpr,  # query heads per KV head
    HEADS_PER_PROGRAM: tl.constexpr,  # G, a power of two dividing GROUP
    HEAD_DIM: tl.constexpr, KV_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, SPLIT: tl.constexpr,
    KV_SCALED: tl.constexpr, USE_PDL: tl.constexpr,
):
    release_next(USE_PDL)
    wait_for_previous(USE_PDL)
    m_block, head_group = tl.program_id(0), tl.program_id(2)
    s, split = tl.program_id(1) // num_splits, tl.program_id(1) % num_splits
    q_len = tl.load(lens_ptr + s)
    if m_block * BLOCK_M < q_len:
        first_row = tl.load(rows_ptr + s)
        start_position = tl.load(positions_ptr + s)
        # tile row r: query i = m_block * BLOCK_M + r // G of the chunk, in query head
        # head_group * G + r % G (a query's G heads on adjacent rows, as they lie in memory)
        r = tl.arange(0, BLOCK_M * HEADS_PER_PROGRAM)
        i = m_block * BLOCK_M + r // HEADS_PER_PROGRAM
        head = head_group * HEADS_PER_PROGRAM + r % HEADS_PER_PROGRAM
        i_mask = i < q_len
        d = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + (first_row + i)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=i_mask[:, None], other=0.0)  # (G * BLOCK_M, D)
        q_pos = start_position + i  # the G rows of one query share its position
        kv_head = head_group * HEADS_PER_PROGRAM // GROUP  # the same for all G heads
        if KV_SCALED:
            k_scale = tl.load(kv_scale_ptr + kv_head)
            v_scale = tl.load(kv_scale_ptr + stride_kv_scale + kv_head)
        else:  # not read
            k_scale = scale_log2
            v_scale = scale_log2
        # keys first_key .. the position of this block's last query, this split's share of them
        num_keys = start_position + tl.minimum((m_block + 1) * BLOCK_M, q_len)
        span = tl.cdiv(tl.cdiv(num_keys - first_key, num_splits), BLOCK_N) * BLOCK_N
        key_start = first_key + split * span
        key_end = tl.minimum(key_start + span, num_keys)
        m = tl.full((BLOCK_M * HEADS_PER_PROGRAM,), float("-inf"), dtype=tl.float32)
        l = tl.zeros((BLOCK_M * HEADS_PER_PROGRAM,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M * HEADS_PER_PROGRAM, HEAD_DIM), dtype=tl.float32)
        # Keys up to the block's first query position are visible to every row: whole tiles of
        # them take no mask; the tiles after (the causal edge, the split's last) do.
        unmasked_end = key_start + tl.maximum(
            tl.minimum(key_end, start_position + m_block * BLOCK_M + 1) - key_start, 0
        ) // BLOCK_N * BLOCK_N
        table = table_ptr + s * stride_table
        k_head, v_head = k_ptr + kv_head * stride_kh, v_ptr + kv_head * stride_kh
        for tile_start in range(key_start, unmasked_end, BLOCK_N):
            m, l, acc = _attend_key_tile(
                q, q_pos, m, l, acc, tile_start, key_end, table, k_head, v_head, stride_kb, stride_ko,
                scale_log2, k_scale, v_scale, HEAD_DIM, KV_BLOCK, BLOCK_N, PRECISION, MASKED=False,
                KV_SCALED=KV_SCALED,
            )
        for tile_start in range(unmasked_end, key_end, BLOCK_N):
            m, l, acc = _attend_key_tile(
                q, q_pos, m, l, acc, tile_start, key_end, table, k_head, v_head, stride_kb, stride_ko,
                scale_log2, k_scale, v_scale, HEAD_DIM, KV_BLOCK, BLOCK_N, PRECISION, MASKED=True,
                KV_SCALED=KV_SCALED,
            )
        if SPLIT:
            part = s * max_len + i
            base = split * stride_split
            tl.store(out_ptr + base + part[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :], acc,
                     mask=i_mask[:, None])
            ml = ml_ptr + split * stride_ml_split + part * stride_ml_t + head * 2
            tl.store(ml, m, mask=i_mask)
            tl.store(ml + 1, l, mask=i_mask)
        else:
            rows = first_row + i
            tl.store(out_ptr + rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                     (acc / l[:, None]).to(out_ptr.dtype.element_ty), mask=i_mask[:, None])


@triton.jit(do_not_specialize=['stride_split', 'stride_ml_split', 'stride_ml_t', 'num_splits', 'max_len'])
def _combine_kernel(
    part_ptr, stride_split, stride_pt,  # (splits, Sp * max_len, H, D) fp32, unit D stride, H stride D
    ml_ptr, stride_ml_split, stride_ml_t,  # (splits, Sp * max_len, H, 2) fp32
    out_ptr, stride_ot, stride_oh,  # (T, H, D)
    rows_ptr, lens_ptr,  # (Sp,)
    num_splits, max_len,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    release_next(USE_PDL)
    wait_for_previous(USE_PDL)
    m_block, s, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_len = tl.load(lens_ptr + s)
    if m_block * BLOCK_M < q_len:
        i = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        i_mask = i < q_len
        rows = tl.load(rows_ptr + s) + i
        part = s * max_len + i
        d = tl.arange(0, HEAD_DIM)
        m_max = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        for split in range(num_splits):  # split 0 holds key first_key, visible to every row: finite max
            ml = ml_ptr + split * stride_ml_split + part * stride_ml_t + head * 2
            m_max = tl.maximum(m_max, tl.load(ml, mask=i_mask, other=0.0))
        total = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
        for split in range(num_splits):
            ml = ml_ptr + split * stride_ml_split + part * stride_ml_t + head * 2
            weight = tl.exp2(tl.load(ml, mask=i_mask, other=0.0) - m_max)
            total += weight * tl.load(ml + 1, mask=i_mask, other=0.0)
            partial = tl.load(part_ptr + split * stride_split + part[:, None] * stride_pt + head * HEAD_DIM + d[None, :],
                              mask=i_mask[:, None], other=0.0)
            acc += weight[:, None] * partial
        tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + d[None, :],
                 (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=i_mask[:, None])


def paged_attention_prefill(
    query: torch.Tensor,  # (T, H, D)
    key_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    value_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    out: torch.Tensor,  # (T, H, D), rows of the served chunks written
    first_rows: torch.Tensor,  # (Sp,) int, token row of each chunk's first query
    lengths: torch.Tensor,  # (Sp,) int >= 0, queries of each chunk (0: chunk skipped)
    start_positions: torch.Tensor,  # (Sp,) int, position of each chunk's first query
    block_tables: torch.Tensor,  # (Sp, max_blocks) int, covering start_position + length keys
    max_length: int,  # >= every lengths[s] (bounds the launch grid)
    scale: float,
    num_splits: int | None = None,  # key splits per query block
    block_m: int | None = None,  # queries per program
    block_n: int = 64,  # keys per loop step
    num_warps: int | None = None,
    num_stages: int = 3,
    heads_per_program: int | None = None,  # G, query heads per program
    # (each None: prefill_launch.py's default)
    first_key: int = 0,  # first key position read, <= every start_positions[s] (1: the MTP layer)
    kv_scale: torch.Tensor | None = None,  # (2, Hkv) fp32 for FP8 caches, else None
) -> None:
    """Causal attention of Sp prefill chunks over their paged K/V, every chunk's metadata on
    the device (so a CUDA graph can replay it with new chunks): for each s, query rows
    first_rows[s] + j, j < lengths[s], at position start_positions[s] + j, attend the keys at
    positions first_key .. start_positions[s] + j of block_tables[s] (this step's K/V already
    written; the keys before first_key are never read). Touches no other row of out. Equal to
    paged_attention(..., first_key=first_key, kv_scale=kv_scale) per chunk within the input
    dtype's rounding (fp32 inputs multiply in full fp32; softmax in fp32, online).

    Each program takes block_m queries in heads_per_program query heads of one KV head (a
    power of two dividing H / Hkv; 1 is the ungrouped kernel), a (G * block_m, D) tile; the
    defaults are prefill_launch.py's. One launch, or with num_splits > 1 (few long-context
    queries: the user message after a restored prefix) each query block's keys split over
    that many programs (keys from first_key on; a split past a block's last key contributes
    nothing), whose fp32 partials a second launch combines. The launches and the partials'
    size depend on Sp, max_length and the shapes only, never on the device metadata or
    first_key."""
    num_chunks = first_rows.shape[0]
    if num_chunks == 0 or max_length == 0:
        return
    _, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    assert key_cache.stride() == value_cache.stride() and key_cache.stride(3) == 1
    assert query.stride(2) == 1 and out.stride(2) == 1 and head_dim == triton.next_power_of_2(head_dim)
    scaled = check_kv_scale(kv_scale, key_cache)
    group = num_heads // num_kv_heads
    launch = prefill_launch(
        query.dtype, num_heads, num_kv_heads, max_length, num_chunks,
        heads_per_program=heads_per_program, block_m=block_m, block_n=block_n,
        num_warps=num_warps, num_stages=num_stages, num_splits=num_splits,
    )
    heads, block_m, num_splits = launch.heads_per_program, launch.block_m, launch.num_splits
    assert group % heads == 0 and heads * block_m == triton.next_power_of_2(heads * block_m)
    split = num_splits > 1
    if split:  # partials of the served queries only: (splits, Sp * max_length, H, D), small
        partial = query.new_empty(num_splits, num_chunks * max_length, num_heads, head_dim, dtype=torch.float32)
        ml = query.new_empty(num_splits, num_chunks * max_length, num_heads, 2, dtype=torch.float32)
        target, strides = partial, (partial.stride(1), partial.stride(2), partial.stride(0))
        ml_strides = (ml.stride(0), ml.stride(1))
    else:  # the output directly; no partials
        ml, target, strides, ml_strides = out, out, (out.stride(0), out.stride(1), 0), (0, 0)
    grid = (triton.cdiv(max_length, block_m), num_chunks * num_splits, num_heads // heads)
    _prefill_kernel[grid](
        query, query.stride(0), query.stride(1),
        key_cache, value_cache, key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        target, *strides, ml, *ml_strides,
        first_rows, lengths, start_positions, block_tables, block_tables.stride(0),
        scale * 1.4426950408889634, num_splits, max_length, first_key, *kv_scale_args(kv_scale, key_cache),
        GROUP=group, HEADS_PER_PROGRAM=heads, HEAD_DIM=head_dim, KV_BLOCK=block_size,
        BLOCK_M=block_m, BLOCK_N=launch.block_n,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",  # fp32 models: no tf32
        SPLIT=split, KV_SCALED=scaled, num_warps=launch.num_warps, num_stages=launch.num_stages,
        **launch_options(),
    )
    if split:  # the partials' layout is per query head: the combine takes one program a head
        _combine_kernel[(triton.cdiv(max_length, block_m), num_chunks, num_heads)](
            partial, partial.stride(0), partial.stride(1), ml, ml.stride(0), ml.stride(1),
            out, out.stride(0), out.stride(1),
            first_rows, lengths, num_splits, max_length,
            HEAD_DIM=head_dim, BLOCK_M=block_m, **launch_options(),
        )


def causal_attention_from_start(
    query: torch.Tensor,  # (n, H, D), positions 0 .. n-1 of one sequence
    key: torch.Tensor,  # (n, Hkv, D), the same tokens' keys
    value: torch.Tensor,  # (n, Hkv, D)
    scale: float,
) -> torch.Tensor:
    """Causal attention of a chunk that starts its sequence, over its own K/V (no cache read):
    torch SDPA's flash kernels (memory-efficient ones for fp32). Returns (n, H, D).

    cuDNN is left out of the backends SDPA may pick (FROM_START_SDPA_BACKENDS): torch prefers it
    on Hopper, and it builds an execution plan for every new sequence length, about 10 ms of
    host time a call (measured on the H200 by benchmarks/ttft_anatomy.py: a prompt of a length
    not seen before took 40-70 ms more to its first token than the same length again). The
    grouped K/V heads are repeated to one per query head first, since the memory-efficient
    kernels take no grouped heads (and the math kernel, which does, materializes the scores);
    the copy is about 1% of the attention's time at 8,192 tokens."""
    group = query.shape[1] // key.shape[1]
    if group > 1:
        key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    q, k, v = (t.transpose(0, 1)[None] for t in (query, key, value))  # (1, H, n, D)
    with sdpa_kernel(FROM_START_SDPA_BACKENDS):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return out[0].transpose(0, 1)
