"""`scan_layers=True` (models/scan.py): each unit's layers run as one lax.scan over their
stacked weights, with the same loss and gradients as the unrolled loop, whole-model and on
a pipeline plan whose stages scan their own layer slices."""
from __future__ import annotations

import jax
import numpy as np
import pytest
from helpers import (assert_same_grads, assert_same_loss, cached_reference, global_batch,
                     make_cfg, reference, run_plan, single_program)

from mmjax.models.mllm import MultimodalModel, trainable_filter
from mmjax.models.tiny import tiny, tiny_valm
from mmjax.planner.plan import Plan
from mmjax.train.inputs import model_inputs
from mmjax.data.assemble import assemble
from mmjax.train.step import make_loss_fn, split_model

pytestmark = pytest.mark.parity  # judged by the float64 rule; CI reruns it under a second XLA config

SCAN = {"llm.scan_layers": True, "encoders.vision.encoder.scan_layers": True}


def _while_loops(cfg, lay, samples) -> int:
    gd, tr, fr = split_model(MultimodalModel(cfg, jax.random.key(0)), trainable_filter(cfg))
    hlo = jax.jit(make_loss_fn(gd)).lower(tr, fr, model_inputs(assemble(samples, lay))).as_text()
    return hlo.count("stablehlo.while")


def test_scanned_units_match_the_unrolled_loop(reference_cache):
    for base, extra in ((tiny, {"generator.scan_layers": True}),
                        (tiny_valm, {"encoders.audio.encoder.scan_layers": True})):
        plain = make_cfg(base)
        scanned = make_cfg(base, **SCAN, **extra)
        lay, samples, loss, grads = cached_reference(reference_cache, plain, 4)
        assert _while_loops(plain, lay, samples) == 0
        assert _while_loops(scanned, lay, samples) == 3  # one loop per scanned unit
        loss_s, grads_s = single_program(scanned, lay, samples)
        assert_same_loss(loss_s, loss)
        assert_same_grads(grads_s, grads)


@pytest.mark.slow
def test_a_pipeline_plan_with_scanned_stages_matches_the_reference():
    plain = make_cfg(tiny)
    # LLM (split over two stages) and vision scanned; the generator's scan is covered
    # whole-model above
    scanned = make_cfg(tiny, **SCAN)
    lay, samples = global_batch(plain, 8)
    loss, grads = reference(plain, lay, samples)
    plan = Plan.uniform(scanned, 8, 2, dp={"vision": 2}, tp={"llm": 2}, pp={"llm": 2})
    _, got_loss, got_grads = run_plan(scanned, plan, lay, samples)
    assert_same_loss(got_loss, loss)
    assert_same_grads(got_grads, grads)


def _saved_bytes(cfg, lay, samples) -> int:
    """Bytes of the residuals the loss's VJP keeps (traced, not compiled), read from
    `jax.ad_checkpoint.print_saved_residuals`' lines ("f32[4,8] output of ...")."""
    import contextlib
    import io
    import re

    from jax.ad_checkpoint import print_saved_residuals

    gd, tr, fr = split_model(MultimodalModel(cfg, jax.random.key(0)), trainable_filter(cfg))
    inputs = model_inputs(assemble(samples, lay))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(lambda t: make_loss_fn(gd)(t, fr, inputs)[0], tr)
    sizes = {"f32": 4, "i32": 4, "u32": 4, "bf16": 2, "f16": 2, "bool": 1, "i8": 1, "u8": 1,
             "f64": 8, "i64": 8}
    total = 0
    for dtype, dims in re.findall(r"^(\w+)\[([\d,]*)\]", out.getvalue(), re.M):
        total += sizes[dtype] * int(np.prod([int(d) for d in dims.split(",") if d]))
    assert total > 0, out.getvalue()[:500]
    return total


UNITS = ("llm", "encoders.vision.encoder", "generator")


def _remat_cfg(remat: str, scan: bool):
    over = {f"{u}.remat": remat for u in UNITS}
    over.update({f"{u}.scan_layers": scan for u in UNITS})
    return make_cfg(tiny, **over)


def test_per_layer_remat_keeps_loss_and_gradients_and_saves_less(reference_cache):
    """`remat` on every unit (models/scan.py): "full" (scanned) and "dots" (looped) give
    the unrolled reference's loss and gradients, and keep fewer residual bytes than
    "none" ("full" the fewest)."""
    plain = make_cfg(tiny)
    lay, samples, loss, grads = cached_reference(reference_cache, plain, 4)
    for remat, scan in (("full", True), ("dots", False)):
        got_loss, got_grads = single_program(_remat_cfg(remat, scan), lay, samples)
        assert_same_loss(got_loss, loss)
        assert_same_grads(got_grads, grads)
    saved = {r: _saved_bytes(_remat_cfg(r, True), lay, samples) for r in ("none", "dots", "full")}
    assert saved["full"] < saved["dots"] < saved["none"], saved


def test_an_unknown_remat_policy_names_the_field():
    import pytest

    cfg = make_cfg(tiny, **{"llm.remat": "some"})
    lay, samples = global_batch(cfg, 2)
    with pytest.raises(ValueError, match="remat='some'.*none.*dots.*full"):
        _saved_bytes(cfg, lay, samples)
