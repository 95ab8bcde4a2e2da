"""train/dispatch_probe.py: the host CPU of dispatching one pipeline action, sampled beside a
benchmark's steps (no wall-clock assertions: what is kept and how it is summarised)."""
import statistics

import jax
import pytest

from mmjax.train.dispatch_probe import DispatchProbe


@pytest.fixture(scope="module")
def probe():
    p = DispatchProbe(leaves=4, host_inputs=2, actions=6)
    assert p.samples == []  # the compile-and-warm sample is not kept
    for _ in range(3):
        p.sample()
    return p


def test_one_sample_per_call_and_the_median_per_action(probe):
    assert len(probe.samples) == 3 and all(s > 0 for s in probe.samples)
    assert probe.action_host_cpu_s() == statistics.median(probe.samples)


def test_the_actions_alternate_between_two_disjoint_meshes(probe):
    a, b = (set(s.mesh.devices.flat) for s in probe.shardings)
    assert len(a) == len(b) == 2 and not a & b
    assert set(jax.devices()[:4]) == a | b


def test_errors_say_what_to_change():
    with pytest.raises(ValueError, match="lower mesh_size"):
        DispatchProbe(mesh_size=len(jax.devices()))
    with pytest.raises(ValueError, match="must be >= 1"):
        DispatchProbe(leaves=0)
    empty = DispatchProbe(leaves=1, host_inputs=1, actions=1)
    with pytest.raises(ValueError, match="no sample taken"):
        empty.action_host_cpu_s()
