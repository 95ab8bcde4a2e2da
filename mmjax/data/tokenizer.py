"""Tokenizers: a Hugging Face `tokenizers` file, or bytes for the synthetic set (no JAX).

`tokenizer.path` (gin) names a local directory holding `tokenizer.json` (the `tokenizers`
library's format) and, optionally, `tokenizer_config.json` (bos/eos/pad tokens and the
`chat_template`, as Hugging Face writes them). The modality markers that assembly wraps
around every image / audio / generated-image block (`MARKERS`) and the placeholders that
conversations use (`<image>`, `<audio>`) are added as special tokens, so they are single ids
and never ordinary text. The model's vocabulary must cover the tokenizer: `padded_vocab`
rounds it up to a multiple of 128 and of every tensor-parallel degree (the embedding is
split by tp).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass

import gin
import numpy as np

from mmjax.errors import UserError
from mmjax.data.sample import SpecialTokens

MARKERS = {"image_start": "<|image_start|>", "image_end": "<|image_end|>",
           "audio_start": "<|audio_start|>", "audio_end": "<|audio_end|>",
           "gen_start": "<|gen_start|>", "gen_end": "<|gen_end|>"}
PLACEHOLDERS = {"image": "<image>", "audio": "<audio>"}


def padded_vocab(size: int, tps=(1,), multiple: int = 128) -> int:
    """`size` rounded up to a multiple of `multiple` and of every tp degree in `tps`."""
    step = math.lcm(multiple, *[max(int(t), 1) for t in tps])
    return -(-int(size) // step) * step


def _token_content(value) -> str | None:
    """tokenizer_config.json writes special tokens as a string or {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value


@dataclass
class Encoding:
    ids: np.ndarray  # int32 [L]
    offsets: list[tuple[int, int]]  # character span of each token in the input


def chat_template(path: str, config: dict) -> str | None:
    """The default chat template as transformers 5 reads it: `chat_template.jinja` beside
    tokenizer_config.json takes priority, then `additional_chat_templates/default.jinja`,
    then tokenizer_config.json's `chat_template` (a string, or a list of named templates
    whose "default" is used), then a processor's legacy `chat_template.json`."""
    for name in ("chat_template.jinja", os.path.join("additional_chat_templates",
                                                      "default.jinja")):
        file = os.path.join(path, name)
        if os.path.isfile(file):
            with open(file, encoding="utf-8") as f:
                return f.read()
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default", next(iter(named.values()), None))
    legacy = os.path.join(path, "chat_template.json")  # a processor's (LLaVA checkpoints)
    if template is None and os.path.isfile(legacy):
        with open(legacy, encoding="utf-8") as f:
            template = json.load(f).get("chat_template")
    return template


class Tokenizer:
    """A `tokenizers` tokenizer with its config: encode/decode, special ids, chat template."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer as HFTokenizer

        file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(file):
            raise UserError(f"tokenizer.path={path!r}: no tokenizer.json there (point it at a "
                             f"directory holding tokenizer.json and tokenizer_config.json)")
        self.path = path
        self.tok = HFTokenizer.from_file(file)
        conf_file = os.path.join(path, "tokenizer_config.json")
        self.config = {}
        if os.path.isfile(conf_file):
            with open(conf_file) as f:
                self.config = json.load(f)
        self.tok.add_special_tokens(list(MARKERS.values()) + list(PLACEHOLDERS.values()))
        self.bos_token = _token_content(self.config.get("bos_token"))
        self.eos_token = _token_content(self.config.get("eos_token"))
        self.pad_token = _token_content(self.config.get("pad_token"))
        for name in ("bos_token", "eos_token", "pad_token"):
            t = getattr(self, name)
            if t is not None and self.tok.token_to_id(t) is None:
                raise UserError(f"{conf_file}: {name}={t!r} is not in tokenizer.json")
        if self.eos_token is None:
            raise UserError(f"tokenizer.path={path!r}: tokenizer_config.json names no "
                             f"eos_token (add \"eos_token\": \"...\")")
        self.chat_template = chat_template(path, self.config)

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def vocab_size(self) -> int:
        """Largest id + 1 (ids of added tokens need not be contiguous)."""
        return max(self.tok.get_vocab(with_added_tokens=True).values()) + 1

    def token_id(self, token: str) -> int:
        i = self.tok.token_to_id(token)
        if i is None:
            raise KeyError(f"token {token!r} not in the tokenizer")
        return i

    def special_tokens(self) -> SpecialTokens:
        """Assembly's ids: documents start with bos (pad or eos where there is no bos, as
        in Qwen2) and end with eos; modality blocks are wrapped in the markers."""
        assert self.eos_token is not None  # __init__ refuses a tokenizer without one
        start = self.bos_token or self.pad_token or self.eos_token
        return SpecialTokens(bos=self.token_id(start), eos=self.token_id(self.eos_token),
                             first_text=0,
                             **{k: self.token_id(v) for k, v in MARKERS.items()})

    def placeholder_id(self, modality: str) -> int:
        return self.token_id(PLACEHOLDERS[modality])

    def encode(self, text: str) -> Encoding:
        """Token ids of `text` without added bos/eos (chat templates write their own)."""
        e = self.tok.encode(text, add_special_tokens=False)
        return Encoding(np.asarray(e.ids, np.int32), list(e.offsets))

    def encode_batch(self, texts: list[str]) -> list[Encoding]:
        out = self.tok.encode_batch(texts, add_special_tokens=False)
        return [Encoding(np.asarray(e.ids, np.int32), list(e.offsets)) for e in out]

    def max_token_chars(self) -> int:
        """The most characters one token stands for (the longest vocabulary entry, in its
        stored form: a byte-level entry's characters are its bytes, never fewer than the
        text's characters), so `len(text) / max_token_chars()` tokens at least."""
        return max(len(t) for t in self.tok.get_vocab(with_added_tokens=True))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def fingerprint(self) -> str:
        """Hash of tokenizer.json and tokenizer_config.json: cached token counts are valid
        only for the tokenizer that made them."""
        h = hashlib.sha256()
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            file = os.path.join(self.path, name)
            if os.path.isfile(file):
                with open(file, "rb") as f:
                    h.update(f.read())
        return h.hexdigest()[:16]


@gin.configurable
def tokenizer(path: str | None = None) -> Tokenizer | None:
    """The configured tokenizer (`tokenizer.path = "/data/tok"`), or None when unset."""
    if not path:
        return None
    if not os.path.isdir(path):
        raise UserError(f"tokenizer.path={path!r} is not a directory (it must hold "
                         f"tokenizer.json and tokenizer_config.json)")
    return Tokenizer(path)
