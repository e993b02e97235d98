"""The gated delta-net's CUDA verification glue (engine/speculative/verify_gpu.py
mix_delta_rule_verification_gpu), on the CPU: PyTorch stand-ins hold the contracts of plain
decoding's two kernels over slot pools (the varlen causal conv, engine/kernels/gpu/conv.py,
and fla-core's one-token recurrent kernel, engine/kernels/gpu/gated_delta_rule.py
gated_delta_rule_decode) and of the mixer's ordinary GPU path for the step's other chunks;
the result must be the CPU verification path's (verify.py mix_verification, the mixer's
one-token decode step chained token by token) at every position and in every slot, the
requests' own slots untouched. The kernels themselves run in
tests/gpu/test_delta_rule_verify_gpu.py, which reuses this module's case."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.interfaces.forward_batch import SequenceChunk, build_forward_batch
from engine.kernels.conv_reference import causal_conv1d_step
from engine.kernels.gated_delta_rule_reference import gated_delta_rule_step, l2_normalize
from engine.kernels.gpu.batch_plan import GpuBatchPlan, build_gpu_batch_plan
from engine.models.qwen3_next import Qwen3NextModel
from engine.models.registry import parse_model_config
from engine.interfaces.sampling_params import SamplingParams
from engine.kernels.gpu.batch_plan import VerificationPlan, build_verification_plan
from engine.layers.verification import mix_delta_rule_verification_gpu, mix_verification
from engine.speculative.verify import VerificationScratch
from engine.speculative.verify_gpu import verification_index
from engine.interfaces.step_io import ScheduledChunk

K = 3  # drafts: n = 4 positions at most
BLOCK_SIZE = 16
RAW = dict(
    model_type="qwen3_next", vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    layer_types=["linear_attention", "full_attention"], num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=32, linear_conv_kernel_dim=4, num_experts=0, rms_norm_eps=1e-6,
    max_position_embeddings=256,
)


def random_mixer(dtype: torch.dtype, device: torch.device):
    """RAW's first gated delta-net with seeded random weights (the same on every device) and
    the model's (conv, recurrent) state shapes."""
    model = Qwen3NextModel(parse_model_config(RAW), dtype)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.copy_(torch.log(torch.rand(param.shape, generator=g) * 8 + 0.5))
            else:
                param.copy_((0.3 if name.endswith("dt_bias") else 0.2) * torch.randn(param.shape, generator=g))
    model = model.to(device=device).eval()
    mixer = next(layer.linear_attn for layer in model.layers if layer.linear_attn is not None)
    return mixer, model.recurrent_state_shape()


@dataclass
class Case:
    """One step: other chunks (a 5-token continued prefill on slot 3, a decode on slot 4) at
    rows 0..5, then verification chunks of 4, 2 and 3 tokens (slots 1, 0, 2) at rows 6, 10, 12;
    state slots 0..4, scratch slots from 5 (k + 1 per slot), every slot random."""

    qkv: torch.Tensor  # (T, C) pre-conv
    b: torch.Tensor  # (T, Hv)
    a: torch.Tensor  # (T, Hv)
    conv_state: torch.Tensor  # (slots, C, K-1), the states before the step
    recurrent_state: torch.Tensor  # (slots, Hv, dk, dv) fp32
    rest: list[tuple[int, int, int]]  # (first row, length, slot) of the other chunks
    verifying: list[tuple[int, int, int]]  # (first row, length, slot) of the verification chunks
    scratch: VerificationScratch
    plan: VerificationPlan


def make_case(mixer, state_shapes, dtype: torch.dtype, device: torch.device, seed: int = 3) -> Case:
    g = torch.Generator().manual_seed(seed)
    rest = [(0, 5, 3), (5, 1, 4)]
    verifying = [(6, 4, 1), (10, 2, 0), (12, 3, 2)]
    num_slots, T = 5, 15
    scratch = VerificationScratch(None, num_slots, K)
    total = num_slots + VerificationScratch.num_scratch_slots(num_slots, K)
    (channels, taps), rec_shape = state_shapes
    Hv = mixer.num_value_heads
    qkv = torch.randn(T, channels, generator=g).to(device, dtype)
    b, a = (torch.randn(T, Hv, generator=g).to(device, dtype) for _ in range(2))
    conv_state = torch.randn(total, channels, taps, generator=g).to(device, dtype)
    recurrent_state = 0.3 * torch.randn(total, *rec_shape, generator=g).to(device)
    rest_chunks = [ScheduledChunk(f"r{slot}", tuple(range(n)), 8, (slot,), slot, False, True,
                                  SamplingParams(temperature=0)) for _, n, slot in rest]
    rest_plan = build_gpu_batch_plan(build_forward_batch(rest_chunks, BLOCK_SIZE, device), BLOCK_SIZE, device)
    firsts, lengths, slots = zip(*verifying)
    index = verification_index(firsts, lengths, slots, scratch)
    plan = build_verification_plan(index, rest_plan, 6, device)
    return Case(qkv, b, a, conv_state, recurrent_state, rest, verifying, scratch, plan)


def reference_run(mixer, case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The CPU path on copies of the case's states: each other chunk through mix_sequence
    (decode through mix_decode), each verification chunk through mix_verification. Returns
    (y (T, Hv, dv) fp32, conv states, recurrent states) after the step."""
    conv, rec = case.conv_state.clone(), case.recurrent_state.clone()
    y = case.qkv.new_zeros(case.qkv.shape[0], mixer.num_value_heads, mixer.value_head_dim, dtype=torch.float32)
    inputs = (case.qkv, case.b, case.a)
    for first, length, slot in case.rest:
        rows = slice(first, first + length)
        step = mixer.mix_decode if length == 1 else mixer.mix_sequence
        state = (conv[slot : slot + 1], rec[slot : slot + 1]) if length == 1 else (conv[slot], rec[slot])
        out, conv_out, rec_out = step(*(t[rows] for t in inputs), *state)
        y[rows] = out
        conv[slot], rec[slot] = conv_out.reshape(conv[slot].shape), rec_out.reshape(rec[slot].shape)
    for first, length, slot in case.verifying:
        rows = slice(first, first + length)
        chunk = SequenceChunk(slot, 8, length, (slot,), False, case.scratch.slots(slot, length))
        y[rows] = mix_verification(mixer.mix_decode, tuple(t[rows] for t in inputs), conv, rec, chunk)
    return y, conv, rec


def conv_varlen_reference(x, conv_state, weight, bias, cu_seqlens, chunk_slot, chunk_reset, token_chunk,
                          apply_silu, out=None):
    """causal_conv1d_varlen's contract in PyTorch: chunk s (rows cu_seqlens[s]:[s+1], token_chunk
    naming it for each row) convolved from conv_state[chunk_slot[s]] (zeros if it resets)
    token by token, the slot left holding the window after the chunk; returns out (T, C)."""
    bounds = cu_seqlens.tolist()
    assert token_chunk.tolist() == [s for s in range(len(bounds) - 1) for _ in range(bounds[s + 1] - bounds[s])]
    out = torch.empty_like(x)
    for s, (slot, reset) in enumerate(zip(chunk_slot.tolist(), chunk_reset.tolist())):
        window = torch.zeros_like(conv_state[slot : slot + 1]) if reset else conv_state[slot : slot + 1]
        for row in range(bounds[s], bounds[s + 1]):
            y, window = causal_conv1d_step(x[row : row + 1], window, weight, bias, apply_silu)
            out[row] = y[0]
        conv_state[slot] = window[0]
    return out


def rule_decode_reference(q, k, v, g, beta, scale, state_pool, slots, reset):
    """gated_delta_rule_decode's contract in PyTorch: q, k raw per key head (L2-normalised and
    expanded to the value heads here), one token of each of S sequences from state_pool[slots]
    (zeros where reset), the new states written back; returns o (S, Hv, dv) in v's dtype."""
    expand = lambda t: l2_normalize(t).repeat_interleave(v.shape[1] // t.shape[1], dim=1)  # noqa: E731
    initial = torch.where((reset != 0)[:, None, None, None], 0.0, state_pool[slots])
    o, new = gated_delta_rule_step(expand(q), expand(k), v, g, beta, initial, scale)
    state_pool[slots] = new
    return o.to(v.dtype)


def mix_rest_reference(mixer):
    """GatedDeltaNet.mix_chunks_gpu's contract over its plan's chunks, in PyTorch: each chunk
    from its slot (zeros where it resets) through mix_sequence, the slot left holding the state
    after it; returns y (T, Hv, dv) in qkv's dtype."""

    def mix_rest(qkv, b, a, conv_state, recurrent_state, plan: GpuBatchPlan):
        y = qkv.new_empty(qkv.shape[0], mixer.num_value_heads, mixer.value_head_dim)
        bounds = plan.cu_seqlens.tolist()
        for s, (slot, reset) in enumerate(zip(plan.chunk_slot.tolist(), plan.chunk_reset.tolist())):
            rows = slice(bounds[s], bounds[s + 1])
            conv, rec = conv_state[slot], recurrent_state[slot]
            if reset:
                conv, rec = torch.zeros_like(conv), torch.zeros_like(rec)
            out, conv_state[slot], recurrent_state[slot] = mixer.mix_sequence(qkv[rows], b[rows], a[rows], conv, rec)
            y[rows] = out.to(y.dtype)
        return y

    return mix_rest


def test_delta_rule_verification_glue_equals_the_cpu_path():
    """y at every row, and every slot's conv and recurrent state, equal the CPU path's; the
    verification chunks' own slots are untouched, and so is every scratch slot past a chunk's
    length."""
    mixer, shapes = random_mixer(torch.float32, torch.device("cpu"))
    case = make_case(mixer, shapes, torch.float32, torch.device("cpu"))
    conv, rec = case.conv_state.clone(), case.recurrent_state.clone()
    with torch.inference_mode():
        want_y, want_conv, want_rec = reference_run(mixer, case)
        y = mix_delta_rule_verification_gpu(
            mixer, case.qkv, case.b, case.a, conv, rec, case.plan,
            conv_step=conv_varlen_reference, rule_step=rule_decode_reference, mix_rest=mix_rest_reference(mixer),
        )
    assert y.dtype == case.qkv.dtype and y.shape == want_y.shape
    for first, length, slot in case.rest + case.verifying:
        for row in range(first, first + length):
            torch.testing.assert_close(y[row], want_y[row], rtol=1e-5, atol=1e-5, msg=f"y at row {row}")
    for slot in range(conv.shape[0]):
        torch.testing.assert_close(conv[slot], want_conv[slot], rtol=0, atol=0, msg=f"conv slot {slot}")
        torch.testing.assert_close(rec[slot], want_rec[slot], rtol=1e-5, atol=1e-5, msg=f"recurrent slot {slot}")
    for _, length, slot in case.verifying:
        assert torch.equal(conv[slot], case.conv_state[slot]) and torch.equal(rec[slot], case.recurrent_state[slot])
        past = list(case.scratch.slots(slot, K + 1))[length:]
        assert torch.equal(conv[past], case.conv_state[past]) and torch.equal(rec[past], case.recurrent_state[past])
    for _, _, slot in case.rest:  # the other chunks moved their own slots on
        assert not torch.equal(rec[slot], case.recurrent_state[slot])


def test_verification_plan_has_one_token_chunk_bounds():
    """chunk_bounds (V + 1,) = 0..V, in the plan's one copy."""
    scratch = VerificationScratch(None, first_slot=20, num_speculative_tokens=K)
    plan = build_verification_plan(verification_index([0, 4, 6], [4, 2, 3], [2, 5, 0], scratch), None, 0,
                                   torch.device("cpu"))
    assert plan.chunk_bounds.tolist() == [0, 1, 2, 3]
