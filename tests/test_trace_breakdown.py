"""scripts/trace_breakdown.py: kernels classed by name, busy time as the union of stream
intervals, idle as the rest of the device span, the derived "XLA Ops" line not counted."""
import gzip
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
from trace_breakdown import breakdown, classify, load_events, main  # noqa: E402


def _trace():
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7,
             "args": {"name": "Stream #13(Compute)"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 8,
             "args": {"name": "Stream #14(Compute)"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 9, "args": {"name": "XLA Ops"}}]
    k = lambda tid, name, ts, dur, op="": {"ph": "X", "pid": 1, "tid": tid, "name": name,
                                           "ts": ts, "dur": dur, "args": {"hlo_op": op}}
    return meta + [
        k(7, "nvjet_sm90_tst_128x160_64x5_2x1_v_bz_NNT", 0, 100, "custom-call.3"),
        k(8, "bam_flash_forward", 50, 100),            # overlaps the GEMM on another stream
        k(7, "input_reduce_fusion_2", 300, 40, "reduce.7"),
        k(7, "loop_multiply_fusion", 400, 60, "multiply_fusion"),
        k(9, "fusion.1", 0, 1000),                      # derived line: not a kernel
        {"ph": "X", "pid": 2, "tid": 1, "name": "PjitFunction", "ts": 0, "dur": 900}]


def test_classes_busy_and_idle():
    r = breakdown(_trace())
    us = 1e-6
    assert r["kernels"] == 4
    assert r["classes_s"] == pytest.approx({"attention": 100 * us, "matmuls": 100 * us,
                                            "norms/reductions": 40 * us, "other": 60 * us})
    assert r["span_s"] == pytest.approx(460 * us)
    assert r["busy_s"] == pytest.approx((150 + 40 + 60) * us)  # 0-150 is one busy run
    assert r["idle_s"] == pytest.approx((460 - 250) * us)


def test_classify_names():
    assert classify("cudnn_generated_fort_native_sdpa_sm90") == "attention"
    assert classify("sm90_xmma_gemm_bf16bf16_bf16f32") == "matmuls"
    assert classify("fusion.12", "dot.4") == "matmuls"
    assert classify("input_reduce_fusion") == "norms/reductions"
    assert classify("loop_add_fusion") == "other"


def test_cli_reads_gzip_and_refuses_an_empty_trace(tmp_path, capsys):
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": _trace()}, f)
    assert len(load_events(str(path))) == len(_trace())
    out = tmp_path / "b.json"
    main([str(path), "--json", str(out)])
    assert "attention" in capsys.readouterr().out
    assert json.loads(out.read_text())["kernels"] == 4
    with pytest.raises(ValueError, match="no device kernels"):
        breakdown([{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "x"}}])
