"""The embedded default model: loads offline, its chat template, the instruction-boundary
prefix property (docs/design.md section 3), reproducible generation, size."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = REPO_ROOT / "models" / "tiny-granite-hybrid"
SCRIPT = REPO_ROOT / "scripts" / "make_tiny_model.py"
MODEL_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
}


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL_DIR, local_files_only=True)


def render(tokenizer, messages, generation_prompt: bool) -> list[int]:
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=generation_prompt, tokenize=True, return_dict=False
    )


def test_files_and_size():
    assert {p.name for p in MODEL_DIR.iterdir()} == MODEL_FILES
    assert sum(p.stat().st_size for p in MODEL_DIR.iterdir()) < 8 * 1024 * 1024


def test_config_uses_published_spelling():
    config = json.loads((MODEL_DIR / "config.json").read_text())
    assert config["model_type"] == "granitemoehybrid"
    assert config["architectures"] == ["GraniteMoeHybridForCausalLM"]
    assert config["num_local_experts"] == 0
    assert config["position_embedding_type"] == "nope"
    assert set(config["layer_types"]) == {"mamba", "attention"}
    assert config["mamba_expand"] * config["hidden_size"] == config["mamba_n_heads"] * config["mamba_d_head"]


def test_model_loads_offline_and_runs(tokenizer):
    import torch
    from transformers import GraniteMoeHybridForCausalLM

    model = GraniteMoeHybridForCausalLM.from_pretrained(MODEL_DIR, local_files_only=True).eval()
    assert model.config.vocab_size == len(tokenizer)
    assert model.config.layer_types == [
        "linear_attention",
        "linear_attention",
        "full_attention",
        "linear_attention",
        "linear_attention",
        "full_attention",
    ]
    assert model.model.rotary_emb is None  # NoPE
    ids = tokenizer.encode("The river was quiet 東京 🦩", return_tensors="pt")
    with torch.no_grad():
        logits = model(ids).logits[0]
    assert logits.shape == (ids.shape[1], len(tokenizer)) and torch.isfinite(logits).all()
    assert len(set(logits.argmax(-1).tolist())) > 1  # not collapsed onto one token


def test_special_tokens(tokenizer):
    assert tokenizer.convert_tokens_to_ids(
        ["<|end_of_text|>", "<|pad|>", "<|start_of_role|>", "<|end_of_role|>"]
    ) == [0, 1, 2, 3]
    assert tokenizer.eos_token_id == 0 and tokenizer.pad_token_id == 1 and tokenizer.bos_token is None
    assert tokenizer.encode("hello", add_special_tokens=True) == tokenizer.encode("hello", add_special_tokens=False)
    generation = json.loads((MODEL_DIR / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 0


def test_chat_template_renders_all_roles(tokenizer):
    messages = [
        {"role": "system", "content": "S"},
        {"role": "developer", "content": "D"},
        {"role": "user", "content": "U"},
        {"role": "assistant", "content": "A"},
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|start_of_role|>system<|end_of_role|>S<|end_of_text|>\n"
        "<|start_of_role|>developer<|end_of_role|>D<|end_of_text|>\n"
        "<|start_of_role|>user<|end_of_role|>U<|end_of_text|>\n"
        "<|start_of_role|>assistant<|end_of_role|>A<|end_of_text|>\n"
        "<|start_of_role|>assistant<|end_of_role|>"
    )
    no_prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert no_prompt == text.removesuffix("<|start_of_role|>assistant<|end_of_role|>")


def test_chat_template_list_content(tokenizer):
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    text = tokenizer.apply_chat_template([{"role": "user", "content": parts}], tokenize=False)
    assert text == "<|start_of_role|>user<|end_of_role|>first\nsecond<|end_of_text|>\n"


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "tool", "content": "x"}],
        [{"role": "user", "content": "x"}, {"role": "function", "content": "y"}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}],
    ],
)
def test_chat_template_rejects(tokenizer, messages):
    from jinja2 import TemplateError

    with pytest.raises(TemplateError):
        tokenizer.apply_chat_template(messages, tokenize=False)


def instruction_boundary(tokenizer, messages) -> int | None:
    """docs/design.md section 3, as the renderer computes it."""
    ids = render(tokenizer, messages, generation_prompt=True)
    k = 0
    while k < len(messages) and messages[k]["role"] in ("system", "developer"):
        k += 1
    if k == 0 or k == len(messages):
        return None
    prefix = render(tokenizer, messages[:k], generation_prompt=False)
    if 0 < len(prefix) < len(ids) and ids[: len(prefix)] == prefix:
        return len(prefix)
    return None


CONVERSATIONS = [
    [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "Be brief.\n"},
        {"role": "developer", "content": "  Use the style guide.  "},
        {"role": "user", "content": "\nWhat is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ],
    [{"role": "developer", "content": ""}, {"role": "user", "content": ""}],
    [
        {"role": "system", "content": [{"type": "text", "text": "東京 🦩"}, {"type": "text", "text": "ok"}]},
        {"role": "user", "content": "🪐 \n\n"},
    ],
    [{"role": "system", "content": "ends with a partial-looking emoji 👩‍"}, {"role": "user", "content": "💻 text"}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_system_prefix_is_token_exact(tokenizer, messages):
    boundary = instruction_boundary(tokenizer, messages)
    assert boundary is not None
    prefix_text = tokenizer.apply_chat_template(
        [m for m in messages if m["role"] in ("system", "developer")], tokenize=False
    )
    assert tokenizer.decode(render(tokenizer, messages, True)[:boundary]) == prefix_text


def test_seam_after_end_of_text_is_stable(tokenizer):
    """The template follows each '<|end_of_text|>\n' with '<|start_of_role|>' or nothing; a special
    token splits the text before BPE runs, so the '\n' is one token either way."""
    newline = tokenizer.encode("\n", add_special_tokens=False)
    assert len(newline) == 1
    alone = tokenizer.encode("x<|end_of_text|>\n", add_special_tokens=False)
    assert alone[-2:] == [tokenizer.eos_token_id] + newline
    for more in ("<|start_of_role|>user", "<|start_of_role|>system<|end_of_role|>\n\n  text"):
        assert tokenizer.encode("x<|end_of_text|>\n" + more, add_special_tokens=False)[: len(alone)] == alone


def test_regenerating_is_byte_identical(tmp_path):
    import torch

    spec = importlib.util.spec_from_file_location("make_tiny_model", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rng_state = torch.random.get_rng_state()
    try:
        module.generate(tmp_path)
    finally:
        torch.random.set_rng_state(rng_state)

    def digests(directory: Path) -> dict[str, str]:
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}

    assert digests(tmp_path) == digests(MODEL_DIR)
