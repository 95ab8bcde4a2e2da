"""What the run says on the console: skips per reason (first time, then counted with their
share in the summary) and which pretrained weights were loaded from where."""
import hf_reference as ref
from test_pretrained_training import CLIP, QWEN, base_cfg

from mmjax.models import hf
from mmjax.train.run_report import SkipReport, pretrained_lines


def test_each_skip_reason_is_said_once_then_counted_in_the_summary():
    said = []
    r = SkipReport(said.append, "runs/x/skipped.jsonl")
    r.step(1, 2, [("a", "too_long: 374 LLM tokens > seq_len 256"), ("b", "too_long: 300 x")])
    r.step(2, 0, [])
    r.step(3, 2, [("c", "missing: image /d/c.png not found"), ("d", "too_long: 290")])
    assert said == [
        "step 1: skipped sample a (too_long: 374 LLM tokens > seq_len 256); every skip is "
        "counted in metrics.jsonl and named in runs/x/skipped.jsonl",
        "step 3: skipped sample c (missing: image /d/c.png not found); every skip is "
        "counted in metrics.jsonl and named in runs/x/skipped.jsonl"]
    assert r.summary(24) == ("skipped 4 samples (16.7% of the 24 trained, replaced by "
                             "others): too_long 3, missing 1; see runs/x/skipped.jsonl")
    assert SkipReport(said.append, "s").summary(24) is None


def test_pretrained_lines_name_unit_directory_and_tensor_count(tmp_path):
    ref.write_checkpoint(tmp_path / "qwen", QWEN, ref.llm_tensors(QWEN, seed=1))
    ref.write_checkpoint(tmp_path / "clip", CLIP, ref.tower_tensors("clip", CLIP, seed=2))
    dirs = {"llm": str(tmp_path / "qwen"), "vision": str(tmp_path / "clip")}
    cfg = hf.prepare_pretrained(base_cfg(), dirs)
    llm_n = len(ref.llm_tensors(QWEN, seed=1))
    lines = pretrained_lines(cfg, dirs)
    assert lines[0] == f"loaded pretrained llm from {dirs['llm']} ({llm_n} tensors)"
    assert lines[1].startswith(f"loaded pretrained vision from {dirs['vision']} (")
    # a tower read at hidden_states[-2] loads the layers it uses (2 of 3)
    n = int(lines[1].rpartition("(")[2].split()[0])
    assert 0 < n <= len(ref.tower_tensors("clip", CLIP, seed=2))
