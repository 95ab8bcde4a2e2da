"""Graceful preemption (train/preemption.py): SIGTERM / SIGINT finish the step in flight,
checkpoint it, say where the run resumes and exit 75; the rerun ends bit-identical to an
uninterrupted run (a 2-process run through launch_local: test_checkpoint_multiprocess.py)."""
import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from mmjax.train.preemption import EXIT_PREEMPTED, Preempted, Preemption

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 12  # enough steps past the signal that the step in flight is never the last
SMALL = ['--gin_param=named_model_config.overrides={"llm.num_layers": 1}',
         "--gin_param=train.global_batch=4", "--gin_param=data_layout.seq_len=128",
         "--gin_param=train.checkpoint_every=100", "--gin_param=train.progress=False",
         f"--gin_param=train.steps={STEPS}"]
EXACT = ("loss", "lm_loss", "diffusion_loss", "grad_norm", "learning_rate", "tokens_seen",
         "tokens_trained", "skipped_samples", "nonfinite_steps")


def test_a_signal_only_sets_the_flag_and_a_second_ctrl_c_stops_at_once():
    with Preemption(lead=False) as p:
        assert not p.requested()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        assert p.signame == "SIGTERM" and p.requested()
        os.kill(os.getpid(), signal.SIGTERM)  # repeated: nothing more
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # restored
    stopped = []
    with Preemption(lead=False, stop_now=lambda: stopped.append(1)) as p:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        assert p.signame == "SIGINT" and not stopped
        os.kill(os.getpid(), signal.SIGINT)  # the second: stop now (from the watcher)
        for _ in range(100):
            if stopped:
                break
            time.sleep(0.01)
        assert stopped == [1]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored
    e = Preempted("SIGTERM", 3, 3, "/w/checkpoints")
    assert str(e) == ("SIGTERM: stopped after step 3; the run will resume from step 3 "
                      "(/w/checkpoints): rerun the same command")


def test_a_signal_during_a_save_lets_the_save_finish(tmp_path):
    """SIGTERM and SIGINT landing while a checkpoint is being written (from another thread,
    as a cluster's notice arrives at any moment) only set the flag: the save completes and
    commits, and the checkpoint restores bit for bit."""
    import threading

    import jax
    import jax.numpy as jnp
    from mmjax.train.checkpoint import Checkpointer

    state = {"w": jnp.arange(1 << 20, dtype=jnp.float32) / 7, "step": jnp.int32(5)}
    for sig in (signal.SIGTERM, signal.SIGINT):
        ck = Checkpointer(str(tmp_path / sig.name))
        with Preemption(lead=False) as p:
            fire = threading.Timer(0.002, os.kill, (os.getpid(), sig))
            fire.start()
            ck.save(5, state, {"next": 5})
            ck.wait()
            fire.join()
            time.sleep(0.01)
            assert p.signame == sig.name
        step, got, data = ck.restore_latest(state)
        ck.close()
        assert step == 5 and data == {"next": 5}
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(state)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _train(workdir):
    return [sys.executable, os.path.join(REPO, "scripts", "train.py"), *SMALL,
            f"--workdir={workdir}"]


def _env():
    return {**os.environ, "JAX_PLATFORMS": "cpu"}


def _metrics(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _wait_rows(path, rows, proc, timeout=400):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if os.path.exists(path):
            with open(path) as f:
                if len(f.readlines()) >= rows:
                    return
        time.sleep(0.05)
    raise AssertionError(f"no {rows} metric rows (rc {proc.poll()})")


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_checkpoints_the_step_reached_and_the_rerun_is_bit_identical(tmp_path, sig):
    from test_checkpoint_multiprocess import _leaves

    straight, work = str(tmp_path / "straight"), str(tmp_path / "work")
    p = subprocess.run(_train(straight), cwd=REPO, env=_env(), capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    after = random.Random(109).randint(1, STEPS - 8)  # seeded: a failure reruns the same step
    proc = subprocess.Popen(_train(work), cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    _wait_rows(os.path.join(work, "metrics.jsonl"), after, proc)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=300)
    reached = len(_metrics(work))
    print(f"{sig.name} after {after} metric rows: stopped after step {reached}")
    assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
    assert reached >= after and reached < STEPS
    assert os.path.isdir(os.path.join(work, "checkpoints", str(reached)))
    line = [x for x in err.splitlines() if x.startswith("preempted: ")]
    assert line == [f"preempted: {sig.name}: stopped after step {reached}; the run will "
                    f"resume from step {reached} ({work}/checkpoints): rerun the same "
                    f"command"], err[-2000:]
    assert "Traceback" not in err
    p = subprocess.run(_train(work), cwd=REPO, env=_env(), capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0 and f"resumed from {work}/checkpoints step {reached}" in \
        p.stderr + p.stdout, p.stderr[-3000:]
    want, got = _metrics(straight), _metrics(work)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for g, w in zip(got, want):
        assert {k: g[k] for k in EXACT} == {k: w[k] for k in EXACT}
    a, b = _leaves(straight, STEPS), _leaves(work, STEPS)
    assert sorted(a) == sorted(b) and len(a) > 20
    for name in a:
        np.testing.assert_array_equal(b[name], a[name], err_msg=name)
