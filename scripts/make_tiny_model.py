#!/usr/bin/env python
"""Build the embedded default model, models/tiny-granite-hybrid, from nothing but this file.

The output is a Hugging Face directory that the engine, the renderer and transformers all load
offline: a dense GraniteMoeHybrid (Mamba2 + attention) with random weights from a fixed seed, a
byte-level BPE tokenizer trained on the small corpus below, and a Granite-style chat template.

Contract: running this script twice, with the same torch / transformers / tokenizers versions,
writes byte-identical files (tests/unit/test_default_model.py checks it against the committed
directory). Everything that could vary is pinned: the seed, the corpus, the trainer settings
(the tokenizers BPE trainer breaks count ties by pair id, so it is deterministic), and the JSON
files are written here with sorted keys rather than by save_pretrained.

Usage: python scripts/make_tiny_model.py [OUT_DIR]   (default: models/tiny-granite-hybrid)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT_DIR = REPO_ROOT / "models" / "tiny-granite-hybrid"

SEED = 0
VOCAB_SIZE = 2048  # tokenizer size == model vocab_size (no padding rows)

# Special tokens get ids 0..3 in this order (the BPE trainer places them first).
END_OF_TEXT = "<|end_of_text|>"  # EOS, id 0
PAD = "<|pad|>"  # id 1
START_OF_ROLE = "<|start_of_role|>"  # id 2
END_OF_ROLE = "<|end_of_role|>"  # id 3
SPECIAL_TOKENS = (END_OF_TEXT, PAD, START_OF_ROLE, END_OF_ROLE)

# Published Granite-4.0-H spelling; transformers 5 remaps it to linear_attention/full_attention.
LAYER_TYPES = ("mamba", "mamba", "attention", "mamba", "mamba", "attention")

# Each message renders on its own, between special tokens, so the rendering of the leading
# system/developer messages is a token-exact prefix of the whole conversation (docs/design.md section 3):
# special tokens split the text before BPE runs, hence nothing merges across a message seam.
# Text parts of list content are joined with "\n" (what vLLM does for string-only templates).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'developer', 'user', 'assistant'] -%}"
    "{{- raise_exception('Unsupported role ' ~ message['role'] ~"
    " '; expected system, developer, user or assistant') -}}"
    "{%- endif -%}"
    "{%- if message['content'] is string -%}"
    "{%- set content = message['content'] -%}"
    "{%- elif message['content'] is none -%}"
    "{%- set content = '' -%}"
    "{%- else -%}"
    "{%- set ns = namespace(texts=[]) -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part is mapping and part['type'] == 'text' -%}"
    "{%- set ns.texts = ns.texts + [part['text']] -%}"
    "{%- else -%}"
    "{{- raise_exception('Only text content parts are supported') -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- set content = ns.texts | join('\\n') -%}"
    "{%- endif -%}"
    "{{- '<|start_of_role|>' ~ message['role'] ~ '<|end_of_role|>' ~ content ~ '<|end_of_text|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|start_of_role|>assistant<|end_of_role|>' -}}"
    "{%- endif -%}"
)

# Written for this project. Prose, dialogue, code, markup, numbers and punctuation, plus accented
# Latin, CJK, Hangul, Cyrillic, Greek and emoji (ZWJ sequences, skin tones, variation selectors),
# so that multi-byte UTF-8 characters end up split across tokens and streaming has to cope.
CORPUS = r'''
The river was quiet that morning, and the fog lay low over the water like a sheet of wet wool.
Marta walked along the bank with her dog, counting the boats: one, two, three... eleven in all.
"Where did they all come from?" she asked the old fisherman. He shrugged, lit his pipe, and said
nothing for a long while. Then: "From upstream, where else? Rivers only run one way, child."
She laughed. It wasn't the answer she wanted, but it was the true one.

In 1969, three astronauts flew to the Moon; two of them walked on its surface for about 21 hours.
The mission cost roughly $25.4 billion (about $180 billion today). Was it worth it? Many say yes.
Science is a way of asking questions carefully: we guess, we test, we measure, and we revise.
A good experiment controls for everything except the one thing you want to learn about.
Weather forecasts improved a great deal after 1990, thanks to satellites, radar and faster computers.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs!
How vexingly quick daft zebras jump; sphinx of black quartz, judge my vow.

Dear team,
Thanks for the update. Please send the final report by Friday, 14 March, at 5:00 p.m. (UTC).
If anything is unclear, reply to this e-mail or call me at +1 (555) 010-2368. Best regards, Sam.

Q: What is the capital of France?
A: Paris. It is also the largest city in France, with about 2.1 million people in the city proper.
Q: How many legs does a spider have?
A: Eight. Insects have six; spiders are arachnids, not insects.
Q: Can you summarise the plot of the book in two sentences?
A: A young woman inherits a failing bakery. She rebuilds it, one loaf at a time, with help from her
neighbours, and learns that the town needed the bakery as much as she did.

Recipe: simple tomato soup (serves 4)
- 1 kg ripe tomatoes, chopped
- 2 onions, 3 cloves of garlic
- 500 ml vegetable stock; salt & pepper to taste
1. Soften the onions in olive oil for 10 minutes.
2. Add garlic, tomatoes and stock; simmer for 25-30 minutes.
3. Blend until smooth. Serve hot, with bread.

def fibonacci(n: int) -> list[int]:
    """Return the first n Fibonacci numbers."""
    values = [0, 1]
    while len(values) < n:
        values.append(values[-1] + values[-2])
    return values[:n]


class Counter:
    def __init__(self, start: int = 0) -> None:
        self.count = start

    def increment(self, step: int = 1) -> int:
        self.count += step
        return self.count


for i, word in enumerate(["alpha", "beta", "gamma"]):
    print(f"{i}: {word!r} -> {len(word)}")

import json, os, sys
config = {"name": "server", "port": 8000, "debug": False, "tags": ["api", "v1"], "ratio": 0.75}
with open(os.path.join("/tmp", "config.json"), "w", encoding="utf-8") as f:
    json.dump(config, f, indent=2)
if __name__ == "__main__":
    sys.exit(main())

function add(a, b) { return a + b; }
const items = [1, 2, 3].map((x) => x * 2).filter((x) => x > 2);
console.log(`total = ${items.reduce((s, x) => s + x, 0)}`);
if (x !== null && y >= 0 || z <= -1) { throw new Error("bad input"); }

SELECT id, name, created_at FROM users WHERE age >= 18 AND country = 'NL' ORDER BY name LIMIT 10;
$ git commit -m "Fix off-by-one error in parser" && git push origin main
$ curl -s http://localhost:8000/v1/models | jq '.data[0].id'
#include <stdio.h>
int main(void) { printf("hello, world\n"); return 0; }
fn main() { let v: Vec<u32> = (0..10).collect(); println!("{:?}", v); }

## Notes
* **Bold**, _italic_, `code`, [link](https://example.com/path?q=1&r=2#top).
> A quote, inside a block.
| col A | col B |
|-------|-------|
| 10    | 20    |

Punctuation: , . ; : ! ? ' " ( ) [ ] { } < > / \ | @ # $ % ^ & * - _ + = ~ ` ... -- --- !! ?? !? :) ;)
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 3.14159 2.71828 -7 +12 1e-3 6.02e23 0x1F 0b1010 50%
Dates and times: 2024-01-31, 31/12/1999, 08:30, 23:59:59, Mon Tue Wed Thu Fri Sat Sun, Jan Feb Mar.

Le café était fermé, alors nous avons marché jusqu'à la boulangerie près de l'église.
Où est la gare ? À gauche, après le théâtre. Ça coûte douze euros, s'il vous plaît. Noël, façade, élève.
El niño comió una manzana mientras su señora madre leía el periódico. ¿Qué hora es? ¡Mañana!
Die Straße ist schön, aber die Brücke über den Fluss ist für Fußgänger gesperrt. Grüße aus München.
Não sei se ele vai à reunião amanhã; a informação ainda não chegou. Coração, ação, pão.
Smörgåsbord, fjärilar och Øresund; the naïve café owner's résumé mentioned a coöperative.

東京は日本の首都です。今日はいい天気ですね。私は毎朝コーヒーを飲みます。
北京是中国的首都。我们明天去图书馆学习。你好，世界！谢谢你的帮助。
서울은 한국의 수도입니다. 안녕하세요, 만나서 반갑습니다.
Москва — столица России. Привет, как дела? Ελληνικά: καλημέρα, ευχαριστώ.
Emoji: 😀 😂 🎉 👍 🚀 ❤️ 🔥 ✨ 🌍 🍕 🐍 🤖 👩‍💻 👨‍👩‍👧 👍🏽 🏳️‍🌈 ☕ ⚡ ✅ ❌
Math and symbols: α + β = γ, ∑ x_i, ∫ f(x) dx, √2 ≈ 1.414, π ≈ 3.14, ∞, ≤ ≥ ≠ ± × ÷ → ← ↔ °C € £ ¥ © ® ™ § ¶ • – — “ ” ‘ ’ « » …

The library opens at nine and closes at six, except on Sundays, when it stays closed all day.
Students often arrive early to claim the tables near the windows, where the light is best.
On the second floor there is a small room full of maps, some of them more than two hundred years old.
The librarian, a patient man with round glasses, knows where every book is, even the lost ones.
When a storm knocked out the power last winter, he kept the doors open and lit candles on the desks.
People came in from the cold, read by candlelight, and talked quietly until the lights came back.

Machine learning models learn patterns from data. A language model predicts the next token given the
previous tokens; a tokenizer turns text into those tokens and back again. Byte-level tokenizers can
represent any string, because every byte has a token of its own, even when a character needs four.
Attention layers store keys and values for each token, while state space layers keep one fixed-size
state that summarises everything seen so far. Hybrid models mix both kinds of layers.
Caching a prefix saves work: if two requests share the same system prompt, the second one can reuse
the computation of the first, as long as the saved state matches the prefix exactly, token by token.

It was late, and the train was slow. Somewhere past midnight the conductor walked through the
carriage, checking tickets and humming an old song. A child slept against the window; her father
read a newspaper he had already read twice. Outside, small towns slid by: a church, a gas station,
a dark field, a single lit window. "Next stop, Riverside," the speaker said, and nobody moved.

Why do cats purr? Nobody knows for certain. Why is the sky blue? Because air scatters blue light
more than red light. Why does bread rise? Because yeast eats sugar and makes carbon dioxide gas.
Why do we sleep? To rest, to remember, to repair; the full answer is still being studied.

system
You are a helpful assistant. Answer briefly and politely; if you do not know, say so.
developer
Follow the style guide: short sentences, no jargon.
user
Please translate "good night" into Spanish.
assistant
"Buenas noches." Would you like the French as well? It is "Bonne nuit".
'''


def train_tokenizer() -> Any:
    """Train the byte-level BPE on CORPUS; returns a `tokenizers.Tokenizer` of VOCAB_SIZE tokens.

    All 256 byte symbols are in the initial alphabet, so any string (any script, any emoji)
    encodes without unknown tokens. No prefix space is added; decoding is the inverse of encoding.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        show_progress=False,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator([CORPUS], trainer)
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"the corpus yields {tokenizer.get_vocab_size()} tokens, expected {VOCAB_SIZE}")
    for expected_id, token in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(token) != expected_id:
            raise RuntimeError(f"{token} did not get id {expected_id}")
    return tokenizer


def model_config() -> dict[str, Any]:
    """config.json as published Granite-4.0-H checkpoints spell it (mamba/attention, nope)."""
    head_dim = 128 // 4
    return {
        "architectures": ["GraniteMoeHybridForCausalLM"],
        "model_type": "granitemoehybrid",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 128,
        "intermediate_size": 256,
        "shared_intermediate_size": 256,
        "num_local_experts": 0,
        "num_experts_per_tok": 0,
        "num_hidden_layers": len(LAYER_TYPES),
        "layer_types": list(LAYER_TYPES),
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "position_embedding_type": "nope",
        "max_position_embeddings": 4096,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-05,
        "mamba_n_heads": 8,
        "mamba_d_head": 32,
        "mamba_expand": 2,
        "mamba_d_state": 32,
        "mamba_n_groups": 1,
        "mamba_d_conv": 4,
        "mamba_chunk_size": 256,
        "mamba_conv_bias": True,
        "mamba_proj_bias": False,
        "embedding_multiplier": 12.0,
        "attention_multiplier": 1.0 / head_dim,
        "residual_multiplier": 0.22,
        "logits_scaling": 2.0,
        # Large enough that logits spread (greedy top-2 gaps rarely below 1e-3) and that
        # attention is far from uniform, so cache bugs change outputs visibly.
        "initializer_range": 0.2,
        # Untied: with tied embeddings a random model just repeats its last input token.
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": SPECIAL_TOKENS.index(END_OF_TEXT),
        "pad_token_id": SPECIAL_TOKENS.index(PAD),
        "use_cache": True,
        "torch_dtype": "float32",
    }


def generation_config() -> dict[str, Any]:
    return {
        "eos_token_id": SPECIAL_TOKENS.index(END_OF_TEXT),
        "pad_token_id": SPECIAL_TOKENS.index(PAD),
    }


def tokenizer_config() -> dict[str, Any]:
    """tokenizer_config.json; no BOS is added (like Granite), decode keeps spaces as they are."""
    added = {
        str(i): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, token in enumerate(SPECIAL_TOKENS)
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": [START_OF_ROLE, END_OF_ROLE],
        "bos_token": None,
        "eos_token": END_OF_TEXT,
        "pad_token": PAD,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "padding_side": "left",
        "chat_template": CHAT_TEMPLATE,
    }


def special_tokens_map() -> dict[str, Any]:
    return {
        "additional_special_tokens": [START_OF_ROLE, END_OF_ROLE],
        "eos_token": END_OF_TEXT,
        "pad_token": PAD,
    }


def write_weights(out_dir: Path, config: dict[str, Any]) -> None:
    """Random weights under torch.manual_seed(SEED), written as out_dir/model.safetensors.

    transformers' init sets every Mamba dt_bias to 1, which makes the state forget almost
    everything after one token; dt_bias is then re-drawn as in the Mamba2 reference init
    (dt log-uniform in [1e-3, 1e-1], dt_bias = softplus^-1(dt)) so the recurrent state carries
    information over tens of tokens and a wrongly restored state shows in the outputs.
    """
    import torch
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    torch.manual_seed(SEED)
    hf_config = GraniteMoeHybridConfig(**{k: v for k, v in config.items() if k != "torch_dtype"})
    model = GraniteMoeHybridForCausalLM(hf_config).to(torch.float32).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            if layer.mamba is None:
                continue
            n_heads = layer.mamba.dt_bias.numel()
            log_dt = torch.rand(n_heads) * (math.log(1e-1) - math.log(1e-3)) + math.log(1e-3)
            dt = torch.exp(log_dt)
            layer.mamba.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        (out_dir / "model.safetensors").write_bytes((Path(tmp) / "model.safetensors").read_bytes())


def write_json(path: Path, obj: dict[str, Any]) -> None:
    """Stable formatting: sorted keys, two-space indent, UTF-8, trailing newline."""
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def generate(out_dir: Path) -> list[Path]:
    """Write every file of the model directory into out_dir (created if missing); returns them."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    (out_dir / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
    write_json(out_dir / "tokenizer_config.json", tokenizer_config())
    write_json(out_dir / "special_tokens_map.json", special_tokens_map())
    config = model_config()
    write_json(out_dir / "config.json", config)
    write_json(out_dir / "generation_config.json", generation_config())
    write_weights(out_dir, config)
    return sorted(out_dir.iterdir())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", type=Path, default=DEFAULT_OUT_DIR)
    args = parser.parse_args(argv)
    for path in generate(args.out_dir):
        print(f"{path.stat().st_size:>10}  {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
