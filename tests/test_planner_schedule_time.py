"""The planner's reported iteration time (planner/schedule_time.py): the runtime's 1F1B
schedule timed by the one recurrence (schedule/simulate.py), against hand counts, DistTrain's
closed form (Eq. 1-2, what the search minimises) and the plan's `predicted` record."""
import pytest

from mmjax.planner.costs import UnitCost
from mmjax.planner.evaluate import Choice, evaluate
from mmjax.planner.hardware import Hardware
from mmjax.planner.schedule_time import schedule_time

HW = Hardware("test", peak_flops=1e14, hbm_bytes=40e9, nvlink_bw=2e11, nic_bw=2.5e10)


def unit(name, seconds, layers=8, boundary=0.0, grads=0.0):
    return UnitCost(name=name, num_layers=layers, time_s={1: seconds}, weight_bytes=1e6,
                    optimizer_bytes=0.0, activation_bytes={1: 1e6}, boundary_bytes=boundary,
                    grad_bytes=grads, flops=1e12, layer_pp_divides=name == "llm")


@pytest.mark.parametrize("pp,m", [(1, 4), (4, 8), (8, 8), (2, 16)])
def test_one_chain_of_equal_stages_is_the_closed_form(pp, m):
    """1F1B of p equal stages, m microbatches, no transfer time: (m + p - 1) stage times,
    which is also Eq. 1-2 (warm-up C, steady state (m - 1) C / p)."""
    llm = unit("llm", 3.0)
    ch = {"llm": Choice(1, 1, pp)}
    want = (m + pp - 1) * 3.0 / pp
    assert schedule_time((llm,), ch, m, HW) == pytest.approx(want, rel=1e-12)
    assert evaluate((llm,), ch, m, HW).iteration_time_s == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("pp,vpp,m", [(2, 2, 8), (4, 2, 8), (2, 4, 4)])
def test_interleaved_1f1b_pays_megatrons_bubble(pp, vpp, m):
    """Interleaved 1F1B (Megatron-LM): m v chunk times plus a bubble of p - 1 chunk times
    (chunk = C / (p v)), more than the closed form's C / v warm-up assumes."""
    llm = unit("llm", 3.0)
    ch = {"llm": Choice(1, 1, pp, vpp)}
    chunk = 3.0 / (pp * vpp)
    got = schedule_time((llm,), ch, m, HW)
    assert got == pytest.approx((m * vpp + pp - 1) * chunk, rel=1e-12)
    assert got > evaluate((llm,), ch, m, HW).iteration_time_s


def test_parallel_encoder_branches_overlap_where_the_closed_form_sums_them():
    """Two encoder branches feed the LLM side by side: the schedule's warm-up is the slower
    branch's, the closed form adds both; transfers and the DP sync are paid in both."""
    costs = (unit("vision", 1.0, 4, 1e6, 1e6), unit("audio", 1.5, 4, 1e6, 1e6),
             unit("llm", 3.0, 8, 1e6))
    ch = {"vision": Choice(1, 1, 2), "audio": Choice(1, 2, 1), "llm": Choice(1, 2, 4)}
    closed = evaluate(costs, ch, 64, HW)
    got = schedule_time(costs, ch, 64, HW)
    assert closed.steady_s + closed.sync_s < got < closed.iteration_time_s
    # without the vision branch's warm-up the closed form drops, the schedule barely moves
    slower = {**ch, "vision": Choice(1, 1, 1)}
    assert schedule_time(costs, slower, 64, HW) < evaluate(costs, slower, 64, HW).iteration_time_s


def test_a_plans_predicted_time_is_the_schedules():
    from mmjax.models.tiny import tiny
    from mmjax.planner.build import plan_model
    from mmjax.planner.hardware import H100

    plan = plan_model(tiny(), H100, 8, 16)
    p = plan.predicted
    ch = {u.name: Choice(u.tp, u.dp, u.pp, u.num_chunks, u.remat) for u in plan.units}
    from mmjax.planner.build import model_costs
    costs, _ = model_costs(tiny(), H100)
    assert p["iteration_time_s"] == pytest.approx(schedule_time(costs, ch, 16, H100), rel=1e-12)
    assert p["closed_form_s"] == pytest.approx(evaluate(costs, ch, 16, H100).iteration_time_s,
                                               rel=1e-12)
    assert p["samples_per_s"] == pytest.approx(16 / p["iteration_time_s"])
