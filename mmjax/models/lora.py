"""Low-rank adapters on a unit's projections (Hu et al., LoRA §4.1): y = x W + (x A) B * s,
A [in, r] drawn as peft draws lora_A (kaiming-uniform with a = sqrt(5): U(±1/sqrt(in))), B
[r, out] zero, so a fresh adapter changes nothing. The adapter weights are `LoRAParam`s,
the only parameters of a LoRA'd unit that train (`mllm.trainable_filter`); the base weights
stay frozen in their stored dtype. `merged_weights` folds them in (W + A B s) for export.
Settings: models/lora_config.py; the story: docs/lora.md."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from mmjax.models.lora_config import LoRAConfig


class LoRAParam(nnx.Param):
    """An adapter weight: trained where its unit's base weights are frozen."""


class LoRA(nnx.Module):
    """One projection's adapter: `a` [din, r], `b` [r, dout], `scale` alpha / r (or
    alpha / sqrt(r), rsLoRA)."""

    def __init__(self, key, din: int, dout: int, cfg: LoRAConfig):
        bound = 1.0 / math.sqrt(din)
        self.a = LoRAParam(jax.random.uniform(key, (din, cfg.rank), jnp.float32, -bound, bound))
        self.b = LoRAParam(jnp.zeros((cfg.rank, dout), jnp.float32))
        self.scale = cfg.scale

    def __call__(self, x):
        dt = x.dtype
        return ((x @ self.a[...].astype(dt)) @ self.b[...].astype(dt)) * jnp.asarray(
            self.scale, dt)

    def delta(self):
        """A B * scale [din, dout] in float32 (what merging adds to the base weight)."""
        a, b = self.a[...].astype(jnp.float32), self.b[...].astype(jnp.float32)
        return (a @ b) * jnp.float32(self.scale)


def adapters(key, shapes: dict, cfg: LoRAConfig | None, kind: str):
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
