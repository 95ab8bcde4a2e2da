"""Start-up on a loaded machine (issue 43 item 2): a process that dies before the first
checkpoint is restarted under `--max_restarts` like any other failure, and processes that
reach start-up far apart (45 s here, past gloo's fixed 30 s rendezvous deadline that killed
1 run in 5 at load 12) meet at the coordination service's barrier (`train.startup_timeout`,
train/startup_barrier.py) instead of dying in orbax's first collective."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(REPO, "scripts", "train.py")
# p1 fails at start-up on its first attempt only (a counter file), then starts 45 s late
WRAPPER = textwrap.dedent(f"""
    import os, runpy, sys, time
    import jax
    if jax.process_index() == 1:
        path = os.environ["MMJAX_TEST_ATTEMPTS"]
        with open(path, "a") as f:
            f.write("x")
        with open(path) as f:
            attempt = len(f.read())
        if attempt == 1:
            print("failing at start-up on purpose (attempt 1)", flush=True)
            sys.exit(3)
        time.sleep(45)
    sys.argv[0] = {TRAIN!r}
    runpy.run_path({TRAIN!r}, run_name="__main__")
""")


@pytest.mark.slow
def test_a_start_up_death_restarts_and_late_peers_meet_at_the_barrier(tmp_path):
    script, work = tmp_path / "fail_once.py", tmp_path / "work"
    script.write_text(WRAPPER)
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "MMJAX_TEST_ATTEMPTS": str(tmp_path / "attempts")}
    p = subprocess.run(
        [sys.executable, os.path.join(REPO, "scripts", "launch_local.py"), "--num_processes=2",
         "--devices_per_process=1", f"--script={script}", "--max_restarts=1", "--timeout=900",
         "--", '--gin_param=named_model_config.overrides={"llm.num_layers": 1}',
         "--gin_param=train.global_batch=4", "--gin_param=data_layout.seq_len=128",
         "--gin_param=train.steps=2", "--gin_param=train.checkpoint_every=2",
         "--gin_param=train.progress=False", f"--workdir={work}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert "launch_local: process p1 (exit status 3) failed; restarting all 2 processes " \
           "(restart 1 of 1)" in p.stderr, out[-4000:]
    assert "DEADLINE_EXCEEDED" not in out
    with open(tmp_path / "attempts") as f:
        assert f.read() == "xx"
    with open(work / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2]
    assert os.path.isdir(work / "checkpoints" / "2")


def test_startup_timeout_is_checked():
    from mmjax.errors import UserError
    from mmjax.train.trainer import train

    for bad in (0, -5, True, "60", 10 ** 6):
        with pytest.raises(UserError, match=r"train.startup_timeout=.*: must be a number >= 1 "
                                            r"and <= 86,400 \(seconds"):
            train("/nonexistent-workdir", startup_timeout=bad)
