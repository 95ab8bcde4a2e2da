"""Ctrl-C while the training step compiles (issue 41 item 5): the first says at once that
the run stops once the compilation finishes, then it stops after that step with its
checkpoint (exit 75); a second exits at once with one line (exit 130), never a traceback
or a crash, however long the compilation still has to run."""
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from mmjax.train.preemption import EXIT_INTERRUPTED, EXIT_PREEMPTED

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = ["--gin_param=train.steps=4", "--gin_param=train.checkpoint_every=100"]


class _Run:
    """train.py in a subprocess, its stderr read line by line in a thread."""

    def __init__(self, workdir, cache):
        env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
        cmd = [sys.executable, os.path.join(REPO, "scripts", "train.py"),
               f"--workdir={workdir}", *RUN,
               f"--gin_param=train.compilation_cache_dir='{cache}'"]  # empty: compiles
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stderr:
            self.lines.append(line)

    def wait_for(self, text: str, timeout: float = 300) -> float:
        t0 = time.monotonic()
        while not any(text in line for line in self.lines):
            assert self.proc.poll() is None, "".join(self.lines[-30:])
            assert time.monotonic() - t0 < timeout, "".join(self.lines[-30:])
            time.sleep(0.02)
        return time.monotonic() - t0

    def finish(self, timeout: float = 300) -> int:
        rc = self.proc.wait(timeout)
        self.reader.join(10)
        return rc


@pytest.mark.slow
def test_ctrl_c_during_compilation_stops_after_it_and_a_second_exits_at_once(tmp_path):
    work = tmp_path / "run"
    # once: told at once, the step compiles and runs, then its checkpoint
    run = _Run(work, tmp_path / "cache1")
    run.wait_for("compiling the training step")
    run.proc.send_signal(signal.SIGINT)
    assert run.wait_for("SIGINT: stopping after the compilation in progress", 10) < 10
    assert run.finish() == EXIT_PREEMPTED, "".join(run.lines[-30:])
    text = "".join(run.lines)
    assert "stopped after step 1" in text and "Traceback" not in text
    assert os.path.isdir(work / "checkpoints" / "1")

    # twice: the second ends the process at once, mid-compilation, with one line
    run = _Run(work, tmp_path / "cache2")  # another empty cache: the step compiles again
    run.wait_for("compiling the training step")
    run.proc.send_signal(signal.SIGINT)
    run.wait_for("SIGINT: stopping after the compilation in progress", 10)
    t0 = time.monotonic()
    run.proc.send_signal(signal.SIGINT)
    rc = run.finish(60)
    took = time.monotonic() - t0
    text = "".join(run.lines)
    assert rc == EXIT_INTERRUPTED, text[-3000:]
    assert took < 5, took
    assert "Traceback" not in text and "Segmentation" not in text
    assert run.lines[-1].startswith("SIGINT again: stopped at once")
    assert not any("compiled the training step" in line for line in run.lines)


def test_ctrl_c_during_set_up_is_one_line_and_exit_130(capsys):
    """A Ctrl-C before any handler of the script's own (imports, gin, the run's set-up)
    ends the script with one line and exit 130, never a traceback; `--debug` keeps it."""
    from mmjax.cli import run_main

    def main(argv):
        raise KeyboardInterrupt

    assert run_main(main, []) == EXIT_INTERRUPTED
    assert capsys.readouterr().err == "interrupted (Ctrl-C): stopped at once\n"
    with pytest.raises(KeyboardInterrupt):
        run_main(main, ["--debug"])
