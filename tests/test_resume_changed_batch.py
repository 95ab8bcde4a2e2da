"""Resuming a real run with another global batch (issue 43 item 7): the console names the
change in one line and the loader goes on from the stored sample; a checkpoint whose loader
state stores only the step (written before positions were counted in samples) resumes bit
for bit as it always did."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from mmjax.train.checkpoint_integrity import data_digest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ['--gin_param=named_model_config.overrides={"llm.num_layers": 1}',
         "--gin_param=data_layout.seq_len=128", "--gin_param=train.checkpoint_every=2",
         "--gin_param=train.progress=False"]
EXACT = ("loss", "lm_loss", "grad_norm", "learning_rate", "tokens_seen", "tokens_trained",
         "skipped_samples")


def _train(workdir, batch=4, stop_after=None):
    stop = [] if stop_after is None else [f"--gin_param=train.stop_after={stop_after}"]
    p = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "train.py"), *SMALL,
                        "--gin_param=train.steps=4", *stop,
                        f"--gin_param=train.global_batch={batch}", f"--workdir={workdir}"],
                       cwd=REPO, env={**os.environ, "JAX_PLATFORMS": "cpu"},
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout + p.stderr


def _metrics(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _data(workdir, step):
    with open(os.path.join(workdir, "checkpoints", str(step), "data", "metadata")) as f:
        return json.load(f)


def _to_older_format(step_dir):
    """The loader state as a checkpoint before positions were counted in samples wrote it
    (the single program's "batches" schema, the step alone), its integrity record's loader
    checksum rewritten to match."""
    path = os.path.join(step_dir, "data", "metadata")
    with open(path) as f:
        data = json.load(f)
    data["batches"] = data.pop("stream")
    data["batches"]["next_batch"] = data["batches"].pop("step")
    for key in ("sample", "global_batch", "seq_len"):
        data["batches"].pop(key)
    with open(path, "w") as f:
        json.dump(data, f)
    ipath = os.path.join(step_dir, "integrity", "metadata")
    with open(ipath) as f:
        record = json.load(f)
    record["data_sha256"] = data_digest(data)
    with open(ipath, "w") as f:
        json.dump(record, f)


@pytest.mark.slow
def test_a_changed_global_batch_is_named_and_an_older_state_resumes_bit_for_bit(tmp_path):
    straight, old, changed = (str(tmp_path / n) for n in ("straight", "old", "changed"))
    _train(straight)
    _train(old, stop_after=2)
    # window 4 + Loader.reserve 8 (configs/tiny.gin) = 12: two steps end at sample 24
    assert {k: _data(old, 2)["stream"][k] for k in ("step", "sample", "global_batch",
                                                    "seq_len")} == \
        {"step": 2, "sample": 24, "global_batch": 4, "seq_len": 128}
    shutil.copytree(old, changed)
    _to_older_format(os.path.join(old, "checkpoints", "2"))
    out = _train(old)
    assert f"resumed from {old}/checkpoints step 2" in out and "resumed with" not in out
    assert "unusable" not in out
    want, got = _metrics(straight), _metrics(old)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    for g, w in zip(got, want):
        assert {k: g[k] for k in EXACT} == {k: w[k] for k in EXACT}
    out = _train(changed, batch=8)
    lines = [x for x in out.splitlines() if x.startswith("resumed with")]
    assert lines == ["resumed with train.global_batch 4 -> 8: the data stream goes on from "
                     "sample 24 (global batch 2 on), no sample read twice or skipped"], out[-3000:]
    # window 8 + 8 = 16: two more steps end at sample 24 + 32
    assert {k: _data(changed, 4)["stream"][k] for k in ("sample", "global_batch")} == \
        {"sample": 56, "global_batch": 8}
