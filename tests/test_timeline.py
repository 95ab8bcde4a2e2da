"""scripts/timeline.py: trace -> Chrome/Perfetto JSON + PNG Gantt chart; --simulate mode."""
import importlib.util
import json
import os

import pytest

from mmjax.schedule.schedule import one_f_one_b
from mmjax.schedule.simulate import simulate

_PATH = os.path.join(os.path.dirname(__file__), os.pardir, "scripts", "timeline.py")
_spec = importlib.util.spec_from_file_location("timeline_script", _PATH)
timeline = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(timeline)

SMALL = [  # llm listed first on purpose: rows must still put the encoder on top
    dict(stage="llm:0", kind="F", microbatch=0, chunk=0, start=1.0, end=2.0),
    dict(stage="vision:0", kind="F", microbatch=0, chunk=0, start=0.0, end=1.0),
    dict(stage="vision:0", kind="F", microbatch=1, chunk=0, start=1.0, end=2.0),
    dict(stage="llm:0", kind="B", microbatch=0, chunk=0, start=2.0, end=4.0),
    dict(stage="llm:0", kind="F", microbatch=1, chunk=0, start=4.0, end=5.0),
    dict(stage="vision:0", kind="B", microbatch=0, chunk=0, start=4.0, end=6.0),
    dict(stage="llm:0", kind="B", microbatch=1, chunk=0, start=5.0, end=7.0),
    dict(stage="vision:0", kind="B", microbatch=1, chunk=0, start=7.0, end=9.0),
    dict(stage="generator:0", kind="F", microbatch=0, chunk=0, start=2.0, end=2.5),
]


def _check_png(path):
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000


def test_trace_to_chrome_and_png(tmp_path):
    src = tmp_path / "trace.json"
    src.write_text(json.dumps(SMALL))
    out = timeline.main([str(src)])
    assert out["chrome"] == str(tmp_path / "trace.perfetto.json")
    chrome = json.loads(open(out["chrome"]).read())
    events = chrome["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == len(SMALL)
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names == {0: "vision:0", 1: "llm:0", 2: "generator:0"}
    b0 = next(e for e in spans if e["name"] == "B0" and names[e["tid"]] == "llm:0")
    assert (b0["ts"], b0["dur"], b0["cat"]) == (2.0e6, 2.0e6, "backward")
    _check_png(out["png"])


def test_simulate_mode_writes_runtime_format(tmp_path):
    prefix = str(tmp_path / "sim")
    out = timeline.main(["--simulate", "--schedule=1f1b", "--stages=2", "--microbatches=4",
                         f"--out={prefix}"])
    trace = json.loads(open(out["trace"]).read())
    assert trace == simulate(one_f_one_b(2, 4), lambda s, a: 1.0 if a.kind == "F" else 2.0
                             ).trace()
    assert max(d["end"] for d in trace) == (4 + 2 - 1) * 3.0
    assert len([e for e in json.load(open(out["chrome"]))["traceEvents"]
                if e["ph"] == "X"]) == 16
    _check_png(out["png"])


@pytest.mark.parametrize("extra", [
    ["--schedule=interleaved", "--stages=2", "--microbatches=4", "--chunks=2"],
    ["--schedule=gpipe", "--stages=3", "--microbatches=3"],
    ["--schedule=multimodal", "--encoders=vision:1,audio:2", "--llm=2", "--generator=1",
     "--frozen=vision,llm", "--microbatches=3"],
])
def test_simulate_other_schedules(tmp_path, extra):
    out = timeline.main(["--simulate", f"--out={tmp_path / 'x'}", *extra])
    trace = json.load(open(out["trace"]))
    assert trace and all(set(d) == set(timeline.FIELDS) for d in trace)
    _check_png(out["png"])
    if "--frozen=vision,llm" in extra:  # frozen vision runs no backward
        assert not [d for d in trace if d["stage"] == "vision:0" and d["kind"] == "B"]


def test_bad_trace_errors(tmp_path):
    with pytest.raises(ValueError, match="JSON list"):
        timeline.check_trace({"traceEvents": []})
    with pytest.raises(ValueError, match="entry #0"):
        timeline.check_trace([{"stage": "llm:0"}])
    with pytest.raises(ValueError, match="kind='W'"):
        timeline.check_trace([dict(SMALL[0], kind="W")])
    with pytest.raises(ValueError, match="unknown units"):
        timeline.main(["--simulate", "--schedule=multimodal", "--frozen=video",
                       f"--out={tmp_path / 'y'}"])
