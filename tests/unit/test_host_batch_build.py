"""The host-side batch builders (build_forward_batch, build_gpu_batch_plan, build_in_pass_plan)
against per-token oracles written here from their contracts, over random mixes of chunks:
decode chunks of one token, prefill chunks that start their sequence or continue it, several
block sizes, reset flags, distinct state slots, block tables longer than a chunk needs. CPU only."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from engine.interfaces.forward_batch import ForwardBatch, SequenceChunk, build_forward_batch
from engine.kernels.gpu.batch_plan import FUSED_DECODE_MAX_ROWS, FreshChunkView, GpuBatchPlan, build_gpu_batch_plan
from engine.kernels.gpu.in_pass_capture import SCAN_CHUNK, CaptureSplit, ScanChunks, build_in_pass_plan
from engine.interfaces.sampling_params import SamplingParams
from engine.interfaces.step_io import ScheduledChunk

CPU = torch.device("cpu")
BLOCK_SIZES = (1, 3, 16, 64)
SEEDS = range(60)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _random_chunks(rng: random.Random, block_size: int) -> list[ScheduledChunk]:
    """1..8 chunks, all decode, all prefill or mixed; each with a block table covering its
    positions plus 0..3 spare blocks, and its own state slot."""
    mix = rng.choice(["decode", "prefill", "mixed"])
    num_chunks = rng.randint(1, 8)
    slots = rng.sample(range(64), num_chunks)
    chunks = []
    for i in range(num_chunks):
        kind = {"decode": "decode", "prefill": rng.choice(["fresh", "continued"])}.get(
            mix, rng.choice(["decode", "fresh", "continued"]))
        if kind == "decode":
            num_tokens, start = 1, rng.randint(0, 300)
        elif kind == "fresh":
            num_tokens, start = rng.randint(2, 300), 0
        else:
            num_tokens, start = rng.randint(2, 300), rng.randint(1, 500)
        num_blocks = _ceil_div(start + num_tokens, block_size) + rng.randint(0, 3)
        chunks.append(ScheduledChunk(
            request_id=f"r{i}",
            token_ids=tuple(rng.randrange(50_000) for _ in range(num_tokens)),
            start_position=start,
            block_table=tuple(rng.sample(range(100_000), num_blocks)),
            state_slot=slots[i],
            reset_state=rng.random() < 0.5,
            sample=True,
            sampling=SamplingParams(),
        ))
    return chunks


def _int64(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _assert_same_tensor(actual: torch.Tensor | None, expected: torch.Tensor | None, name: str) -> None:
    if expected is None:
        assert actual is None, name
        return
    assert actual.dtype == torch.int64 and actual.device == CPU, name
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.equal(actual, expected), name


# --- build_forward_batch ---------------------------------------------------------------------


def _forward_batch_oracle(chunks: list[ScheduledChunk], block_size: int) -> ForwardBatch:
    input_ids, positions, slots, cu = [], [], [], [0]
    for chunk in chunks:
        for offset, token in enumerate(chunk.token_ids):
            position = chunk.start_position + offset
            input_ids.append(token)
            positions.append(position)
            slots.append(chunk.block_table[position // block_size] * block_size + position % block_size)
        cu.append(len(input_ids))
    return ForwardBatch(
        input_ids=_int64(input_ids),
        positions=_int64(positions),
        slot_mapping=_int64(slots),
        chunks=tuple(
            SequenceChunk(c.state_slot, c.start_position, len(c.token_ids), c.block_table, c.reset_state)
            for c in chunks
        ),
        cu_seqlens=tuple(cu),
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_forward_batch_matches_the_per_token_oracle(seed):
    rng = random.Random(seed)
    block_size = rng.choice(BLOCK_SIZES)
    chunks = _random_chunks(rng, block_size)
    batch = build_forward_batch(chunks, block_size, CPU)
    want = _forward_batch_oracle(chunks, block_size)
    for name in ("input_ids", "positions", "slot_mapping"):
        _assert_same_tensor(getattr(batch, name), getattr(want, name), name)
    assert batch.chunks == want.chunks
    assert batch.cu_seqlens == want.cu_seqlens and all(type(v) is int for v in batch.cu_seqlens)


def test_forward_batch_rejects_a_block_table_that_does_not_cover_the_chunk():
    rng = random.Random(0)
    chunk = _random_chunks(rng, 16)[0]
    short = replace(chunk, start_position=40, token_ids=(5, 6, 7, 8, 9), block_table=(3, 4, 5))
    assert build_forward_batch([short], 16, CPU).slot_mapping.tolist() == [5 * 16 + 8 + k for k in range(5)]
    too_short = replace(short, token_ids=tuple(range(9)))  # position 48 needs a fourth block
    with pytest.raises(ValueError):
        build_forward_batch([short, too_short], 16, CPU)


# --- build_gpu_batch_plan --------------------------------------------------------------------


def _padded(table: tuple[int, ...], width: int) -> list[int]:
    return [table[j] if j < len(table) else 0 for j in range(width)]


def _gpu_plan_oracle(batch: ForwardBatch, block_size: int) -> dict:
    """The fields of the GpuBatchPlan of `batch`, from GpuBatchPlan's docstring."""
    chunks, cu = batch.chunks, batch.cu_seqlens
    decode = [i for i, c in enumerate(chunks) if c.num_tokens == 1]
    prefill = [i for i, c in enumerate(chunks) if c.num_tokens > 1]
    paged = [i for i in prefill if chunks[i].start_position > 0]
    decode_width = max([_ceil_div(chunks[i].start_position + 1, block_size) for i in decode], default=0)
    paged_width = max(
        [_ceil_div(chunks[i].start_position + chunks[i].num_tokens, block_size) for i in prefill], default=0)
    prefill_rows, prefill_cu = [], [0]
    for i in prefill:
        for row in range(cu[i], cu[i + 1]):
            prefill_rows.append(row)
        prefill_cu.append(len(prefill_rows))
    token_chunk = []
    for i, c in enumerate(chunks):
        token_chunk += [i] * c.num_tokens
    return dict(
        num_chunks=len(chunks),
        cu_seqlens=_int64(list(cu)),
        chunk_slot=_int64([c.state_slot for c in chunks]),
        chunk_reset=_int64([int(c.reset_state) for c in chunks]),
        token_chunk=_int64(token_chunk),
        num_decode=len(decode),
        decode_rows=_int64([cu[i] for i in decode]),
        decode_slots=_int64([chunks[i].state_slot for i in decode]),
        decode_reset=_int64([int(chunks[i].reset_state) for i in decode]),
        decode_seq_lens=_int64([chunks[i].start_position + 1 for i in decode]),
        decode_block_table=_int64([_padded(chunks[i].block_table, decode_width) for i in decode]).view(
            len(decode), decode_width),
        num_prefill=len(prefill),
        prefill_rows=None if prefill_rows == list(range(batch.num_tokens)) else _int64(prefill_rows),
        prefill_cu_seqlens=_int64(prefill_cu),
        prefill_scan_chunks=_scan_chunks_oracle([chunks[i].num_tokens for i in prefill]) if len(prefill) > 1 else None,
        prefill_slots=_int64([chunks[i].state_slot for i in prefill]),
        prefill_reset=_int64([int(chunks[i].reset_state) for i in prefill]),
        fresh_chunks=tuple(FreshChunkView(cu[i], cu[i + 1]) for i in prefill if i not in paged),
        paged_first_rows=_int64([cu[i] for i in prefill]),
        paged_lengths=_int64([chunks[i].num_tokens if i in paged else 0 for i in prefill]),
        paged_positions=_int64([chunks[i].start_position for i in prefill]),
        paged_tables=_int64([_padded(chunks[i].block_table, paged_width) for i in prefill]).view(
            len(prefill), paged_width),
        paged_max_length=max([chunks[i].num_tokens for i in paged], default=0),
        stacked_qkv=batch.num_tokens == 1,
        fused_mamba_decode=not prefill and len(decode) <= FUSED_DECODE_MAX_ROWS,
        folded_gated_norm=False,  # the model's fold_gated_norm not given
        prefill_valid=None,
        in_pass=None,
        verification=None,  # no chunk here carries drafts
        first_key=chunks[0].first_key if chunks else 0,  # every chunk's (checked by the plan)
    )


def _scan_chunks_oracle(lengths: list[int]) -> ScanChunks:
    """The scan cuts each sequence into SCAN_CHUNK-row chunks from its start, row by row."""
    pairs, offsets = [], [0]
    for sequence, n in enumerate(lengths):
        pairs += [[sequence, r // SCAN_CHUNK] for r in range(0, n, SCAN_CHUNK)]
        offsets.append(len(pairs))
    return ScanChunks(_int64(pairs).view(-1, 2), _int64(offsets))


def _assert_same_chunks(actual: ScanChunks | None, expected: ScanChunks | None, name: str) -> None:
    if expected is None:
        assert actual is None, name
        return
    _assert_same_tensor(actual.indices, expected.indices, f"{name}.indices")
    _assert_same_tensor(actual.offsets, expected.offsets, f"{name}.offsets")
    assert actual.count == len(expected.indices)


# every device tensor of the plan: views of the one packed copy
PACKED_FIELDS = (
    "cu_seqlens", "chunk_slot", "chunk_reset", "token_chunk", "decode_rows", "decode_slots",
    "decode_reset", "decode_seq_lens", "decode_block_table", "prefill_rows", "prefill_cu_seqlens",
    "prefill_slots", "prefill_reset", "paged_first_rows", "paged_lengths", "paged_positions",
    "paged_tables",
)


def _assert_plan_matches_the_oracle(plan: GpuBatchPlan, batch: ForwardBatch, block_size: int) -> None:
    want = _gpu_plan_oracle(batch, block_size)
    assert set(want) == {f for f in GpuBatchPlan.__dataclass_fields__}
    for name, expected in want.items():
        actual = getattr(plan, name)
        if isinstance(expected, torch.Tensor) or (expected is None and name in PACKED_FIELDS):
            _assert_same_tensor(actual, expected, name)
        elif name == "prefill_scan_chunks":
            _assert_same_chunks(actual, expected, name)
        else:
            assert actual == expected and type(actual) is type(expected), name


@pytest.mark.parametrize("seed", SEEDS)
def test_gpu_plan_matches_the_oracle_and_is_one_packed_buffer(seed):
    rng = random.Random(seed)
    block_size = rng.choice(BLOCK_SIZES)
    batch = build_forward_batch(_random_chunks(rng, block_size), block_size, CPU)
    plan = build_gpu_batch_plan(batch, block_size, CPU)
    _assert_plan_matches_the_oracle(plan, batch, block_size)
    for view in plan.fresh_chunks:
        assert type(view.start) is int and type(view.end) is int
    packed = [getattr(plan, name) for name in PACKED_FIELDS]
    if plan.prefill_scan_chunks is not None:
        packed += [plan.prefill_scan_chunks.indices, plan.prefill_scan_chunks.offsets]
    storages = {t.untyped_storage().data_ptr() for t in packed if t is not None}
    assert len(storages) == 1  # one host buffer, so one host-to-device copy on CUDA
    (base,) = storages
    misaligned = [name for name in PACKED_FIELDS
                  if getattr(plan, name) is not None and (getattr(plan, name).data_ptr() - base) % 16]
    assert not misaligned  # Triton specialises pointers on 16-byte alignment: no new variants


def _with_first_key(batch: ForwardBatch, first_keys: list[int]) -> ForwardBatch:
    return replace(batch, chunks=tuple(replace(c, first_key=k) for c, k in zip(batch.chunks, first_keys)))


def _continuing_chunks(rng: random.Random, block_size: int) -> list[ScheduledChunk]:
    """_random_chunks without the chunks at position 0 (none of the MTP head's starts there)."""
    chunks: list[ScheduledChunk] = []
    while not chunks:
        chunks = [c for c in _random_chunks(rng, block_size) if c.start_position > 0]
    return chunks


@pytest.mark.parametrize("seed", range(20))
def test_gpu_plan_carries_the_batchs_first_key(seed):
    """Chunks that all read keys from position 1 (the MTP layer's): the plan says first_key 1
    and is otherwise the plan of the same chunks from key 0."""
    rng = random.Random(seed)
    block_size = rng.choice(BLOCK_SIZES)
    batch = build_forward_batch(_continuing_chunks(rng, block_size), block_size, CPU)
    head_batch = _with_first_key(batch, [1] * len(batch.chunks))
    plan = build_gpu_batch_plan(head_batch, block_size, CPU)
    assert plan.first_key == 1 and build_gpu_batch_plan(batch, block_size, CPU).first_key == 0
    _assert_plan_matches_the_oracle(plan, head_batch, block_size)


def test_gpu_plan_refuses_mixed_first_keys_and_a_chunk_before_its_first_key():
    """One first_key serves a whole launch: chunks that differ are refused; so is a chunk from
    position 0 with first_key 1 (its first query would read no key; SDPA would read key 0)."""
    rng = random.Random(3)
    batch = build_forward_batch(_continuing_chunks(rng, 16) + _continuing_chunks(rng, 16), 16, CPU)
    mixed = [1] + [0] * (len(batch.chunks) - 1)
    with pytest.raises(ValueError, match="first_key"):
        build_gpu_batch_plan(_with_first_key(batch, mixed), 16, CPU)
    for num_tokens in (1, 5):  # a decode chunk, a fresh prefill chunk
        chunk = replace(_random_chunks(rng, 16)[0], start_position=0, token_ids=tuple(range(num_tokens)),
                        block_table=(7,))
        fresh = build_forward_batch([chunk], 16, CPU)
        assert build_gpu_batch_plan(fresh, 16, CPU).first_key == 0
        with pytest.raises(ValueError, match="first_key"):
            build_gpu_batch_plan(_with_first_key(fresh, [1]), 16, CPU)


# --- build_in_pass_plan ----------------------------------------------------------------------


def _random_in_pass(rng: random.Random) -> tuple[list[tuple[int, int, int]], list[CaptureSplit]]:
    """Prefill chunks of a random batch (decode chunks between them) and captures in some."""
    prefill, splits, row = [], [], rng.randint(0, 3)
    for chunk in range(rng.randint(1, 6)):
        if rng.random() < 0.3:
            row += 1  # a decode chunk: not in `prefill`
            continue
        num_tokens = rng.randint(2, 400)
        prefill.append((chunk, row, num_tokens))
        if rng.random() < 0.6:
            splits.append(CaptureSplit(chunk, row, rng.randint(1, num_tokens - 1), chunk, rng.random() < 0.5))
        row += num_tokens
    return prefill, splits


def _in_pass_oracle(prefill, splits) -> dict:
    """Scan rows row by row: a captured chunk is front-padded until its split is a multiple of
    SCAN_CHUNK; every scan sequence is cut into chunks of SCAN_CHUNK rows from its start."""
    split_of = {s.chunk: s.split for s in splits}
    scan_rows, scan_cu, chunk_starts = [], [0], []  # chunk_starts: (sequence, row in sequence)
    for sequence, (chunk, first_row, num_tokens) in enumerate(prefill):
        rows = list(range(first_row, first_row + num_tokens))
        if chunk in split_of:
            while (len(rows) - num_tokens + split_of[chunk]) % SCAN_CHUNK:
                rows.insert(0, -1)
        chunk_starts += [(sequence, r) for r in range(0, len(rows), SCAN_CHUNK)]
        scan_rows += rows
        scan_cu.append(len(scan_rows))
    sequence_of = {chunk: j for j, (chunk, _, _) in enumerate(prefill)}
    capture_chunks = []
    for s in splits:
        j = sequence_of[s.chunk]
        pad = scan_cu[j + 1] - scan_cu[j] - prefill[j][2]
        capture_chunks.append(chunk_starts.index((j, pad + s.split)))
    out_rows = [i for i, row in enumerate(scan_rows) if row >= 0]
    one_run = bool(out_rows) and out_rows == list(range(out_rows[0], out_rows[0] + len(out_rows)))
    return dict(
        scan_rows=_int64(scan_rows), scan_cu=_int64(scan_cu),
        scan_chunks=_scan_chunks_oracle([b - a for a, b in zip(scan_cu, scan_cu[1:])]) if len(prefill) > 1 else None,
        out_rows=_int64(out_rows), out_start=out_rows[0] if one_run else None,
        capture_chunks=_int64(capture_chunks),
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_in_pass_plan_matches_the_row_by_row_oracle(seed):
    rng = random.Random(seed)
    prefill, splits = _random_in_pass(rng)
    plan = build_in_pass_plan(prefill, splits, {}, {}, CPU)
    want = _in_pass_oracle(prefill, splits)
    for name, expected in want.items():
        actual = getattr(plan, name)
        if isinstance(expected, torch.Tensor):
            _assert_same_tensor(actual, expected, name)
        elif name == "scan_chunks":
            _assert_same_chunks(actual, expected, name)
        else:
            assert actual == expected and type(actual) is type(expected), name
    assert plan.splits == tuple(splits)


@pytest.mark.parametrize("lengths,split_at,out_start", [
    ([100], {0: 70}, 58),  # one sequence, padded: one run after the padding
    ([100, 50], {0: 70}, 58),  # the second sequence follows without padding: still one run
    ([100, 50], {1: 10}, None),  # padding between the sequences
    ([100, 80], {1: 63}, None),  # one padding row between them
    ([100, 50], {}, 0),
])
def test_in_pass_out_start_is_set_only_for_one_run(lengths, split_at, out_start):
    starts = [sum(lengths[:j]) for j in range(len(lengths))]
    prefill = [(j, starts[j], n) for j, n in enumerate(lengths)]
    splits = [CaptureSplit(j, starts[j], k, j, False) for j, k in split_at.items()]
    assert build_in_pass_plan(prefill, splits, {}, {}, CPU).out_start == out_start


@pytest.mark.parametrize("split", [
    CaptureSplit(0, 0, 0, 0, False),  # before the chunk's first token
    CaptureSplit(0, 0, 100, 0, False),  # after its last
    CaptureSplit(1, 100, 5, 1, False),  # chunk 1 is not a prefill chunk
])
def test_in_pass_plan_rejects_a_split_outside_a_prefill_chunk(split):
    with pytest.raises(ValueError):
        build_in_pass_plan([(0, 0, 100), (2, 101, 30)], [split], {}, {}, CPU)
