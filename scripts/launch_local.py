#!/usr/bin/env python
"""Start an N-process run on this machine: `python scripts/launch_local.py --num_processes=N
[--devices_per_process=K] [--script=scripts/train.py] [--timeout=S] [--max_restarts=R]
-- <script args>`.

Each process is `python -m mmjax.launch` with a coordinator on 127.0.0.1 at a free port
(jax.distributed, CPU devices per process = K). Output lines are prefixed `[pI]` and
streamed as they come. When one process fails the others are killed (a peer waiting in a
collective would otherwise hang; a hung process makes its peers fail within seconds through
the coordinator's heartbeat); the exit status is that of the first process seen failing
(128 + N for a death by signal N), else 0. The first failure is named with its cause (exit
status, signal, heartbeat lost: a process stopped or frozen stops touching its heartbeat
file), and a peer that then dies reporting the lost connection is named as a consequence.
SIGTERM / SIGINT to the launcher are forwarded to every process (each in its own session, so
a terminal's Ctrl-C arrives once); scripts/train.py then finishes its step, checkpoints and
exits 75, and so does the launcher.

Supervision: with `--max_restarts=R` a failed attempt restarts all N processes (a fresh
coordinator), up to R times; the script resumes from its last checkpoint (scripts/train.py
does). When restarts run out the launcher exits with the culprit's status, naming it and
printing its last output lines.

Exit 75 from any process is a preemption, not a failure: a SIGTERM to one process stops
every process after the same step with a checkpoint (mmjax/train/preemption.py), so the
others are waited for, never killed. The launcher then exits 75, or with
`--restart_on_preemption` starts all N again at once without counting a restart.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# gloo's per-connection chatter (written by C++ straight to stderr, so it can land in the
# middle of another line) and absl/glog info and warning lines (I0000 ..., W0000 ...,
# "WARNING: All log messages before absl::InitializeLog() ..."): noise to a user.
_GLOO = re.compile(r"\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. Expected number of "
                   r"connected peer ranks is : \d+")
_ABSL = re.compile(r"^(?:[IW]\d{4} [\d:.]+\s+\d+ \S+:\d+\] |WARNING: All log "
                   r"messages before absl::InitializeLog\(\) is called)")


def quiet(line: str) -> str | None:
    """`line` without gloo and absl noise; None when nothing else is left."""
    cleaned = _GLOO.sub("", line)
    if (cleaned != line and not cleaned.strip()) or _ABSL.match(cleaned):
        return None
    return cleaned


def _pump(proc: subprocess.Popen, prefix: str, lock: threading.Lock, tail) -> None:
    for raw in proc.stdout:
        line = quiet(raw.rstrip("\n"))
        if line is None:
            continue
        line += "\n"
        tail.append(line.rstrip("\n"))
        with lock:
            sys.stdout.write(f"{prefix} {line}")
            sys.stdout.flush()


EXIT_PREEMPTED = 75  # mmjax/train/preemption.py: stopped on a signal with a checkpoint
# what a process prints when it dies because a peer did (gloo / the coordination service)
_PEER_LOSS = re.compile(r"gloo|connection (?:closed|reset|refused)|heartbeat|coordination "
                        r"service|DEADLINE_EXCEEDED|UNAVAILABLE|socket closed|peer",
                        re.IGNORECASE)


def describe(rc: int) -> str:
    """A process's end in words: its exit status or the signal that killed it."""
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit status {rc}"


def launch(num_processes: int, script_args: list[str], devices_per_process: int = 4,
           script: str | None = None, timeout: float | None = None,
           max_restarts: int = 0, tail_lines: int = 20,
           heartbeat_timeout: float = 60.0, restart_on_preemption: bool = False) -> int:
    """Run the processes, restarting all of them after a failure up to `max_restarts`
    times; -> exit status (see module docstring). SIGTERM / SIGINT are forwarded to every
    process (each finishes its step, checkpoints and exits 75) and end the run, no restart.
    A process's own exit 75 (a signal sent to it, not to the launcher) ends the run with
    75, or restarts it uncounted with `restart_on_preemption`."""
    if max_restarts < 0:
        raise ValueError("launch: --max_restarts must be >= 0")
    stop = _Stop()
    attempt = 0
    with stop:
        while True:
            status, culprit, tail, why = _attempt(num_processes, script_args,
                                                  devices_per_process, script, timeout,
                                                  tail_lines, stop, heartbeat_timeout)
            if status == EXIT_PREEMPTED and not stop.signame:
                if restart_on_preemption:
                    print(f"launch_local: process p{culprit} was preempted (exit 75, all "
                          f"stopped with a checkpoint); restarting all {num_processes} "
                          f"processes (not counted as a failure)", file=sys.stderr, flush=True)
                    continue
                print(f"launch_local: process p{culprit} was preempted; all {num_processes} "
                      f"stopped with a checkpoint (exit 75): rerun to resume",
                      file=sys.stderr, flush=True)
                return status
            if status == 0 or stop.signame:
                if stop.signame:
                    how = ("all stopped with a checkpoint" if status == EXIT_PREEMPTED
                           else describe(status))
                    print(f"launch_local: {stop.signame} forwarded to all {num_processes} "
                          f"processes; {how} (exit {status})", file=sys.stderr, flush=True)
                return status
            who = f"process p{culprit} ({why})"
            if attempt < max_restarts:
                attempt += 1
                print(f"launch_local: {who} failed; restarting all {num_processes} processes "
                      f"(restart {attempt} of {max_restarts})", file=sys.stderr,
                      flush=True)
                continue
            after = f" after {max_restarts} restart(s)" if max_restarts else ""
            status = status if status >= 0 else 128 - status  # killed by N: 128 + N
            print(f"launch_local: {who} failed{after}; its last lines:", file=sys.stderr)
            for line in tail[culprit]:
                print(f"  [p{culprit}] {line}", file=sys.stderr)
            for i, lines in sorted(tail.items()):
                if i != culprit:  # failed on its own too: its story may be the cause
                    print(f"launch_local: process p{i} also failed; its last lines:",
                          file=sys.stderr)
                    for line in lines:
                        print(f"  [p{i}] {line}", file=sys.stderr)
            return status


class _Stop:
    """While active: SIGTERM / SIGINT are recorded and forwarded to the live processes
    (`procs`, set per attempt) instead of killing the launcher."""

    def __init__(self):
        self.signame, self.procs, self._old = None, [], {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._forward)
        return self

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)
        return False

    def _forward(self, signum, frame) -> None:
        self.signame = self.signame or signal.Signals(signum).name
        for p in self.procs:
            if p.poll() is None:
                os.kill(p.pid, signum)


def _stopped(pid: int) -> bool:
    """The process is stopped (SIGSTOP / SIGTSTP: state T in /proc; False elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _alive(path: str, since: float, timeout: float) -> bool:
    """A process's heartbeat (a file mmjax.launch touches every second) is fresh: not
    older than `timeout` s (before its first beat: counted from the start)."""
    try:
        last = os.path.getmtime(path)
    except OSError:
        last = since
    return time.time() - max(last, since) < timeout


def _attempt(num_processes, script_args, devices_per_process, script, timeout, tail_lines,
             stop=None, heartbeat_timeout: float = 60.0):
    """One start of all processes; -> (exit status, culprit process id, {process id: last
    lines} for the culprit and every peer that failed on its own, the culprit's story).
    The culprit is the first process seen failing (exit, signal, or heartbeat lost); a
    peer that then dies reporting a lost connection is a consequence and named as one."""
    import tempfile

    stop = stop or _Stop()
    if num_processes < 1 or devices_per_process < 1:
        raise ValueError("launch: --num_processes and --devices_per_process must be >= 1")
    coordinator = f"127.0.0.1:{free_port()}"
    env = dict(os.environ)
    # The per-process device count comes from jax_num_cpu_devices; a forced count in
    # XLA_FLAGS (e.g. from a test harness) would override it.
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(flags)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    beats = tempfile.mkdtemp(prefix="mmjax_heartbeats_")
    procs, lock = [], threading.Lock()
    t_start = time.time()
    for i in range(num_processes):
        cmd = [sys.executable, "-m", "mmjax.launch", f"--coordinator={coordinator}",
               f"--num_processes={num_processes}", f"--process_id={i}",
               f"--local_device_count={devices_per_process}"]
        if script:
            cmd.append(f"--script={script}")
        env_i = {**env, "MMJAX_HEARTBEAT_FILE": os.path.join(beats, f"p{i}")}
        # own session: a terminal's Ctrl-C reaches the launcher only, which forwards it once
        procs.append(subprocess.Popen(cmd + ["--"] + list(script_args), env=env_i, cwd=REPO,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, bufsize=1, start_new_session=True))
    stop.procs = procs
    tails = [collections.deque(maxlen=tail_lines) for _ in procs]
    pumps = [threading.Thread(target=_pump, args=(p, f"[p{i}]", lock, tails[i]), daemon=True)
             for i, p in enumerate(procs)]
    for t in pumps:
        t.start()
    status, culprit, why, hung = 0, 0, "", set()
    preempted = []  # the processes seen exiting 75, in that order
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        # every process polled each round (a list, not any()'s short circuit): a process
        # that ends while an earlier one runs is seen at once, so the first to fail is
        # the one blamed
        while any([p.poll() is None for p in procs]):
            if stop.signame:  # every process finishes its step and checkpoints: wait
                time.sleep(0.1)
                continue
            # exit 75: preempted; the others stop after the same step (never killed)
            preempted += [i for i, p in enumerate(procs)
                          if p.returncode == EXIT_PREEMPTED and i not in preempted]
            failed = [i for i, p in enumerate(procs)
                      if p.returncode not in (None, 0, EXIT_PREEMPTED)]
            hung = {i for i, p in enumerate(procs) if p.returncode is None and (
                not _alive(os.path.join(beats, f"p{i}"), t_start, heartbeat_timeout)
                or (failed and _stopped(p.pid)))}
            late = deadline is not None and time.monotonic() > deadline
            if failed or hung:
                culprit, why = _first(procs, failed, hung, tails, heartbeat_timeout)
                status = procs[culprit].returncode if culprit in failed else 124
                break
            if late:
                status, culprit, why = 124, 0, f"timed out after {timeout}s"
                print(f"launch_local: timed out after {timeout}s", file=sys.stderr)
                break
            time.sleep(0.1)
    finally:
        killed = [p.poll() is None for p in procs]
        for p, k in zip(procs, killed):
            if k:
                p.kill()
        for p in procs:
            p.wait()
        for t in pumps:
            t.join(timeout=5)
        shutil.rmtree(beats, ignore_errors=True)
    if stop.signame:
        codes = {p.returncode for p in procs}
        return (EXIT_PREEMPTED if codes == {EXIT_PREEMPTED} else max(codes, key=abs)), 0, {}, ""
    preempted += [i for i, p in enumerate(procs)
                  if p.returncode == EXIT_PREEMPTED and i not in preempted]
    if status == 0 and preempted and all(p.returncode in (0, EXIT_PREEMPTED) for p in procs):
        return EXIT_PREEMPTED, preempted[0], {}, "preempted"
    if status == 0:
        codes = [i for i, p in enumerate(procs) if p.returncode != 0]
        if codes:
            culprit, why = _first(procs, codes, set(), tails, heartbeat_timeout)
            status = procs[culprit].returncode
    if status != 0:
        codes = ", ".join(f"p{i}={p.returncode}" for i, p in enumerate(procs))
        print(f"launch_local: failed ({codes}); first: p{culprit}, {why}", file=sys.stderr)
        for i, p in enumerate(procs):
            if i != culprit and p.returncode not in (0, None) and not killed[i]:
                lost = any(_PEER_LOSS.search(x) for x in tails[i])
                why_i = f" after losing its peer p{culprit} (a consequence)" if lost else ""
                print(f"launch_local: p{i} then {describe(p.returncode)}{why_i}",
                      file=sys.stderr)
    failed = {i: list(tails[i]) for i, p in enumerate(procs)
              if i == culprit or (p.returncode not in (0, None) and not killed[i]
                                  and not any(_PEER_LOSS.search(x) for x in tails[i]))}
    return status, culprit, failed, why


def _first(procs, failed, hung, tails, heartbeat_timeout) -> tuple[int, str]:
    """(culprit, its story) among the processes seen failing in one poll: a lost
    heartbeat (stopped or frozen) first, then a death by signal, then an exit whose last
    lines do not report a lost peer, then any."""
    if hung:
        i = min(hung)
        return i, f"heartbeat lost: no sign of life for {heartbeat_timeout:g}s (stopped or hung)"
    def rank(i):  # its own failure before a peer's report of the loss; a signal first
        lost = any(_PEER_LOSS.search(x) for x in tails[i])
        return (lost, procs[i].returncode >= 0, i)
    i = min(failed, key=rank)
    return i, describe(procs[i].returncode)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = []
    if "--" in argv:
        k = argv.index("--")
        argv, rest = argv[:k], argv[k + 1:]
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num_processes", type=int, required=True)
    p.add_argument("--devices_per_process", type=int, default=4)
    p.add_argument("--script", default=None, help="script to run (default scripts/train.py)")
    p.add_argument("--timeout", type=float, default=None,
                   help="kill all after S seconds (per attempt)")
    p.add_argument("--max_restarts", type=int, default=0,
                   help="restart all processes after a failure up to R times")
    p.add_argument("--heartbeat_timeout", type=float, default=60.0,
                   help="a process with no heartbeat for S seconds (stopped, frozen) counts "
                        "as failed: all are stopped (and restarted with --max_restarts)")
    p.add_argument("--restart_on_preemption", action="store_true",
                   help="a process that exits 75 (preempted: every process stopped with a "
                        "checkpoint) restarts all at once, not counted in --max_restarts; "
                        "without it the launcher exits 75")
    args = p.parse_args(argv)
    if args.max_restarts < 0:
        p.error("--max_restarts must be >= 0")
    return launch(args.num_processes, rest, args.devices_per_process, args.script, args.timeout,
                  args.max_restarts, heartbeat_timeout=args.heartbeat_timeout,
                  restart_on_preemption=args.restart_on_preemption)


if __name__ == "__main__":
    from mmjax.cli import run_main

    sys.exit(run_main(main))
