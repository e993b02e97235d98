"""Engine configuration: one frozen object, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "models" / "tiny-granite-hybrid"
CHECKPOINT_SLOTS = ("prompt", "response", "instruction")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the in-process engine needs to start.

    max_model_len: longest prompt + output in tokens; None takes the model's
        max_position_embeddings.
    block_size: tokens per KV block.
    max_num_batched_tokens: token budget of one step (prefill chunks plus decode tokens).
    max_num_seqs: most requests running at once (also the number of recurrent state slots).
    kv_cache_bytes / state_cache_bytes: memory budgets; the block count and the state slot
        count are derived from them (state slots are also capped by max_num_seqs).
    checkpoint_slots: which request-boundary checkpoints to capture, any subset of
        ("prompt", "response", "instruction"), stored as a tuple in that order; empty turns
        checkpoint caching off.
    checkpoint_cache_bytes: budget for checkpoint tensors held outside the KV blocks (recurrent
        state, attention tail, hidden row); the KV blocks they reference count against
        kv_cache_bytes.
    tensor_parallel_size: ranks the model is split over (one process or Ray actor each; one
        GPU each on CUDA). The cache budgets are per rank.
    in_pass_capture: allow the instruction checkpoint to be taken inside the prefill chunk's
        forward pass instead of cutting the chunk at the boundary. It takes effect only where
        the worker reports it can (CacheCapacity.in_pass_capture: one rank on CUDA); LLMEngine
        combines the two into CheckpointPolicy.in_pass_capture. False always cuts.
    async_scheduling: schedule and submit step k+1 before step k's tokens are back, so the
        device starts it as soon as step k ends and the engine's host work (updating,
        detokenizing, scheduling) overlaps the device; each step() returns the outputs of the
        step before. A request that stops then has computed one token more than it would
        without (its last sampled token, fed by the step already in flight), so its response
        checkpoint covers that token too. False: each step is collected before the next is
        scheduled.
    """

    model_dir: str = str(DEFAULT_MODEL_DIR)
    max_model_len: int | None = None
    block_size: int = 16
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 16
    kv_cache_bytes: int = 64 * 1024 * 1024
    state_cache_bytes: int = 64 * 1024 * 1024
    checkpoint_slots: tuple[str, ...] = CHECKPOINT_SLOTS
    checkpoint_cache_bytes: int = 64 * 1024 * 1024
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    tensor_parallel_size: int = 1
    in_pass_capture: bool = True
    async_scheduling: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.kv_cache_bytes <= 0 or self.state_cache_bytes <= 0:
            raise ValueError("kv_cache_bytes and state_cache_bytes must be positive")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if isinstance(self.checkpoint_slots, str):
            raise ValueError(f"checkpoint_slots must be a list, a subset of {list(CHECKPOINT_SLOTS)}")
        unknown = set(self.checkpoint_slots) - set(CHECKPOINT_SLOTS)
        if unknown:
            raise ValueError(
                f"checkpoint_slots may hold only {list(CHECKPOINT_SLOTS)}, got {sorted(unknown)}"
            )
        # one canonical form (a tuple in CHECKPOINT_SLOTS order, duplicates collapsed), so two
        # configs that ask for the same slots compare equal
        canonical = tuple(slot for slot in CHECKPOINT_SLOTS if slot in self.checkpoint_slots)
        object.__setattr__(self, "checkpoint_slots", canonical)
        if self.checkpoint_cache_bytes < 0:
            raise ValueError("checkpoint_cache_bytes must be >= 0")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
