"""Multi-process runtime: 2 processes x 4 CPU devices (jax.distributed on localhost, gloo)
train the same small Plan as one process with 8 devices and must give the same losses.

The plan (tests/multiprocess_driver.py, layout "span"): vision on process 0, LLM stage 0 on
process 0, LLM stage 1 on a dp-2 mesh spanning both processes, generator on process 1, so
the run exercises stages a process does not hold (shape-only placeholders in the broker
transfers), a stage mesh across processes (global inputs, cross-process dp all-reduce and
ZeRO-1 update) and the cross-process loss and grad-norm reductions.
"""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = [sys.executable, os.path.join(ROOT, "scripts", "launch_local.py")]


def _env():
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.mark.slow
def test_two_process_losses_equal_single_process(gloo_jobs):
    steps = 2
    cmd = LAUNCH + ["--num_processes=2", "--devices_per_process=4", "--timeout=400",
                    "--script=" + os.path.join(ROOT, "tests", "multiprocess_driver.py"),
                    "--", "--layout=span", f"--steps={steps}"]
    # The job runs alone (no reference computed meanwhile in this process): its two
    # processes must reach each gloo collective within gloo's 30 s of each other.
    proc = subprocess.run(cmd, env=_env(), cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=420)
    out = proc.stdout
    assert proc.returncode == 0, out[-8000:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from multiprocess_driver import run_steps

    ref = run_steps("span", steps)  # one process, 8 forced devices (conftest)
    line = next(ln for ln in out.splitlines() if ln.startswith("[p0] LOSSES "))
    got = json.loads(line[len("[p0] LOSSES "):])
    assert len(got) == len(ref) == steps
    for g, r in zip(got, ref):
        for k in ("loss", "lm_loss", "diffusion_loss", "grad_norm"):
            np.testing.assert_allclose(g[k], r[k], rtol=1e-5, err_msg=k)
    assert got[1]["loss"] != got[0]["loss"]  # the update happened


_FAILING = textwrap.dedent("""
    import sys, time
    import jax
    if jax.process_index() == 1:
        print("process 1 fails", flush=True)
        sys.exit(3)
    time.sleep(300)  # a peer that would wait forever
""")


@pytest.mark.slow
def test_launch_local_kills_the_rest_when_one_fails(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(_FAILING)
    res = subprocess.run(LAUNCH + ["--num_processes=2", "--devices_per_process=1",
                                   f"--script={script}"],
                         env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=120)
    # p0 is killed by the launcher or aborts on its own when the coordinator sees p1 gone;
    # either way the run ends (no hang until the timeout) with p1's status.
    assert res.returncode == 3, res.stdout[-2000:] + res.stderr[-2000:]
    assert "[p1] process 1 fails" in res.stdout
    assert "launch_local: failed (p0=-" in res.stderr  # p0 died of a signal, not slept on


def test_launch_rejects_bad_process_id():
    from mmjax.launch import initialize

    with pytest.raises(ValueError, match="process_id=2"):
        initialize("127.0.0.1:1", num_processes=2, process_id=2)


_FAILS_ONCE = textwrap.dedent("""
    import os, sys
    import jax
    marker = sys.argv[1]
    if jax.process_index() == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        print("process 1 fails on the first attempt", flush=True)
        sys.exit(3)
    print("attempt ok", flush=True)
""")


@pytest.mark.slow
def test_launch_local_restarts_all_then_gives_up_naming_the_culprit(tmp_path):
    once, always = tmp_path / "once.py", tmp_path / "always.py"
    once.write_text(_FAILS_ONCE)
    always.write_text(_FAILING)
    run = lambda script, *extra: subprocess.run(
        LAUNCH + ["--num_processes=2", "--devices_per_process=1", "--max_restarts=1",
                  f"--script={script}", "--", *extra],
        env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    res = run(once, str(tmp_path / "marker"))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "process p1 (exit status 3) failed; restarting all 2 processes (restart 1 of 1)" \
        in res.stderr
    second = res.stdout.split("process 1 fails on the first attempt")[1]  # the restart
    assert "[p0] attempt ok" in second and "[p1] attempt ok" in second
    res = run(always)
    assert res.returncode == 3, res.stdout[-2000:] + res.stderr[-2000:]
    assert res.stderr.count("restarting all 2 processes") == 1
    assert "launch_local: process p1 (exit status 3) failed after 1 restart(s); its last " \
           "lines:\n  [p1] process 1 fails" in res.stderr


_STOPS_ONCE = textwrap.dedent("""
    import os, signal, sys, time
    import jax
    marker = sys.argv[1]
    if jax.process_index() == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        print("process 1 stops itself", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(3)
    print("attempt ok", flush=True)
""")

_KILLED = textwrap.dedent("""
    import os, signal, time
    import jax
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices("start")
    if jax.process_index() == 1:
        time.sleep(1)
        os.kill(os.getpid(), signal.SIGKILL)
    multihost_utils.sync_global_devices("never")  # p0 waits for its lost peer
""")


@pytest.mark.slow
def test_a_stopped_process_is_found_by_its_heartbeat_and_the_group_restarted(tmp_path):
    script = tmp_path / "stops.py"
    script.write_text(_STOPS_ONCE)
    res = subprocess.run(LAUNCH + ["--num_processes=2", "--devices_per_process=1",
                                   "--max_restarts=1", "--heartbeat_timeout=5",
                                   f"--script={script}", "--", str(tmp_path / "marker")],
                         env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "process p1 (heartbeat lost: no sign of life for 5s (stopped or hung)) failed; " \
           "restarting all 2 processes (restart 1 of 1)" in res.stderr, res.stderr[-2000:]
    second = res.stdout.split("process 1 stops itself")[1]
    assert "[p0] attempt ok" in second and "[p1] attempt ok" in second


@pytest.mark.slow
def test_the_killed_process_is_blamed_and_its_peers_abort_called_a_consequence(tmp_path):
    script = tmp_path / "killed.py"
    script.write_text(_KILLED)
    res = subprocess.run(LAUNCH + ["--num_processes=2", "--devices_per_process=1",
                                   f"--script={script}"],
                         env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 128 + 9, res.stdout[-2000:] + res.stderr[-2000:]
    assert "first: p1, killed by SIGKILL" in res.stderr, res.stderr[-2000:]
    assert "launch_local: process p1 (killed by SIGKILL) failed; its last lines:" in res.stderr
    assert "process p0 also failed" not in res.stderr  # its abort is not a second cause


@pytest.mark.parametrize("flags,env,want", [
    (("h:1", 2, 1), {}, ("h:1", 2, 1)),
    ((None, None, None), {"MMJAX_COORDINATOR": "c:2", "MMJAX_NUM_PROCESSES": "4",
                          "MMJAX_PROCESS_ID": "3"}, ("c:2", 4, 3)),
    (("h:1", 4, None), {"JOB_COMPLETION_INDEX": "2"}, ("h:1", 4, 2)),  # k8s indexed Job
    (("h:1", None, None), {"MMJAX_NUM_PROCESSES": "2", "MMJAX_PROCESS_ID": "1",
                           "JOB_COMPLETION_INDEX": "0"}, ("h:1", 2, 1)),
    ((None, None, None), {"SLURM_JOB_ID": "7"}, (None, None, None)),  # jax auto-detects
])
def test_cluster_settings_from_flags_environment_kubernetes_and_slurm(flags, env, want):
    from mmjax.launch import cluster_settings

    got = cluster_settings(*flags, env=env)
    assert (got["coordinator"], got["num_processes"], got["process_id"]) == want


def test_cluster_settings_missing_outside_slurm_names_what_is_missing():
    from mmjax.errors import UserError
    from mmjax.launch import cluster_settings

    with pytest.raises(UserError, match=r"--coordinator, --process_id not given"):
        cluster_settings(None, 2, None, env={})
