"""DraftInputStaging (engine/speculative/draft_graphs.py): the host half of a draft graph's
inputs, pure numpy. Expected values worked out by hand for block size 4 and k = 3."""

from __future__ import annotations

import numpy as np

from engine.routes.forward_routes import GraphScratch
from engine.speculative.draft_graphs import DraftInputStaging

SCRATCH = GraphScratch(max_blocks_per_seq=4, scratch_slot=9, scratch_block=20)


def _staging(size: int = 2) -> DraftInputStaging:
    return DraftInputStaging(size, depths=3, max_blocks=4, block_size=4, graph_scratch=SCRATCH)


def test_a_start_and_a_padding_row():
    staging = _staging()
    # drafts at positions 5, 6, 7 of a table whose block 1 (positions 4..7) is block 2
    staging.stage([(5, (7, 2, 9))])
    positions, kv, seq_lens, table = staging.views(staging.buffer)
    assert positions[:, 0].tolist() == [5, 6, 7]
    assert kv[:, 0].tolist() == [9, 10, 11]  # block 2, offsets 1..3
    assert seq_lens[:, 0].tolist() == [6, 7, 8]
    assert table[0].tolist() == [7, 2, 20, 20]  # up to the block of position 7, then the scratch block
    # padding: positions 1, 2, 3 in the scratch block (slots 81..83), every table entry it
    assert positions[:, 1].tolist() == [1, 2, 3]
    assert kv[:, 1].tolist() == [81, 82, 83]
    assert seq_lens[:, 1].tolist() == [2, 3, 4]
    assert table[1].tolist() == [20, 20, 20, 20]


def test_a_draft_run_across_a_block_boundary():
    staging = _staging(size=1)
    staging.stage([(3, (5, 6))])  # positions 3 (block 5, offset 3), 4 and 5 (block 6)
    positions, kv, _, _ = staging.views(staging.buffer)
    assert kv[:, 0].tolist() == [23, 24, 25]
    assert positions[:, 0].tolist() == [3, 4, 5]


def test_restaging_leaves_nothing_of_the_previous_rows():
    staging = _staging()
    staging.stage([(5, (7, 2, 9)), (1, (3,))])
    staging.stage([(1, (3,))])
    fresh = _staging()
    fresh.stage([(1, (3,))])
    assert np.array_equal(staging.buffer, fresh.buffer)


def test_fits_needs_the_table_to_cover_every_draft_and_the_width():
    staging = _staging()
    assert staging.fits(5, (7, 2))  # positions 5..7: blocks 0 and 1
    assert not staging.fits(6, (7, 2))  # position 8 needs a third block
    assert not staging.fits(14, (1, 2, 3, 4, 5))  # position 16 needs a fifth: past the width
    assert staging.fits(13, (1, 2, 3, 4, 5, 6))  # positions 13..15: four blocks, the rest unused


def test_a_table_longer_than_the_width_is_staged_up_to_its_last_draft():
    staging = _staging(size=1)
    staging.stage([(13, (1, 2, 3, 4, 5, 6))])
    _, kv, _, table = staging.views(staging.buffer)
    assert table[0].tolist() == [1, 2, 3, 4]
    assert kv[:, 0].tolist() == [17, 18, 19]  # block 4, offsets 1..3
