"""launch_local blames the process that failed first (issue 43 item 2): every process is
polled each round, so one that exits while a lower-numbered one still runs is seen at
once. Here p1 fails the way a start-up barrier times out on a loaded machine (exit 1,
"DEADLINE_EXCEEDED") while p0 is still busy; p0 would abort seconds later (as the
coordination service makes it when a peer is gone). Before, p1's exit went unseen until
p0 died, and the signal death was blamed."""
import os
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = textwrap.dedent("""
    import os, sys, time
    import jax
    if jax.process_index() == 1:
        print("Gloo context initialization failed: DEADLINE_EXCEEDED: GetKeyValue() timed out",
              flush=True)
        sys.exit(1)
    time.sleep(4)
    os.abort()
""")


@pytest.mark.slow
def test_the_first_process_to_fail_is_blamed_not_a_later_signal_death(tmp_path):
    script = tmp_path / "barrier_timeout.py"
    script.write_text(SCRIPT)
    p = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "launch_local.py"),
                        "--num_processes=2", "--devices_per_process=1", f"--script={script}",
                        "--timeout=120"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 1, p.stderr[-3000:]
    assert "launch_local: failed (p0=-9, p1=1); first: p1, exit status 1" in p.stderr, \
        p.stderr[-3000:]
    assert "launch_local: process p1 (exit status 1) failed; its last lines:" in p.stderr
