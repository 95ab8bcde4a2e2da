"""Multi-process start-up: `jax.distributed` initialisation, and `python -m mmjax.launch`.

docs/design.md "Units, stages and sub-meshes": stages may sit in different processes; every
process runs the same host program (host-driven MPMD, DistTrain §7 broker) over the global
device list. `initialize` must run before anything touches a JAX backend. On CPU it selects
the gloo collectives (cross-process ppermute / psum) and the per-process device count; a
low heartbeat timeout makes a dead peer fail the others within seconds instead of minutes.

    python -m mmjax.launch --coordinator=HOST:PORT --num_processes=N --process_id=I \
        [--local_device_count=K] [--script=scripts/train.py] -- <script args>

Cluster settings come from the flags, else the environment (`cluster_settings`):
MMJAX_COORDINATOR / MMJAX_NUM_PROCESSES / MMJAX_PROCESS_ID, the process id of a Kubernetes
indexed Job (JOB_COMPLETION_INDEX), or, under SLURM (srun), jax.distributed's own
auto-detection (coordinator = first node of the step, one process per task).
"""
from __future__ import annotations

import argparse
import os
import runpy
import sys
import traceback

from mmjax.errors import UserError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cluster_settings(coordinator, num_processes, process_id, env=None) -> dict:
    """The jax.distributed arguments: explicit flags first, then MMJAX_* variables, then a
    Kubernetes indexed Job's JOB_COMPLETION_INDEX for the process id. Under SLURM, what is
    still unset is left to jax.distributed's SLURM auto-detection (None). Raises UserError
    naming what is missing elsewhere."""
    env = os.environ if env is None else env
    coordinator = coordinator or env.get("MMJAX_COORDINATOR")
    if num_processes is None and env.get("MMJAX_NUM_PROCESSES"):
        num_processes = int(env["MMJAX_NUM_PROCESSES"])
    if process_id is None:
        pid = env.get("MMJAX_PROCESS_ID", env.get("JOB_COMPLETION_INDEX"))
        process_id = None if pid is None else int(pid)
    settings = {"coordinator": coordinator, "num_processes": num_processes,
                "process_id": process_id}
    missing = [k for k, v in settings.items() if v is None]
    if missing and "SLURM_JOB_ID" not in env:
        raise UserError(f"launch: {', '.join('--' + k for k in missing)} not given and not "
                        f"in the environment (MMJAX_COORDINATOR, MMJAX_NUM_PROCESSES, "
                        f"MMJAX_PROCESS_ID or JOB_COMPLETION_INDEX; or run under srun)")
    return settings


def initialize(coordinator_address: str | None, num_processes: int | None,
               process_id: int | None,
               local_device_count: int | None = None, heartbeat_timeout_seconds: int = 10,
               initialization_timeout: int = 300) -> None:
    """`jax.distributed.initialize` for process `process_id` of `num_processes`.

    `local_device_count`: CPU devices this process exposes (`jax_num_cpu_devices`; ignored
    on GPU, where each process sees its local accelerators). Call before any JAX
    computation; the CPU platform then uses gloo for cross-process collectives. A None
    setting is left to jax.distributed's auto-detection (SLURM). `initialization_timeout`:
    seconds every process has to connect to the coordinator (a loaded machine starts
    processes minutes apart; the training script's own start-up barrier is
    `train.startup_timeout`, train/startup_barrier.py)."""
    if num_processes is not None and num_processes < 1:
        raise ValueError(f"initialize: num_processes={num_processes} must be >= 1")
    if (num_processes is not None and process_id is not None
            and not 0 <= process_id < num_processes):
        raise ValueError(f"initialize: process_id={process_id} must be in "
                         f"[0, num_processes={num_processes})")
    from mmjax.cpu_threads import reserve_cpu_threads

    reserve_cpu_threads(local_device_count or 1)  # before the CPU client starts
    import jax

    if local_device_count is not None:
        if local_device_count < 1:
            raise ValueError(f"initialize: local_device_count={local_device_count} must be >= 1")
        jax.config.update("jax_num_cpu_devices", int(local_device_count))
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address, num_processes=num_processes,
                               process_id=process_id,
                               heartbeat_timeout_seconds=heartbeat_timeout_seconds,
                               initialization_timeout=initialization_timeout)


def beat_to(path: str | None, every: float = 1.0) -> None:
    """Touch `path` every `every` s from a daemon thread: the launcher's sign of life of
    this process (a stopped or frozen process stops beating; scripts/launch_local.py)."""
    if not path:
        return
    import threading
    import time

    def beat():
        while True:
            with open(path, "a"):
                os.utime(path)
            time.sleep(every)
    threading.Thread(target=beat, name="mmjax-heartbeat", daemon=True).start()


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = []
    if "--" in argv:
        k = argv.index("--")
        argv, rest = argv[:k], argv[k + 1:]
    p = argparse.ArgumentParser(prog="python -m mmjax.launch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--coordinator", default=None,
                   help="HOST:PORT of process 0's coordinator (default: environment, SLURM)")
    p.add_argument("--num_processes", type=int, default=None)
    p.add_argument("--process_id", type=int, default=None)
    p.add_argument("--local_device_count", type=int, default=None,
                   help="CPU devices per process (jax_num_cpu_devices)")
    p.add_argument("--heartbeat_timeout_seconds", type=int, default=10)
    p.add_argument("--initialization_timeout", type=int, default=300,
                   help="seconds every process has to connect to the coordinator")
    p.add_argument("--script", default=os.path.join(REPO, "scripts", "train.py"),
                   help="Python script run in-process after initialisation (its __main__)")
    args = p.parse_args(argv)
    if not os.path.exists(args.script):
        sys.exit(f"error: --script={args.script!r} not found")
    try:
        c = cluster_settings(args.coordinator, args.num_processes, args.process_id)
    except (UserError, ValueError) as e:  # ValueError: a flag or variable that is no int
        sys.exit(f"error: {e}")
    beat_to(os.environ.get("MMJAX_HEARTBEAT_FILE"))
    initialize(c["coordinator"], c["num_processes"], c["process_id"],
               args.local_device_count, args.heartbeat_timeout_seconds,
               args.initialization_timeout)
    import jax

    sys.argv = [args.script] + rest
    code = 0
    try:
        runpy.run_path(args.script, run_name="__main__")
    except SystemExit as e:  # the script's own exit status
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 (report, then exit non-zero below)
        traceback.print_exc()
        code = 1
    if code == 0:
        jax.distributed.shutdown()
        return 0
    # A failed process must not wait in jax.distributed's shutdown barrier (at exit) for
    # peers that may be blocked on it: leave at once, the launcher stops the others.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
