"""Chat templates and loss masks (no JAX).

A conversation is rendered to one string exactly as Hugging Face's `apply_chat_template`
does (Jinja2 sandbox with `trim_blocks` / `lstrip_blocks`, `raise_exception`, the tokenizer's
special tokens as variables, `add_generation_prompt`), with the tokenizer's own
`chat_template` or a named one (`TEMPLATES`: llama3, qwen2, plain). The string is split at
the `<image>` / `<audio>` placeholders (added special tokens, so tokenizing the pieces equals
tokenizing the whole) and each text piece is tokenised with character offsets.

Loss masks: with `loss_on="assistant"` a token is trained iff it lies in an assistant
turn's span, which is found by rendering prefixes: turn i spans
[len(render(messages[:i], add_generation_prompt=True)), len(render(messages[:i+1]))), i.e.
its content and the template's end-of-turn marker, without the role header (the model
learns to answer and to stop, not to predict the prompt). `loss_on="all"` trains every text
token (caption / pretraining data).
"""
from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any
from dataclasses import dataclass
from datetime import datetime

import numpy as np

from mmjax.errors import UserError
from mmjax.data.tokenizer import PLACEHOLDERS

LOSS_ON = ("assistant", "all")
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
         "system": "system"}

TEMPLATES = {
    # Meta-Llama-3-Instruct's template.
    "llama3": (
        "{% set loop_messages = messages %}{% for message in loop_messages %}"
        "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
        " + message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
        "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
        "{% endif %}"),
    # Qwen2-Instruct's template (default system prompt when none is given).
    "qwen2": (
        "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
        "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"),
    # LLaVA's pretraining format ("plain"): the turns' contents, no roles; each answer
    # ends with a newline.
    "plain": ("{% for message in messages %}{{ message['content'] }}"
              "{% if message['role'] == 'assistant' %}{{ '\n' }}{% endif %}{% endfor %}"),
}


def _llama3(messages, add_generation_prompt, v):
    for i, m in enumerate(messages):
        yield ((v["bos_token"] if i == 0 else "") + "<|start_header_id|>" + m["role"]
               + "<|end_header_id|>\n\n"), m["content"].strip() + "<|eot_id|>"
    if add_generation_prompt:
        yield "<|start_header_id|>assistant<|end_header_id|>\n\n", ""


def _qwen2(messages, add_generation_prompt, v):
    for i, m in enumerate(messages):
        system = (i == 0 and messages[0]["role"] != "system")
        yield ((system * "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
               + "<|im_start|>" + m["role"] + "\n"), m["content"] + "<|im_end|>\n"
    if add_generation_prompt:
        yield "<|im_start|>assistant\n", ""


def _plain(messages, add_generation_prompt, v):
    for m in messages:
        yield "", m["content"] + ("\n" if m["role"] == "assistant" else "")


# The named templates written as Python: per message (its header, its body), the body of an
# assistant turn being its trained span by the module docstring's prefix rule (content and
# end-of-turn marker). The same text as the Jinja template and the same spans as the prefix
# renders, from one pass (tests/test_data_tokenizer_chat.py checks both); used when a
# format's template is a named one, as the example tokenizer's is.
# (keyed `str | None`: looked up by a template name that may be None)
COMPILED: dict[str | None, Callable] = {"llama3": _llama3, "qwen2": _qwen2, "plain": _plain}
# placeholder text -> its modality, and the pattern that splits a rendered chat around them
_KIND_OF = {v: k for k, v in PLACEHOLDERS.items()}
_AROUND_PLACEHOLDERS = re.compile("(" + "|".join(map(re.escape, _KIND_OF)) + ")")


class ChatError(ValueError):
    """A conversation that cannot be rendered (bad roles, a template's raise_exception)."""


def _environment():
    """Jinja2 as `transformers` compiles chat templates (sandboxed, trim/lstrip blocks,
    loopcontrols, `{% generation %}` blocks accepted, `raise_exception`, `strftime_now`)."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_render", []), [], [], body
                                   ).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise ChatError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def normalize_messages(conversation: list[dict]) -> list[dict]:
    """LLaVA turns ({"from": "human"|"gpt"|"system", "value"}) or HF messages ({"role",
    "content"}) -> HF messages."""
    out = []
    for i, turn in enumerate(conversation):
        who = turn.get("from", turn.get("role"))
        text = turn.get("value", turn.get("content"))
        if who not in ROLES or not isinstance(text, str):
            raise ChatError(f"turn {i}: needs from/role in {sorted(ROLES)} and a string "
                            f"value/content, got {who!r}")
        out.append({"role": ROLES[who], "content": text})
    return out


@dataclass
class RenderedChat:
    """The conversation in LLM order: ("text", ids, trained) or ("image"|"audio", None,
    None) pieces; `trained` is bool [L] (None: every token trained)."""

    pieces: list[tuple[str, Any, np.ndarray | None]]  # ids: the tokenizer's list (or None)

    def count(self, modality: str) -> int:
        return sum(p[0] == modality for p in self.pieces)


class ChatFormat:
    """Renders conversations for one tokenizer with one template and loss policy."""

    def __init__(self, tokenizer, template: str | None = None, loss_on: str = "assistant"):
        if loss_on not in LOSS_ON:
            raise UserError(f"loss_on={loss_on!r}: use one of {LOSS_ON}")
        source = TEMPLATES.get(template, template) if template else tokenizer.chat_template
        if not source:
            raise UserError(f"chat template: the tokenizer has no chat_template; name one of "
                             f"{sorted(TEMPLATES)} (e.g. llava_source.chat_template = \"plain\")")
        self.tokenizer, self.loss_on = tokenizer, loss_on
        self.template = _environment().from_string(source)
        named = next((k for k, v in TEMPLATES.items() if v == source), None)
        self.compiled = COMPILED.get(named)
        self.special = tokenizer.special_tokens()
        self.variables = {k: getattr(tokenizer, k) or "" for k in
                          ("bos_token", "eos_token", "pad_token")}

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        try:
            return self.template.render(messages=messages,
                                        add_generation_prompt=add_generation_prompt,
                                        **self.variables)
        except ChatError:
            raise
        except Exception as e:  # jinja2 errors of a broken template or message
            raise ChatError(f"chat template: {type(e).__name__}: {e}") from None

    def assistant_spans(self, messages: list[dict], full: str) -> list[tuple[int, int]]:
        """Character spans of the assistant turns in `full` (see module docstring)."""
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            head = self.render(messages[:i], add_generation_prompt=True)
            upto = self.render(messages[:i + 1])
            if not (full.startswith(upto) and upto.startswith(head)):
                raise ChatError("chat template: rendering is not prefix-stable, so assistant "
                                "turns cannot be located; use a named template")
            spans.append((len(head), len(upto)))
        return spans

    def __call__(self, conversation: list[dict], add_generation_prompt: bool = False
                 ) -> RenderedChat:
        messages = normalize_messages(conversation)
        spans: list[tuple[int, int]] | None
        if self.compiled is not None and messages and messages[0]["role"] != "assistant":
            full, spans = self.render_compiled(messages, add_generation_prompt)
        else:  # any other template (or a conversation the prefix rule refuses)
            full = self.render(messages, add_generation_prompt)
            spans = None if self.loss_on == "all" else self.assistant_spans(messages, full)
        if self.loss_on == "all":
            return self.split(full, None)
        assert spans is not None  # None only when loss_on == "all" (returned above)
        trained = np.zeros(len(full) + 1, bool)
        for a, b in spans:
            trained[a:b] = True
        return self.split(full, trained)

    def render_compiled(self, messages: list[dict], add_generation_prompt: bool = False
                        ) -> tuple[str, list[tuple[int, int]]]:
        """A named template's text and assistant spans in one pass (`COMPILED`)."""
        assert self.compiled is not None  # __call__ renders compiled only with a named template
        parts: list[str] = []
        spans: list[tuple[int, int]] = []
        n = 0
        for m, (head, body) in zip(messages + [{"role": ""}],
                                   self.compiled(messages, add_generation_prompt,
                                                 self.variables)):
            n += len(head)
            if m["role"] == "assistant":
                spans.append((n, n + len(body)))
            n += len(body)
            parts += (head, body)
        return "".join(parts), spans

    def split(self, text: str, trained_chars: np.ndarray | None) -> RenderedChat:
        """Tokenise `text` piecewise around placeholders, with per-token masks."""
        parts = _AROUND_PLACEHOLDERS.split(text)
        pieces: list[tuple[str, Any, Any]] = []  # (kind, ids, mask) as RenderedChat holds
        base = 0
        for part in parts:
            if part in _KIND_OF:
                pieces.append((_KIND_OF[part], None, None))
            elif part:
                enc = self.tokenizer.encode(part)
                mask = None
                if trained_chars is not None:  # a token is trained iff its first character is
                    offs = np.asarray(enc.offsets, np.int64).reshape(-1, 2)
                    mask = (offs[:, 1] > offs[:, 0]) & trained_chars[base + offs[:, 0]]
                if len(enc.ids):
                    pieces.append(("text", enc.ids, mask))
            base += len(part)
        # Assembly writes the document's bos itself: drop the template's.
        if pieces and pieces[0][0] == "text" and pieces[0][1][0] == self.special.bos:
            _, ids, mask = pieces[0]
            pieces[0] = ("text", ids[1:], None if mask is None else mask[1:])
            if not len(ids) - 1:
                pieces.pop(0)
        return RenderedChat(pieces)
