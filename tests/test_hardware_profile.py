"""The measured device profile (planner/hardware_profile.py): efficiencies from the timed
points by the layer's FLOP formula, log-bilinear interpolation clamped to the grid, the cost
model pricing a layer by it, plan.py taking the profile's own device, and the committed H100
profile covering its grid."""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from mmjax.errors import UserError
from mmjax.planner.costs import work_time
from mmjax.planner.unit_work import Work
from mmjax.planner.hardware import H100, hardware_of_device
from mmjax.planner.hardware_profile import (HardwareProfile, is_hardware_profile, layer_dims,
                                            layer_flops)

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
PEAK = 1e15


def _profile(times: dict) -> dict:
    """A profile JSON from {(kind, width, tokens): fwd+bwd seconds} (bwd = 2 fwd)."""
    return {"device": "NVIDIA H100 80GB HBM3", "points": [
        {"kind": k, "width": w, "tokens": n, "fwd_s": t / 3, "bwd_s": 2 * t / 3}
        for (k, w, n), t in times.items()]}


def test_layer_flops_counts_the_generic_layer():
    # gated, width 256: ffn 3.5 x 256 = 896, heads 2 of 128; 4 d^2 projections, 3 d f MLP,
    # causal core 2 n^2 d (half of q.k and p.v's 4 n^2 d)
    assert layer_dims("gated_causal", 256) == (896, 2)
    assert layer_flops("gated_causal", 256, 100) == 2 * 100 * (4 * 256**2 + 3 * 256 * 896) \
        + 2 * 100**2 * 256
    assert layer_dims("gelu_full", 256) == (1024, 4)
    assert layer_flops("gelu_full", 256, 100) == 2 * 100 * (4 * 256**2 + 2 * 256 * 1024) \
        + 4 * 100**2 * 256
    with pytest.raises(ValueError, match="gated_causal"):
        layer_dims("moe", 256)


def test_efficiency_at_points_interpolated_and_clamped():
    eff = {(1024, 512): 0.2, (1024, 4096): 0.4, (4096, 512): 0.5, (4096, 4096): 0.8}
    times = {("gated_causal", w, n): 3 * layer_flops("gated_causal", w, n) / e / PEAK
             for (w, n), e in eff.items()}
    p = HardwareProfile.from_json(_profile(times), PEAK)
    for (w, n), e in eff.items():
        assert math.isclose(p.efficiency("gated_causal", w, n), e, rel_tol=1e-12)
    # the log-midpoint of both axes is the mean of the four corners
    assert math.isclose(p.efficiency("gated_causal", 2048, math.sqrt(512 * 4096)),
                        np.mean(list(eff.values())), rel_tol=1e-12)
    # along one axis, log-linear: a quarter of the way in log width
    w = 1024 * 4 ** 0.25
    assert math.isclose(p.efficiency("gated_causal", w, 512), 0.2 + 0.25 * 0.3, rel_tol=1e-12)
    # clamped, never extrapolated
    assert math.isclose(p.efficiency("gated_causal", 64, 10), 0.2, rel_tol=1e-12)
    assert math.isclose(p.efficiency("gated_causal", 1e6, 1e6), 0.8, rel_tol=1e-12)


def test_an_incomplete_grid_is_refused():
    times = {("gelu_full", 1024, 512): 1.0, ("gelu_full", 1024, 4096): 1.0,
             ("gelu_full", 4096, 512): 1.0}
    with pytest.raises(UserError, match="full width x tokens grid"):
        HardwareProfile.from_json(_profile(times), PEAK)
    with pytest.raises(UserError, match="no 'points'"):
        HardwareProfile.from_json({"device": "x"}, PEAK)


def test_work_time_prices_by_the_profile_at_the_call_tokens():
    times = {(k, w, n): 3 * layer_flops(k, w, n) / e / H100.peak_flops
             for k, e in (("gated_causal", 0.5), ("gelu_full", 0.25))
             for w in (512, 8192) for n in (256, 16384)}
    p = HardwareProfile.from_json(_profile(times), H100.peak_flops)
    w = Work(flops=1e12, width=2048, allreduce_bytes=0.0, act_bytes=0.0, in_bytes=0.0, bwd=2,
             tokens=1000, kind="gated_causal")
    fwd, bwd = work_time(w, 1, H100.with_profile(p, call_tokens=4096))
    assert math.isclose(fwd, 1e12 / (0.5 * H100.peak_flops), rel_tol=1e-9)
    assert math.isclose(bwd, 2 * fwd, rel_tol=1e-9)
    gelu = Work(1e12, 2048, 0.0, 0.0, 0.0, 2, tokens=1000, kind="gelu_full")
    assert math.isclose(work_time(gelu, 1, H100.with_profile(p))[0],
                        1e12 / (0.25 * H100.peak_flops), rel_tol=1e-9)
    # without a profile the assumed curve prices it
    assert math.isclose(work_time(w, 1, H100)[0],
                        1e12 / (H100.peak_flops * H100.efficiency(2048)), rel_tol=1e-12)


def test_the_committed_h100_profile_covers_its_grid():
    path = os.path.join(ROOT, "configs", "hardware", "h100.json")
    assert is_hardware_profile(path)
    assert hardware_of_device(json.load(open(path))["device"]).name == "H100"
    p = HardwareProfile.load(path, H100.peak_flops)
    assert set(p.efficiency_grid) == {"gated_causal", "gelu_full"}
    grid = np.asarray(p.efficiency_grid["gated_causal"])
    assert grid.shape == (len(p.widths), len(p.tokens)) and ((grid > 0) & (grid < 1)).all()
    # wider layers and longer sequences run closer to peak on this device
    assert (np.diff(grid[:, -1]) > 0).all() and (np.diff(grid[-2]) > 0).all()


def test_plan_cli_takes_the_profiles_device(tmp_path):
    def plan(*extra):
        return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "plan.py"),
                               "--gin_file=configs/cornstarch/valm_ss.gin", "--gpus=24",
                               "--global_batch=24", *extra],
                              capture_output=True, text=True, cwd=ROOT)
    prof = "--profile=configs/hardware/h100.json"
    r = plan(prof, f"--json={tmp_path / 'p.json'}")
    assert r.returncode == 0, r.stderr
    assert "profiled: NVIDIA H100" in r.stdout
    r = plan(prof, "--hardware=a800")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("error: --hardware=a800 but --profile")
