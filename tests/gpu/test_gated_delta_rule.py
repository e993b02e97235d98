"""The gated delta rule on CUDA (engine/kernels/gpu/gated_delta_rule.py: fla-core's kernels
over the engine's state slots) against its pure-PyTorch reference
(engine/kernels/gated_delta_rule_reference.py), in fp32 and bf16; then Qwen3-Next's gated
delta-net mixer and whole model (dense, and with routed experts) on their CUDA path against
their PyTorch path.

fla-core's kernels cannot run under Triton's interpreter: every test here needs a CUDA device.
Slots of chunks that reset are filled with NaN first: they must not be read.
"""

from __future__ import annotations

import pytest
import torch

from engine.interfaces.forward_batch import build_forward_batch
from engine.kernels.gated_delta_rule_reference import (
    chunk_gated_delta_rule, gated_delta_rule_step, l2_normalize,
)
from engine.kernels.gpu.batch_plan import build_gpu_batch_plan
from engine.models.qwen3_next import Qwen3NextModel
from engine.models.registry import parse_model_config
from engine.interfaces.sampling_params import SamplingParams
from engine.interfaces.step_io import ScheduledChunk, SchedulerOutput
from tests.gpu.conftest import eager_forward, relative_error

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="fla-core's kernels need a CUDA device"),
]

HK, HV, K, V = 2, 4, 32, 64  # grouped value heads: each key head serves 2 value heads
TOLERANCES = {torch.float32: 5e-3, torch.bfloat16: 3e-2}  # fla's dots run in tf32 / bf16
BLOCK_SIZE = 16


def _inputs(num_tokens: int, seed: int) -> dict[str, torch.Tensor]:
    """Raw q, k (T, HK, K), v (T, HV, V), g (T, HV) <= 0 and beta (T, HV) in (0, 1), CPU fp32."""
    g = torch.Generator().manual_seed(seed)
    return dict(
        q=torch.randn(num_tokens, HK, K, generator=g), k=torch.randn(num_tokens, HK, K, generator=g),
        v=torch.randn(num_tokens, HV, V, generator=g),
        g=-torch.rand(num_tokens, HV, generator=g) * 1.5 - 0.01,
        beta=torch.rand(num_tokens, HV, generator=g),
    )


def _reference(x: dict[str, torch.Tensor], state: torch.Tensor, scale: float):
    """The reference over one sequence: q, k L2-normalised and expanded to the value heads."""
    expand = lambda t: l2_normalize(t).repeat_interleave(HV // HK, dim=1)  # noqa: E731
    return chunk_gated_delta_rule(expand(x["q"]), expand(x["k"]), x["v"], x["g"], x["beta"],
                                  state, scale, chunk_size=16)


def _on(x: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """q, k, v in dtype, g and beta fp32, on CUDA."""
    return {n: t.cuda().to(dtype if n in ("q", "k", "v") else torch.float32) for n, t in x.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths", [[37], [5, 70, 17]])  # fixed-length path; varlen path
def test_prefill_matches_reference(dtype, lengths):
    from engine.kernels.gpu.gated_delta_rule import gated_delta_rule_prefill

    scale, tol = K ** -0.5, TOLERANCES[dtype]
    g = torch.Generator().manual_seed(7)
    pool = torch.randn(len(lengths) + 2, HV, K, V, generator=g) * 0.1
    slots = list(range(2, 2 + len(lengths)))
    resets = [i % 2 == 1 for i in range(len(lengths))]
    chunks = [_inputs(n, seed=i) for i, n in enumerate(lengths)]
    expected = [_reference(x, torch.zeros(HV, K, V) if r else pool[s], scale)
                for x, s, r in zip(chunks, slots, resets)]
    gpu_pool = pool.cuda()
    for s, r in zip(slots, resets):
        if r:
            gpu_pool[s] = float("nan")
    flat = {n: torch.cat([x[n] for x in chunks]) for n in chunks[0]}
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda")
    o = gated_delta_rule_prefill(
        **_on(flat, dtype), scale=scale, state_pool=gpu_pool,
        slots=torch.tensor(slots, device="cuda"), reset=torch.tensor(resets, device="cuda", dtype=torch.int64),
        cu_seqlens=cu,
    )
    assert o.dtype == dtype and o.shape == (sum(lengths), HV, V)
    for i, (s, (want_o, want_state)) in enumerate(zip(slots, expected)):
        assert relative_error(o[cu[i]:cu[i + 1]].float().cpu(), want_o) < tol, f"chunk {i} output"
        assert relative_error(gpu_pool[s].cpu(), want_state) < tol, f"chunk {i} state"
    assert torch.equal(gpu_pool[0].cpu(), pool[0]), "a slot no chunk owns was written"


def test_padding_rows_leave_the_state_unchanged():
    """A graph's padded prefill: rows past the valid ones must not move the state."""
    from engine.kernels.gpu.gated_delta_rule import gated_delta_rule_prefill

    scale = K ** -0.5
    x = _inputs(64, seed=3)
    valid = torch.arange(64) < 41
    want_o, want_state = _reference({n: t[:41] for n, t in x.items()}, torch.zeros(HV, K, V), scale)
    pool = torch.zeros(2, HV, K, V, device="cuda")
    o = gated_delta_rule_prefill(
        **_on(x, torch.float32), scale=scale, state_pool=pool, slots=torch.tensor([1], device="cuda"),
        reset=torch.tensor([1], device="cuda"), cu_seqlens=torch.tensor([0, 64], device="cuda"),
        valid=valid.cuda(),
    )
    assert relative_error(o[:41].cpu(), want_o) < TOLERANCES[torch.float32]
    assert relative_error(pool[1].cpu(), want_state) < TOLERANCES[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_matches_reference(dtype):
    from engine.kernels.gpu.gated_delta_rule import gated_delta_rule_decode

    scale, tol = K ** -0.5, TOLERANCES[dtype]
    g = torch.Generator().manual_seed(11)
    num = 5
    pool = torch.randn(num + 1, HV, K, V, generator=g) * 0.1
    slots, resets = [5, 1, 3, 2, 4], [False, True, False, False, True]
    x = _inputs(num, seed=12)
    initial = torch.stack([torch.zeros(HV, K, V) if r else pool[s] for s, r in zip(slots, resets)])
    expand = lambda t: l2_normalize(t).repeat_interleave(HV // HK, dim=1)  # noqa: E731
    want_o, want_state = gated_delta_rule_step(expand(x["q"]), expand(x["k"]), x["v"], x["g"],
                                               x["beta"], initial, scale)
    gpu_pool = pool.cuda()
    for s, r in zip(slots, resets):
        if r:
            gpu_pool[s] = float("nan")
    o = gated_delta_rule_decode(
        **_on(x, dtype), scale=scale, state_pool=gpu_pool, slots=torch.tensor(slots, device="cuda"),
        reset=torch.tensor(resets, device="cuda", dtype=torch.int64),
    )
    assert relative_error(o.float().cpu(), want_o) < tol
    for i, s in enumerate(slots):
        assert relative_error(gpu_pool[s].cpu(), want_state[i]) < tol, f"slot {s}"


# ---- the mixer and the model ----------------------------------------------------------------

RAW = dict(
    model_type="qwen3_next", vocab_size=101, hidden_size=128, intermediate_size=192,
    num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    linear_num_key_heads=HK, linear_num_value_heads=HV, linear_key_head_dim=K,
    linear_value_head_dim=V, linear_conv_kernel_dim=4, num_experts=0, rms_norm_eps=1e-6,
    max_position_embeddings=512,
)
# every layer sparse: 4 routed experts (grouped GEMM on CUDA) and a gated shared expert
RAW_EXPERTS = dict(RAW, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                   shared_expert_intermediate_size=96)
# dense and sparse MLP layers mixed: layer 1 sparse, layers 0, 2 (decoder_sparse_step) and 3
# (mlp_only_layers) dense MLPs of intermediate_size channels
RAW_MIXED = dict(RAW_EXPERTS, decoder_sparse_step=2, mlp_only_layers=[3])


def _random_model(device: str, dtype: torch.dtype, raw: dict = RAW) -> Qwen3NextModel:
    """raw's architecture with seeded random weights (the same on every device)."""
    model = Qwen3NextModel(parse_model_config(raw), dtype)  # A_log, dt_bias stay fp32
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=g).to(param.dtype)
            if name.endswith("A_log"):
                param.copy_(torch.log(torch.rand(param.shape, generator=g) * 8 + 0.5))
            elif name.endswith("router.layer.weight"):  # wide routing margins: bf16 picks the same experts
                param.copy_(noise)
            elif name.endswith("dt_bias") or name.endswith("norm.weight"):
                param.copy_(0.3 * noise + (1.0 if name.endswith("linear_attn.norm.weight") else 0.0))
            else:
                param.copy_(0.05 * noise)
    model.stack_projections()
    return model.to(device=device).eval()


def _chunk(request: int, tokens: list[int], start: int, reset: bool) -> ScheduledChunk:
    return ScheduledChunk(
        request_id=f"r{request}", token_ids=tuple(tokens), start_position=start,
        block_table=tuple(range(request * 8, request * 8 + 8)), state_slot=request + 1,
        reset_state=reset, sample=True, sampling=SamplingParams(),
    )


def _steps() -> list[SchedulerOutput]:
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(0, RAW["vocab_size"], (n,), generator=g).tolist()  # noqa: E731
    return [
        SchedulerOutput((_chunk(0, ids(20), 0, True), _chunk(1, ids(7), 0, True))),
        SchedulerOutput((_chunk(1, ids(70), 7, False), _chunk(0, ids(1), 20, False),
                         _chunk(2, ids(1), 0, True))),
        SchedulerOutput((_chunk(2, ids(1), 1, False), _chunk(0, ids(1), 21, False),
                         _chunk(1, ids(1), 77, False))),
    ]


def _run(device: str, dtype: torch.dtype, raw: dict) -> tuple[list[torch.Tensor], torch.Tensor]:
    model = _random_model(device, dtype, raw)
    caches = model.allocate_caches(num_blocks=32, block_size=BLOCK_SIZE, num_state_slots=5, device=device)
    for layer in caches.ssm_state:  # slots start as garbage: reset chunks must not read them
        caches.ssm_state[layer].fill_(float("nan"))
        caches.conv_state[layer].fill_(float("nan"))
    hiddens = []
    with torch.inference_mode():
        for step in _steps():
            batch = build_forward_batch(list(step.chunks), BLOCK_SIZE, torch.device(device))
            hiddens.append(eager_forward(model, batch, caches).float().cpu())
    first = min(caches.ssm_state)
    return hiddens, caches.ssm_state[first][1:4].cpu()


@pytest.mark.parametrize("raw,dtype,tol", [
    (RAW, torch.float32, 1e-2), (RAW_EXPERTS, torch.float32, 1e-2), (RAW_MIXED, torch.float32, 1e-2),
    # the PyTorch path itself in bf16 on the CPU is 3.5% (dense) and 7.5% (experts) from fp32
    # on these random models
    (RAW, torch.bfloat16, 6e-2), (RAW_EXPERTS, torch.bfloat16, 1.2e-1),
], ids=["dense-fp32", "experts-fp32", "mixed-fp32", "dense-bf16", "experts-bf16"])
def test_model_gpu_forward_matches_cpu(raw, dtype, tol):
    """Three steps mixing fresh and continued prefills and decodes: every step's hidden states
    and the recurrent state slots after them, CUDA (fp32, bf16) against CPU fp32."""
    ref_hiddens, ref_state = _run("cpu", torch.float32, raw)
    hiddens, state = _run("cuda", dtype, raw)
    for i, (h, ref) in enumerate(zip(hiddens, ref_hiddens)):
        assert relative_error(h, ref) < tol, f"step {i} hidden"
    assert relative_error(state, ref_state) < tol, "recurrent state after the last step"


def test_mixer_gpu_path_matches_its_pytorch_path():
    """GatedDeltaNet.forward with a GpuBatchPlan against the same mixer without one, fp32 on
    CUDA: outputs and every chunk's conv and recurrent state slots."""
    model = _random_model("cuda", torch.float32)
    mixer = next(layer.linear_attn for layer in model.layers if layer.linear_attn is not None)
    g = torch.Generator().manual_seed(2)
    lengths = [5, 1, 17, 1, 40]
    resets = [i % 2 == 1 for i in range(len(lengths))]
    chunks = [_chunk(i, [0] * n, 0 if reset else 3, reset) for i, (n, reset) in enumerate(zip(lengths, resets))]
    batch = build_forward_batch(chunks, BLOCK_SIZE, torch.device("cuda"))
    hidden = torch.randn(batch.num_tokens, RAW["hidden_size"], generator=g).cuda()
    (conv_dim, taps), rec_shape = model.recurrent_state_shape()
    num_slots = len(lengths) + 1
    conv_state = torch.randn(num_slots, conv_dim, taps, generator=g).cuda()
    rec_state = 0.1 * torch.randn(num_slots, *rec_shape, generator=g).cuda()
    for c in chunks:
        if c.reset_state:
            conv_state[c.state_slot] = float("nan")
            rec_state[c.state_slot] = float("nan")
    states = {path: (conv_state.clone(), rec_state.clone()) for path in ("gpu", "pytorch")}
    with torch.inference_mode():
        plan = build_gpu_batch_plan(batch, BLOCK_SIZE, torch.device("cuda"))
        got = mixer(hidden, batch, *states["gpu"], gpu_plan=plan)
        want = mixer(hidden, batch, *states["pytorch"])
    assert relative_error(got, want) < 5e-3, "output"
    for c in chunks:
        for got_state, want_state, name in zip(states["gpu"], states["pytorch"], ("conv", "recurrent")):
            assert relative_error(got_state[c.state_slot], want_state[c.state_slot]) < 5e-3, \
                f"{name} slot {c.state_slot}"


def random_model_dir(directory, raw: dict = RAW_EXPERTS, **changes):
    """A saved random Qwen3-Next of raw's architecture (with `changes`) and the embedded model's
    tokenizer, its vocabulary sized to it; max_position_embeddings 1024."""
    import json
    import shutil

    from engine.engine_config import DEFAULT_MODEL_DIR
    from tests.tp.tp_support import write_random_checkpoint

    embedded = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    raw = dict(raw, vocab_size=embedded["vocab_size"], max_position_embeddings=1024,
               eos_token_id=embedded.get("eos_token_id"), **changes)
    model_dir = write_random_checkpoint(directory, raw)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (DEFAULT_MODEL_DIR / name).exists():
            shutil.copy(DEFAULT_MODEL_DIR / name, model_dir / name)
    return model_dir


def test_engine_on_cuda_serves_checkpoints_exactly(tmp_path):
    """LLMEngine on CUDA (fp32; decode and prefill CUDA graphs, fla-core's kernels, the experts'
    grouped GEMM) with a random Qwen3-Next with experts: a restored instruction checkpoint and
    a continued conversation give the from-scratch outputs (tokens, logits within 1e-4). The
    instruction checkpoint is taken in-pass (tests/gpu/test_delta_rule_in_pass.py)."""
    from engine.engine_config import EngineConfig
    from engine.core.llm_engine import LLMEngine
    from tests.engine.exactness import Outcome, Tally, check_near_ties, compare
    from tests.engine.reuse_cases import instruction_reuse, multi_turn

    model_dir = random_model_dir(tmp_path / "qwen3_next")
    engine = LLMEngine(EngineConfig(
        model_dir=str(model_dir), device="cuda", dtype="float32", max_model_len=512,
        max_num_batched_tokens=512, kv_cache_bytes=32 << 20, state_cache_bytes=32 << 20,
    ))
    assert engine.scheduler.checkpoints.in_pass_capture
    tally = Tally()
    for label, case in (("instruction reuse", instruction_reuse), ("multi-turn", multi_turn)):
        first, second, scratch = case(engine, f"gpu-qn-{label}")
        assert second.cached >= (second.boundary if label == "instruction reuse" else len(first.prompt)) > 0
        assert scratch.cached == 0
        compare(Outcome(second.tokens, second.logits, second.text, second.cached),
                Outcome(scratch.tokens, scratch.logits, scratch.text, scratch.cached), tally, label)
    check_near_ties(tally, "qwen3_next on cuda")
    assert engine.pool_usage().idle
