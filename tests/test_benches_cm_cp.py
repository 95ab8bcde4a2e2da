"""Smoke tests of scripts/bench_collective_matmul.py (DistTrain §7, StepCCL) and
scripts/bench_context.py (Cornstarch §6.5 Table 4 analogue) at tiny sizes, in-process.

They check the JSON's keys and rows, that the decomposed variants agree with GSPMD, the plain
CPU note, and that the balance rows re-derive from mmjax.data.token_distribution (no
wall-clock assertions)."""
import importlib.util
import json
import os

import jax
import numpy as np
import pytest

from mmjax.errors import UserError
from mmjax.data import token_distribution as td


def _load(name):
    path = os.path.join(os.path.dirname(__file__), os.pardir, "scripts", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"{name}_script", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------ collective matmul

CM_SHAPES = [(24, 8, 4)]  # (tokens, hidden, tp): shards of 6 rows
CM_VARIANTS = ["gspmd", "uni-c2", "bi-c2"]
CM_ROW = {"variant", "tokens", "hidden", "tp", "compile_s", "step_s_median", "step_s_min",
          "tflops_per_s", "max_rel_err_vs_gspmd"}


@pytest.fixture(scope="module")
def cm_result(tmp_path_factory):
    bench = _load("bench_collective_matmul")
    out = tmp_path_factory.mktemp("bench") / "cm.json"
    shapes = ";".join(",".join(map(str, s)) for s in CM_SHAPES)
    rc = bench.main(["--shapes", shapes, "--chunks", "2", "--steps", "1",
                     "--windowed", "off", "--json", str(out)])
    with open(out) as fh:
        return rc, json.load(fh)


def test_collective_matmul_bench_rows_and_cpu_note(cm_result):
    rc, result = cm_result
    assert rc == 0  # every variant within 1e-3 of gspmd in float32
    assert set(result) == {"platform", "device_kind", "dtype", "chunks", "steps", "notes",
                           "results"}
    assert (result["platform"], result["dtype"], result["chunks"], result["steps"]) == (
        jax.default_backend(), "float32", [2], 1)
    rows = result["results"]
    assert [(r["tokens"], r["hidden"], r["tp"], r["variant"]) for r in rows] == [
        (*s, v) for s in CM_SHAPES for v in CM_VARIANTS]
    for r in rows:
        assert set(r) == CM_ROW  # --windowed off: no xla-windowed row, no marker field
        assert r["compile_s"] > 0 and 0 < r["step_s_min"] <= r["step_s_median"]
        assert r["max_rel_err_vs_gspmd"] < 1e-5
        flops = 3 * 2 * (2 * r["tokens"] * r["hidden"] * 4 * r["hidden"])
        assert r["tflops_per_s"] == pytest.approx(flops / r["step_s_median"] / 1e12)
        if r["variant"] == "gspmd":
            assert r["max_rel_err_vs_gspmd"] == 0.0
    if result["platform"] == "cpu":
        assert len(result["notes"]) == 1
        assert "CPU" in result["notes"][0] and "do NOT show" in result["notes"][0]


def test_collective_matmul_bench_bad_shapes_name_the_flag():
    bench = _load("bench_collective_matmul")
    with pytest.raises(UserError, match="--shapes"):
        bench.parse_shapes("10,8,4")  # 10 tokens over tp=4
    with pytest.raises(UserError, match="--chunks"):
        bench.main(["--chunks", "0", "--json", os.devnull])


# ------------------------------------------------------------------ context parallelism

CP_ARGS = dict(lengths=[256, 384], families=["prepended", "embedded", "packing"], ranks=4,
               block=16, draws=2, lpt_tokens=4096, repeats=2, ilp_lengths=[128], ilp_draws=1,
               ilp_time_limit=5.0)


@pytest.fixture(scope="module")
def cp_result(tmp_path_factory):
    bench = _load("bench_context")
    out = tmp_path_factory.mktemp("bench") / "cp.json"
    argv = []
    for key, value in CP_ARGS.items():
        argv += [f"--{key}", *map(str, value if isinstance(value, list) else [value])]
    record = bench.main(argv + ["--json", str(out)])
    with open(out) as fh:
        saved = json.load(fh)
    assert saved == json.loads(json.dumps(record))
    return bench, saved


def test_context_bench_balance_rows_rederive(cp_result):
    bench, result = cp_result
    assert set(result) == {"config", "balance", "lpt_timing", "lpt_vs_ilp"}
    assert {k: result["config"][k] for k in CP_ARGS} == CP_ARGS
    rows = result["balance"]
    assert [(r["length"], r["family"]) for r in rows] == [
        (n, f) for n in CP_ARGS["lengths"] for f in CP_ARGS["families"]]
    ranks, block = CP_ARGS["ranks"], CP_ARGS["block"]
    for r in rows:
        assert set(r) == {"length", "family", *bench.ORDER}
        assert r["lpt"]["ratio_to_lpt"] == 1.0
        for m in bench.ORDER:
            assert set(r[m]) == {"imbalance", "ratio_to_lpt", "max"}
            assert r[m]["imbalance"] >= 1.0
        # Brute force: the mean over draws recomputed straight from token_distribution.
        maxes = {m: [] for m in bench.ORDER}
        for seed in range(CP_ARGS["draws"]):
            mask = td.example_mask(r["family"], r["length"], seed)
            work = td.block_work(mask, block)
            for m in bench.ORDER[:4]:
                dist = td.distribute(mask, ranks, m, block, seed=seed)
                maxes[m].append(td.work_stats(work, dist, block)["max"])
            capped = td.distribute(mask, ranks, "lpt", block, capacity=-(-work.size // ranks))
            maxes["lpt_capped"].append(td.work_stats(work, capped, block)["max"])
            for dist in (td.distribute(mask, ranks, m, block, seed=seed) for m in td.METHODS):
                assert sorted(np.concatenate(dist).tolist()) == list(range(r["length"]))
        for m in bench.ORDER:
            assert r[m]["max"] == pytest.approx(np.mean(maxes[m]), rel=1e-12)
            ratio = np.mean(np.divide(maxes[m], maxes["lpt"]))
            assert r[m]["ratio_to_lpt"] == pytest.approx(ratio, rel=1e-12)


def test_context_bench_lpt_timing_and_ilp(cp_result):
    _, result = cp_result
    blocks = -(-CP_ARGS["lpt_tokens"] // CP_ARGS["block"])
    assert [t["family"] for t in result["lpt_timing"]] == [
        "causal", "prepended", "embedded", "packing"]
    for t in result["lpt_timing"]:
        assert (t["tokens"], t["block"], t["blocks"]) == (CP_ARGS["lpt_tokens"],
                                                          CP_ARGS["block"], blocks)
        assert min(t["lpt_ms"], t["block_work_ms"], t["distribute_lpt_ms"]) > 0
    exact = result["lpt_vs_ilp"]
    assert [(r["length"], r["family"]) for r in exact] == [
        (n, f) for n in CP_ARGS["ilp_lengths"] for f in CP_ARGS["families"]]
    for r in exact:
        assert r["draws"] == 1 and 0 <= r["proven_optimal"] <= 1
        # A proven-optimal ILP makespan can never exceed LPT's.
        if r["proven_optimal"]:
            assert r["lpt_over_ilp"] >= 1.0 - 1e-12
        assert r["max_lpt_over_ilp"] >= r["lpt_over_ilp"] - 1e-12
