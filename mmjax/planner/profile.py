"""Profiler: measured C(TP, size) tables for the orchestrator (DistTrain §3, "performance
profiler with linear interpolation"). The only planner file that imports JAX.

For each unit, one transformer layer of the unit's shape (width d, FFN f, heads; SwiGLU for
the LLM, GELU MLP for encoders and the generator) is timed forward and forward+backward at
every TP size the machine has (weights column/row-sharded over a ('tp',) mesh, as
Megatron/GSPMD does) and at a few sequence sizes drawn from the workload's size
distribution (quantiles). The points form a piecewise-linear table per TP (linear
extrapolation past the ends); `profiled_costs` turns the tables into `UnitCost.time_s`
(layers x per-sample mean over the workload, frozen rule of Cornstarch §4.2 for the backward),
and the analytic model stays the fallback for anything not measured: a TP size the machine
cannot run (fewer devices than TP) gets the analytic time scaled by measured / analytic at
the largest measured TP, so a 2-device profile still plans a model that needs TP 8.
Layers are timed in bfloat16 by default, the dtype the models compute in and the cost
model assumes (`costs.WEIGHT_BYTES`, `ACT_BYTES`); XLA runs bf16 matmuls on CPU too.
"""
from __future__ import annotations

import dataclasses
import json
import math
import time
from typing import Literal, cast
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mmjax.models.config import MLLMConfig
from mmjax.planner.costs import UnitCost, layer_times, unit_costs, work_time
from mmjax.planner.unit_work import module_backward_factors, unit_work
from mmjax.planner.hardware import Hardware
from mmjax.planner.workload import Workload
from mmjax.models.units import is_generator, is_llm


@dataclass(frozen=True)
class LayerShape:
    width: int
    ffn: int
    heads: int
    gated: bool  # SwiGLU (LLM) vs GELU MLP
    causal: bool


def unit_shape(model: MLLMConfig, unit: str) -> LayerShape:
    if is_llm(unit):
        llm = model.llm
        return LayerShape(llm.hidden_size, llm.ffn_size, llm.num_heads, True, True)
    if is_generator(unit):
        g = model.generator
        assert g is not None  # the model has a generator unit
        return LayerShape(g.hidden_size, g.ffn_size, g.num_heads, False, False)
    c = model.encoder(unit).encoder
    return LayerShape(c.hidden_size, c.ffn_size, c.num_heads, False, False)


# ---- the generic layer -------------------------------------------------------------------
def init_layer(shape: LayerShape, key, dtype=jnp.float32) -> dict:
    d, f = shape.width, shape.ffn
    ks = jax.random.split(key, 7)
    w = lambda k, a, b: jax.random.normal(k, (a, b), dtype) / math.sqrt(a)
    p = {"wq": w(ks[0], d, d), "wk": w(ks[1], d, d), "wv": w(ks[2], d, d),
         "wo": w(ks[3], d, d), "w1": w(ks[4], d, f), "w2": w(ks[5], f, d)}
    if shape.gated:
        p["w3"] = w(ks[6], d, f)
    return p


def layer_forward(shape: LayerShape, params: dict, x, attention: str | None = None):
    """Pre-norm attention + MLP over x [batch, tokens, width]; `attention` is
    `jax.nn.dot_product_attention`'s implementation (None: XLA's choice)."""
    b, n, d = x.shape
    hd = d // shape.heads

    def norm(t):
        return t * jax.lax.rsqrt(jnp.mean(t * t, axis=-1, keepdims=True) + 1e-6)

    h = norm(x)
    split = lambda t: t.reshape(b, n, shape.heads, hd)
    att = jax.nn.dot_product_attention(split(h @ params["wq"]), split(h @ params["wk"]),
                                       split(h @ params["wv"]), is_causal=shape.causal,
                                       # one of jax's implementation names (the caller's)
                                       implementation=cast(Literal["xla", "cudnn"] | None,
                                                           attention))
    x = x + att.reshape(b, n, d) @ params["wo"]
    h = norm(x)
    if shape.gated:
        h = jax.nn.silu(h @ params["w1"]) * (h @ params["w3"])
    else:
        h = jax.nn.gelu(h @ params["w1"])
    return x + h @ params["w2"]


def layer_specs(shape: LayerShape) -> dict:
    """Megatron TP: q, k, v, w1, w3 column-parallel; o, w2 row-parallel."""
    col, row = P(None, "tp"), P("tp", None)
    specs = {"wq": col, "wk": col, "wv": col, "wo": row, "w1": col, "w2": row}
    if shape.gated:
        specs["w3"] = col
    return specs


def best_time(fn, *args, repeats: int) -> float:
    """The fastest of `repeats` timed calls of `fn(*args)`, after one to compile and warm up."""
    jax.block_until_ready(fn(*args))  # compile + warm up
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def time_layer(shape: LayerShape, tokens: int, tp: int, devices=None, repeats: int = 3,
               dtype=jnp.bfloat16, attention: str | None = None) -> tuple[float, float]:
    """(forward, backward) seconds of one layer on `tokens` tokens at tensor parallelism
    `tp` (the first `tp` devices), weights and activations in `dtype` (bf16: the models'
    compute dtype)."""
    devices = list(devices or jax.devices())[:tp]
    if len(devices) < tp:
        raise ValueError(f"time_layer: tp={tp} needs {tp} devices; have {len(devices)}")
    if shape.heads % tp or shape.ffn % tp:
        raise ValueError(f"time_layer: tp={tp} must divide heads={shape.heads} and "
                         f"ffn={shape.ffn}")
    mesh = Mesh(np.array(devices), ("tp",))
    params = init_layer(shape, jax.random.key(0), dtype)
    specs = layer_specs(shape)
    params = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
    x = jax.device_put(jnp.ones((1, tokens, shape.width), dtype), NamedSharding(mesh, P()))
    fwd = jax.jit(lambda p, x: layer_forward(shape, p, x, attention))
    grad = jax.jit(jax.grad(lambda p, x: jnp.sum(layer_forward(shape, p, x, attention)),
                            argnums=(0, 1)))
    tf = best_time(fwd, params, x, repeats=repeats)
    tfb = best_time(grad, params, x, repeats=repeats)
    return tf, max(tfb - tf, 0.0)


# ---- tables ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Curve:
    """Piecewise-linear time of one layer vs tokens (linear extrapolation at both ends)."""

    sizes: tuple[int, ...]
    fwd_s: tuple[float, ...]
    bwd_s: tuple[float, ...]

    def __call__(self, tokens: float) -> tuple[float, float]:
        return _interp(self.sizes, self.fwd_s, tokens), _interp(self.sizes, self.bwd_s, tokens)


def _interp(xs, ys, x) -> float:
    if len(xs) == 1:
        return ys[0] * x / xs[0]
    if x <= xs[0] or x >= xs[-1]:
        i = 0 if x <= xs[0] else len(xs) - 2
        slope = (ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i])
        return max(0.0, ys[i] + slope * (x - xs[i]))
    return float(np.interp(x, xs, ys))


@dataclass(frozen=True)
class ProfileTable:
    device: str
    units: dict[str, dict[int, Curve]]  # unit -> tp -> curve of one layer
    dtype: str = "bfloat16"  # what the layers were timed in

    def to_json(self) -> dict:
        return {"device": self.device, "dtype": self.dtype,
                "units": {u: {str(t): dataclasses.asdict(c) for t, c in tps.items()}
                          for u, tps in self.units.items()}}

    @classmethod
    def from_json(cls, d: dict) -> "ProfileTable":
        units = {u: {int(t): Curve(tuple(c["sizes"]), tuple(c["fwd_s"]), tuple(c["bwd_s"]))
                     for t, c in tps.items()} for u, tps in d["units"].items()}
        return cls(d["device"], units, d.get("dtype", "float32"))  # older tables: f32

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=2)

    @classmethod
    def load(cls, path: str) -> "ProfileTable":
        with open(path) as f:
            return cls.from_json(json.load(f))


def sample_sizes(model: MLLMConfig, wl: Workload, unit: str, points: int = 4,
                 multiple: int = 8) -> list[int]:
    """Quantiles of the unit's per-sequence token counts, rounded up to `multiple`."""
    if is_llm(unit):
        seqs = list(wl.llm_tokens)
    elif is_generator(unit):
        assert model.generator is not None  # the model has a generator unit
        seqs = [model.generator.num_patches]
    else:
        seqs = [n for per in wl.encoder_tokens[unit] for n in per]
    qs = np.quantile(np.asarray(seqs, dtype=np.float64), np.linspace(0, 1, points))
    return sorted({int(math.ceil(q / multiple) * multiple) for q in qs})


def profile_model(model: MLLMConfig, wl: Workload, tp_sizes=(1, 2, 4, 8), points: int = 4,
                  repeats: int = 3, devices=None, max_tokens: int | None = None,
                  dtype=jnp.bfloat16) -> ProfileTable:
    """Time one layer of every unit at each TP the machine has and a few workload sizes
    (TP sizes above the device count are skipped: `profiled_costs` extrapolates them)."""
    devices = list(devices or jax.devices())
    units = {}
    for unit in model.unit_names:
        shape = unit_shape(model, unit)
        sizes = sample_sizes(model, wl, unit, points)
        if max_tokens:
            sizes = sorted({min(s, max_tokens) for s in sizes})
        curves = {}
        for tp in tp_sizes:
            if tp > len(devices) or shape.heads % tp or shape.ffn % tp:
                continue
            meas = [time_layer(shape, s, tp, devices, repeats, dtype) for s in sizes]
            curves[tp] = Curve(tuple(sizes), tuple(m[0] for m in meas), tuple(m[1] for m in meas))
        units[unit] = curves
    return ProfileTable(str(devices[0].device_kind), units, jnp.dtype(dtype).name)


def profiled_costs(model: MLLMConfig, wl: Workload, hw: Hardware, table: ProfileTable,
                   recompute="auto") -> tuple[UnitCost, ...]:
    """Analytic `UnitCost`s with `time_s` replaced, where measured, by layers x mean over
    samples of the interpolated per-sequence layer times, plus the analytic time of the
    parts around the layers (embedding, LM head, projector; units of >= 3 layers). Valid TP
    sizes that were not measured keep the analytic time, calibrated by measured / analytic
    at the largest measured TP (the nearest in communication pattern); a unit with no
    measured TP keeps its analytic times."""
    out = []
    for cost in unit_costs(model, wl, hw, recompute):
        one = _profiled(model, wl, hw, table, cost)
        if cost.variants:
            one = dataclasses.replace(one, variants={
                p: _profiled(model, wl, hw, table, v) for p, v in cost.variants.items()})
        out.append(one)
    return tuple(out)


def _profiled(model: MLLMConfig, wl: Workload, hw: Hardware, table: ProfileTable,
              cost: UnitCost) -> UnitCost:
    """`cost` (one remat policy: `cost.remat`) with its times from `table` where measured;
    the backward re-runs the measured forward ("full") or the analytic attention core
    ("dots")."""
    factors = module_backward_factors(model)
    curves = table.units.get(cost.name, {})
    if not curves:
        return cost
    if is_llm(cost.name):
        per_sample = [[n] for n in wl.llm_tokens]
    elif is_generator(cost.name):
        assert model.generator is not None  # the model has a generator unit
        per_sample = [[model.generator.num_patches] * k for k in wl.generated]
    else:
        per_sample = [list(x) for x in wl.encoder_tokens[cost.name]]
    factor = factors[cost.name]
    times, fwds = {}, {}
    for tp, curve in curves.items():
        if tp not in cost.time_s:
            continue
        f = np.mean([sum(curve(n)[0] for n in s) for s in per_sample]) if per_sample else 0.0
        b = np.mean([sum(curve(n)[1] for n in s) for s in per_sample]) if per_sample else 0.0
        bwd = b if factor == 2 else factor * f
        if cost.remat == "full" and factor > 0:
            bwd += f
        elif cost.remat == "dots" and factor > 0:
            bwd += _attention_redo(model, wl, hw, cost, tp)
        extra, extra_fwd = _analytic_extras(model, wl, hw, cost, tp, cost.remat)
        times[tp] = cost.num_layers * float(f + bwd) + extra
        fwds[tp] = cost.num_layers * float(f) + extra_fwd
    if times:
        ref = max(times)  # unmeasured TP: analytic x (measured / analytic at `ref`)
        scale, fscale = times[ref] / cost.time_s[ref], fwds[ref] / cost.fwd_s[ref]
        for tp in cost.time_s:
            if tp not in times:
                times[tp] = cost.time_s[tp] * scale
                fwds[tp] = cost.fwd_s[tp] * fscale
        times = dict(sorted(times.items()))
        fwds = dict(sorted(fwds.items()))
    return dataclasses.replace(cost, time_s=times or cost.time_s, fwd_s=fwds or cost.fwd_s)


def _attention_redo(model, wl, hw, cost: UnitCost, tp: int) -> float:
    """Analytic seconds a middle layer's backward spends re-running the attention core
    under "dots" (what selective recomputation adds, Korthikanti et al. §4.2)."""
    uw = unit_work(model, wl, cost.name)
    mid = uw.layers[len(uw.layers) // 2]
    return work_time(mid, tp, hw, "dots")[1] - work_time(mid, tp, hw, "none")[1]


def _analytic_extras(model, wl, hw, cost: UnitCost, tp: int, recompute: bool | str
                     ) -> tuple[float, float]:
    """Analytic (forward + backward, forward) time outside the repeated layers: total minus
    L x a middle layer."""
    if cost.num_layers < 3:
        return 0.0, 0.0
    lt = layer_times(unit_work(model, wl, cost.name), tp, hw, recompute)
    total = sum(f + b for f, b in lt)
    fwd = sum(f for f, _ in lt)
    return (max(0.0, total - cost.num_layers * sum(lt[1])),
            max(0.0, fwd - cost.num_layers * lt[1][0]))


# ---- the device profile (planner/hardware_profile.py) -----------------------------------
def profile_hardware(widths=(768, 1152, 2048, 4096, 8192), tokens=(512, 2048, 8192),
                     kinds=("gated_causal", "gelu_full"), repeats: int = 5,
                     dtype=jnp.bfloat16, attention: str | None = "auto", on_point=None
                     ) -> dict:
    """Time one generic layer forward and backward at every (kind, width, tokens) on this
    machine's first device and return the JSON a `HardwareProfile` reads (device named).
    `attention="auto"`: cuDNN's fused kernel on GPU in bf16 (what the models' `auto` runs for
    plain causal / full masks), XLA's elsewhere."""
    from mmjax.planner.hardware_profile import layer_dims

    dev = jax.devices()[0]
    if attention == "auto":
        gpu = dev.platform == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
        attention = "cudnn" if gpu else None
    points = []
    for kind in kinds:
        for w in widths:
            f, heads = layer_dims(kind, w)
            shape = LayerShape(w, f, heads, kind == "gated_causal", kind == "gated_causal")
            for n in tokens:
                impl = attention
                try:
                    fwd, bwd = time_layer(shape, n, 1, [dev], repeats, dtype, impl)
                except Exception as exc:  # cuDNN refuses a shape: XLA's attention, noted
                    if impl is None:
                        raise
                    impl = None
                    fwd, bwd = time_layer(shape, n, 1, [dev], repeats, dtype, impl)
                    print(f"{kind} {w}x{n}: {attention} failed ({type(exc).__name__}), "
                          f"timed with XLA's attention", flush=True)
                point = {"kind": kind, "width": w, "tokens": n, "fwd_s": fwd, "bwd_s": bwd,
                         "attention": impl or "xla"}
                points.append(point)
                if on_point is not None:
                    on_point(point)
    return {"device": str(dev.device_kind), "platform": dev.platform,
            "jax": jax.__version__, "dtype": jnp.dtype(dtype).name,
            "attention": attention or "xla", "repeats": repeats, "points": points}
