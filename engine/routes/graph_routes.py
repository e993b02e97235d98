"""The CUDA graph routes of one CUDA device, captured once when the worker starts."""

from __future__ import annotations

from engine.interfaces.forward_batch import ModelCaches
from engine.routes.decode_graphs import DecodeGraphRunner, decode_batch_sizes
from engine.routes.forward_routes import GraphScratch
from engine.routes.prefill_graphs import PrefillGraphRunner, prefill_graph_sizes


def capture_graph_routes(
    model, caches: ModelCaches, scratch: GraphScratch, max_num_seqs: int, max_num_batched_tokens: int,
):
    """The decode and the prefill CUDA graph routes of one CUDA device, captured: decode graphs
    for batch sizes up to max_num_seqs (at most 128), whose token pool holds max_num_seqs
    sampled tokens; prefill graphs up to the step's token budget (None when the budget is
    below the smallest size)."""
    decode = DecodeGraphRunner(
        model, caches, decode_batch_sizes(min(max_num_seqs, 128)), scratch, num_sampled=max_num_seqs,
    )
    decode.capture()
    sizes = prefill_graph_sizes(max_num_batched_tokens)
    prefill = PrefillGraphRunner(model, caches, sizes, scratch) if sizes else None
    if prefill is not None:
        prefill.capture()
    return decode, prefill
