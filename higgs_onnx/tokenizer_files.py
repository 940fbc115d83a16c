"""Tokenizer files of the Higgs v3 checkpoint layout (`tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja`).

The toolkit carries the real Qwen3 byte-level BPE with the 84 added tokens at their real ids
(`assets/qwen3_higgs_tokenizer.json.gz`, spec §3.1). The `4b` preset writes it unchanged; the `tiny` preset keeps
only the first `base_vocab` BPE ranks (and the merges that produce them) and appends the same 84 added tokens in
the same order right after, so every tag is still one id — just a different id. Runtime code looks ids up by string.
"""

from __future__ import annotations

import gzip
import json
from functools import lru_cache
from pathlib import Path

ASSETS = Path(__file__).resolve().parent / "assets"
REAL_TOKENIZER = ASSETS / "qwen3_higgs_tokenizer.json.gz"

# Qwen's im-style template. It ships with the real checkpoint but takes no part in TTS prompts (spec §3).
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@lru_cache(maxsize=1)
def real_tokenizer_json() -> str:
    with gzip.open(REAL_TOKENIZER, "rt", encoding="utf-8") as f:
        return f.read()


def tiny_tokenizer_json(base_vocab: int) -> dict:
    """The real tokenizer cut to its first `base_vocab` ranks, with the 84 added tokens re-numbered after them."""
    tok = json.loads(real_tokenizer_json())
    vocab = {s: i for s, i in tok["model"]["vocab"].items() if i < base_vocab}
    merges = [m for m in tok["model"]["merges"] if "".join(m) in vocab and m[0] in vocab and m[1] in vocab]
    tok["model"]["vocab"] = vocab
    tok["model"]["merges"] = merges
    for k, added in enumerate(tok["added_tokens"]):  # keep the real order
        added["id"] = base_vocab + k
    return tok


def tokenizer_config(tokenizer: dict) -> dict:
    """`tokenizer_config.json` as the real repo has it (Qwen2Tokenizer), with ids taken from `tokenizer`."""
    added = {str(a["id"]): {k: a[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")}
             for a in tokenizer["added_tokens"]}
    return {
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|endoftext|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def write_tokenizer_files(out: Path, base_vocab: int | None) -> dict:
    """Write the three tokenizer files into `out`; `base_vocab=None` writes the real vocabulary. Returns the JSON."""
    if base_vocab is None:
        text = real_tokenizer_json()
        tok = json.loads(text)
    else:
        tok = tiny_tokenizer_json(base_vocab)
        text = json.dumps(tok, ensure_ascii=False)
    (out / "tokenizer.json").write_text(text, encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(tok), indent=2) + "\n")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE + "\n")
    return tok
