"""The prefill CUDA graphs' padded sizes (engine/routes/prefill_graphs.py): pure Python, on the CPU."""

from engine.routes.prefill_graphs import prefill_graph_sizes


def test_prefill_sizes():
    """Sizes up to the step budget, ascending; past 256 tokens a chunk pads by at most a
    quarter of its length; none below 64."""
    sizes = prefill_graph_sizes(8192)
    assert sizes[0] == 64 and sizes[-1] == 1024 and list(sizes) == sorted(set(sizes))
    for n in range(257, sizes[-1] + 1):
        assert min(s for s in sizes if s >= n) - n <= n // 4, n
    assert prefill_graph_sizes(512)[-1] == 512 and prefill_graph_sizes(300)[-1] == 256
    assert prefill_graph_sizes(63) == ()
