"""train/beside_profile.py: the probes timed beside a benchmark's steps, and the profile
made of their medians (formulas on the recorded samples, no wall-clock assertions)."""
import statistics

import pytest

from mmjax.train.beside_profile import ProbeSet, half_width


@pytest.mark.parametrize("h", [0.0, 40.0, 384.0])
def test_half_width_recovers_the_curve(h):
    peak = 1e11
    rates = {w: peak * w / (w + h) for w in (32, 64, 128, 256)}
    assert half_width(peak, rates) == pytest.approx(h, abs=1e-6)


def test_half_width_is_never_negative():
    assert half_width(1e9, {32: 2e9, 64: 3e9}) == 0.0


@pytest.fixture(scope="module")
def probes():
    p = ProbeSet(sides=(64, 128), stream_bytes=1 << 16, widths=(16, 32), rows=64)
    assert p.samples == {}  # the compile-and-warm sample is not kept
    for _ in range(3):
        p.sample()
    return p


@pytest.mark.parametrize("basis", ["wall", "cpu"])
def test_profile_is_the_medians(probes, basis):
    prof = probes.profile(basis)
    tail = "" if basis == "wall" else "_cpu"
    med = lambda k: statistics.median(probes.samples[k + tail])
    assert prof["basis"] == basis and prof["measured_beside_steps"] == 3
    assert prof["matmul_peak_flops"]["float32"] == pytest.approx(
        max(2 * 64 ** 3 / med("matmul64"), 2 * 128 ** 3 / med("matmul128")))
    assert prof["memory_bw"] == pytest.approx(2 * (1 << 16) / med("stream"))
    assert prof["dense_attention_pair_s"] == pytest.approx(med("attention") / probes.pairs)
    rates = {w: 2 * 64 * w * 2 * w / med(f"narrow{w}") for w in (16, 32)}
    assert prof["matmul_half_width"] == pytest.approx(
        half_width(prof["matmul_peak_flops"]["float32"], rates))
    assert prof["device_busy_cores"] == pytest.approx(
        statistics.median(probes.samples["attention_cpu"])
        / statistics.median(probes.samples["attention"]))


def test_profile_needs_samples_and_a_known_basis():
    p = ProbeSet(sides=(32,), stream_bytes=1 << 12, widths=(8,), rows=16)
    with pytest.raises(ValueError, match="no sample"):
        p.profile()
    p.sample()
    with pytest.raises(ValueError, match="'wall' or 'cpu'"):
        p.profile("gpu")
