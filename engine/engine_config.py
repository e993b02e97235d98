"""Engine configuration: one frozen object, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from cache.checkpoint_keys import CheckpointKind
from cache.eviction import EvictionPolicy

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "models" / "tiny-granite-hybrid"
CHECKPOINT_SLOTS = tuple(kind.value for kind in CheckpointKind)  # the order captures keep
EVICTION_POLICIES = tuple(policy.value for policy in EvictionPolicy)
DEFAULT_BUDGET_BYTES = 64 * 1024 * 1024  # each cache budget given neither in bytes nor by memory_utilization
SPECULATIVE_DRAFTERS = ("ngram", "mtp")
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")  # engine/parallel/kv_cache_format.py
MAX_SPECULATIVE_TOKENS = 16


def _option(default, help: str):
    """A field with its one-line meaning, which docs/configuration.md is generated from
    (deployments/config_reference.py)."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class EngineConfig:
    """Everything the in-process engine needs to start; each field's meaning is its `help`
    (rendered in docs/configuration.md). The cache budgets are per tensor-parallel rank.

    in_pass_capture takes effect only where the worker reports it can
    (CacheCapacity.in_pass_capture: one rank on CUDA); LLMEngine combines the two into
    CheckpointPolicy.in_pass_capture. With async scheduling (overlaps_steps) each step()
    returns the outputs of the step before, and a request that stops has computed one token
    more than it would without (its last sampled token, fed by the step already in flight),
    so its response checkpoint covers that token too.
    """

    model_dir: str = _option(str(DEFAULT_MODEL_DIR), "Local Hugging Face model directory "
                             "(config.json, safetensors, tokenizer); the default is the embedded "
                             "tiny model.")
    max_model_len: int | None = _option(None, "Longest prompt + output of a request, in tokens; "
                                        "unset: the model's max_position_embeddings.")
    block_size: int = _option(16, "Tokens per KV block.")
    max_num_batched_tokens: int = _option(512, "Token budget of one engine step (prefill chunks "
                                          "plus decode tokens).")
    max_num_seqs: int = _option(16, "Most requests running at once (also caps the recurrent "
                                "state slots).")
    memory_utilization: float | None = _option(None, "Share of memory the cache budgets not "
                                               "given in bytes take, in (0, 1]: on cuda of the "
                                               "device memory free once the weights are "
                                               "loaded, on cpu of a quarter of the RAM "
                                               "available; split between KV blocks, recurrent "
                                               "state and checkpoints (docs/checkpoints.md, "
                                               "Memory). Unset: each budget not "
                                               "given is 64 MiB.")
    kv_cache_bytes: int | None = _option(None, "Memory for KV blocks, per rank; the block count "
                                         "is derived from it and must hold one request of "
                                         "max_model_len tokens. Unset: from memory_utilization, "
                                         "else 64 MiB.")
    state_cache_bytes: int | None = _option(None, "Memory for recurrent state slots, per rank; "
                                            "the slot count is derived from it. Unset: from "
                                            "memory_utilization, else 64 MiB.")
    checkpoint_slots: tuple[str, ...] = _option(CHECKPOINT_SLOTS, "Request-boundary checkpoints "
                                                "to capture: any subset of prompt, response, "
                                                "instruction, breakpoint (at the clients' "
                                                "cache_control markers); empty turns checkpoint "
                                                "caching off.")
    checkpoint_cache_bytes: int | None = _option(None, "Memory for checkpoint tensors held "
                                                 "outside the KV blocks (recurrent state, "
                                                 "attention tail, hidden row), per rank; the KV "
                                                 "blocks they reference count against "
                                                 "kv_cache_bytes. Unset: from "
                                                 "memory_utilization, else 64 MiB.")
    host_checkpoint_bytes: int | None = _option(None, "Host memory (pinned on cuda, plain RAM on "
                                                "cpu) for checkpoints evicted from the "
                                                "device's budgets: a request that needs one "
                                                "waits while it is copied back, instead of "
                                                "recomputing it (docs/checkpoints.md, Memory); "
                                                "what it evicts goes to the object-store tier "
                                                "when checkpoint_transfer is on. "
                                                "0 turns this tier off. One rank only for now. "
                                                "Unset: from memory_utilization, else off.")
    checkpoint_eviction: str = _option("value", "Which checkpoint goes first when a budget is "
                                       "full: value (least prefill compute saved per byte "
                                       "held, halved every checkpoint_value_half_life uses of "
                                       "the tier since it was last used) or lru (least "
                                       "recently used). Each tenant keeps its fair share "
                                       "either way.")
    checkpoint_value_half_life: float = _option(128.0, "With checkpoint_eviction value: after "
                                                "this many checkpoint publications and hits "
                                                "without a use, a checkpoint counts half as "
                                                "valuable.")
    capture_wait_s: float = _option(10.0, "A request that shares a longer prefix with a running "
                                    "request about to capture it waits up to this long for that "
                                    "checkpoint instead of computing the prefix again "
                                    "(engine/checkpoints/in_flight.py). 0 turns waiting off.")
    dtype: str = _option("float32", "Model dtype: float32, bfloat16 or float16.")
    device: str = _option("cpu", "cpu, or cuda (one GPU per rank).")
    kv_cache_dtype: str = _option("auto", "How KV blocks store keys and values: auto (the "
                                  "model dtype) or fp8_e4m3 (cuda on compute capability 8.9 "
                                  "or later: FP8 E4M3 with a static scale per KV head and "
                                  "attention layer, from kv_cache_scales.json in the model "
                                  "dir, else 1.0; half the bytes of bf16, so kv_cache_bytes "
                                  "holds twice the blocks; docs/design.md, KV cache). "
                                  "Checkpoints are kept apart by it: one engine never "
                                  "imports another's of another KV format.")
    seed: int = _option(0, "torch seed of the workers, and of sampling for requests without "
                        "their own seed.")
    tensor_parallel_size: int = _option(1, "Ranks the model is split over: 1 runs the model in "
                                        "the LLM server replica, N > 1 one worker (one GPU on "
                                        "cuda) each.")
    in_pass_capture: bool = _option(True, "Take the instruction checkpoint inside the prefill "
                                    "chunk's forward pass where the worker can (one rank on "
                                    "cuda); false always ends a chunk at the boundary.")
    async_scheduling: bool | None = _option(None, "Schedule and submit each step before the "
                                            "previous one's tokens are back, so the device "
                                            "never waits for the host; false runs one step at "
                                            "a time. Unset: on where a step runs apart from "
                                            "the host (cuda, or tensor_parallel_size > 1), off "
                                            "for one CPU rank, whose step runs inside its "
                                            "submit: there overlapping would only hold each "
                                            "output back one step.")
    cpu_compile_decode: bool = _option(False, "CPU, one rank: run decode-only steps through the "
                                       "model compiled by torch.compile (inductor), about "
                                       "twice as fast a step on small models. The compile runs "
                                       "on a thread of its own from the engine's start (a minute "
                                       "or more the first time, cached on disk afterwards) while "
                                       "every step runs eagerly (GET /health says "
                                       "warming_up: true meanwhile); the engine stays eager if it "
                                       "fails.")
    num_speculative_tokens: int | None = _option(None, "Draft tokens verified per step for "
                                                 "greedy requests (speculative decoding, exact: "
                                                 "the output is the same as without; "
                                                 "docs/speculative.md); 0 turns it off, at most "
                                                 "16. Unset: the speculation policy decides (off "
                                                 "on the CPU; on CUDA the MTP drafter where the "
                                                 "measured step costs and the head's acceptance "
                                                 "say it wins, with its k and batch cap).")
    speculative_drafter: str = _option("ngram", "Where draft tokens come from when "
                                       "num_speculative_tokens > 0: ngram (prompt lookup, no "
                                       "extra weights) or mtp (the model's multi-token-"
                                       "prediction head: Qwen3-Next's mtp.* weights, or a head "
                                       "trained by benchmarks/train_mtp_head.py in the model "
                                       "dir).")
    speculative_max_batch_size: int | None = _option(None, "Draft only in steps that start "
                                                     "with at most this many running requests; "
                                                     "above it every request decodes plainly "
                                                     "(a verification step costs several "
                                                     "decode steps at large batches: README.md, "
                                                     "Speculative decoding). Unset: at any "
                                                     "batch size. No effect with "
                                                     "num_speculative_tokens 0.")
    random_mtp_head_seed: int | None = _option(None, "Benchmarks and tests only: attach a random "
                                               "MTP head drawn from this seed to a model whose "
                                               "checkpoint has none (GraniteMoeHybrid), for "
                                               "speculative_drafter mtp; it drafts at random. "
                                               "Unset: none.")

    @property
    def overlaps_steps(self) -> bool:
        """async_scheduling as the engine applies it: the setting, or where it is unset, on
        for cuda and for tensor_parallel_size > 1 and off for one CPU rank."""
        if self.async_scheduling is not None:
            return self.async_scheduling
        return self.device.startswith("cuda") or self.tensor_parallel_size > 1

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        self._check_budgets()
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
        if self.checkpoint_eviction not in EVICTION_POLICIES:
            raise ValueError(f"checkpoint_eviction must be one of {list(EVICTION_POLICIES)}, "
                             f"got {self.checkpoint_eviction!r}")
        half_life = self.checkpoint_value_half_life
        if isinstance(half_life, bool) or not isinstance(half_life, (int, float)) or not half_life > 0:
            raise ValueError(f"checkpoint_value_half_life must be a number > 0, got {half_life!r}")
        wait = self.capture_wait_s
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not wait >= 0:
            raise ValueError(f"capture_wait_s must be a number >= 0, got {wait!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype != "auto" and not self.device.startswith("cuda"):
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype} runs on device cuda only (its kernels "
                             f"are the CUDA path's), got device {self.device!r}; use kv_cache_dtype auto")
        self._check_speculation()

    def _check_budgets(self) -> None:
        """Byte budgets are integers (kv and state > 0, checkpoints >= 0) or unset;
        memory_utilization a number in (0, 1] or unset. Without memory_utilization an unset
        budget becomes DEFAULT_BUDGET_BYTES here (the host tier's 0: off); with it, the worker
        sizes it from memory (engine/parallel/memory_budget.py). The host tier needs one
        rank."""
        share = self.memory_utilization
        if share is not None and (isinstance(share, bool) or not isinstance(share, (int, float))
                                  or not 0 < share <= 1):
            raise ValueError(f"memory_utilization must be a number in (0, 1] or unset, got {share!r}")
        for name, least in (("kv_cache_bytes", 1), ("state_cache_bytes", 1), ("checkpoint_cache_bytes", 0)):
            value = getattr(self, name)
            if value is None:
                if share is None:
                    object.__setattr__(self, name, DEFAULT_BUDGET_BYTES)
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an integer >= {least} or unset, got {value!r}")
        host = self.host_checkpoint_bytes
        if host is None and share is None:
            object.__setattr__(self, "host_checkpoint_bytes", 0)
        elif host is not None and (isinstance(host, bool) or not isinstance(host, int) or host < 0):
            raise ValueError(f"host_checkpoint_bytes must be an integer >= 0 or unset, got {host!r}")
        elif host and self.tensor_parallel_size > 1:
            raise ValueError("host_checkpoint_bytes > 0 needs tensor_parallel_size 1 for now (the host "
                             "tier copies evicted checkpoints out of the model in this process); set it to 0")

    def _check_speculation(self) -> None:
        """Speculative decoding (engine/speculative/): k unset (engine/speculative/policy.py
        resolve_speculation decides once the model is known) or in [0, MAX_SPECULATIVE_TOKENS],
        a known drafter, a random MTP head only for the mtp drafter; ValueError naming the key
        otherwise."""
        k = self.num_speculative_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_SPECULATIVE_TOKENS):
            raise ValueError(
                f"num_speculative_tokens must be an integer in [0, {MAX_SPECULATIVE_TOKENS}] "
                f"(0 turns speculative decoding off) or unset (the speculation policy decides), got {k!r}")
        if self.speculative_drafter not in SPECULATIVE_DRAFTERS:
            raise ValueError(f"speculative_drafter must be one of {list(SPECULATIVE_DRAFTERS)}, "
                             f"got {self.speculative_drafter!r}")
        cap = self.speculative_max_batch_size
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise ValueError(f"speculative_max_batch_size must be an integer >= 1 or unset, got {cap!r}")
        seed = self.random_mtp_head_seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise ValueError(f"random_mtp_head_seed must be an integer >= 0 or unset, got {seed!r}")
        if seed is not None and self.speculative_drafter != "mtp":
            raise ValueError("random_mtp_head_seed attaches a head for speculative_drafter mtp, "
                             f"not {self.speculative_drafter!r}; unset it or set the drafter to mtp")
