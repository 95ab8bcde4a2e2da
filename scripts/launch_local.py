#!/usr/bin/env python
"""Start an N-process run on this machine: `python scripts/launch_local.py --num_processes=N
[--devices_per_process=K] [--script=scripts/train.py] [--timeout=S] [--max_restarts=R]
-- <script args>`.

Each process is `python -m mmjax.launch` with a coordinator on 127.0.0.1 at a free port
(jax.distributed, CPU devices per process = K). Output lines are prefixed `[pI]` and
streamed as they come. When one process fails the others are killed (a peer waiting in a
collective would otherwise hang; a hung process makes its peers fail within seconds through
the coordinator's heartbeat); the exit status is that of the first process seen failing
(a script's own non-zero exit preferred over a peer's abort on losing it), else 0.

Supervision: with `--max_restarts=R` a failed attempt restarts all N processes (a fresh
coordinator), up to R times; the script resumes from its last checkpoint (scripts/train.py
does). When restarts run out the launcher exits with the culprit's status, naming it and
printing its last output lines.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
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


def launch(num_processes: int, script_args: list[str], devices_per_process: int = 4,
           script: str | None = None, timeout: float | None = None,
           max_restarts: int = 0, tail_lines: int = 20) -> int:
    """Run the processes, restarting all of them after a failure up to `max_restarts`
    times; -> exit status (see module docstring)."""
    if max_restarts < 0:
        raise ValueError("launch: --max_restarts must be >= 0")
    for attempt in range(max_restarts + 1):
        status, culprit, tail = _attempt(num_processes, script_args, devices_per_process,
                                         script, timeout, tail_lines)
        if status == 0:
            return 0
        who = f"process p{culprit} (exit status {status})"
        if attempt < max_restarts:
            print(f"launch_local: {who} failed; restarting all {num_processes} processes "
                  f"(restart {attempt + 1} of {max_restarts})", file=sys.stderr, flush=True)
            continue
        after = f" after {max_restarts} restart(s)" if max_restarts else ""
        print(f"launch_local: {who} failed{after}; its last lines:", file=sys.stderr)
        for line in tail[culprit]:
            print(f"  [p{culprit}] {line}", file=sys.stderr)
        for i, lines in sorted(tail.items()):
            if i != culprit:  # a peer that failed on its own too: its story may be the cause
                print(f"launch_local: process p{i} also failed; its last lines:", file=sys.stderr)
                for line in lines:
                    print(f"  [p{i}] {line}", file=sys.stderr)
        return status
    return status  # unreachable: the loop returns


def _attempt(num_processes, script_args, devices_per_process, script, timeout, tail_lines):
    """One start of all processes; -> (exit status, culprit process id, {process id: last
    lines} for the culprit and every peer that exited non-zero on its own)."""
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
    procs, lock = [], threading.Lock()
    for i in range(num_processes):
        cmd = [sys.executable, "-m", "mmjax.launch", f"--coordinator={coordinator}",
               f"--num_processes={num_processes}", f"--process_id={i}",
               f"--local_device_count={devices_per_process}"]
        if script:
            cmd.append(f"--script={script}")
        procs.append(subprocess.Popen(cmd + ["--"] + list(script_args), env=env, cwd=REPO,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, bufsize=1))
    tails = [collections.deque(maxlen=tail_lines) for _ in procs]
    pumps = [threading.Thread(target=_pump, args=(p, f"[p{i}]", lock, tails[i]), daemon=True)
             for i, p in enumerate(procs)]
    for t in pumps:
        t.start()
    status, culprit = 0, 0
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            failed = [(p.returncode, i) for i, p in enumerate(procs)
                      if p.returncode not in (None, 0)]
            late = deadline is not None and time.monotonic() > deadline
            if failed or late:
                # Prefer a script's own exit status over a peer's abort on losing it.
                status, culprit = max(failed, key=lambda c: c[0] > 0) if failed else (124, 0)
                if late:
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
    if status == 0:
        codes = [(p.returncode, i) for i, p in enumerate(procs) if p.returncode != 0]
        status, culprit = max(codes, key=lambda c: c[0] > 0) if codes else (0, 0)
    if status != 0:
        codes = ", ".join(f"p{i}={p.returncode}" for i, p in enumerate(procs))
        print(f"launch_local: failed ({codes})", file=sys.stderr)
    failed = {i: list(tails[i]) for i, p in enumerate(procs)
              if i == culprit or (p.returncode not in (0, None) and not killed[i])}
    return status, culprit, failed


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
    args = p.parse_args(argv)
    if args.max_restarts < 0:
        p.error("--max_restarts must be >= 0")
    return launch(args.num_processes, rest, args.devices_per_process, args.script, args.timeout,
                  args.max_restarts)


if __name__ == "__main__":
    from mmjax.cli import run_main

    sys.exit(run_main(main))
