"""planner/step_model.py: the single-device step is the cost model's per-unit compute with
the linear work on the step's slots, attention on real pairs times the kernel's slowdown, and
the memory-bound optimizer update and loss head at the device's HBM bandwidth."""
import pytest

from mmjax.models.tiny import tiny
from mmjax.planner.costs import work_time
from mmjax.planner.hardware import H100
from mmjax.planner.step_model import (ADAM_BYTES_PER_PARAM, HEAD_BYTES_PER_LOGIT,
                                      single_step_time)
from mmjax.planner.unit_work import unit_work
from mmjax.planner.workload import default_workload


def _split(model, wl, unit, remat):
    lin = att = 0.0
    for w in unit_work(model, wl, unit).layers + unit_work(model, wl, unit).extra:
        f, b = work_time(w, 1, H100, remat)
        att += (f + b) * w.attn_flops / w.flops
        lin += (f + b) * (1 - w.attn_flops / w.flops)
    return lin, att


def test_terms_by_hand():
    model = tiny()
    wl = default_workload(model)
    remat = {"llm": "dots", "vision": "full", "generator": "none"}
    fills = {"llm": 1.5, "vision": 1.25}
    slow = {"llm": 1.8}
    p = single_step_time(model, wl, H100, 8, remat, fills, 1_000_000, 4096, slow)
    for u in model.unit_names:
        lin, att = _split(model, wl, u, remat[u])
        assert p.units_s[u] == pytest.approx(8 * (lin * fills.get(u, 1) + att * slow.get(u, 1)))
    assert p.optimizer_s == pytest.approx(ADAM_BYTES_PER_PARAM * 1e6 / H100.hbm_bw)
    assert p.head_s == pytest.approx(HEAD_BYTES_PER_LOGIT * 4096 * model.llm.vocab_size
                                     / H100.hbm_bw)
    assert p.total_s == pytest.approx(sum(p.units_s.values()) + p.optimizer_s + p.head_s)
    # padding and recomputation only add time: full fills, no slowdown, no remat is less
    base = single_step_time(model, wl, H100, 8, {}, {}, 1_000_000, 4096)
    assert all(base.units_s[u] < p.units_s[u] for u in ("llm", "vision"))
