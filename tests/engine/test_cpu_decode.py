"""The compiled CPU decode route (engine/routes/cpu_decode.py, EngineConfig.cpu_compile_decode)
against the eager pass, on a two-layer random model (one Mamba2 block, one attention block)
small enough to compile in CI: the same greedy tokens, logits within fp32 rounding of each
other, the same cache contents, decode steps served by the compiled graph; the engine serving
eagerly while the graph compiles on its own thread, and decoding eagerly when the compile
fails."""

from __future__ import annotations

import logging
import threading
from dataclasses import replace

import pytest
import torch
from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

from engine.core.llm_engine import LLMEngine
from engine.engine_config import EngineConfig
from engine.interfaces.generation_request import GenerationRequest
from engine.interfaces.sampling_params import SamplingParams
from engine.routes import cpu_decode
from tests.families.hf_reference_checks import save_engine_model

LOGITS_RTOL = 1e-5  # max|compiled - eager| / max|eager|: fp32 rounding of fused loops

TWO_LAYERS = dict(
    hidden_size=32, num_hidden_layers=2, layer_types=["mamba", "attention"], shared_intermediate_size=48,
    num_local_experts=0, num_attention_heads=4, num_key_value_heads=2, attention_multiplier=0.2,
    position_embedding_type=None, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8,
    mamba_d_conv=4, mamba_chunk_size=16, embedding_multiplier=6.0, residual_multiplier=0.5,
    logits_scaling=2.5, initializer_range=0.2,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_engine_model(GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM, TWO_LAYERS,
                             tmp_path_factory.mktemp("two_layers"))


def _config(model_dir, **changes) -> EngineConfig:
    return EngineConfig(model_dir=str(model_dir), max_model_len=256, max_num_seqs=4, checkpoint_slots=(),
                        async_scheduling=False, **changes)


def _generate(engine: LLMEngine) -> tuple[dict[str, list[int]], dict[str, list[torch.Tensor]], dict[str, torch.Tensor]]:
    """Three requests decoding together (slots 0, 1, 2), one finishing early, a fourth joining
    when it ends (its slot now behind the others': rows out of slot order); every token's logits
    and, at the end, the caches' state slots and KV."""
    sampling = lambda n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, return_logits=True)  # noqa: E731
    prompts = {"a": [5, 9, 300, 77, 41, 8], "b": [1000, 3], "c": [17] * 11}
    for rid, prompt in prompts.items():
        engine.add_request(GenerationRequest(rid, prompt, sampling(3 if rid == "b" else 9)))
    tokens: dict[str, list[int]] = {}
    logits: dict[str, list[torch.Tensor]] = {}
    joined = False
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            logits.setdefault(out.request_id, []).append(out.logits)
            if out.request_id == "b" and out.finished and not joined:
                engine.add_request(GenerationRequest("d", [44, 45, 46], sampling(6)))
                joined = True
    caches = engine.executor.caches
    return tokens, logits, {"kv": caches.kv_stack.clone(), "conv": caches.conv_stack.clone(),
                            "ssm": caches.ssm_stack.clone()}


def test_compiled_decode_equals_the_eager_pass(model_dir, monkeypatch):
    monkeypatch.setattr(cpu_decode, "WARM_UP_BUDGET_S", 0.0)  # the graph of 2+ rows only: CI time
    torch.manual_seed(0)
    compiled = LLMEngine(_config(model_dir, cpu_compile_decode=True))
    route = compiled.executor.compiled_decode
    assert route is not None and route.wait_warm_up(timeout_s=600) and route.compile_seconds > 0
    eager = LLMEngine(_config(model_dir))
    want_tokens, want_logits, want_caches = _generate(eager)
    got_tokens, got_logits, got_caches = _generate(compiled)
    print(f"compile {route.compile_seconds:.1f} s, {route.steps} steps compiled")
    assert route.steps >= 5  # the decode steps of 2+ rows (a lone row, prefill steps: eager)
    assert got_tokens == want_tokens
    for rid, rows in want_logits.items():
        want, got = torch.stack(rows), torch.stack(got_logits[rid])
        error = float((got - want).abs().max() / want.abs().max())
        print(f"{rid}: logits max relative difference {error:.2e}")
        assert error < LOGITS_RTOL
    for name, want in want_caches.items():
        torch.testing.assert_close(got_caches[name], want, rtol=1e-5, atol=1e-5, msg=f"{name} caches differ")


def test_a_failed_compile_leaves_every_step_to_the_eager_pass(model_dir, monkeypatch, caplog):
    """The compile raising (here: the compiler replaced by one that raises) turns the route off
    with one warning; the engine decodes the same tokens eagerly."""
    def failing(*args, **kwargs):
        def compiled(*a, **k):
            raise RuntimeError("no C++ compiler")
        return compiled

    monkeypatch.setattr(cpu_decode.torch, "compile", failing)
    with caplog.at_level(logging.WARNING, logger=cpu_decode.__name__):
        engine = LLMEngine(_config(model_dir, cpu_compile_decode=True))
        route = engine.executor.compiled_decode
        assert route.wait_warm_up(timeout_s=600) and not engine.warming_up()
    warnings = [r for r in caplog.records if r.name == cpu_decode.__name__]
    assert len(warnings) == 1 and "no C++ compiler" in warnings[0].getMessage()
    tokens, _, _ = _generate(engine)
    assert route.steps == 0
    assert tokens == _generate(LLMEngine(_config(model_dir)))[0]


def test_the_graph_does_not_depend_on_the_kv_block_count(model_dir, monkeypatch, tmp_path):
    """Budgets taken from the memory free at start give another KV block count at each start;
    the compiled graph treats that count as a symbol, so an engine of another count compiles
    nothing new (it reuses the graph, or finds it in inductor's cache) where a graph with the
    count as a constant would miss the cache and compile again. A fresh inductor cache and a
    reset dynamo: no graph of an earlier run or test."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(cpu_decode, "WARM_UP_BUDGET_S", 0.0)  # the graph of 2+ rows only
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch._dynamo.reset()  # nor the graphs the other tests compiled in this process
    blocks, misses = [], []
    for kv_bytes in (3 << 20, 5 << 20):
        before = counters["inductor"]["fxgraph_cache_miss"]
        engine = LLMEngine(_config(model_dir, cpu_compile_decode=True, kv_cache_bytes=kv_bytes))
        assert engine.executor.compiled_decode.wait_warm_up(timeout_s=600)
        assert engine.executor.compiled_decode._sizes == {"many"}
        blocks.append(engine.executor.capacity.num_blocks)
        misses.append(counters["inductor"]["fxgraph_cache_miss"] - before)
        engine.shutdown()
    assert blocks[0] != blocks[1]
    assert misses[0] >= 1 and misses[1] == 0, f"inductor cache misses per engine: {misses}"


def test_the_engine_serves_eagerly_while_its_decode_step_compiles(model_dir, monkeypatch):
    """The constructor returns while the decode step compiles on its own thread (held here
    until the gate opens): the engine serves meanwhile, every step eagerly, and says it is
    warming up; once the compile ends, its decode steps of 2+ rows take the compiled graph,
    with the same tokens."""
    gate = threading.Event()
    real_compile = torch.compile

    def gated_compile(function, **options):
        compiled = real_compile(function, **options)

        def after_the_gate(*args):
            assert gate.wait(timeout=600), "the test never opened the gate"
            return compiled(*args)
        return after_the_gate

    monkeypatch.setattr(cpu_decode, "WARM_UP_BUDGET_S", 0.0)  # the graph of 2+ rows only
    monkeypatch.setattr(cpu_decode.torch, "compile", gated_compile)
    engine = LLMEngine(_config(model_dir, cpu_compile_decode=True))
    route = engine.executor.compiled_decode
    assert engine.warming_up()
    during, _, _ = _generate(engine)
    assert route.steps == 0 and engine.warming_up()  # still compiling: nothing took the route
    gate.set()
    assert route.wait_warm_up(timeout_s=600) and not engine.warming_up()
    after, _, _ = _generate(engine)
    assert route.steps >= 5
    assert after == during == _generate(LLMEngine(_config(model_dir)))[0]
