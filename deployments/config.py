"""Application arguments: the `args:` block of serve_config.yaml, validated once by build_app.

Unknown keys are rejected (extra="forbid") so a typo fails the deploy with a message that names
the key instead of silently running with a default.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from engine.config import CHECKPOINT_SLOTS, DEFAULT_MODEL_DIR, EngineConfig


class AppConfig(BaseModel):
    """Everything `build_app` needs: the engine's sizing and the Ray resources of each process.

    Engine fields map one to one onto `engine.config.EngineConfig`. CPU fields are Ray logical
    CPUs; the defaults add up to 1.4 so the whole application fits a 2-core machine, with one
    full CPU for the worker actor (the only process that runs the model); each further
    tensor-parallel rank asks for another worker_num_cpus.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Model and API naming.
    model_dir: str = Field(str(DEFAULT_MODEL_DIR), description="HF checkpoint directory (local).")
    served_model_name: str = Field("hybrid-serve-tiny", min_length=1)

    # Engine sizing (see EngineConfig).
    max_model_len: int | None = Field(None, ge=2, description="None: the model's maximum.")
    block_size: int = Field(16, ge=1, description="Tokens per KV block.")
    max_num_batched_tokens: int = Field(512, ge=1, description="Token budget of one step.")
    max_num_seqs: int = Field(16, ge=1, description="Most requests running at once.")
    kv_cache_bytes: int = Field(64 * 1024 * 1024, gt=0, description="Budget for KV blocks.")
    state_cache_bytes: int = Field(64 * 1024 * 1024, gt=0, description="Budget for state slots.")
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    tensor_parallel_size: int = Field(
        1, ge=1, description="Ranks the model is split over: one worker actor (one GPU) each.")
    async_scheduling: bool = Field(
        True, description="Submit each engine step before the previous one's tokens are back.")

    # Request-boundary checkpoints (DESIGN.md section 2).
    checkpoint_slots: tuple[str, ...] = Field(
        CHECKPOINT_SLOTS,
        description="Checkpoints to capture: any subset of prompt, response, instruction; [] = off.",
    )
    checkpoint_cache_bytes: int = Field(
        64 * 1024 * 1024, ge=0,
        description="Budget for checkpoint tensors outside the KV blocks (state, tail, hidden row).",
    )

    # Ray resources (logical CPUs) and Serve request limits.
    ingress_num_cpus: float = Field(0.1, ge=0)
    renderer_num_cpus: float = Field(0.1, ge=0)
    llm_server_num_cpus: float = Field(0.1, ge=0)
    scheduler_num_cpus: float = Field(0.1, ge=0)
    worker_num_cpus: float = Field(1.0, gt=0, description="Per tensor-parallel rank.")
    max_ongoing_requests: int = Field(256, ge=1, description="Per replica, every deployment.")
    health_check_period_s: float = Field(
        10.0, gt=0, description="How often Serve probes each LLM server replica (its actors).")

    @field_validator("checkpoint_slots", mode="before")
    @classmethod
    def _known_slots(cls, value):
        """A list of slot names; unknown names are refused by name, duplicates collapse."""
        if value is None:
            return ()
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            raise ValueError(f"must be a list, a subset of {list(CHECKPOINT_SLOTS)}")
        unknown = [v for v in value if v not in CHECKPOINT_SLOTS]
        if unknown:
            raise ValueError(
                f"unknown checkpoint slot(s) {unknown}; allowed: {list(CHECKPOINT_SLOTS)}")
        return tuple(slot for slot in CHECKPOINT_SLOTS if slot in value)

    def engine_config(self) -> EngineConfig:
        """The engine's frozen config (raises ValueError on values the engine refuses)."""
        return EngineConfig(
            model_dir=self.model_dir,
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            kv_cache_bytes=self.kv_cache_bytes,
            state_cache_bytes=self.state_cache_bytes,
            checkpoint_slots=self.checkpoint_slots,
            checkpoint_cache_bytes=self.checkpoint_cache_bytes,
            dtype=self.dtype,
            device=self.device,
            seed=self.seed,
            tensor_parallel_size=self.tensor_parallel_size,
            async_scheduling=self.async_scheduling,
        )


def parse_app_config(args: dict | AppConfig | None) -> AppConfig:
    """Validate the builder args; raise ValueError whose message names every offending key."""
    if isinstance(args, AppConfig):
        return args
    try:
        return AppConfig.model_validate(args or {})
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            key = ".".join(str(part) for part in err["loc"]) or "<args>"
            if err["type"] == "extra_forbidden":
                problems.append(f"unknown config key {key!r}")
            else:
                problems.append(f"{key}: {err['msg']}")
        allowed = ", ".join(AppConfig.model_fields)
        raise ValueError(
            "invalid hybrid-serve app args: " + "; ".join(problems) + f" (allowed keys: {allowed})"
        ) from None
