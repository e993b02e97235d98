"""Train an MTP head for a model without one (the 1.5B GraniteMoeHybrid of
benchmarks/roofline/model.py, or the tiny embedded model with --cpu) on the model's own greedy
continuations, the model's weights frozen, and write a model dir the engine drafts with
(speculative_drafter mtp, or the speculation policy's default: engine/speculative/policy.py).

1. Data: varied prompts (random token spans of varied lengths, and chat prompts of random words
   under a few system prompts), each continued greedily by the model itself (LLMEngine,
   speculation off); the training sequences are prompt + continuation.
2. Targets: the frozen model's final-normed hidden rows h_0 .. h_{L-1} of each sequence (one
   forward pass, no gradients; on CUDA through the GPU path's batch plan).
3. Training: the head (engine/models/mtp_head.py: norms, fc, one attention decoder layer of
   the family, norm; initialised as random_mtp_head draws it) predicts t_{q+1} from (t_q,
   h_{q-1}) at every position q >= 1 of a sequence, through the engine's own PyTorch path
   (run_head over a private KV cache of the head's layer), cross-entropy of the model's LM
   head (frozen) on the head's output; AdamW.
4. Output: --out-dir holds the model's files (hard links where possible) plus the head
   (engine/speculative/policy.py TRAINED_HEAD_FILE, unsharded) and TRAINED_HEAD_REPORT: the
   acceptance at each draft depth measured by the engine drafting with the head on held-out
   prompts (LLMEngine, speculation on, k = --k), whether its outputs equal plain decoding's,
   the same on as many training prompts ("seen": how well the head the engine loads fits what
   it was trained on), and the training figures. The policy reads the held-out acceptance.

    python benchmarks/train_mtp_head.py --out-dir $OUT/granite-1p5b-mtp          # on the GPU
    python benchmarks/train_mtp_head.py --cpu --steps 20 --out-dir /tmp/tiny-mtp   # seconds, CPU

benchmarks/spec_decode.py --train-head runs this first and measures with the trained head.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from engine.core.llm_engine import LLMEngine  # noqa: E402
from engine.engine_config import DEFAULT_MODEL_DIR, EngineConfig  # noqa: E402
from engine.interfaces.forward_batch import build_forward_batch  # noqa: E402
from engine.interfaces.generation_request import GenerationRequest  # noqa: E402
from engine.interfaces.sampling_params import SamplingParams  # noqa: E402
from engine.interfaces.step_io import ScheduledChunk  # noqa: E402
from engine.models.mtp_head import run_head  # noqa: E402
from engine.speculative.policy import TRAINED_HEAD_FILE, TRAINED_HEAD_REPORT  # noqa: E402

WORDS = ("the river over stone light paper north seven quiet garden engine window before after "
         "market winter number silver question answer table music letter bridge island").split()
SYSTEMS = ("You are a terse assistant.", "Answer as a ship's log would.", "Reply with lists of facts.")
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Settings:
    cpu: bool
    steps: int
    batch: int  # sequences per training step
    sequences: int  # training sequences
    heldout: int  # prompts the acceptance is measured on
    output_tokens: int  # greedy continuation of each prompt
    k: int  # draft depths measured
    lr: float
    seed: int


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, required=True, help="the model dir to write")
    parser.add_argument("--cpu", action="store_true", help="the tiny embedded model on the CPU (seconds)")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="the model to train a head for (default: the 1.5B random model, built "
                             "as benchmarks/bench_gpu.py builds it; with --cpu the tiny model)")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default 600; --cpu 20)")
    parser.add_argument("--batch", type=int, default=None, help="sequences a step (default 32; --cpu 4)")
    parser.add_argument("--sequences", type=int, default=None, help="training sequences (default 512; --cpu 8)")
    parser.add_argument("--heldout", type=int, default=None, help="held-out prompts (default 32; --cpu 2)")
    parser.add_argument("--output-tokens", type=int, default=None, help="continuation length (default 192; --cpu 12)")
    parser.add_argument("--k", type=int, default=3, help="draft depths the acceptance is measured at")
    parser.add_argument("--lr", type=float, default=None, help="AdamW learning rate (default 3e-4; --cpu 3e-3)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def settings_of(args: argparse.Namespace) -> Settings:
    pick = lambda value, gpu, cpu: value if value is not None else (cpu if args.cpu else gpu)  # noqa: E731
    return Settings(cpu=args.cpu, steps=pick(args.steps, 600, 20), batch=pick(args.batch, 32, 4),
                    sequences=pick(args.sequences, 512, 8), heldout=pick(args.heldout, 32, 2),
                    output_tokens=pick(args.output_tokens, 192, 12), k=args.k, lr=pick(args.lr, 3e-4, 3e-3),
                    seed=args.seed)


def engine_config(model_dir: Path, settings: Settings, **changes) -> EngineConfig:
    """Plain decoding by default (num_speculative_tokens 0: the policy is not asked)."""
    changes = {"num_speculative_tokens": 0, **changes}
    if settings.cpu:
        return EngineConfig(model_dir=str(model_dir), max_num_seqs=16, **changes)
    return EngineConfig(model_dir=str(model_dir), device="cuda", dtype="bfloat16", max_model_len=2048,
                        max_num_seqs=64, max_num_batched_tokens=8192, kv_cache_bytes=2 << 30,
                        state_cache_bytes=3 << 30, checkpoint_cache_bytes=1 << 30, **changes)


def prompts(tokenizer, count: int, vocab: int, rng: random.Random, longest: int) -> list[list[int]]:
    """Half random token spans (8..longest ids), half chat prompts of random words (up to
    longest / 2) under a system prompt, in random order."""
    out = []
    for i in range(count):
        if i % 2:
            out.append([rng.randrange(100, vocab) for _ in range(rng.randint(8, longest))])
        else:
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, longest // 2)))
            conversation = [{"role": "system", "content": rng.choice(SYSTEMS)}, {"role": "user", "content": words}]
            out.append([int(t) for t in tokenizer.apply_chat_template(
                conversation, add_generation_prompt=True, tokenize=True, return_dict=False)])
    rng.shuffle(out)
    return out


def continue_greedily(engine: LLMEngine, batch: list[list[int]], max_tokens: int, salt: str) -> list[list[int]]:
    """Each prompt's greedy continuation (EOS ignored, so every one has max_tokens)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(batch):
        engine.add_request(GenerationRequest(f"{salt}-{i}", prompt, params, cache_salt=salt))
    tokens: dict[str, list[int]] = {f"{salt}-{i}": [] for i in range(len(batch))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return [tokens[f"{salt}-{i}"] for i in range(len(batch))]


def _chunks(sequences: list[list[int]], blocks_per_seq: int, start: int = 0) -> list[ScheduledChunk]:
    return [ScheduledChunk(f"s{i}", tuple(seq[start:]), start, tuple(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)),
                           i, True, False, SamplingParams(temperature=0)) for i, seq in enumerate(sequences)]


@torch.no_grad()
def hidden_rows(model, sequences: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """The frozen model's final-normed hidden rows of each sequence ((L, D) each), in one
    forward pass over fresh caches (on CUDA through the GPU path's batch plan)."""
    longest = max(map(len, sequences))
    blocks_per_seq = -(-longest // BLOCK_SIZE)
    caches = model.allocate_caches(num_blocks=blocks_per_seq * len(sequences), block_size=BLOCK_SIZE,
                                   num_state_slots=len(sequences), device=device)
    batch = build_forward_batch(_chunks(sequences, blocks_per_seq), BLOCK_SIZE, device)
    plan = None
    if device.type == "cuda":
        from engine.kernels.gpu.batch_plan import build_gpu_batch_plan

        plan = build_gpu_batch_plan(batch, BLOCK_SIZE, device, fold_gated_norm=model.folds_gated_norm())
    hidden = model(batch, caches, gpu_plan=plan)
    bounds = batch.cu_seqlens
    return [hidden[bounds[i] : bounds[i + 1]].clone() for i in range(len(sequences))]


class HeadCache:
    """The head layer's KV cache alone (what run_head reads and writes: caches.key_cache and
    value_cache at the head's layer index, in the model dtype: no FP8 scales), fresh for each
    training step."""

    def __init__(self, layer: int, blocks: int, like: torch.Tensor) -> None:
        self.block_size = BLOCK_SIZE
        self.key_cache = {layer: like.new_zeros(blocks, BLOCK_SIZE, *like.shape[2:])}
        self.value_cache = {layer: like.new_zeros(blocks, BLOCK_SIZE, *like.shape[2:])}
        self.kv_scale: dict[int, torch.Tensor] = {}


def head_loss(model, head, sequences: list[list[int]], hidden: list[torch.Tensor], device: torch.device,
              cache_like: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the head's prediction of t_{q+1} from (t_q, h_{q-1}) over every
    position 1 <= q <= L - 2 of the sequences: rows of positions 1 .. L - 2, keys from
    position 1 (first_key 1), through the engine's PyTorch path (run_head, gpu_plan None)."""
    blocks_per_seq = -(-max(map(len, sequences)) // BLOCK_SIZE)
    inputs = [seq[:-1] for seq in sequences]  # position L - 1 has no target
    batch = build_forward_batch(_chunks(inputs, blocks_per_seq, start=1), BLOCK_SIZE, device)
    batch = replace(batch, chunks=tuple(replace(c, first_key=1) for c in batch.chunks))
    previous = torch.cat([h[: len(seq) - 2] for h, seq in zip(hidden, sequences)])  # h_0 .. h_{L-3}
    cache = HeadCache(head.layer_index, blocks_per_seq * len(sequences), cache_like)
    out = run_head(model, head, cache, batch, previous, None)
    targets = torch.tensor([t for seq in sequences for t in seq[2:]], device=device)
    return F.cross_entropy(model.compute_logits(out).float(), targets)


def measure_acceptance(model_dir: Path, runs: dict[str, tuple[list[list[int]], list[list[int]]]],
                       settings: Settings) -> dict:
    """The engine drafting with the trained head (k = settings.k) over each run's prompts (label
    -> (prompts, plain decoding's outputs)): for each, the acceptance at each depth and whether
    the outputs equal plain decoding's."""
    engine = LLMEngine(engine_config(model_dir, settings, num_speculative_tokens=settings.k, speculative_drafter="mtp"))
    report = {}
    for label, (batch, plain) in runs.items():
        before = engine.stats().speculation.copy()
        outputs = continue_greedily(engine, batch, settings.output_tokens, label)
        after = engine.stats().speculation
        proposed = [a - b for a, b in zip(after.depth_proposed, before.depth_proposed)]
        accepted = [a - b for a, b in zip(after.depth_accepted, before.depth_accepted)]
        chunks = after.verification_chunks - before.verification_chunks
        report[label] = {
            "acceptance_by_depth": [a / p if p else 0.0 for a, p in zip(accepted, proposed)],
            "depth_proposed": proposed, "depth_accepted": accepted,
            "tokens_per_verification": 1 + sum(accepted) / max(chunks, 1),
            "same_outputs_as_off": outputs == plain,
        }
    engine.shutdown()
    return report


def copy_model(source: Path, target: Path) -> None:
    """target gets source's files (hard links where the filesystem allows, else copies)."""
    target.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():  # files only: not a head the source may have (its own folder)
        if path.is_file():
            destination = target / path.name
            destination.unlink(missing_ok=True)
            try:
                os.link(path, destination)
            except OSError:
                shutil.copy2(path, destination)


def train(model_dir: Path, out_dir: Path, settings: Settings, log=print) -> dict:
    """Steps 1-4 of the module docstring; returns the report written to TRAINED_HEAD_REPORT."""
    from safetensors.torch import save_file

    started = time.perf_counter()
    torch.manual_seed(settings.seed)
    rng = random.Random(settings.seed)
    teacher = LLMEngine(engine_config(model_dir, settings))
    model = teacher.executor.model  # the worker's model, in this process (tensor_parallel_size 1)
    device = next(model.parameters()).device
    all_prompts = prompts(teacher.tokenizer, settings.sequences + settings.heldout, teacher.vocab_size, rng,
                          longest=32 if settings.cpu else 96)
    train_prompts, heldout = all_prompts[: settings.sequences], all_prompts[settings.sequences :]
    sequences = []
    for first in range(0, len(train_prompts), 64):
        part = train_prompts[first : first + 64]
        sequences += [p + c for p, c in zip(part, continue_greedily(teacher, part, settings.output_tokens, f"t{first}"))]
    plain = continue_greedily(teacher, heldout, settings.output_tokens, "heldout")
    generated = time.perf_counter()
    log(f"{len(sequences)} sequences continued in {generated - started:.1f} s")
    hidden = []
    for first in range(0, len(sequences), 32):
        hidden += hidden_rows(model, sequences[first : first + 32], device)
    cache_like = next(iter(teacher.executor.caches.key_cache.values()))
    head = model.random_mtp_head(settings.seed)
    head.requires_grad_(True)
    parameters = [p for p in head.parameters()]
    optimizer = torch.optim.AdamW(parameters, lr=settings.lr, weight_decay=0.0)
    losses = []
    for step in range(settings.steps):
        picked = rng.sample(range(len(sequences)), min(settings.batch, len(sequences)))
        loss = head_loss(model, head, [sequences[i] for i in picked], [hidden[i] for i in picked], device, cache_like)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        losses.append(float(loss))
        if step % max(1, settings.steps // 10) == 0 or step == settings.steps - 1:
            log(f"step {step}: loss {losses[-1]:.4f}")
    trained = time.perf_counter()
    copy_model(model_dir, out_dir)
    (out_dir / TRAINED_HEAD_FILE).parent.mkdir(exist_ok=True)
    save_file({name: p.detach().to("cpu").contiguous() for name, p in head.named_parameters()},
              str(out_dir / TRAINED_HEAD_FILE))
    teacher.shutdown()
    del teacher, model, head, hidden, optimizer, parameters, cache_like  # the GPU memory, before the next engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    report = {"model_dir": str(model_dir), "settings": settings.__dict__, "losses": losses,
              "first_loss": losses[0] if losses else None, "final_loss": losses[-1] if losses else None,
              "generate_seconds": generated - started, "train_seconds": trained - generated}
    seen = train_prompts[: settings.heldout]
    measured = measure_acceptance(out_dir, {
        "heldout": (heldout, plain),
        "seen": (seen, [sequences[i][len(p):] for i, p in enumerate(seen)]),
    }, settings)
    report.update(measured["heldout"])  # acceptance_by_depth: the held-out prompts', what the policy reads
    report["seen"] = measured["seen"]
    report["wall_seconds"] = time.perf_counter() - started
    (out_dir / TRAINED_HEAD_REPORT).write_text(json.dumps(report, indent=2))
    log(f"acceptance by depth, held out {[round(a, 3) for a in report['acceptance_by_depth']]}, "
        f"seen {[round(a, 3) for a in report['seen']['acceptance_by_depth']]}; same outputs as off: "
        f"{report['same_outputs_as_off'] and report['seen']['same_outputs_as_off']} ({report['wall_seconds']:.1f} s)")
    return report


def model_dir_for(args: argparse.Namespace, tmp: Path) -> Path:
    """--model-dir, else the tiny model (--cpu) or the 1.5B random model written under tmp."""
    if args.model_dir is not None:
        return args.model_dir
    if args.cpu:
        return DEFAULT_MODEL_DIR
    from bench_gpu import model_dir_of

    return model_dir_of(argparse.Namespace(quick=False), tmp)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        return train(model_dir_for(args, Path(tmp)), args.out_dir, settings_of(args))


if __name__ == "__main__":
    main()
