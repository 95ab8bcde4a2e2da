"""scripts/bench_step.py at tiny sizes: the step trains, and its FLOP count, MFU and planner
prediction are the formulas they claim (no wall-clock assertions)."""
import importlib.util
import json
import math
import os

import pytest

from mmjax.data.data_spec import sample_workload
from mmjax.planner.costs import unit_costs
from mmjax.planner.hardware import H100

_PATH = os.path.join(os.path.dirname(__file__), os.pardir, "scripts", "bench_step.py")
_spec = importlib.util.spec_from_file_location("bench_step_script", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "bench_step.json"
    rec = bench.main(["--steps", "2", "--warmup", "1", "--override", "llm.num_layers=1",
                      "--json", str(out)])
    with open(out) as fh:
        assert json.load(fh).keys() == rec.keys()
    return rec


def test_formulas(record):
    r = record
    assert r["args"]["override"] == ["llm.num_layers=1"]
    assert len(r["step_times_s"]) == 2 and len(r["losses"]) == 3
    assert all(math.isfinite(x) for x in r["losses"])
    assert r["mfu"] == pytest.approx(r["model_flops_per_step"] / r["step_time_s"]
                                     / r["peak_flops"])
    assert r["tokens_per_s"] == pytest.approx(r["tokens_per_step"] / r["step_time_s"])
    # the planner's model FLOPs and time for the samples the bench drew, recomputed here
    cfg = bench.named_model_config("tiny", {"llm.num_layers": 1})
    source = bench.SyntheticSource(bench.synthetic_dataset(cfg))
    wl = sample_workload(source, cfg, 3 * 8, name="bench batches")
    costs = unit_costs(cfg, wl, H100, recompute=False)
    assert r["model_flops_per_step"] == pytest.approx(8 * sum(c.flops for c in costs))
    assert r["predicted_step_s"] == pytest.approx(8 * sum(c.time_s[1] for c in costs))
    assert set(r["predicted_unit_s"]) == {"vision", "llm", "generator"}
    # XLA's count of the compiled step covers at least the forward's share of the model's
    assert r["xla_flops_per_step"] > r["model_flops_per_step"] / 3


def test_bad_override_is_a_user_error():
    with pytest.raises(Exception, match="llm.no_such_field"):
        bench.main(["--override", "llm.no_such_field=1", "--json", os.devnull])
