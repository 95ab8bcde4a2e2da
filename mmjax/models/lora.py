"""Low-rank adapters on a unit's projections (Hu et al., LoRA §4.1): y = x W + (x A) B * s,
A [in, r] drawn as peft draws lora_A (kaiming-uniform with a = sqrt(5): U(±1/sqrt(in))), B
[r, out] zero, so a fresh adapter changes nothing. The adapter weights are `LoRAParam`s,
the only parameters of a LoRA'd unit that train (`mllm.trainable_filter`); the base weights
stay frozen in their stored dtype. models/lora_merge.py folds them in (W + A B s).
Dropout on the adapter's input (peft's `lora_dropout`) applies only inside `dropout_key(key)`
(the training step's scope): each adapter call traced there draws its mask from `key` folded
with its own call number; a layer's calls (`layer_dropout`) from `key` folded with the
layer's unit and index, numbered within the layer. Settings: models/lora_config.py; the story: docs/lora.md."""
from __future__ import annotations

import contextlib
import contextvars
import math
import zlib

import jax
import jax.numpy as jnp
from flax import nnx

from mmjax.models.lora_config import LoRAConfig


_DROPOUT = contextvars.ContextVar("mmjax_lora_dropout", default=None)
DROPOUT_SEED = 0x10A  # a training step's masks: this key folded with the applied-step count


@contextlib.contextmanager
def dropout_key(key):
    """Trace-time scope: adapters with dropout > 0 drop their inputs, masks drawn from `key`
    (a training step's) folded with each call's number in the trace; outside one (evaluation,
    generation, export) no dropout applies, as in peft's eval mode."""
    token = _DROPOUT.set([key, 0])
    try:
        yield
    finally:
        _DROPOUT.reset(token)


def dropout_active() -> bool:
    """Whether a training step's dropout scope is open (`dropout_key`)."""
    return _DROPOUT.get() is not None


@contextlib.contextmanager
def layer_dropout(index, unit: str | None = None):
    """Within `dropout_key`: the adapters of layer `index` (a Python int in a loop, traced in
    a scan) of `unit` draw masks from the step's key folded with (unit, index), numbered
    from 0 within the layer, so a layer stack draws the same masks looped or scanned
    (models/scan.py; the co-located step scans what the single program may loop)."""
    scope = _DROPOUT.get()
    if scope is None:
        yield
        return
    key = jax.random.fold_in(scope[0], zlib.crc32((unit or "").encode()) & 0x7FFFFFFF)
    token = _DROPOUT.set([jax.random.fold_in(key, index), 0])
    try:
        yield
    finally:
        _DROPOUT.reset(token)


def _dropped(x, p: float):
    """x with each element zeroed with probability p, the rest scaled by 1 / (1 - p)."""
    scope = _DROPOUT.get()
    if not p or scope is None:
        return x
    scope[1] += 1
    keep = jax.random.bernoulli(jax.random.fold_in(scope[0], scope[1]), 1.0 - p, x.shape)
    return jnp.where(keep, x / jnp.asarray(1.0 - p, x.dtype), jnp.zeros_like(x))


class LoRAParam(nnx.Param):
    """An adapter weight: trained where its unit's base weights are frozen."""


class LoRA(nnx.Module):
    """One projection's adapter: `a` [din, r], `b` [r, dout], `scale` alpha / r (or
    alpha / sqrt(r), rsLoRA); `dropout` on its input within `dropout_key`."""

    def __init__(self, key, din: int, dout: int, cfg: LoRAConfig):
        bound = 1.0 / math.sqrt(din)
        self.a = LoRAParam(jax.random.uniform(key, (din, cfg.rank), jnp.float32, -bound, bound))
        self.b = LoRAParam(jnp.zeros((cfg.rank, dout), jnp.float32))
        self.scale, self.dropout = cfg.scale, cfg.dropout

    def __call__(self, x):
        dt = x.dtype
        x = _dropped(x, self.dropout)
        return ((x @ self.a[...].astype(dt)) @ self.b[...].astype(dt)) * jnp.asarray(
            self.scale, dt)

    def delta(self):
        """A B * scale [din, dout] in float32 (what merging adds to the base weight)."""
        a, b = self.a[...].astype(jnp.float32), self.b[...].astype(jnp.float32)
        return (a @ b) * jnp.float32(self.scale)


def adapters(key, shapes: dict[str, tuple[int, int]], cfg: LoRAConfig | None, kind: str):
    """{projection: LoRA} for the projections of `shapes` ({name: (din, dout)}) that `cfg`
    targets in a unit of `kind`, as an nnx.Dict; None without LoRA. Adapter j's key is
    fold_in(key, 1 << 20 | j): no collision with the base weights' splits of `key`."""
    if cfg is None:
        return None
    names = [n for n in cfg.targets_in(kind) if n in shapes]
    return nnx.Dict({n: LoRA(jax.random.fold_in(key, 1 << 20 | j), *shapes[n], cfg)
                     for j, n in enumerate(names)}) or None


def adapt(lora, name: str, x, y):
    """y plus the adapter `name` of `lora` on x (y unchanged where there is none)."""
    if lora is None or name not in lora:
        return y
    return y + lora[name](x).astype(y.dtype)
