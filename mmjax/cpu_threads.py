"""XLA:CPU's thread pool sized for the devices one process simulates.

XLA:CPU runs every device's program on one shared intra-op pool, as many threads as cores
by default, and a collective holds its thread until every participant arrives. A program
whose collectives are not all in one data-dependent chain (a layer scan gathering one
encoder's ZeRO-3 weights beside another encoder's all-to-all, in the co-located layout) can
then have some devices' threads waiting in one collective while the devices they wait for
need a free thread to reach it: with 8 forced devices on 2 cores this deadlocked until
XLA's 40 s rendezvous timeout aborted the process. At 2·devices + 1 threads every device can
hold one thread in a collective and one in a loop body with one to spare (on a 2-core
machine with 8 devices: 4 threads still deadlock, 9 do not). XLA reads the size from
`NPROC` when the CPU client starts, so this must run before anything touches a backend.
"""
from __future__ import annotations

import os
import re

_FORCED = re.compile(r"--xla_force_host_platform_device_count=(\d+)")


def forced_device_count(xla_flags: str) -> int | None:
    """The CPU device count `--xla_force_host_platform_device_count` asks for, if any."""
    m = _FORCED.findall(xla_flags or "")
    return int(m[-1]) if m else None


def pool_threads(devices: int, cores: int) -> int:
    """Intra-op threads a process with `devices` CPU devices needs on `cores` cores."""
    return max(cores, 2 * devices + 1)


def reserve_cpu_threads(devices: int | None = None, env=None) -> int | None:
    """Set `NPROC` so XLA:CPU's pool fits `devices` (default: the forced count in
    XLA_FLAGS) when the machine's cores do not; a `NPROC` already set is the user's and
    stays. -> the value set, or None when nothing was changed."""
    env = os.environ if env is None else env
    if "NPROC" in env:
        return None
    if devices is None:
        devices = forced_device_count(env.get("XLA_FLAGS", ""))
    cores = os.cpu_count() or 1
    if devices is None or pool_threads(devices, cores) <= cores:
        return None
    env["NPROC"] = str(pool_threads(devices, cores))
    return int(env["NPROC"])


def force_cpu_devices(count: int, env=None) -> None:
    """XLA_FLAGS asks the CPU platform for `count` devices unless it already names a count
    (scripts that show sharding on any machine), and the pool is sized for them."""
    env = os.environ if env is None else env
    flags = env.get("XLA_FLAGS", "")
    if forced_device_count(flags) is None:
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()
    reserve_cpu_threads(env=env)
