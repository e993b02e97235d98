"""hybrid-serve's engine in this process, with no Ray and no HTTP: one runner.Target per
checkpoint_slots setting, for compare-policies --in-process (the GPU runs: Ray and the HTTP
stack do not travel to the device machine; torch, transformers, httpx and tqdm do).

EngineChat does what the ingress and renderer do for one chat request, then streams
AsyncLLMEngine.generate into the StreamResult the HTTP client returns:
  render     deployments/prompts/rendering.py's PromptRenderer, the Renderer deployment's own
             code: the model's chat template with the generation prompt, the verified
             instruction boundary and cache breakpoints (the messages' cache_control
             markers), the prefix renderings remembered;
  request    extra_body's cache_salt and ignore_eos become GenerationRequest.cache_salt and
             SamplingParams.ignore_eos; temperature and max_tokens pass as they are;
  times      seconds from the engine submission, which is AFTER rendering (an HTTP server's
             TTFT includes its rendering; here it is kept apart, in the result's render_s,
             as an HTTP server's is in its Server-Timing header, so the table measures the
             engine): first_chunk_s at the first output, ttft_s at the first
             output with non-empty text (with ttft_at_first_token, at the first output with a
             token, text or not: a random-weight model may generate only ids that decode to
             no text, such as its end-of-text id), itl_s as client.py computes it;
  counts     prompt_tokens, completion_tokens and cached_tokens from the last output
             (RequestOutput.num_cached_tokens: what the engine restored).

`engine_targets` starts one LLMEngine per setting (all at once, so the runner can interleave
them; size the caches so they fit together) and shuts them down when the block ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import statistics
import time
import uuid
from collections.abc import Iterator

from hybrid_serve_bench.client import ChatRequest, StreamResult, _inter_token_latency
from hybrid_serve_bench.policies import policy_label
from hybrid_serve_bench.runner import Target


class EngineChat:
    """runner.Target.chat over one AsyncLLMEngine. render_s: every request's rendering time
    (appended by __call__). ttft_at_first_token: see the module doc."""

    def __init__(self, engine, ttft_at_first_token: bool = False) -> None:  # engine: AsyncLLMEngine
        from deployments.prompts.rendering import PromptRenderer

        self.engine = engine
        self.ttft_at_first_token = ttft_at_first_token
        self.renderer = PromptRenderer(engine.engine.tokenizer)  # as a Renderer replica holds one
        self.render_s: list[float] = []

    async def __call__(self, request: ChatRequest) -> StreamResult:
        """One request to its end. Never raises: failures come back as StreamResult.error."""
        from engine.interfaces.generation_request import GenerationRequest
        from engine.interfaces.sampling_params import SamplingParams

        extra = request.extra_body or {}
        rendered = time.perf_counter()
        try:
            prompt = self.renderer.render_chat(request.messages)
            generation = GenerationRequest(
                request_id=uuid.uuid4().hex, prompt_token_ids=prompt.token_ids,
                sampling=SamplingParams(max_tokens=request.max_tokens, temperature=request.temperature,
                                        ignore_eos=bool(extra.get("ignore_eos"))),
                instruction_boundary=prompt.instruction_boundary,
                cache_breakpoints=prompt.cache_breakpoints, cache_salt=extra.get("cache_salt"))
        except Exception as exc:  # template refusal, invalid sampling
            return _failed(rendered, f"{type(exc).__name__}: {exc}")
        start = time.perf_counter()
        self.render_s.append(start - rendered)
        first_chunk = first_content = last_content = last = None
        content_events, parts = 0, []
        try:
            async for out in self.engine.generate(generation):
                now = time.perf_counter() - start
                first_chunk = now if first_chunk is None else first_chunk
                if out.new_text or (self.ttft_at_first_token and out.new_token_ids):
                    first_content = now if first_content is None else first_content
                    last_content = now
                    content_events += 1
                    parts.append(out.new_text)
                last = out
        except Exception as exc:  # refused by add_request, or the executor died
            return _failed(start, f"{type(exc).__name__}: {exc}")
        e2e = time.perf_counter() - start
        error = last.error if last is not None else "no output"
        if error is None and first_content is None:
            error = "no content in the stream"
        return StreamResult(
            first_chunk_s=first_chunk, ttft_s=first_content,
            itl_s=_inter_token_latency(first_content, last_content, last.num_output_tokens, content_events),
            e2e_s=e2e, prompt_tokens=last.num_prompt_tokens, completion_tokens=last.num_output_tokens,
            cached_tokens=last.num_cached_tokens, finish_reason=last.finish_reason,
            reply="".join(parts), error=error, render_s=self.render_s[-1])

    def render_p50_s(self) -> float | None:
        return statistics.median(self.render_s) if self.render_s else None


def _failed(start: float, error: str) -> StreamResult:
    return StreamResult(None, None, None, time.perf_counter() - start, None, None, None, None, "", error)


@contextlib.contextmanager
def engine_targets(policies: list[tuple[str, ...]], base_config, served_model_name: str = "hybrid-serve",
                   ttft_at_first_token: bool = False) -> Iterator[tuple[list[Target], list[dict]]]:
    """Yield (targets, configs): per policy, a Target whose chat is an EngineChat over its own
    LLMEngine (base_config, an engine.config.EngineConfig, with the policy's checkpoint_slots),
    and that config as a dict. Every engine is shut down when the block ends."""
    from engine.core.async_engine import AsyncLLMEngine
    from engine.core.llm_engine import LLMEngine

    engines: list[AsyncLLMEngine] = []
    try:
        targets, configs = [], []
        for slots in policies:
            config = dataclasses.replace(base_config, checkpoint_slots=slots)
            engine = AsyncLLMEngine(LLMEngine(config))
            engines.append(engine)
            label = policy_label(slots)
            targets.append(Target(label, f"in-process:{label}", served_model_name,
                                  chat=EngineChat(engine, ttft_at_first_token)))
            configs.append(dataclasses.asdict(config))
        yield targets, configs
    finally:
        for engine in engines:
            engine.shutdown()


async def warm_up(targets: list[Target], conversations: list[list[dict]], max_tokens: int = 4,
                  then: list[list[dict]] = ()) -> None:
    """Send all of `conversations` to each target at once (one target after the other), then
    all of `then` the same way, under a salt of their own (so nothing they leave is restored
    later, while `then` restores what `conversations` left): a new engine's first steps of a
    shape compile and autotune kernels, which must stay out of the measured requests, and the
    steps of a burst that restores differ from those of one that computes.
    Raises if one fails."""
    salt = f"warm-up-{uuid.uuid4().hex[:8]}"
    for batch in (conversations, then):
        for target in targets:
            results = await asyncio.gather(*(target.chat(ChatRequest(
                target.model, messages, max_tokens, extra_body={"cache_salt": salt, "ignore_eos": True}))
                for messages in batch))
            failed = [r.error for r in results if r.error]
            if failed:
                raise RuntimeError(f"warm-up request to {target.label} failed: {failed[0]}")


def device_name(device: str) -> str:
    """The accelerator's name (torch.cuda.get_device_name) for cuda, else the platform's."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name()
    import platform

    return platform.processor() or platform.machine()
