"""Does the bf16 GPU path compute what the fp32 CPU reference does? Greedy tokens and logits
of a short prompt, teacher-forced, apart from every timed step."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.execution.loader import load_model
from engine.execution.worker import Worker
from engine.interfaces.forward_batch import build_forward_batch
from engine.interfaces.step_io import SchedulerOutput
from engine.kernels.gpu.batch_plan import build_gpu_batch_plan
from roofline.model import BLOCK_SIZE, CONFIG_1P5B, chunk


def numerics_check(worker: Worker, model_dir: Path, prompt_len: int = 32, new_tokens: int = 8) -> dict:
    """Greedy tokens on the GPU (prefill + decode steps) vs the fp32 CPU reference, teacher-forced."""
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(2, CONFIG_1P5B["vocab_size"], (prompt_len,), generator=g).tolist()
    blocks = 4
    request, tokens, gpu_logits = 0, list(prompt), []
    step = SchedulerOutput((chunk(request, prompt, 0, blocks, True),))
    for i in range(new_tokens):
        batch = build_forward_batch(list(step.chunks), BLOCK_SIZE, worker.device)
        with torch.inference_mode():
            plan = build_gpu_batch_plan(batch, BLOCK_SIZE, worker.device,
                                        fold_gated_norm=worker.eager_pass.fold_gated_norm)
            hidden = worker.model(batch, worker.caches, gpu_plan=plan)
            gpu_logits.append(worker.model.compute_logits(hidden[-1:]).cpu()[0])
        tokens.append(int(gpu_logits[-1].argmax()))
        step = SchedulerOutput((chunk(request, tokens[-1:], len(tokens) - 1, blocks, False),))
    gpu_logits = torch.stack(gpu_logits)  # (new_tokens, V)

    ref_model, _ = load_model(model_dir, dtype=torch.float32, device="cpu")
    ref_caches = ref_model.allocate_caches(num_blocks=blocks, block_size=BLOCK_SIZE, num_state_slots=1)
    ref_step = SchedulerOutput((chunk(0, tokens[:-1], 0, blocks, True),))
    with torch.inference_mode():
        hidden = ref_model(build_forward_batch(list(ref_step.chunks), BLOCK_SIZE, torch.device("cpu")), ref_caches)
        ref_logits = ref_model.compute_logits(hidden[prompt_len - 1 :])  # (new_tokens, V)
    del ref_model, ref_caches
    err = (gpu_logits - ref_logits).abs().max(dim=-1).values
    top2 = ref_logits.topk(2, dim=-1).values
    near_tie = (top2[:, 0] - top2[:, 1]) <= 2 * err
    agree = gpu_logits.argmax(-1) == ref_logits.argmax(-1)
    rel = float((gpu_logits - ref_logits).norm() / ref_logits.norm())
    return {
        "prompt_tokens": prompt_len, "greedy_tokens": new_tokens,
        "logits_relative_error": rel,
        "greedy_agree": int(agree.sum()), "disagree_near_tie": int((~agree & near_tie).sum()),
        "disagree_not_tie": int((~agree & ~near_tie).sum()),
        "passed": rel < 5e-2 and int((~agree & ~near_tie).sum()) == 0,
    }
