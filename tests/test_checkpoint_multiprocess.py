"""Multi-process checkpoints (issue 15): 2 processes x 2 CPU devices run scripts/train.py on a
plan whose stages each live in one process (vision, LLM stage 0 on process 0; LLM stage 1,
generator on process 1), so every process saves only the shards it holds.

- kill -9 of a random process at a random step under `launch_local.py --max_restarts`:
  every metric and every checkpoint leaf equal the uninterrupted 2-process run, bit for bit;
- 4 steps on that plan, then steps 5-8 under another plan (other dp and pp, one process) or
  as one program: the losses of the uninterrupted run up to float reassociation (1e-5).
"""
import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import orbax.checkpoint as ocp
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = [sys.executable, os.path.join(ROOT, "scripts", "launch_local.py")]
STEPS = 8
SMALL = ['--gin_param=named_model_config.overrides={"llm.num_layers": 2}',
         "--gin_param=train.global_batch=4", "--gin_param=data_layout.seq_len=384",
         "--gin_param=train.checkpoint_every=2", "--gin_param=train.progress=False",
         "--gin_param=train.keep_checkpoints=10", f"--gin_param=train.steps={STEPS}",
         # global batch k = samples [4k, 4k+4), as the single program reads them (none of the
         # first 32 is too long for 384 tokens: the loader would skip it, the program not)
         "--gin_param=Loader.shuffle=False", "--gin_param=Loader.reserve=0"]
PLAN_A = ["--plan=manual", '--gin_param=manual_plan.pp={"llm": 2}']  # 4 devices, pp 2
PLAN_B = ["--plan=manual", '--gin_param=manual_plan.dp={"llm": 2}']  # 4 devices, dp 2
EXACT = ("loss", "lm_loss", "diffusion_loss", "grad_norm", "learning_rate", "tokens_seen",
         "tokens_trained", "skipped_samples", "nonfinite_steps")


def _env():
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _cmd(workdir, processes, devices, extra, restarts=0):
    return LAUNCH + [f"--num_processes={processes}", f"--devices_per_process={devices}",
                     "--timeout=500", f"--max_restarts={restarts}", "--",
                     *SMALL, f"--workdir={workdir}", *extra]


def _run(workdir, processes, devices, extra):
    p = subprocess.run(_cmd(workdir, processes, devices, extra), env=_env(), cwd=ROOT,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=560, check=False)
    assert p.returncode == 0, p.stdout[-6000:]
    return p.stdout


def _metrics(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _leaves(workdir, step):
    """{name: numpy array} of a checkpoint, read on the host (any process count wrote it)."""
    path = os.path.join(workdir, "checkpoints", str(step))
    with open(os.path.join(path, "integrity", "metadata")) as f:
        entries = json.load(f)["leaves"]
    target = {k: np.zeros(e["shape"], e["dtype"]) for k, e in entries.items()}
    args = {k: ocp.RestoreArgs(restore_type=np.ndarray) for k in target}
    out = ocp.PyTreeCheckpointer().restore(os.path.join(path, "state"),
                                           args=ocp.args.PyTreeRestore(target, restore_args=args))
    return {entries[k]["name"]: np.asarray(v) for k, v in out.items()}


def _resumed_at_4_and_matches(out: str, work: str, straight: str) -> None:
    """Resumed from step 4, and every step's losses and gradient norm equal the
    uninterrupted run's up to float reassociation (the parity tolerance)."""
    assert "resumed from" in out and "step 4" in out, out[-3000:]
    want, got = _metrics(straight), _metrics(work)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for g, w in zip(got, want):
        for k in ("loss", "lm_loss", "diffusion_loss", "grad_norm"):
            np.testing.assert_allclose(g[k], w[k], rtol=1e-5, err_msg=f"step {g['step']} {k}")


@pytest.fixture
def straight(tmp_path_factory, reference_cache, gloo_jobs):
    """The uninterrupted 8-step 2-process run on plan A (once per session)."""
    if "mp_checkpoint_straight" not in reference_cache:
        work = str(tmp_path_factory.mktemp("straight"))
        _run(work, 2, 2, PLAN_A)
        reference_cache["mp_checkpoint_straight"] = work
    return reference_cache["mp_checkpoint_straight"]


def _worker_pids(launcher_pid):
    out = subprocess.run(["pgrep", "-P", str(launcher_pid)], stdout=subprocess.PIPE, text=True,
                         check=False)
    return [int(p) for p in out.stdout.split()]


@pytest.mark.slow
def test_kill_9_of_a_two_process_run_resumes_bit_identical(straight, tmp_path, gloo_jobs):
    rng = random.Random(104)  # seeded: a failure reruns the same kill
    work = str(tmp_path / "killed")
    kill_after, victim = rng.randint(1, STEPS - 2), rng.randint(0, 1)
    launcher = subprocess.Popen(_cmd(work, 2, 2, PLAN_A, restarts=2), env=_env(), cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = os.path.join(work, "metrics.jsonl")
    deadline = time.monotonic() + 500
    while time.monotonic() < deadline and launcher.poll() is None:
        if os.path.exists(metrics):
            with open(metrics) as f:
                if len(f.readlines()) >= kill_after:
                    break
        time.sleep(0.2)
    pids = sorted(_worker_pids(launcher.pid))
    assert launcher.poll() is None and len(pids) == 2, (kill_after, pids)
    os.kill(pids[victim], signal.SIGKILL)
    print(f"kill -9 of process p{victim} after {kill_after} step(s)")  # shown with -s
    out, _ = launcher.communicate(timeout=560)
    assert launcher.returncode == 0, out[-6000:]
    assert "restarting all 2 processes" in out, out[-3000:]
    want, got = _metrics(straight), _metrics(work)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1)), (kill_after, victim)
    for g, w in zip(got, want):
        assert {k: g[k] for k in EXACT} == {k: w[k] for k in EXACT}, (kill_after, victim)
    a, b = _leaves(straight, STEPS), _leaves(work, STEPS)
    assert sorted(a) == sorted(b) and len(a) > 50
    for name in a:
        np.testing.assert_array_equal(b[name], a[name], err_msg=name)


@pytest.mark.slow
def test_sigterm_to_the_launcher_checkpoints_every_process_and_the_rerun_is_bit_identical(
        straight, tmp_path, gloo_jobs):
    """SIGTERM to launch_local at a random step: forwarded to both processes, which finish
    the same step, checkpoint it and exit 75 (the launcher too); the rerun ends with every
    metric and checkpoint leaf of the uninterrupted run."""
    work = str(tmp_path / "preempted")
    after = random.Random(141).randint(1, STEPS - 4)  # seeded: a failure reruns the same step
    launcher = subprocess.Popen(_cmd(work, 2, 2, PLAN_A), env=_env(), cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = os.path.join(work, "metrics.jsonl")
    deadline = time.monotonic() + 500
    while time.monotonic() < deadline and launcher.poll() is None:
        if os.path.exists(metrics):
            with open(metrics) as f:
                if len(f.readlines()) >= after:
                    break
        time.sleep(0.1)
    launcher.send_signal(signal.SIGTERM)
    out, _ = launcher.communicate(timeout=560)
    reached = len(_metrics(work))
    print(f"SIGTERM after {after} rows: stopped after step {reached}")
    assert launcher.returncode == 75, out[-6000:]
    assert f"[p0] preempted: SIGTERM: stopped after step {reached}; the run will resume from " \
           f"step {reached}" in out, out[-3000:]
    assert "all stopped with a checkpoint (exit 75)" in out
    assert os.path.isdir(os.path.join(work, "checkpoints", str(reached)))
    _run(work, 2, 2, PLAN_A)
    want, got = _metrics(straight), _metrics(work)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for g, w in zip(got, want):
        assert {k: g[k] for k in EXACT} == {k: w[k] for k in EXACT}, after
    a, b = _leaves(straight, STEPS), _leaves(work, STEPS)
    assert sorted(a) == sorted(b) and len(a) > 50
    for name in a:
        np.testing.assert_array_equal(b[name], a[name], err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["plan_b_one_process", "one_program"])
def test_four_steps_on_two_processes_then_four_on_another_plan(straight, tmp_path, how,
                                                                gloo_jobs):
    work = str(tmp_path / "replan")
    _run(work, 2, 2, PLAN_A + ["--gin_param=train.stop_after=4"])
    assert [r["step"] for r in _metrics(work)] == [1, 2, 3, 4]
    if how == "plan_b_one_process":
        out = _run(work, 1, 4, PLAN_B)
    else:
        out = _run(work, 1, 1, [])
    _resumed_at_4_and_matches(out, work, straight)
    # the new run's checkpoint holds the same arrays, in the same logical shapes
    a, b = _leaves(straight, STEPS), _leaves(work, STEPS)
    assert {n: x.shape for n, x in a.items()} == {n: x.shape for n, x in b.items()}


PLAN_TP = ["--plan=manual", '--gin_param=manual_plan.tp={"llm": 2}']  # 4 devices, tp 2


@pytest.mark.slow
def test_one_process_with_llm_tp2_then_two_processes_on_plan_a(straight, tmp_path, gloo_jobs):
    """1 -> 2 processes and tp 2 -> tp 1 (and pp 1 -> 2): the plan-independent checkpoint of
    a one-process tp-2 run restores onto the two-process plan A."""
    work = str(tmp_path / "grow")
    _run(work, 1, 4, PLAN_TP + ["--gin_param=train.stop_after=4"])
    out = _run(work, 2, 2, PLAN_A)
    _resumed_at_4_and_matches(out, work, straight)


@pytest.mark.slow
def test_two_processes_skip_a_damaged_newest_checkpoint(straight, tmp_path, gloo_jobs):
    """Both processes verify the newest checkpoint (4), find a data file of it truncated,
    set it aside and resume from 2; the finished run equals the uninterrupted one."""
    work = str(tmp_path / "damaged")
    _run(work, 2, 2, PLAN_A + ["--gin_param=train.stop_after=4"])
    files = [os.path.join(r, f) for r, _, fs in
             os.walk(os.path.join(work, "checkpoints", "4", "state")) for f in fs
             if "ocdbt" in r or f.startswith("d")]
    big = max(files, key=os.path.getsize)
    with open(big, "r+b") as f:
        f.truncate(os.path.getsize(big) // 2)
    out = _run(work, 2, 2, PLAN_A)
    assert "checkpoint step 4" in out and "is unusable" in out, out[-3000:]
    assert "resumed from" in out and "step 2" in out, out[-3000:]
    assert os.path.isdir(os.path.join(work, "checkpoints.unusable", "4"))
    want, got = _metrics(straight), _metrics(work)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for g, w in zip(got, want):
        assert {k: g[k] for k in EXACT} == {k: w[k] for k in EXACT}, g["step"]
