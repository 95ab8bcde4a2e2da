"""Shared test machinery: the tiny parity setup, the single-device reference, gradient
comparison and HLO parsing. Imported by the test modules (tests/ is on sys.path)."""
from __future__ import annotations

import functools
import importlib.util
import os
import re

import jax
import numpy as np
from flax import nnx

from mmjax.data.layout import AssemblyLayout, check_sample
from mmjax.data.assemble import assemble
from mmjax.data.synthetic import SyntheticConfig, SyntheticDataset
from mmjax.models.config import with_overrides
from mmjax.models.mllm import MultimodalModel, trainable_filter
from mmjax.models.tiny import tiny
from mmjax.data.feed import FeedShapes, microbatch_feed
from mmjax.pipeline.reference_layout import to_reference_layout
from mmjax.pipeline.runtime import PipelineRuntime
from mmjax.train.inputs import model_inputs
from mmjax.train.step import make_loss_fn, split_model

TINY = {"llm.num_layers": 4, "encoders.vision.encoder.num_layers": 2}


def make_cfg(base=tiny, **overrides):
    return with_overrides(base(), {**TINY, **overrides})


def global_batch(cfg, n, kind="laion", packing="pad"):
    lay = AssemblyLayout.from_config(cfg, 160, packing, vision_caps=(64, 256),
                                     audio_frame_caps=(128, 256, 512))
    ds = SyntheticDataset(kind, SyntheticConfig.for_model(cfg, gen_fraction=0.5,
                                                          frames_median=60.0), seed=3)
    samples = [s for s in (ds[i] for i in range(6 * n)) if check_sample(s, lay) is None][:n]
    assert len(samples) == n
    return lay, samples


def reference(cfg, lay, samples):
    """Loss and gradients of the single-device model on the whole global batch."""
    mdl = MultimodalModel(cfg, jax.random.key(0))
    gd, tr, fr = split_model(mdl, trainable_filter(cfg))
    (loss, aux), g = jax.jit(jax.value_and_grad(make_loss_fn(gd), has_aux=True))(
        tr, fr, model_inputs(assemble(samples, lay)))
    return float(loss), nnx.to_pure_dict(g)


def reference_loss(cfg, lay, samples) -> float:
    """The single-device model's loss on the whole global batch, forward only (a test of
    forward passes needs no gradient program)."""
    mdl = MultimodalModel(cfg, jax.random.key(0))
    gd, tr, fr = split_model(mdl, trainable_filter(cfg))
    loss, _ = jax.jit(make_loss_fn(gd))(tr, fr, model_inputs(assemble(samples, lay)))
    return float(loss)


def cached_reference(cache: dict | None, cfg, n, kind="laion", packing="pad"):
    """(lay, samples, loss, grads) for `global_batch(cfg, n, kind, packing)`; with a
    `cache` (the session fixture `reference_cache`) each reference is computed once."""
    lay, samples = global_batch(cfg, n, kind, packing)
    key = (cfg, n, kind, packing)
    if cache is None or key not in cache:
        result = reference(cfg, lay, samples)
        if cache is None:
            return (lay, samples) + result
        cache[key] = result
    return (lay, samples) + cache[key]


def plan_feeds(plan, lay, samples, assignments=None, cp_method="lpt", **kw):
    """The plan's microbatch feeds of `samples` (one global batch, or several back to
    back: the feeds of every step in order), all padded to one shape floor (the union of
    their own shapes, as the loader's shape scan pads them), so every stage compiles its
    forward and backward once, not once per microbatch shape. `kw`: more
    `microbatch_feed` arguments."""
    n = plan.microbatch_size
    dp = {u.name: u.dp for u in plan.units}
    kw = {"cp": plan.unit("llm").cp, "cp_method": cp_method, "cp_block": 16, **kw}
    make = lambda m, floor=None: microbatch_feed(samples[m * n:(m + 1) * n], lay, dp,
                                                 (assignments or {}).get(m), floor=floor,
                                                 **kw)
    count = len(samples) // n
    assert count * n == len(samples) and count % plan.num_microbatches == 0
    floor = functools.reduce(FeedShapes.union, [make(m).shapes for m in range(count)])
    feeds = [make(m, floor) for m in range(count)]
    assert all(f.shapes == floor for f in feeds)
    return feeds


def run_plan(cfg, plan, lay, samples, assignments=None, cp_method="lpt"):
    rt = PipelineRuntime(cfg, plan)
    res = rt.run(plan_feeds(plan, lay, samples, assignments, cp_method))
    grads = to_reference_layout(plan, res.pure_grads())
    return rt, res.losses()["loss"], grads


def assert_same_grads(got, ref):
    """Per tensor ||g - g_ref|| <= 1e-5 ||g_ref||; tensors whose true gradient is zero (e.g.
    attention key biases, softmax-invariant) must be zero to 1e-6 of the global norm."""
    flat_ref = dict((jax.tree_util.keystr(p), np.asarray(v))
                    for p, v in jax.tree_util.tree_flatten_with_path(ref)[0])
    flat_got = dict((jax.tree_util.keystr(p), np.asarray(v))
                    for p, v in jax.tree_util.tree_flatten_with_path(got)[0])
    assert set(flat_got) == set(flat_ref), (set(flat_ref) ^ set(flat_got))
    gnorm = np.sqrt(sum(float(np.sum(v.astype(np.float64) ** 2)) for v in flat_ref.values()))
    for k, r in flat_ref.items():
        diff = np.linalg.norm((flat_got[k] - r).astype(np.float64))
        rn = np.linalg.norm(r.astype(np.float64))
        if rn < 1e-6 * gnorm:
            assert diff <= 1e-6 * gnorm, (k, diff, gnorm)
        else:
            assert diff <= 1e-5 * rn, (k, diff / rn)


def check(cfg, plan, n=8, kind="laion", packing="pad", assignments=None, cp_method="lpt",
          cache=None):
    """Run `plan` on the runtime and compare loss and every gradient with the reference."""
    lay, samples, ref_loss, ref_grads = cached_reference(cache, cfg, n, kind, packing)
    rt, loss, grads = run_plan(cfg, plan, lay, samples, assignments, cp_method)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_same_grads(grads, ref_grads)
    return rt


# ------------------------------------------------------------------------------------ HLO
_CALLS = r"(?:calls|to_apply|body)=%?([\w.\-]+)"


def hlo_computations(hlo: str) -> dict[str, str]:
    """Computation name -> body text of a compiled HLO module."""
    return dict(re.findall(r"\n(?:ENTRY )?%?([\w.\-]+) [^\n]*\{\n(.*?)\n\}", hlo, re.S))


def computations_with_dots(comps: dict[str, str]) -> set[str]:
    """Names of the computations that hold a dot or (transitively) call one that does."""
    has_dot = {name for name, body in comps.items() if re.search(r" dot\(", body)}
    grew = True
    while grew:
        grew = False
        for name, body in comps.items():
            if name not in has_dot and any(c in has_dot for c in re.findall(_CALLS, body)):
                has_dot.add(name)
                grew = True
    return has_dot


def entry_lines(hlo: str) -> list[str]:
    return re.search(r"\nENTRY [^\n]*\{\n(.*?)\n\}", hlo, re.S).group(1).splitlines()


def is_dot_line(line: str, has_dot: set[str]) -> bool:
    return bool(re.search(r" dot\(", line)) or any(c in has_dot for c in re.findall(_CALLS, line))


def load_script(name: str):
    """scripts/<name>.py as a module (to call its main or helpers in-process)."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location(f"{name}_cli",
                                                  os.path.join(repo, "scripts", name + ".py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
