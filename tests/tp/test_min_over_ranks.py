"""TensorParallel.min_over_ranks over gloo (spawned ranks): every rank gets the smallest value
of every rank, which is how ranks sizing budgets from their own free memory agree on one
capacity (engine/parallel/memory_budget.py rank_free_memory)."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.parallel.tensor_parallel import TensorParallel


def _rank(rank: int, world: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        # rank r has (r + 5) and (10 - r): the minimum of the first is rank 0's, of the second the last rank's
        values = TensorParallel(rank, world).min_over_ranks((rank + 5, 10 - rank), torch.device("cpu"))
        with open(f"{out_dir}/{rank}.json", "w") as file:
            json.dump(list(values), file)
    finally:
        dist.destroy_process_group()


def test_every_rank_gets_the_minimum_of_all(tmp_path):
    world = 2
    mp.spawn(_rank, args=(world, str(tmp_path / "init"), str(tmp_path)), nprocs=world, join=True)
    got = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(world)]
    assert got == [[5, 10 - (world - 1)]] * world
    assert TensorParallel.single().min_over_ranks((3, 4), torch.device("cpu")) == (3, 4)
