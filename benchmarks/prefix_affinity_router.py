"""Ray Serve LLM's PrefixCacheAffinityRouter on our LLM server, for the prefix_affinity mode of
benchmarks/cluster_routing.py (benchmark-only: the app never uses it).

What using it takes (Ray 2.60.0, from the installed source):

- The public name, `ray.serve.llm.request_router.PrefixCacheAffinityRouter`, is a subclass with
  a docstring and `pass` of `ray.llm._internal.serve.routing_policies.prefix_aware.
  prefix_aware_router.PrefixCacheAffinityRouter`. Importing it imports the `ray.serve.llm`
  package, whose LLMConfig needs pyarrow (cloud filesystems) and whose ingress builder needs
  vLLM or SGLang (the OpenAI protocol models): with pyarrow installed it still fails with
  "Neither vLLM nor SGLang is installed". The class it renames imports only Ray, so this module
  takes the public name when it imports and that class otherwise (ROUTER_SOURCE says which).
- The router reads text from the call's arguments: the first one with a `messages` or `prompt`
  attribute (messages joined by their contents, roles and chat template dropped; only dict
  messages count, a pydantic message gives ""), and raises ValueError when there is none. Our
  LLM server's `generate` gets a GenerationRequest: the renderer's token ids and no text, so
  every generation would fail to route. RenderedPromptAffinityRouter changes only that: its
  text is the decoded token ids (chat template included), what Ray's router reads for a
  /v1/completions request whose prompt is the rendered chat. Neither our router nor the LLM
  server changes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest
from transformers import AutoTokenizer

from engine.interfaces.generation_request import GenerationRequest

try:
    from ray.serve.llm.request_router import PrefixCacheAffinityRouter
except ImportError:  # the same class under its internal name (the public one only renames it)
    from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
        PrefixCacheAffinityRouter,
    )

ROUTER_SOURCE = f"{PrefixCacheAffinityRouter.__module__}.{PrefixCacheAffinityRouter.__name__}"


def prompt_text(args: Sequence, decode: Callable[[list[int]], str]) -> str | None:
    """The text of the first GenerationRequest among a call's `args`: `decode` of its prompt
    token ids; None when there is none (a call that is not a generation)."""
    for arg in args:
        if isinstance(arg, GenerationRequest):
            return decode(list(arg.prompt_token_ids))
    return None


class RenderedPromptAffinityRouter(PrefixCacheAffinityRouter):
    """Ray's PrefixCacheAffinityRouter, unchanged but for where the text comes from: the
    decoded token ids of the GenerationRequest (prompt_text)."""

    def initialize_state(self, model_dir: str, **kwargs) -> None:
        """kwargs: PrefixCacheAffinityRouter's (imbalanced_threshold, match_rate_threshold, ...)."""
        super().initialize_state(**kwargs)
        self._tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def _extract_text_from_request(self, pending_request: PendingRequest) -> str:
        text = prompt_text(pending_request.args, self._tokenizer.decode)
        if text is None:  # Ray's own reading (messages or prompt), or its ValueError
            return super()._extract_text_from_request(pending_request)
        return text


def router_config(model_dir: str) -> RequestRouterConfig:
    """The LLM server's request_router_config for the mode: Ray's defaults otherwise
    (imbalanced_threshold inf: load never overrides a match; match_rate_threshold 0.1)."""
    return RequestRouterConfig(request_router_class=RenderedPromptAffinityRouter,
                               request_router_kwargs={"model_dir": model_dir})
