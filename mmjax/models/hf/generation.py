"""`generate(module, max_new_tokens=N, **hf_inputs)`: greedy decoding of a module `hf.load`
built (a decoder `LLM`, a LLaVA or Qwen2-VL `MultimodalModel`) from Hugging Face's inputs,
token for token what transformers' `model.generate(**hf_inputs, do_sample=False,
max_new_tokens=N)` returns after the prompt (transformers 5.24's rules, docs/guide.md):

- left padding through `attention_mask` (absent: inferred from `pad_token_id` as
  transformers does); positions count real tokens only (M-RoPE: `get_rope_index` over the
  real tokens, then + rope delta per step);
- stopping: a row that emits an `eos_token_id` is finished (the eos is kept); its later
  columns hold `pad_token_id`; decoding ends once every row is finished, so the result has
  N columns, or fewer when all rows stopped early;
- eos / pad ids from generation_config.json, else config.json (top level, then
  text_config), as `GenerationConfig.from_model_config`; pad defaults to the first eos;
- `repetition_penalty` (generation_config.json or the argument) as transformers'
  `RepetitionPenaltyLogitsProcessor`: the logit of every token already in the sequence
  (prompt, padding included, and generated) divided by it (multiplied when negative);
  other logits processors that change greedy tokens are refused in one line.

The decoding itself is `models/decode.py` (prefill, then KV-cached `decode_step`s).
"""
from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mmjax.models.decode import decode_step, next_rope_position, prefill_embedded
from mmjax.models.llm import LLM
from mmjax.models.mllm import MultimodalModel

# generation_config fields whose non-default value changes greedy tokens (logits processors,
# beam search) and that mmjax does not apply: refused rather than silently ignored
_UNSUPPORTED = {"no_repeat_ngram_size": 0, "bad_words_ids": None,
                "min_length": 0, "min_new_tokens": None, "forced_bos_token_id": None,
                "forced_eos_token_id": None, "suppress_tokens": None,
                "begin_suppress_tokens": None, "sequence_bias": None, "num_beams": 1,
                "encoder_repetition_penalty": 1.0, "encoder_no_repeat_ngram_size": 0,
                "exponential_decay_length_penalty": None, "guidance_scale": None,
                "penalty_alpha": None, "low_memory": None}


def _source(module) -> tuple[Path | None, dict | None]:
    """The directory `hf.load` read (if still there) and its config.json."""
    src = getattr(module, "hf_source", None)
    if src is None:
        return None, None
    if src.lstrip().startswith("{"):  # Qwen2-VL remembers its config with the directory
        info = json.loads(src)
        d = Path(info["dir"]) if info.get("dir") else None
        return (d if d is not None and d.is_dir() else None), info.get("config")
    d = Path(src)
    return d, json.loads((d / "config.json").read_text())


# the eos / pad ids transformers' config classes default to when config.json omits them
_CLASS_IDS = {"llama": (2, None), "mistral": (2, None), "qwen2": (None, None),
              "qwen3": (None, None), "gemma2": (1, 0), "gemma3_text": (1, 0),
              "gemma3": (1, 0), "phi3": (32000, 32000), "qwen2_vl": (151645, None),
              "qwen2_5_vl": (151645, None), "qwen2_vl_text": (151645, None),
              "qwen2_5_vl_text": (151645, None)}


def _config_ids(config: dict) -> dict:
    """eos / pad ids of a config.json: its top level, else (composite) its text_config's,
    else the defaults of the text model's config class."""
    text = config.get("text_config")
    inner = text if text is not None else config
    kind = inner.get("model_type") or ("llama" if config.get("model_type") == "llava"
                                       else config.get("model_type"))
    defaults = _CLASS_IDS.get(kind, (None, None)) if isinstance(kind, str) else (None, None)
    out = {}
    for i, k in enumerate(("eos_token_id", "pad_token_id")):
        top = config.get(k)
        out[k] = top if top is not None or text is None and k in config else (
            inner[k] if k in inner else defaults[i])
    return out


def generation_config(module) -> dict:
    """The generation settings transformers reads for this module's source checkpoint."""
    d, config = _source(module)
    if d is not None and (d / "generation_config.json").is_file():
        return json.loads((d / "generation_config.json").read_text())
    config = config or {}
    out = {k: v for k, v in config.items() if v is not None and not isinstance(v, dict)}
    for k, v in (config.get("text_config") or {}).items():
        if out.get(k, _UNSUPPORTED.get(k)) == _UNSUPPORTED.get(k) and v is not None:
            out[k] = v
    out.update(_config_ids(config))
    return out


def special_ids(module, eos_token_id=None, pad_token_id=None,
                repetition_penalty=None) -> tuple[tuple, int | None, float]:
    """(eos ids, pad id, repetition penalty) as transformers' generate settles them;
    arguments override the checkpoint's."""
    g = generation_config(module)
    bad = {k: g[k] for k, default in _UNSUPPORTED.items()
           if k in g and g[k] is not None and g[k] != default}
    if bad:
        raise ValueError(f"generate: the checkpoint's generation settings {bad} change "
                         f"transformers' greedy tokens and mmjax does not apply them (remove "
                         f"them from generation_config.json / config.json)")
    eos = g.get("eos_token_id") if eos_token_id is None else eos_token_id
    eos = () if eos is None else tuple(np.atleast_1d(eos).astype(int).tolist())
    pad = g.get("pad_token_id") if pad_token_id is None else pad_token_id
    penalty = g.get("repetition_penalty") if repetition_penalty is None else repetition_penalty
    penalty = 1.0 if penalty is None else float(penalty)
    if penalty <= 0:
        raise ValueError(f"generate: repetition_penalty={penalty} (give a positive number; "
                         f"1.0: none)")
    return eos, (eos[0] if pad is None and eos else pad), penalty


@jax.jit
def _penalized(logits, seen, penalty):
    """transformers' RepetitionPenaltyLogitsProcessor over the tokens `seen` [B, V]."""
    hit = jnp.where(logits < 0, logits * penalty, logits / penalty)
    return jnp.where(seen, hit, logits)


def _attention_mask(ids, mask, eos, pad):
    """transformers' `_prepare_attention_mask_for_generation`: the given mask, else
    ids != pad when pad occurs in ids and is not an eos id, else all ones."""
    if mask is not None:
        return np.asarray(mask) != 0
    if pad is not None and (ids == pad).any() and pad not in eos:
        return ids != pad
    return np.ones(ids.shape, bool)


@nnx.jit(static_argnames=("max_len", "image_token"))
def _prefill_llava(model, ids, pixels, positions, allowed, max_len, image_token):
    from mmjax.models.hf.llava_forward import llava_embed
    x = llava_embed(model, ids, pixels, image_token)
    return prefill_embedded(model.llm, x, positions, allowed, max_len)


@nnx.jit(static_argnames=("max_len",))
def _prefill_qwen2_vl(model, a, allowed, max_len):
    from mmjax.models.hf.qwen2_vl_forward import qwen2_vl_embed
    x = qwen2_vl_embed(model, a["tokens"], a["patches"], a["patch_seg"], a["patch_pos"],
                       a["gather"])
    return prefill_embedded(model.llm, x, a["positions"], allowed, max_len)


@nnx.jit(static_argnames=("max_len",))
def _prefill_text(model, ids, positions, allowed, max_len):
    return prefill_embedded(model, model.embed_tokens(ids), positions, allowed, max_len)


def _prefill(module, inputs: dict, ids, valid, max_len: int):
    """-> (last prompt logits [B, V], cache, RoPE positions of the prompt)."""
    from mmjax.models.hf.dispatch import _is_qwen2_vl
    s = ids.shape[1]
    allowed = jnp.asarray(np.tril(np.ones((s, s), bool))[None] & valid[:, None, :])
    # transformers' position_ids: attention_mask.cumsum(-1) - 1, 0 at padding
    positions = jnp.asarray(np.where(valid, np.cumsum(valid, axis=1) - 1, 0), jnp.int32)
    if _is_qwen2_vl(module):
        from mmjax.models.hf.qwen2_vl_forward import qwen2_vl_prompt
        a = qwen2_vl_prompt(module, ids, attention_mask=valid.astype(np.int64), **inputs)
        return (*_prefill_qwen2_vl(module, a, allowed, max_len=max_len), a["positions"])
    if isinstance(module, MultimodalModel):
        from mmjax.models.hf.llava_forward import check_image_tokens
        token = getattr(module, "hf_image_token", None)
        if token is None:
            raise ValueError("generate: this MultimodalModel was not loaded from a LLaVA or "
                             "Qwen2-VL checkpoint (hf.load): its image token id is unknown")
        if "pixel_values" not in inputs:  # a text-only prompt: the text model alone
            if (ids == token).any():
                raise ValueError(f"generate: input_ids hold image tokens (id {token}) but no "
                                 f"pixel_values were given")
            return (*_prefill_text(module.llm, jnp.asarray(ids, jnp.int32), positions,
                                   allowed, max_len=max_len), positions)
        pixels = inputs.pop("pixel_values")
        check_image_tokens(module, token, ids, pixels)
        out = _prefill_llava(module, jnp.asarray(ids, jnp.int32),
                             jnp.asarray(pixels, jnp.float32), positions, allowed,
                             max_len=max_len, image_token=int(token))
        return (*out, positions)
    return (*_prefill_text(module, jnp.asarray(ids, jnp.int32), positions, allowed,
                           max_len=max_len), positions)


def _check_inputs(module, inputs: dict) -> None:
    from mmjax.models.hf.dispatch import _is_qwen2_vl
    takes = ({"pixel_values", "image_grid_thw", "mm_token_type_ids"} if _is_qwen2_vl(module)
             else {"pixel_values"} if isinstance(module, MultimodalModel) else set())
    if not isinstance(module, (LLM, MultimodalModel)):
        raise ValueError(f"generate: a {type(module).__name__} does not generate text (pass "
                         f"an LLM, LLaVA or Qwen2-VL model hf.load built)")
    extra = sorted(set(inputs) - takes)
    if extra:
        raise ValueError(f"generate: inputs {extra} do not apply to this "
                         f"{type(module).__name__} (it takes input_ids, attention_mask"
                         f"{''.join(', ' + k for k in sorted(takes))})")


def generate(module, max_new_tokens: int, input_ids=None, attention_mask=None,
             eos_token_id=None, pad_token_id=None, repetition_penalty=None,
             **inputs) -> np.ndarray:
    """Greedy new tokens [B, <= max_new_tokens] (int64) after `input_ids`, as transformers'
    `generate(do_sample=False)` returns them (module docstring: padding, eos, pad)."""
    if input_ids is None:
        raise ValueError("generate: input_ids is required (the prompt, [batch, length])")
    if int(max_new_tokens) < 1:
        raise ValueError(f"generate: max_new_tokens={max_new_tokens} (give at least 1)")
    _check_inputs(module, inputs)
    ids = np.asarray(input_ids).astype(np.int64)
    if ids.ndim != 2:
        raise ValueError(f"generate: input_ids has shape {ids.shape}; give [batch, length]")
    eos, pad, penalty = special_ids(module, eos_token_id, pad_token_id, repetition_penalty)
    valid = _attention_mask(ids, attention_mask, eos, pad)
    b, s = ids.shape
    n = int(max_new_tokens)
    logits, cache, positions = _prefill(module, dict(inputs), ids, valid, s + n)
    graphdef, state = nnx.split(module)
    rope = next_rope_position(positions, s)
    key_valid = jnp.asarray(np.concatenate([valid, np.ones((b, n), bool)], axis=1))
    vocab = int(logits.shape[-1])
    seen = np.zeros((b, vocab), bool)  # tokens in the sequence so far (repetition penalty)
    rows, cols = np.nonzero(ids < vocab)
    seen[rows, ids[rows, cols]] = True
    unfinished = np.ones(b, bool)
    out = []
    for t in range(n):
        if penalty != 1.0:
            logits = _penalized(logits, jnp.asarray(seen), jnp.float32(penalty))
        token = np.asarray(jnp.argmax(logits, axis=-1)).astype(np.int64)
        if eos:
            assert pad is not None  # special_ids: with eos ids, pad defaults to the first
            token = np.where(unfinished, token, pad)
            unfinished &= ~np.isin(token, eos)
        out.append(token)
        if t + 1 == n or not unfinished.any():
            break
        inside = token < vocab
        seen[np.arange(b)[inside], token[inside]] = True
        # a finished row's input is its pad id (clipped into the vocabulary); its outputs
        # are replaced by pad, so what it attends to does not matter
        fed = jnp.asarray(np.clip(token, 0, vocab - 1), jnp.int32)
        logits, cache = decode_step(graphdef, state, fed, jnp.int32(s + t), cache,
                                    rope + t, key_valid)
    return np.stack(out, axis=1)
