"""One renderer for every path (deployments/prompts/rendering.py): the Renderer deployment's
code (its class, without Serve, called as the ingress calls it through a handle: with
ChatMessage models) and the benchmark's in-process target (hybrid_serve_bench's EngineChat,
with the bench's message dicts) submit the same token ids and instruction boundary for the
same messages, a boundary or none, and the same cache breakpoints, with the model's template and
with templates where the boundary fails closed, the first time and from the remembered instructions; they refuse the
same conversations. And the module renders with no Ray and no HTTP stack imported."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from deployments.http.protocol import ChatMessage
from deployments.renderer import Renderer
from engine.core.output_processor import RequestOutput
from engine.engine_config import DEFAULT_MODEL_DIR
from engine.interfaces.sampling_params import InvalidRequestError
from hybrid_serve_bench.client import ChatRequest
from hybrid_serve_bench.engine_target import EngineChat
from tests.unit.test_renderer_boundary import CONCATENATING_TEMPLATE, MERGING_TEMPLATE, NEEDS_USER_TEMPLATE, SYSTEM, USER

TEMPLATES = {"model": None, "merges-system-into-user": MERGING_TEMPLATE,
             "bpe-merge-across-seam": CONCATENATING_TEMPLATE, "needs-a-user": NEEDS_USER_TEMPLATE}

CONVERSATIONS = {
    "system-user": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}],
    "system-developer-user": [{"role": "system", "content": SYSTEM},
                              {"role": "developer", "content": "Be brief."},
                              {"role": "user", "content": USER}],
    "no-system": [{"role": "user", "content": USER}],
    "multi-turn": [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hi."},
                   {"role": "assistant", "content": "Hello! How can I help?"},
                   {"role": "user", "content": USER}],
    "system-only": [{"role": "system", "content": SYSTEM}],
    "marked": [{"role": "system", "content": SYSTEM},
               {"role": "user", "content": [{"type": "text", "text": "A shared document.",
                                             "cache_control": {"type": "ephemeral"}},
                                            {"type": "text", "text": USER}]},
               {"role": "assistant", "content": "An answer.", "cache_control": {"type": "ephemeral"}},
               {"role": "user", "content": "And then?"}],
}

# (template, conversation) -> the boundary's rejection (None: a boundary), or "refused": the
# template refuses the conversation. The cases the parity below must cover, pinned so that
# both paths giving no boundary for everything cannot pass.
EXPECTED = {
    ("model", "system-user"): None,
    ("model", "system-developer-user"): None,
    ("model", "no-system"): "no_leading_instructions",
    ("model", "multi-turn"): None,
    ("model", "system-only"): "all_instructions",
    ("model", "marked"): None,
    ("merges-system-into-user", "system-user"): "not_a_prefix",
    ("merges-system-into-user", "multi-turn"): "not_a_prefix",
    ("bpe-merge-across-seam", "system-user"): "not_a_prefix",
    ("needs-a-user", "system-user"): "render_error",
    ("needs-a-user", "system-only"): "refused",
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    """A tokenizer directory per template (the embedded model's tokenizer, its template
    replaced), for the Renderer's constructor and the bench's engine alike."""
    dirs = {"model": str(DEFAULT_MODEL_DIR)}
    for name, template in TEMPLATES.items():
        if template is not None:
            tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
            tokenizer.chat_template = template
            dirs[name] = str(tmp_path_factory.mktemp(name))
            tokenizer.save_pretrained(dirs[name])
    return dirs


class _CapturingEngine:
    """An AsyncLLMEngine stand-in for EngineChat (`engine.tokenizer` as LLMEngine loads it):
    keeps the GenerationRequests it is given and answers each with one token."""

    def __init__(self, model_dir: str) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.submitted = []

    @property
    def engine(self):
        return self

    async def generate(self, request):
        self.submitted.append(request)
        yield RequestOutput(request.request_id, (5,), "hi", True, "length", len(request.prompt_token_ids), 1)


@pytest.mark.parametrize("template, conversation", list(EXPECTED), ids=[f"{t}:{c}" for t, c in EXPECTED])
def test_the_bench_target_and_the_renderer_deployment_submit_the_same_prompt(model_dirs, template, conversation):
    renderer = Renderer.func_or_class(model_dirs[template])  # the deployment's class, no Serve
    engine = _CapturingEngine(model_dirs[template])
    bench = EngineChat(engine)
    messages = CONVERSATIONS[conversation]
    for attempt in ("first", "remembered"):
        try:
            served = renderer.render_chat([ChatMessage(**m) for m in messages])
        except InvalidRequestError as exc:
            assert EXPECTED[template, conversation] == "refused", exc
            result = asyncio.run(bench(ChatRequest("m", messages, 1)))
            assert result.error == f"InvalidRequestError: {exc}" and not engine.submitted
            continue
        assert served.boundary_rejection == EXPECTED[template, conversation], attempt
        assert (served.instruction_boundary is not None) == (served.boundary_rejection is None)
        result = asyncio.run(bench(ChatRequest("m", messages, 1)))
        assert result.error is None, result.error
        submitted = engine.submitted.pop()
        assert submitted.prompt_token_ids == served.token_ids, attempt
        assert submitted.instruction_boundary == served.instruction_boundary, attempt
        assert submitted.cache_breakpoints == served.cache_breakpoints, attempt
    if (template, conversation) == ("model", "marked"):
        assert len(served.cache_breakpoints) == 2


def test_rendering_imports_no_ray_and_no_http_stack():
    """The bench's in-process target runs where Ray and the HTTP stack are not installed."""
    code = (
        "import sys\n"
        "from deployments.prompts.rendering import PromptRenderer\n"
        f"renderer = PromptRenderer.from_pretrained({str(DEFAULT_MODEL_DIR)!r})\n"
        "prompt = renderer.render_chat([{'role': 'system', 'content': 'Be brief.'},"
        " {'role': 'user', 'content': 'Hi.'}])\n"
        "assert prompt.instruction_boundary is not None, prompt\n"
        "print(sorted(m for m in ('ray', 'fastapi', 'starlette', 'pydantic') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
