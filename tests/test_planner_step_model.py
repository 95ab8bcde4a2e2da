"""planner/step_model.py: the single-device step is the cost model's per-unit compute with
the linear work on the step's slots, attention on real pairs times the kernel's slowdown, and
the memory-bound optimizer update and loss head at the device's HBM bandwidth."""
from dataclasses import replace

import pytest

from mmjax.models.tiny import tiny
from mmjax.planner.costs import work_time
from mmjax.planner.elementwise import elementwise_s
from mmjax.planner.hardware import H100
from mmjax.planner.step_model import (ADAM_BYTES_PER_PARAM, HEAD_BYTES_PER_LOGIT,
                                      SlotShapes, dense_attention_s, single_step_time,
                                      slot_workloads)
from mmjax.planner.unit_work import unit_work
from mmjax.planner.workload import default_workload


def _split(model, wl, unit, remat, hw=H100):
    lin = att = 0.0
    for w in unit_work(model, wl, unit).layers + unit_work(model, wl, unit).extra:
        f, b = work_time(w, 1, hw, remat)
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
    for u in model.unit_names:  # the elementwise passes on the slots, as the linear work
        assert p.elementwise_s[u] == pytest.approx(
            8 * fills.get(u, 1) * elementwise_s(model, wl, u, H100, remat[u], 2))
    assert p.total_s == pytest.approx(sum(p.units_s.values()) + sum(p.elementwise_s.values())
                                      + p.optimizer_s + p.head_s)
    # padding and recomputation only add time: full fills, no slowdown, no remat is less
    base = single_step_time(model, wl, H100, 8, {}, {}, 1_000_000, 4096)
    assert all(base.units_s[u] < p.units_s[u] for u in ("llm", "vision"))


# ---- XLA's dense attention: static shapes, pairs x heads at the measured time per pair ----
DENSE_HW = replace(H100, dense_pair_s=1e-9, dense_pair_head_dim=16)
SLOTS = SlotShapes(rows=5, seq_len=256, encoders={"vision": (2, 128)})


def _linear(model, wl, unit):
    lin, _ = _split(model, wl, unit, "none", replace(DENSE_HW, call_tokens=0.0))
    return lin


def test_dense_slots_by_hand():
    """Each LLM row and encoder buffer is one full sequence: linear work at the profile's
    efficiency for that length, attention = layers x heads x S^2 pairs x the measured time
    per pair (the tiny model's heads are 16 wide: the measured head dim, no FLOP term)."""
    model = tiny()
    wl = default_workload(model)
    p = single_step_time(model, wl, DENSE_HW, 8, {}, {}, 1000, 4096, slots=SLOTS)
    llm, vision = slot_workloads(model, wl, SLOTS)["llm"], slot_workloads(model, wl, SLOTS)[
        "vision"]
    assert llm[0].llm_tokens == (256,) and llm[1] == 5
    assert vision[0].encoder_tokens == {"vision": ((128,),)} and vision[1] == 2
    assert p.units_s["llm"] == pytest.approx(5 * (_linear(model, llm[0], "llm")
                                                  + 4 * 4 * 256 ** 2 * 1e-9))
    assert p.units_s["vision"] == pytest.approx(2 * (_linear(model, vision[0], "vision")
                                                     + 2 * 2 * 128 ** 2 * 1e-9))
    assert p.elementwise_s["llm"] == pytest.approx(
        5 * elementwise_s(model, llm[0], "llm", DENSE_HW, "none", 2))
    # the generator is not in the slots: priced on its real samples as before
    base = single_step_time(model, wl, DENSE_HW, 8, {}, {}, 1000, 4096)
    assert p.units_s["generator"] == base.units_s["generator"]


def test_dense_attention_head_dim_and_passes():
    """A wider head adds its Q K^T and P V FLOPs (12 per pair and head dim, forward +
    backward) at the peak; a frozen unit runs the forward third; remat re-runs it."""
    model = tiny()
    base = dense_attention_s(model, "llm", 256, DENSE_HW)
    wide = dense_attention_s(model, "llm", 256, replace(DENSE_HW, dense_pair_head_dim=8))
    assert wide - base == pytest.approx(4 * 4 * 256 ** 2 * 12 * 8 / DENSE_HW.peak_flops)
    assert dense_attention_s(model, "llm", 256, DENSE_HW, bwd=0) == pytest.approx(base / 3)
    assert dense_attention_s(model, "llm", 256, DENSE_HW, remat="dots") == pytest.approx(
        base * 4 / 3)


def test_dense_without_a_measured_pair_time_prices_attention_by_flops():
    model = tiny()
    wl = default_workload(model)
    hw = replace(DENSE_HW, dense_pair_s=0.0)
    p = single_step_time(model, wl, hw, 8, {}, {}, 1000, 4096, slots=SLOTS)
    slot_wl, rows = slot_workloads(model, wl, SLOTS)["llm"]
    lin, att = _split(model, slot_wl, "llm", "none", replace(hw, call_tokens=0.0))
    assert p.units_s["llm"] == pytest.approx(rows * (lin + att))


@pytest.mark.parametrize("heads,seq", [(8, 256), (4, 512)])
def test_dense_attention_work_goes_with_heads_times_pairs(heads, seq):
    """What the per-pair price rests on, checked on the compiled program: XLA's dense
    attention (forward + backward) moves bytes in proportion to heads x S^2 - doubling the
    heads doubles them, doubling S quadruples them (cost_analysis of the lowered HLO)."""
    import jax
    import jax.numpy as jnp

    from mmjax.models.attention import dot_product_attention

    def bytes_of(h, s):
        x = jax.ShapeDtypeStruct((2, s, h, 16), jnp.float32)
        allowed = jnp.tril(jnp.ones((s, s), bool))[None]
        grad = jax.jit(jax.grad(lambda q, k, v: dot_product_attention(q, k, v, allowed).sum(),
                                argnums=(0, 1, 2)))
        cost = grad.lower(x, x, x).compile().cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        return cost["bytes accessed"]

    ratio = bytes_of(heads, seq) / bytes_of(4, 256)
    assert ratio == pytest.approx(heads * seq ** 2 / (4 * 256 ** 2), rel=0.1)
