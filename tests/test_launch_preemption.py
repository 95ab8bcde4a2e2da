"""launch_local: exit 75 from one process is a preemption, not a failure (issue 43 item 6).
A SIGTERM sent to one process makes every process stop after the same step and exit 75;
the launcher waits for the others (never kills them mid-checkpoint) and exits 75, or with
--restart_on_preemption starts them again without spending a --max_restarts restart. The
script here is a stand-in for scripts/train.py: p1 exits 75 at once, p0 a moment later
(finishing its checkpoint), each leaving a file when it gets that far."""
import os
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = [sys.executable, os.path.join(REPO, "scripts", "launch_local.py")]
SCRIPT = textwrap.dedent("""
    import os, sys, time
    import jax
    out = sys.argv[1]
    attempt = len([n for n in os.listdir(out) if n.startswith("p0_")])
    if jax.process_index() == 0:
        time.sleep(3)  # still writing its checkpoint when p1 has exited
    open(os.path.join(out, f"p{jax.process_index()}_{attempt}"), "w").close()
    if attempt >= int(sys.argv[2]):
        sys.exit(0)
    sys.exit(75)
""")


def _run(tmp_path, *flags, preemptions=1):
    script = tmp_path / "preempted.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    p = subprocess.run(LAUNCH + ["--num_processes=2", "--devices_per_process=1",
                                 f"--script={script}", "--timeout=120", *flags, "--",
                                 str(out), str(preemptions)],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    return p, sorted(os.listdir(out))


@pytest.mark.slow
def test_one_process_preempted_ends_the_run_with_75_and_no_restart_spent(tmp_path):
    p, done = _run(tmp_path, "--max_restarts=2")
    assert p.returncode == 75, p.stderr[-3000:]
    assert done == ["p0_0", "p1_0"]  # p0 was waited for, not killed; no second attempt
    assert "failed" not in p.stderr and "restarting" not in p.stderr, p.stderr[-3000:]
    assert p.stderr.strip().splitlines()[-1] == (
        "launch_local: process p1 was preempted; all 2 stopped with a checkpoint (exit 75): "
        "rerun to resume")


@pytest.mark.slow
def test_restart_on_preemption_restarts_without_counting_a_failure(tmp_path):
    p, done = _run(tmp_path, "--max_restarts=0", "--restart_on_preemption", preemptions=2)
    assert p.returncode == 0, p.stderr[-3000:]
    assert done == ["p0_0", "p0_1", "p0_2", "p1_0", "p1_1", "p1_2"]
    assert p.stderr.count("was preempted (exit 75, all stopped with a checkpoint); "
                          "restarting all 2 processes (not counted as a failure)") == 2
    assert "failed" not in p.stderr, p.stderr[-3000:]
