"""Frozen-status-aware partitioning and Cornstarch Algorithm 1 (Cornstarch §4.2, §5.2)."""
import itertools

import numpy as np
import pytest

from mmjax.models.named import named_config
from mmjax.planner.hardware import A800
from mmjax.planner.build import model_costs
from mmjax.planner.partition import (balanced_split, loosely_coupled, max_stage_time,
                                     partition_unit, planning_weights)


def brute_split(weights, k):
    n, best = len(weights), None
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0,) + cuts + (n,)
        worst = max(sum(weights[a:b]) for a, b in zip(bounds[:-1], bounds[1:]))
        best = worst if best is None else min(best, worst)
    return best


@pytest.mark.parametrize("seed", range(20))
def test_balanced_split_is_optimal(seed):
    rng = np.random.default_rng(seed)
    w = rng.uniform(0.1, 3.0, size=int(rng.integers(1, 11))).tolist()
    k = int(rng.integers(1, len(w) + 1))
    split = balanced_split(w, k)
    assert len(split) == k and sum(split) == len(w) and min(split) >= 1
    start, worst = 0, 0.0
    for s in split:
        worst = max(worst, sum(w[start:start + s]))
        start += s
    assert worst == pytest.approx(brute_split(w, k))


def test_split_errors():
    with pytest.raises(ValueError, match="num_stages"):
        balanced_split([1.0, 2.0], 3)


def test_frozen_encoder_stages_take_more_layers():
    """A frozen encoder whose last layer carries a trainable projector: balancing fwd+bwd
    puts more encoder layers in the first (backward-free) stage (Cornstarch Fig. 7c)."""
    layers = [(1.0, 0.0)] * 7 + [(1.0, 2.0)]
    aware = partition_unit("vision", layers, 2, aware=True)
    unaware = partition_unit("vision", layers, 2, aware=False)
    assert aware.split == (5, 3) and unaware.split == (4, 4)
    assert aware.max_stage_s < unaware.max_stage_s
    assert planning_weights(layers, False) == [3.0] * 8


CASES = ["cornstarch/vlm_m", "cornstarch/vlm_l", "cornstarch/alm_m", "cornstarch/alm_l"]


def test_loosely_coupled_frozen_aware_direction():
    """Cornstarch Table 3 / Table 9 (LLM-M, TP 2, 24 microbatches, 24 GPUs = 12 stages):
    frozen-aware partitioning gives the LLM at least as many stages and the frozen encoder
    at most as many, and is never slower; for VLM-L it is strictly faster."""
    gains = {}
    for name in CASES:
        m = named_config(name)
        enc = m.encoders[0].name
        _, lc = model_costs(m, A800)
        kw = dict(num_microbatches=24, max_total_stages=12, max_unit_stages=6)
        aware = loosely_coupled(lc["llm"][2], {enc: lc[enc][2]}, aware=True, **kw)
        unaware = loosely_coupled(lc["llm"][2], {enc: lc[enc][2]}, aware=False, **kw)
        assert aware.stages["llm"] >= unaware.stages["llm"], name
        assert aware.stages[enc] <= unaware.stages[enc], name
        assert aware.iteration_time_s <= unaware.iteration_time_s * (1 + 1e-12), name
        gains[name] = unaware.iteration_time_s / aware.iteration_time_s
    assert gains["cornstarch/vlm_l"] > 1.05


def test_loosely_coupled_matches_stage_targets():
    """Every encoder gets the fewest stages whose slowest stage fits the LLM's stage time."""
    llm = [(1.0, 2.0)] * 8
    enc = {"vision": [(0.5, 1.0)] * 6, "audio": [(2.0, 0.0)] * 4}
    r = loosely_coupled(llm, enc, num_microbatches=16, max_unit_stages=8)
    t = r.llm.max_stage_s
    for p in r.encoders:
        assert p.max_stage_s <= t
        if p.num_stages > 1:
            fewer = partition_unit(p.name, enc[p.name], p.num_stages - 1)
            assert fewer.max_stage_s > t
    assert max_stage_time(llm, r.llm.split) == pytest.approx(t)
