"""Building blocks shared by the models: norms, dense weights, positions, matmul hooks.

Every weight is created from an explicit PRNG key, and every transformer layer from
`fold_in(unit_key, global_layer_index)`, so a pipeline stage that builds only layers
[start, end) gets bit-identical parameters to the same layers of the whole model.
"""
from __future__ import annotations

import math

import jax
import numpy as np
import jax.numpy as jnp
from flax import nnx

from mmjax.models.attention import bam_attention
from mmjax.models.lora import adapt, adapters



class PlainOps:
    """Default matmul hook: plain dots. Overlapped TP swaps in decomposed collective matmuls
    (parallel/tp_ops.py) without the model knowing; models never import parallel/."""

    def column(self, x, *ws):
        return tuple(x @ w for w in ws)

    def row(self, x, w):
        return x @ w


PLAIN = PlainOps()


def param(key, shape, std=0.02, dtype=jnp.float32):
    """N(0, std^2) weights, built as `jax.random.normal` builds them (sqrt(2) erfinv(u),
    u ~ U(-1, 1)) but with the scale in that one constant: `normal(...) * std` let XLA fold
    the two constants together inside a jitted init (parallel/sharded_init.py) and move
    values by an ulp. This way eager and jitted, sharded or not, give the same bits."""
    dtype = jnp.dtype(dtype)
    lo = np.nextafter(np.array(-1.0, dtype), np.array(0.0, dtype))
    u = jax.random.uniform(key, shape, dtype, lo, 1.0)
    return nnx.Param(jax.lax.erf_inv(u) * np.array(np.sqrt(2.0) * std, dtype))


def zeros(shape, dtype=jnp.float32):
    return nnx.Param(jnp.zeros(shape, dtype))


def ones(shape, dtype=jnp.float32):
    return nnx.Param(jnp.ones(shape, dtype))


class RMSNorm(nnx.Module):
    """RMSNorm in float32; `plus_one`: Gemma's form, scale stored as w (initialised 0) and
    applied as (1 + w), so checkpoints map one to one."""

    def __init__(self, dim: int, eps: float = 1e-6, plus_one: bool = False):
        self.scale = zeros((dim,)) if plus_one else ones((dim,))
        self.eps = eps
        self.plus_one = plus_one

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        w = self.scale[...].astype(jnp.float32)
        return (y * (1.0 + w if self.plus_one else w)).astype(x.dtype)


class LayerNorm(nnx.Module):
    """LayerNorm in float32; `affine=False` for adaLN-modulated norms (DiT)."""

    def __init__(self, dim: int, eps: float = 1e-6, affine: bool = True):
        self.eps = eps
        self.affine = affine
        if affine:
            self.scale = ones((dim,))
            self.bias = zeros((dim,))

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
        y = (xf - mean) * jax.lax.rsqrt(var + self.eps)
        if self.affine:
            y = y * self.scale[...] + self.bias[...]
        return y.astype(x.dtype)


class Dense(nnx.Module):
    """x @ kernel + bias, kernel [in, out]; `lora` (a LoRAConfig) puts an adapter beside the
    kernel (models/lora.py; `kind` "tower" / "projector" names the projection `name`)."""

    def __init__(self, key, din: int, dout: int, bias: bool = True, std: float | None = None,
                 lora=None, kind: str = "projector", name: str = "fc1"):
        self.kernel = param(key, (din, dout), std if std is not None else 1.0 / math.sqrt(din))
        self.bias = zeros((dout,)) if bias else None
        self.lora = adapters(key, {name: (din, dout)}, lora, kind)
        self.proj_name = name

    def __call__(self, x):
        y = adapt(self.lora, self.proj_name, x, x @ self.kernel[...].astype(x.dtype))
        return y if self.bias is None else y + self.bias[...].astype(x.dtype)


def rope_inv_freq(dim: int, theta: float, scaling: tuple | None = None):
    """RoPE inverse frequencies [dim/2] in float32, as HF's `ROPE_INIT_FUNCTIONS` compute them.

    `scaling` (`LLMConfig.rope_scaling`): ("linear", factor) divides every frequency;
    ("llama3", factor, low, high, original): wavelengths longer than original/low are divided
    by `factor`, shorter than original/high kept, the band between blended linearly in
    original/wavelength (`_compute_llama3_parameters`); ("yarn", factor, original, beta_fast,
    beta_slow, attention_factor, truncate): YaRN's ramp between interpolated and extrapolated
    frequencies over the dims whose rotations at `original` positions fall between beta_slow
    and beta_fast (Peng et al., YaRN §3.2; `_compute_yarn_parameters`)."""
    inv = 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    if scaling is None:
        return inv
    kind, *p = scaling
    if kind == "linear":
        return inv / p[0]
    if kind == "yarn":
        factor, original, beta_fast, beta_slow, _, truncate = p
        corr = lambda rot: dim * math.log(original / (rot * 2 * math.pi)) / (2 * math.log(theta))
        low, high = corr(beta_fast), corr(beta_slow)
        if truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        high = high + 0.001 if low == high else high
        ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
        extrapolation = 1 - ramp
        return inv / factor * (1 - extrapolation) + inv * extrapolation
    factor, low, high, original = p
    wavelen = 2 * math.pi / inv
    scaled = jnp.where(wavelen > original / low, inv / factor, inv)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return jnp.where(medium, blended, scaled)


def rope_attention_factor(scaling: tuple | None) -> float:
    """The factor HF multiplies cos and sin by: YaRN's (config attention_factor, else
    0.1 ln(factor) + 1 for factor > 1); 1 for the other types."""
    if scaling is None or scaling[0] != "yarn":
        return 1.0
    factor, attention_factor = scaling[1], scaling[5]
    if attention_factor is not None:
        return float(attention_factor)
    return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


def apply_rope(x, positions, inv, factor=1.0, mrope_section=None):
    """Rotary embedding (rotate-half convention) with inverse frequencies `inv` [D/2] (may be
    traced: a layer scan selects a layer's table) and cos / sin scaled by `factor`.
    x [B, S, H, D], positions [B, S]. `mrope_section` (Qwen2-VL M-RoPE, sections t/h/w over
    the D/2 frequencies): positions may be [B, S, 3] and frequency j turns with the position
    component of the section it lies in (HF `recomposition_frequencies`); [B, S] positions
    are the same position on all three (text)."""
    d = x.shape[-1]
    if mrope_section is not None and positions.ndim == x.ndim - 1:
        comp = np.repeat(np.arange(len(mrope_section)) % 3, mrope_section)
        ang = positions.astype(jnp.float32)[..., comp] * inv  # [B, S, D/2]
    else:
        ang = positions.astype(jnp.float32)[..., None] * inv  # [B, S, D/2]
    cos, sin = jnp.cos(ang)[:, :, None, :] * factor, jnp.sin(ang)[:, :, None, :] * factor
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., : d // 2], xf[..., d // 2:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def rope(x, positions, theta: float, scaling: tuple | None = None, mrope_section=None):
    """Rotary embedding (rotate-half convention). x [B, S, H, D], positions [B, S] (or
    [B, S, 3] with `mrope_section`, see `apply_rope`); `scaling`: see `rope_inv_freq`."""
    inv = rope_inv_freq(x.shape[-1], theta, scaling)
    return apply_rope(x, positions, inv, rope_attention_factor(scaling), mrope_section)


def sinusoidal(positions, dim: int, max_period: float = 10000.0):
    """Sinusoidal embedding of (possibly fractional) positions [...] -> [..., dim]."""
    half = dim // 2
    freqs = jnp.exp(-math.log(max_period) * jnp.arange(half, dtype=jnp.float32) / half)
    ang = positions.astype(jnp.float32)[..., None] * freqs
    return jnp.concatenate([jnp.sin(ang), jnp.cos(ang)], axis=-1)


def whisper_sinusoids(length: int, dim: int, max_timescale: float = 10000.0):
    """Whisper's fixed position table [length, dim]: [sin | cos] of t * exp(-i * log(max) /
    (dim/2 - 1)), i < dim/2 (what OpenAI's Whisper and HF's WhisperEncoder store). Computed
    on the host in NumPy float32, so the frozen table has the same bits eagerly, under jit
    and on any backend (export and generation rebuild it; docs/design.md, "Export")."""
    half = dim // 2
    inc = np.float32(math.log(max_timescale) / (half - 1))
    ang = np.arange(length, dtype=np.float32)[:, None] * np.exp(
        -inc * np.arange(half, dtype=np.float32))[None, :]
    return jnp.asarray(np.concatenate([np.sin(ang), np.cos(ang)], axis=-1))


ACTIVATIONS = {
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
    "silu": jax.nn.silu,
}


class EncoderBlock(nnx.Module):
    """Pre-LN transformer block with biases and an MLP (ViT, CLIP, SigLIP, Whisper encoder);
    `act` names an entry of ACTIVATIONS (exact GELU, tanh GELU, CLIP's quick_gelu);
    `k_bias=False`: no key bias (Whisper's k_proj has none); `lora`: a LoRAConfig (adapters
    on its "tower" projections, models/lora.py)."""

    def __init__(self, key, dim: int, ffn: int, num_heads: int, eps: float,
                 act: str = "gelu_tanh", k_bias: bool = True, lora=None):
        ks = jax.random.split(key, 6)
        self.num_heads = num_heads
        self.act = act
        self.ln1 = LayerNorm(dim, eps)
        dense = lambda i, n, din, dout, bias=True: Dense(ks[i], din, dout, bias, lora=lora,
                                                         kind="tower", name=n)
        self.q, self.k = dense(0, "q", dim, dim), dense(1, "k", dim, dim, k_bias)
        self.v, self.o = dense(2, "v", dim, dim), dense(3, "o", dim, dim)
        self.ln2 = LayerNorm(dim, eps)
        self.fc1, self.fc2 = dense(4, "fc1", dim, ffn), dense(5, "fc2", ffn, dim)

    def __call__(self, x, meta, attention_impl: str = "auto", tiles=None):
        """x [B, S, d]; meta: the tokens' TokenMeta (`segment_meta` for packed items); `tiles`:
        its `attention.shared_tiles`, built once for the stack."""
        b, s, d = x.shape
        h = self.ln1(x)
        split = lambda t: t.reshape(b, s, self.num_heads, d // self.num_heads)
        att = bam_attention(split(self.q(h)), split(self.k(h)), split(self.v(h)), meta,
                            implementation=attention_impl, tiles=tiles)
        x = x + self.o(att.reshape(b, s, d))
        return x + self.fc2(ACTIVATIONS[self.act](self.fc1(self.ln2(x))))


def cast_floats(tree, dtype):
    """Every floating leaf of `tree` in `dtype` (mixed precision: fp32 master -> bf16 compute)."""
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                        tree)
