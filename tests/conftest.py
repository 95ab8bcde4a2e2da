"""Test-session setup, before JAX initialises (subprocesses inherit the environment):

- 8 forced CPU devices, so sharding tests run anywhere;
- JAX's persistent compilation cache, with every program cached. Programs with the same HLO
  are then compiled once per machine, not once per test: the reference model shared by the
  parity tests, stage programs shared by plans, and everything the CLI subprocesses compile.
  `MMJAX_TEST_CACHE` moves it (default `~/.cache/mmjax/jax-tests`, at most 4 GiB); set it
  to an empty directory to time a cold run;
- two pytest-xdist workers (pyproject's addopts): the suite is mostly single-threaded XLA
  compilation and Python tracing, so two processes use both cores.
"""
import os

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
_cache = os.environ.get("MMJAX_TEST_CACHE",
                        os.path.join(os.path.expanduser("~"), ".cache", "mmjax", "jax-tests"))
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _cache)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# A size limit turns on the cache's file lock, so concurrent pytest workers and the CLI
# subprocesses never read an entry another process is still writing.
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(4 << 30))


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
