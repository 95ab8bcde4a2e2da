"""XLA:CPU's pool sized for forced devices (mmjax/cpu_threads.py): the arithmetic, the
user's NPROC kept, and the deadlock it prevents (an 8-device co-located ZeRO-3 encoder-tp
step on a 2-thread pool aborts at XLA's rendezvous timeout; tests/test_colocated_encoder_tp
runs the same programs under the test session's pool)."""
import os

from mmjax.cpu_threads import (force_cpu_devices, forced_device_count, pool_threads,
                               reserve_cpu_threads)


def test_forced_count_is_read_from_xla_flags_last_one_wins():
    assert forced_device_count("") is None
    assert forced_device_count("--xla_cpu_foo=1") is None
    assert forced_device_count("--xla_force_host_platform_device_count=8") == 8
    assert forced_device_count("--xla_force_host_platform_device_count=2 "
                               "--a=1 --xla_force_host_platform_device_count=4") == 4


def test_pool_holds_two_threads_per_device_and_one_spare():
    assert pool_threads(8, 2) == 17
    assert pool_threads(1, 2) == 3
    assert pool_threads(2, 64) == 64  # a big host already has enough


def test_nproc_set_only_when_the_cores_are_too_few_and_never_over_the_users():
    cores = os.cpu_count() or 1
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    got = reserve_cpu_threads(env=env)
    if cores >= 17:
        assert got is None and "NPROC" not in env
    else:
        assert got == 17 and env["NPROC"] == "17"
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "NPROC": "3"}
    assert reserve_cpu_threads(env=env) is None and env["NPROC"] == "3"
    env = {}
    assert reserve_cpu_threads(env=env) is None and env == {}  # one device: nothing to do
    env = {}
    reserve_cpu_threads(cores, env=env)  # explicit count (jax.distributed's local devices)
    assert env["NPROC"] == str(2 * cores + 1)


def test_force_cpu_devices_keeps_a_count_already_given():
    env = {"XLA_FLAGS": "--xla_cpu_foo=1"}
    force_cpu_devices(8, env=env)
    assert env["XLA_FLAGS"] == "--xla_cpu_foo=1 --xla_force_host_platform_device_count=8"
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    force_cpu_devices(8, env=env)
    assert forced_device_count(env["XLA_FLAGS"]) == 2
    cores = os.cpu_count() or 1
    assert env.get("NPROC") == (None if cores >= 5 else "5")


def test_the_test_session_runs_with_the_pool_it_needs():
    """conftest sizes the pool for its 8 forced devices (inherited by every subprocess)."""
    cores = os.cpu_count() or 1
    if pool_threads(8, cores) > cores:
        assert int(os.environ["NPROC"]) >= 17
