"""Speculative verification of Qwen3-Next's gated delta-net on one CUDA device
(engine/layers/verification.py mix_delta_rule_verification_gpu).

- The mixer: tests/engine/test_delta_rule_verify_gpu_host.py's step (two other chunks, then
  verification chunks of 4, 2 and 3 tokens) through the real kernels (the one-pass kernel
  engine/kernels/gpu/delta_rule_verify.py, mix_chunks_gpu for the others) against
  the CPU verification path run in PyTorch on the same device (mix_verification, the mixer's
  decode step chained token by token): y at every row and every slot's states, the requests'
  own slots untouched; fp32 and bf16.
- The engine: tests/families/test_qwen3_next_speculative_gpu.py (a model whose drafts are
  accepted; a plain random Qwen3-Next repeats too little for the n-gram drafter).

The glue itself is checked on the CPU with PyTorch stand-ins for the kernels
(tests/engine/test_delta_rule_verify_gpu_host.py), the one-pass kernel against its reference
in tests/gpu/test_verify_kernels.py (also under Triton's interpreter). The other chunks run
fla-core's kernels, which cannot run under Triton's interpreter: every test here needs the GPU.
"""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_delta_rule_verify_gpu_host import K, make_case, random_mixer, reference_run
from tests.gpu.conftest import relative_error

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="fla-core's kernels need a CUDA device"),
]

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}  # kernel vs PyTorch, over up to 4 chained steps
# the other chunks' 5-token prefill: fla's chunked kernel against the reference's chunked scan
# (tests/gpu/test_gated_delta_rule.py's mixer tolerance)
REST_TOL = {torch.float32: 5e-3, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixer_verification_equals_the_chained_decode_step(dtype):
    from engine.layers.verification import mix_delta_rule_verification_gpu

    device = torch.device("cuda")
    mixer, shapes = random_mixer(dtype, device)
    case = make_case(mixer, shapes, dtype, device)
    conv, rec = case.conv_state.clone(), case.recurrent_state.clone()
    with torch.inference_mode():
        want_y, want_conv, want_rec = reference_run(mixer, case)
        y = mix_delta_rule_verification_gpu(mixer, case.qkv, case.b, case.a, conv, rec, case.plan)
        torch.cuda.synchronize()
    worst = 0.0
    for first, length, slot in case.verifying:
        for i, scratch_slot in enumerate(case.scratch.slots(slot, length)):
            row = first + i
            error = max(relative_error(y[row].float(), want_y[row]), relative_error(rec[scratch_slot], want_rec[scratch_slot]))
            worst = max(worst, error)
            assert error < TOL[dtype], f"y or recurrent state, chunk at {first}, position {i}: {error:.2e}"
            assert torch.equal(conv[scratch_slot], want_conv[scratch_slot]), f"conv window, chunk at {first}, position {i}"
        assert torch.equal(conv[slot], case.conv_state[slot]) and torch.equal(rec[slot], case.recurrent_state[slot])
        past = list(case.scratch.slots(slot, K + 1))[length:]
        assert torch.equal(conv[past], case.conv_state[past]) and torch.equal(rec[past], case.recurrent_state[past])
    print(f"\n[{dtype}] verification positions: worst relative error {worst:.2e}")
    for first, length, slot in case.rest:
        rows = slice(first, first + length)
        assert relative_error(y[rows].float(), want_y[rows]) < REST_TOL[dtype], f"y of the other chunk at {first}"
        assert relative_error(rec[slot], want_rec[slot]) < REST_TOL[dtype], f"recurrent slot {slot}"
        assert torch.equal(conv[slot], want_conv[slot]), f"conv slot {slot}"

