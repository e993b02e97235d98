"""The gated delta-net's CUDA verification glue (engine/layers/verification.py
mix_delta_rule_verification_gpu), on the CPU: the one-pass kernel's PyTorch reference
(engine/kernels/verification_reference.py delta_rule_verify_reference) and a PyTorch stand-in
for the mixer's ordinary GPU path (the step's other chunks) in place of the kernels; the
result must be the CPU verification path's (mix_verification, the mixer's one-token decode
step chained token by token) at every position and in every slot, the requests' own slots
untouched. The kernel against that reference: tests/gpu/test_verify_kernels.py; the route on
a GPU: tests/gpu/test_delta_rule_verify_gpu.py, which reuses this module's case."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.interfaces.forward_batch import SequenceChunk, build_forward_batch
from engine.kernels.verification_reference import delta_rule_verify_reference
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
            verify=delta_rule_verify_reference, mix_rest=mix_rest_reference(mixer),
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
