"""Shared test machinery: the tiny parity setup, the single-device reference, gradient
comparison and HLO parsing. Imported by the test modules (tests/ is on sys.path)."""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os
import re
from typing import Any

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
from reference_layout import pure_grads, to_reference_layout
from mmjax.pipeline.runtime import PipelineRuntime
from mmjax.train.inputs import model_inputs
from mmjax.train.step import make_loss_fn, split_model
from float64_reference import in_float64

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


@dataclasses.dataclass(frozen=True)
class Exact:
    """A quantity of the single-device program, as the tests judge every plan's result: its
    float32 value, the same program's value in float64 (tests/float64_reference.py), and the
    length of the longest float32 sum behind it (rows x positions of the global batch: a
    weight's gradient sums over every position)."""
    f32: Any
    f64: Any
    length: int

    def __float__(self):
        return float(self.f32)


def sum_length(inputs) -> int:
    """Rows x positions of the LLM's token grid: the longest sum in a weight gradient."""
    return int(np.prod(np.shape(inputs["tokens"])))


def exact_reference(loss_fn, trainable, frozen, inputs) -> tuple[Exact, Exact]:
    """(loss, grads) of `loss_fn` (`make_loss_fn(...)`: loss and aux) in float32 and in float64."""
    fn = jax.value_and_grad(loss_fn, has_aux=True)
    (loss, _), g = jax.jit(fn)(trainable, frozen, inputs)
    (loss64, _), g64 = in_float64(fn)(trainable, frozen, inputs)
    n = sum_length(inputs)
    return (Exact(float(loss), float(loss64), n),
            Exact(nnx.to_pure_dict(g), nnx.to_pure_dict(g64), n))


def single_program(cfg, lay, samples) -> tuple[float, dict]:
    """The single-device model's float32 loss and gradients (a variant judged against a
    reference: scanned layers, remat policies)."""
    mdl = MultimodalModel(cfg, jax.random.key(0))
    gd, tr, fr = split_model(mdl, trainable_filter(cfg))
    (loss, _), g = jax.jit(jax.value_and_grad(make_loss_fn(gd), has_aux=True))(
        tr, fr, model_inputs(assemble(samples, lay)))
    return float(loss), nnx.to_pure_dict(g)


def reference(cfg, lay, samples) -> tuple[Exact, Exact]:
    """Loss and gradients of the single-device model on the whole global batch."""
    mdl = MultimodalModel(cfg, jax.random.key(0))
    gd, tr, fr = split_model(mdl, trainable_filter(cfg))
    return exact_reference(make_loss_fn(gd), tr, fr, model_inputs(assemble(samples, lay)))


def reference_loss(cfg, lay, samples) -> Exact:
    """The single-device model's loss on the whole global batch, forward only (a test of
    forward passes needs no gradient program)."""
    mdl = MultimodalModel(cfg, jax.random.key(0))
    gd, tr, fr = split_model(mdl, trainable_filter(cfg))
    inputs = model_inputs(assemble(samples, lay))
    fn = lambda *a: make_loss_fn(gd)(*a)[0]
    return Exact(float(jax.jit(fn)(tr, fr, inputs)), float(in_float64(fn)(tr, fr, inputs)),
                 sum_length(inputs))


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


def run_plan(cfg, plan, lay, samples, assignments=None, cp_method="lpt", schedule="1f1b"):
    rt = PipelineRuntime(cfg, plan, schedule=schedule)
    res = rt.run(plan_feeds(plan, lay, samples, assignments, cp_method),
                 rt.initial_compute_params())
    grads = to_reference_layout(plan, pure_grads(res))
    return rt, res.losses()["loss"], grads


# The tolerance rule (docs/testing.md). A plan computes the single program's mathematics with
# its float32 sums split and ordered differently (per device, per microbatch, per stage, per
# TP shard), so its rounding error is of the same kind and size as the single float32
# program's own. Judged against the float64 truth (tests/float64_reference.py), each tensor
# may be FACTOR times as far from it as the single float32 program is, plus a floor for a
# reference that happens to round luckily: one float32 rounding per term of the longest sum,
# eps32 * sqrt(L) * |truth| (random-walk growth). A tensor whose true value is zero
# (attention key biases: softmax-invariant) holds only rounding noise in both programs, so
# FACTOR alone judges it. FACTOR: over the parity tests (1,976 tensor comparisons at XLA:CPU
# -O0, 2,158 at -O2 with AVX2; scripts/tolerance_report.py) the largest plan-to-reference
# error ratio was 3.1 (a vision key bias, pure noise; p99 1.5-1.7), the closest call 0.77 of
# the bound; 8 leaves room for other code generators, and a real error (a dropped sample, a
# wrong scale) is 1e2-1e4 times larger.
EPS32 = float(np.finfo(np.float32).eps)
FACTOR = 8.0


def _flat(tree) -> dict:
    return {jax.tree_util.keystr(p): np.asarray(v, np.float64)
            for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _log_margin(what: str, rows: list) -> None:
    """With MMJAX_PARITY_LOG=<file>, append each comparison's errors (to measure the rule
    across XLA settings and machines: scripts/tolerance_report.py reads it)."""
    path = os.environ.get("MMJAX_PARITY_LOG")
    if path:
        with open(path, "a") as f:
            test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
            for row in rows:
                f.write(json.dumps({"what": what, "test": test, **row}) + "\n")


def _judge(got: dict, ref: Exact, what: str) -> None:
    f32, f64 = _flat(ref.f32), _flat(ref.f64)
    assert set(got) == set(f64), set(got) ^ set(f64)
    gnorm = float(np.sqrt(sum(np.sum(v * v) for v in f64.values())))
    floor = EPS32 * np.sqrt(ref.length)
    rows, bad = [], []
    for k, truth in f64.items():
        scale = float(np.linalg.norm(truth))
        err = float(np.linalg.norm(got[k] - truth))
        err_ref = float(np.linalg.norm(f32[k] - truth))
        allowed = FACTOR * err_ref + floor * max(scale, EPS32 * gnorm)
        rows.append({"key": k, "err": err, "err_ref": err_ref, "scale": scale,
                     "gnorm": gnorm, "length": ref.length, "allowed": allowed})
        if not err <= allowed:
            bad.append((k, f"error {err:.3g} > allowed {allowed:.3g} (float32 reference's "
                           f"error {err_ref:.3g}, |truth| {scale:.3g})"))
    _log_margin(what, rows)
    assert not bad, bad


def assert_same_grads(got, ref: Exact):
    """Every gradient tensor of `got` is as close to the float64 truth as the single float32
    program's (the rule above)."""
    assert isinstance(ref, Exact), "compare against helpers.reference / exact_reference"
    _judge(_flat(got), ref, "grads")


def assert_same_loss(got, ref: Exact):
    """A plan's loss against the single program's, by the same rule."""
    assert isinstance(ref, Exact), "compare against helpers.reference / exact_reference"
    _judge(_flat({"loss": np.float64(got)}), Exact({"loss": ref.f32}, {"loss": ref.f64}, ref.length),
           "loss")


def check(cfg, plan, n=8, kind="laion", packing="pad", assignments=None, cp_method="lpt",
          cache=None, schedule="1f1b"):
    """Run `plan` on the runtime (pipeline schedule `schedule`) and compare loss and every
    gradient with the reference."""
    lay, samples, ref_loss, ref_grads = cached_reference(cache, cfg, n, kind, packing)
    rt, loss, grads = run_plan(cfg, plan, lay, samples, assignments, cp_method, schedule)
    assert_same_loss(loss, ref_loss)
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


IN_ORDER_ENV = "MMJAX_TEST_IN_ORDER_COLLECTIVES"


def in_order_collectives(request) -> bool:
    """Run the calling test in a child pytest whose XLA:CPU schedules collectives in
    program order (tests/conftest.py, docs/testing.md): XLA flags are per process, and the
    default scheduler can deadlock a stage with hybrid ZeRO-3 groups on 8 simulated devices.
    -> True in the parent (the child passed: the caller returns), False in the child (the
    caller runs its body)."""
    import subprocess
    import sys

    if os.environ.get(IN_ORDER_ENV) == "1":
        return False
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, IN_ORDER_ENV: "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    env.pop("PYTEST_XDIST_WORKER", None)
    env.pop("PYTEST_XDIST_WORKER_COUNT", None)
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-m", "",
                        "-p", "no:cacheprovider", request.node.nodeid], cwd=root, env=env,
                       capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    assert " 1 passed" in " " + p.stdout.splitlines()[-1], p.stdout[-2000:]
    return True
