"""Test-session setup, before JAX initialises (subprocesses inherit the environment):

- 8 forced CPU devices, so sharding tests run anywhere;
- JAX's persistent compilation cache, with every program cached. Programs with the same HLO
  are then compiled once per machine, not once per test: the reference model shared by the
  parity tests, stage programs shared by plans, and everything the CLI subprocesses compile.
  `MMJAX_TEST_CACHE` moves it (default `~/.cache/mmjax/jax-tests`); set it to an empty
  directory to time a cold run. It is kept under 4 GiB here, oldest entries first, once per
  session: JAX's own size limit (`JAX_COMPILATION_CACHE_MAX_SIZE`) lists and stats the whole
  directory under a lock on every write, quadratic in the entries (0.7 ms CPU per write
  at 6,800 entries, seconds of wall time on a loaded machine), both workers waiting on it.
  Without it, a worker that reads an entry another process is still writing gets a
  decompression error, which JAX reports as a warning and recompiles;
- XLA:CPU compiles with LLVM at -O0, without its expensive passes and with its legacy
  elemental emitters instead of the MLIR fusion emitters (where this XLA has the flag):
  test programs are tiny and run a few times, so compile time is most of their cost (a
  tiny MLLM's gradient: 14.8 -> 8.0 s CPU at -O0, -> 3 s without the fusion emitters;
  the same loss to the bit);
- with `MMJAX_TEST_IN_ORDER_COLLECTIVES=1`, XLA:CPU's concurrency-optimised HLO scheduler
  off (where this XLA has the flag). With it on, a device may enter a program's independent
  collectives in another order than its peers (hybrid ZeRO-3 groups: an all-gather within a
  group beside an all-reduce across groups), and with 8 devices on 2 cores the rendezvous
  then deadlocks until XLA's 40 s timeout aborts the worker. The tests that execute hybrid
  groups in a pipeline stage rerun themselves in a child process with it
  (`in_order_collectives` in tests/helpers.py); the rest of the suite keeps XLA's default
  scheduler, whose memory the planner's memory model is checked against (docs/testing.md);
- two pytest-xdist workers (pyproject's addopts): the suite is mostly single-threaded XLA
  compilation and Python tracing, so two processes use both cores.
"""
import os
import subprocess
import sys

import pytest

from mmjax.cpu_threads import reserve_cpu_threads  # imports no JAX

NO_FUSION_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
IN_ORDER_COLLECTIVES = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def _xla_accepts(flag: str) -> bool:
    """Whether this jaxlib's XLA knows `flag` (XLA aborts the process on an unknown flag, so
    a child process asks; about 1 s CPU, once per session)."""
    env = {**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"}
    probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return probe.returncode == 0


os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags += " --xla_force_host_platform_device_count=8"
if os.environ["JAX_PLATFORMS"] == "cpu" and "xla_backend_optimization_level" not in _flags:
    _flags += " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    if _xla_accepts(NO_FUSION_EMITTERS):  # decided once: the workers inherit XLA_FLAGS
        _flags += " " + NO_FUSION_EMITTERS
if os.environ.get("MMJAX_TEST_IN_ORDER_COLLECTIVES") == "1" and \
        "concurrency_optimized_scheduler" not in _flags:
    if _xla_accepts(IN_ORDER_COLLECTIVES):
        _flags += " " + IN_ORDER_COLLECTIVES
os.environ["XLA_FLAGS"] = _flags.strip()
reserve_cpu_threads(env=os.environ)  # XLA:CPU's pool fits the 8 devices (mmjax/cpu_threads.py)
_cache = os.environ.get("MMJAX_TEST_CACHE",
                        os.path.join(os.path.expanduser("~"), ".cache", "mmjax", "jax-tests"))
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _cache)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
CACHE_LIMIT = 4 << 30


def _prune_cache(path: str, limit: int) -> None:
    """Delete the least recently written entries until the cache holds <= `limit` bytes."""
    if not os.path.isdir(path):
        return
    entries = []
    for e in os.scandir(path):
        try:
            st = e.stat()
        except FileNotFoundError:
            continue
        entries.append((st.st_mtime, st.st_size, e.path))
    total = sum(size for _, size, _ in entries)
    for _, size, name in sorted(entries):
        if total <= limit:
            break
        try:
            os.remove(name)
        except FileNotFoundError:
            pass
        total -= size


if not os.environ.get("PYTEST_XDIST_WORKER"):  # once, in the controlling process
    _prune_cache(os.environ["JAX_COMPILATION_CACHE_DIR"], CACHE_LIMIT)


@pytest.fixture
def gloo_jobs(tmp_path_factory):
    """Held by a test that starts a multi-process (gloo) job: one such job at a time across
    the xdist workers. Gloo gives a peer 30 s to reach each collective; two jobs compiling
    at once on a 2-core machine can exceed that."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    shared = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root
    with FileLock(str(shared / "gloo_jobs.lock")):
        yield


@pytest.fixture(scope="session")
def reference_cache():
    """Reference (single-device) losses and gradients, computed once per session and key."""
    return {}
