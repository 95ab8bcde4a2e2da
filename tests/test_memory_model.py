"""The planner's per-stage memory model (planner/memory.py) against XLA's account of the
runtime's compiled stage programs, and the planner's use of it.

Compiled side (pipeline/memory_account.py): every program's footprint is `memory_analysis()`
argument + output - alias + temp; a stage's peak adds what the runtime holds outside each
program (master and AdamW shards, accumulators, the other in-flight microbatches'
residuals, frozen weights and the compute copy the step replaces) and takes the largest
phase (forward, backward, optimizer step). Predicted side: `stage_memory` from the stage's
parameter counts and the tokens its microbatch carries. They agree within 15% per stage on
the tiny config (dp2/pp2 and tp2 plans, remat full / dots / none) and on a middle LLM
stage of the mid-size config (MLLM-9B widths, tp 8 and dp 2 x tp 4), whose residual bytes
and optimizer step agree to the byte.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from helpers import global_batch, make_cfg

from mmjax.data.feed import microbatch_feed
from mmjax.models.config import with_overrides
from mmjax.models.named import named_config
from mmjax.parallel.mesh import stage_mesh
from mmjax.pipeline.memory_account import (abstract_peak, abstract_stage, compiled_stage,
                                           in_flight, predicted_abstract, predicted_stage)
from mmjax.planner.module_params import module_params, replicated_params
from mmjax.planner.plan import Plan, UnitPlan

TOLERANCE = 0.15


def _tiny_plan(cfg, kind: str, remat: str) -> Plan:
    if kind == "dp2pp2":
        return Plan.uniform(cfg, 4, 2, dp={"vision": 2, "llm": 2, "generator": 2},
                            pp={"llm": 2}, remat=remat)
    return Plan.uniform(cfg, 4, 2, dp=1, tp=2, remat=remat)


def stage_errors(kind: str, remat: str) -> dict:
    """{stage: (predicted, compiled) peak bytes per device} of one tiny-config step."""
    from mmjax.train.pipelined import PipelinedRunner

    cfg = make_cfg()
    plan = _tiny_plan(cfg, kind, remat)
    lay, samples = global_batch(cfg, 4)
    ps = PipelinedRunner(cfg, plan, 1e-3)
    dp = {u.name: u.dp for u in plan.units}
    ps.train_on([microbatch_feed(samples[m * 2:(m + 1) * 2], lay, dp) for m in range(2)])
    flight = in_flight(ps.runtime.schedule)
    out = {}
    for sid in ps.runtime.stages:
        c = compiled_stage(ps, sid, flight[sid])
        p = predicted_stage(cfg, plan, ps, sid, flight[sid])
        out[str(sid)] = (p.peak, c["peak"], p.residuals, c["residuals"])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kind,remat", [("dp2pp2", "full"), ("dp2pp2", "dots"),
                                        ("tp2", "none"), ("tp2", "full")])
def test_tiny_stage_peaks_match_compiled_memory(kind, remat):
    for sid, (pred, comp, pres, cres) in stage_errors(kind, remat).items():
        assert abs(pred / comp - 1) <= TOLERANCE, (sid, pred, comp)
        if cres > 1 << 16:  # residuals large enough to matter
            assert abs(pres / cres - 1) <= TOLERANCE, (sid, pres, cres)


MID_CASES = [(1, 8, "none"), (1, 8, "full"), (2, 4, "dots")]


@pytest.fixture(scope="module")
def mid():
    cfg = with_overrides(named_config("disttrain/mllm_9b_mid"), {"llm.num_layers": 3})
    lay, samples = global_batch(cfg, 2)
    return cfg, lay, samples


@pytest.mark.parametrize("dp,tp,remat", MID_CASES)
def test_mid_size_llm_stage_matches_compiled_memory(mid, dp, tp, remat):
    """A middle stage (one MLLM-9B layer, 4096 wide, 11008 FFN) compiled from shapes alone
    (0.2B parameters: nothing is allocated)."""
    cfg, lay, samples = mid
    feed = microbatch_feed(samples, lay, {"vision": 1, "llm": dp, "generator": 1})
    mesh = stage_mesh(jax.devices()[:dp * tp], dp, tp, 1)
    up = UnitPlan("llm", dp=dp, tp=tp, pp=3, layers=(1, 1, 1), remat=remat)
    r = abstract_stage(cfg, up, 1, 2, feed, mesh, jnp.float32)
    p = predicted_abstract(cfg, up, r, flight=2)
    assert abs(p.peak / abstract_peak(r, 2) - 1) <= TOLERANCE
    assert abs(p.residuals / r["residuals"] - 1) <= 0.01  # residuals to the byte, nearly
    assert abs((p.master + p.optimizer + p.step_work) / r["step"] - 1) <= 0.01
    bwd = p.params + p.residuals + p.io + p.accumulators + p.backward_work
    if remat != "none":  # "none": XLA folds half the parameter cotangents into the
        #                  accumulators (the backward program is 17% under the model)
        assert abs(bwd / r["backward"] - 1) <= TOLERANCE


def test_replicated_parameters_follow_the_runtime_rules():
    """The planner's count of what TP leaves whole equals parallel/tensor.py's rules on the
    built stage (tiny config: the generator's adaLN modulation is half its parameters)."""
    from flax import nnx
    from jax.sharding import Mesh
    import numpy as np

    from mmjax.parallel.sharded_init import abstract_split
    from mmjax.pipeline.stage_modules import stage_module

    cfg = make_cfg()
    mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("dp", "tp"))
    params = module_params(cfg)
    for unit in cfg.unit_names:
        _, tr, _ = abstract_split(stage_module, (cfg, unit, 0, cfg.num_layers(unit)),
                                  jax.random.key(0), (nnx.Param, ...), mesh)
        whole = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(tr)
                    if a.sharding.shard_shape(a.shape) == a.shape)
        assert replicated_params(cfg, unit) == whole, unit
        total = params[unit] + params.get(f"{unit}.projector", 0)
        assert sum(int(np.prod(a.shape)) for a in jax.tree.leaves(tr)) == total


@pytest.mark.slow
def test_dots_under_the_dp_vmap_keeps_the_weight_matmuls_and_matches_the_reference():
    """With dp > 1 the stage vmaps over its ranks, so every weight matmul has a batch
    dimension; "dots" still keeps their outputs (more than "full"'s stage input) and the
    step equals the single-device model."""
    from helpers import check

    cfg = make_cfg()
    plan = Plan.uniform(cfg, 4, 2, dp={"vision": 2, "llm": 2, "generator": 2},
                        pp={"llm": 2}, remat="dots")
    rt = check(cfg, plan, n=4)
    assert rt is not None
    errors = stage_errors("dp2pp2", "dots")
    full = stage_errors("dp2pp2", "full")
    for sid in ("llm:0", "llm:1"):
        assert errors[sid][3] > 10 * full[sid][3], (sid, errors[sid][3], full[sid][3])
