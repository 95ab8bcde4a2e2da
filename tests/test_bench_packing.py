"""scripts/bench_packing.py at small sizes: its fill columns are the formulas they claim,
recomputed here from the same batches, and the JSON holds what the tables print."""
import importlib.util
import json
import os

import numpy as np
import pytest

import packing_reference as reference
from mmjax.data.batch_shapes import pack_rows
from mmjax.data.layout import shape_bucket

_PATH = os.path.join(os.path.dirname(__file__), os.pardir, "scripts", "bench_packing.py")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_packing_script", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_fill_columns_are_their_formulas(bench, tmp_path):
    out = bench.main(["--global_batch", "16", "--steps", "3", "--dp", "2",
                      "--microbatches", "2", "--samples_per_rank", "4", "--repeats", "1",
                      "--json", str(tmp_path / "p.json")])
    assert json.load(open(tmp_path / "p.json"))["part1"] == out["part1"]
    rows = out["part1"]
    assert [(r["mix"], r["seq_len"]) for r in rows] == [
        ("llava", 2048), ("llava", 4096), ("laion", 2048), ("laion", 4096)]
    r = rows[0]
    _, steps = bench.batches("llava", 2048, 16, 3)
    tokens = np.array([sum(m.llm_length for m in b) for b in steps], float)
    for key, packer in (("before", reference.pack_rows), ("after", pack_rows)):
        b = np.array([shape_bucket(max(packer([m.llm_length for m in s], 2048, "pack")) + 1)
                      for s in steps])
        assert r[key]["step"] == pytest.approx(float(np.mean(tokens / (b * 2048))))
        assert r[key]["run"] == pytest.approx(float(tokens.mean() / (b.max() * 2048)))
    for r in rows:  # perfect packing bounds both; one static shape never beats per step
        for k in ("before", "after"):
            assert 0 < r[k]["run"] <= r[k]["step"] <= r["bound"]["step"] <= 1
        assert 0 < r["vision"] <= 1
    for r in out["part2"]:
        assert all(0 < r[p] <= 1 for p in ("none", "disttrain", "orchmllm"))
    assert all(v > 0 for t in out["part3"].values() for v in t.values())
    for r in out["part4"]:  # the loader's row budget: the run's shape within it
        assert 1 <= r["rows"] <= r["row_budget"]
        assert 0 < r["min_fill"] <= r["fill"] <= 1
        assert 1 <= r["samples"][0] <= r["samples"][1] <= 16 + 16 // 4  # the window
