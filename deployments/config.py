"""Application arguments: the `args:` block of serve_config.yaml, validated once by build_app.

Unknown keys are rejected (extra="forbid") so a typo fails the deploy with a message that names
the key instead of silently running with a default.
"""

from __future__ import annotations

import dataclasses

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from engine.engine_config import EngineConfig

ENGINE_KEYS = frozenset(field.name for field in dataclasses.fields(EngineConfig))


class AppConfig(BaseModel):
    """Everything `build_app` needs: the engine's configuration and the Serve/Ray settings of
    each process.

    `engine` is the engine's own EngineConfig (engine/engine_config.py), validated field by field with
    the engine's checks; serve_config.yaml gives it as a nested block. CPU fields are Ray
    logical CPUs; the defaults add up to 1.3 so the whole application fits a 2-core machine,
    with one full CPU for the process that runs the model: the LLM server replica itself with
    one rank (it asks for llm_server_num_cpus + worker_num_cpus), else one worker actor per
    tensor-parallel rank (worker_num_cpus each).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    engine: EngineConfig = Field(
        default_factory=EngineConfig,
        description="The engine's configuration (the table below); unknown keys are refused.")
    served_model_name: str = Field(
        "hybrid-serve-tiny", min_length=1, description="The `model` name clients send.")

    stream_interval: int = Field(
        4, ge=1,
        description="Tokens per streamed delta after the first (the last may carry fewer): each "
                    "delta costs the LLM server, ingress and proxy CPU, so fewer deltas leave "
                    "more for the model (docs/design.md section 6).")

    direct_ingress: bool = Field(
        True,
        description="The lean serving path (docs/design.md section 6): the LLM server replicas "
                    "serve the OpenAI routes themselves behind Ray Serve's HAProxy ingress, so "
                    "streamed tokens cross one process boundary before the client. It needs "
                    "RAY_SERVE_ENABLE_HA_PROXY=1 in Ray's environment before Ray starts (`make "
                    "serve` and the k8s manifests set it, where HAProxy can run); without it, or "
                    "false: the classic path, Serve's proxy -> ingress -> renderer -> LLM server.")
    render_in_replica: bool = Field(
        True,
        description="On the lean path, render prompts (chat template, tokenizer, instruction "
                    "boundary) in the LLM server replica; false: through the Renderer "
                    "deployment, a hop more per request, which keeps that CPU off the replica "
                    "that generates (benchmarks/serve_latency.py measures both).")

    api_keys_file: str | None = Field(
        None,
        description="File of API keys, one a line; with it (or HYBRID_SERVE_API_KEYS set in the "
                    "ingress's environment) every route but /health needs a key, and each key's "
                    "checkpoints are its own (deployments/http/api_keys.py).")

    max_body_bytes: int = Field(
        8 * 1024 * 1024, ge=1024,
        description="Largest request body the ingress reads; a larger one gets HTTP 413.")
    max_requests_in_flight: int = Field(
        256, ge=1,
        description="Generation requests each ingress replica accepts at once; beyond it a "
                    "request gets HTTP 429 with Retry-After at once instead of queueing.")
    retry_after_s: float = Field(
        1.0, gt=0, description="The Retry-After of a 429 (rounded up to whole seconds).")
    max_stop_strings: int = Field(
        16, ge=1, description="Stop strings, and stop token ids, one request may give; more get "
                              "HTTP 400.")
    max_stop_string_chars: int = Field(
        256, ge=1, description="Longest stop string accepted; a longer one gets HTTP 400.")
    max_cache_breakpoints: int = Field(
        4, ge=1,
        description="cache_control markers (on messages and text content parts) one chat request "
                    "may carry; more get HTTP 400. Each accepted marker is a checkpoint the "
                    "engine keeps where the renderer verified it (README.md, Cache breakpoints); "
                    "with the breakpoint slot off they are accepted and ignored.")
    max_prompt_tokens: int | None = Field(
        None, ge=1,
        description="Longest prompt accepted, in tokens; a longer one gets HTTP 400. Unset: "
                    "any prompt that leaves room for one output token in engine.max_model_len.")
    max_output_tokens: int = Field(
        4096, ge=1,
        description="Largest max_tokens a request may ask for (HTTP 400 beyond), and the "
                    "max_tokens of a request that gives none (capped by the room left in "
                    "engine.max_model_len), so no request runs away with the replica.")
    max_queued_requests: int = Field(
        1024, ge=1,
        description="Requests each ingress replica may queue for a renderer or LLM server "
                    "replica that is at max_ongoing_requests; beyond it a request gets HTTP "
                    "503 with Retry-After (Serve's max_queued_requests).")

    checkpoint_routing: bool = Field(
        False,
        description="Send each generation to the LLM server replica that holds its prompt's "
                    "longest checkpoint (deployments/cluster/router.py), through a cluster "
                    "index actor the replicas report to (README.md, Checkpoints across "
                    "replicas). Off by default: with one replica it gains nothing; turn it on "
                    "with several.")
    routing_queue_threshold: int | None = Field(
        None, ge=1,
        description="With checkpoint_routing, a holder with this many requests in flight or "
                    "more is overloaded and the request goes to Serve's power-of-two choice "
                    "instead. Unset: engine.max_num_seqs (beyond a full batch a request waits "
                    "in the holder's queue).")

    checkpoint_transfer: bool = Field(
        False,
        description="The object-store tier (README.md, Checkpoints across replicas): LLM server "
                    "replicas export instruction checkpoints, hit checkpoints and (with a host "
                    "tier) what their host tier evicts into the Ray "
                    "object store, owned by the application's cluster index actor, fetch a "
                    "stored copy when a request about to be admitted would save enough prefill (the "
                    "request waits in the scheduler meanwhile), import the "
                    "hottest ones when they start and export what is worth keeping when they "
                    "stop. Off by default: each export costs a copy of the checkpoint's bytes.")
    checkpoint_store_bytes: int = Field(
        1024 * 1024 * 1024, ge=0,
        description="With checkpoint_transfer, the object-store tier's byte budget (the copies' "
                    "shard bytes, all replicas together); beyond it the least recently used "
                    "copies are dropped. Count it against the Ray object store's memory.")
    fetch_min_tokens_per_mib: float = Field(
        4.0, ge=0,
        description="With checkpoint_transfer, fetch a stored copy only when it saves at least "
                    "this many prefill tokens per MiB fetched: the break-even is the prefill "
                    "rate (tokens/s) over the object store's fetch bandwidth (MiB/s). The "
                    "default suits a model whose checkpoint is a few MiB and a CPU or GPU "
                    "prefill of some thousand tokens a second against a local object store; "
                    "measure both for your deployment. 0: fetch whenever fetch_min_tokens "
                    "are saved.")
    fetch_min_tokens: int = Field(
        32, ge=1,
        description="With checkpoint_transfer, fewer prefill tokens saved than this are "
                    "recomputed (a fetch's round trips cost more).")
    fetch_timeout_s: float = Field(
        5.0, gt=0,
        description="With checkpoint_transfer, the longest a replica waits for a stored copy's "
                    "objects; beyond it the request computes from scratch.")
    warm_start_max_checkpoints: int = Field(
        8, ge=0,
        description="With checkpoint_transfer, a starting LLM server replica imports up to this "
                    "many of the application's stored instruction checkpoints, most hit first, "
                    "before it reports ready (0: none).")
    warm_start_max_bytes: int = Field(
        256 * 1024 * 1024, ge=0,
        description="With checkpoint_transfer, the warm start's byte bound.")
    warm_start_timeout_s: float = Field(
        30.0, gt=0,
        description="With checkpoint_transfer, the longest a warm start may delay a replica's "
                    "start (it is cut short, never failed).")
    drain_export_timeout_s: float = Field(
        10.0, ge=0,
        description="With checkpoint_transfer, the longest a stopping LLM server replica spends "
                    "exporting what is worth keeping; keep it below Serve's "
                    "graceful_shutdown_timeout_s (20 s by default), which ends the replica.")

    # Ray resources (logical CPUs) and Serve request limits.
    ingress_num_cpus: float = Field(0.1, ge=0, description="Ray CPUs of each ingress replica.")
    renderer_num_cpus: float = Field(0.1, ge=0, description="Ray CPUs of each renderer replica.")
    llm_server_num_cpus: float = Field(
        0.1, ge=0, description="Ray CPUs of each LLM server replica (the engine's step loop), "
                               "besides the model's worker_num_cpus when it runs the model.")
    worker_num_cpus: float = Field(
        1.0, gt=0, description="Ray CPUs and torch threads per tensor-parallel rank: of the LLM "
                               "server replica with one rank, of each worker actor with more.")
    allow_autoscaling_wait_s: float | None = Field(
        None, ge=0,
        description="When the cluster cannot hold what the app asks at build time, how long to "
                    "wait for an autoscaler to add nodes (asking it for the app's resources) "
                    "before the build is refused; 0 refuses at once. Unset: 600 on a KubeRay "
                    "cluster, else 0 (deployments/placement.py).")
    max_ongoing_requests: int = Field(
        256, ge=1, description="Requests each renderer and LLM server replica serves at once "
                               "(the ingress takes max_requests_in_flight plus room for /health "
                               "and /metrics).")
    health_check_period_s: float = Field(
        10.0, gt=0, description="How often Serve probes each LLM server replica (its step loop "
                                "and rank actors).")

    @field_validator("engine", mode="before")
    @classmethod
    def _known_engine_keys(cls, value):
        """Refuse keys EngineConfig does not have, by name (pydantic would drop them)."""
        if isinstance(value, dict):
            unknown = sorted(set(value) - ENGINE_KEYS)
            if unknown:
                raise ValueError(f"unknown engine key(s) {unknown}")
        return value


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
                problems.append(f"{key}: {err['msg'].removeprefix('Value error, ')}")
        allowed = ", ".join(AppConfig.model_fields)
        engine_keys = ", ".join(sorted(ENGINE_KEYS))
        raise ValueError(
            "invalid hybrid-serve app args: " + "; ".join(problems)
            + f" (allowed keys: {allowed}; under engine: {engine_keys})"
        ) from None
