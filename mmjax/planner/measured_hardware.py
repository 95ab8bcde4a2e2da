"""The `Hardware` of a measured device (no JAX): a hardware profile's measured section
(`train/device_measure.py`, written by scripts/profile_hardware.py) priced as the cost
model's spec, so a run on a CPU is priced by the CPU it ran on, never by an H100's numbers.

Peak = the best matmul FLOP/s measured in the run's dtype, and it is 100% of the curve
(`max_efficiency` 1: what the best matmul achieved is the most a layer can); memory and
collective bandwidths are the measured ones (one collective bandwidth inside and across
"nodes": the measured devices are one node). A known GPU keeps its spec's fields the
profile does not measure (its nodes' NIC bandwidth, GPUs per node). With the profile's layer
points (`HardwareProfile`), layers are priced at their measured efficiency of that peak.
"""
from __future__ import annotations

from dataclasses import replace

from mmjax.errors import UserError
from mmjax.planner.hardware import Hardware, hardware_of_device
from mmjax.planner.hardware_profile import DEFAULT_CALL_TOKENS, HardwareProfile


def has_measurement(profile: dict) -> bool:
    """Whether a profile JSON carries the device's measured peak (profile_hardware.py since
    issue 40; older ones hold only the layer points)."""
    return bool(profile.get("matmul_peak_flops"))


def measured_peak(profile: dict, dtype: str) -> float:
    peaks = profile["matmul_peak_flops"]
    if dtype not in peaks:
        raise UserError(f"the hardware profile of {profile.get('device')!r} measured the "
                        f"matmul peak in {sorted(peaks)}, not {dtype} (re-run "
                        f"scripts/profile_hardware.py)")
    return float(peaks[dtype])


def check_device(profile: dict, device_kind: str, path: str = "the profile") -> None:
    """A profile prices only the device it was measured on."""
    if str(profile.get("device")) != device_kind:
        raise UserError(f"{path} was measured on {profile.get('device')!r}, this run is on "
                        f"{device_kind!r} (measure this device: python "
                        f"scripts/profile_hardware.py --out FILE)")


def hardware_from_profile(profile: dict, dtype: str = "bfloat16",
                          call_tokens: float = DEFAULT_CALL_TOKENS) -> Hardware:
    """The cost model's spec of the device `profile` measured, for a run in `dtype`."""
    spec = hardware_of_device(str(profile.get("device", "")))
    if has_measurement(profile):
        peak = measured_peak(profile, dtype)
        base = spec or Hardware("?", peak, 0.0, 0.0, 0.0)
        coll = profile.get("collective_bw") or base.nvlink_bw or profile["memory_bw"]
        hw = replace(base, name=f"measured {profile['device']}", peak_flops=peak,
                     max_efficiency=1.0, hbm_bw=float(profile["memory_bw"]),
                     hbm_bytes=float(profile.get("memory_bytes") or base.hbm_bytes),
                     nvlink_bw=float(coll), nic_bw=float(base.nic_bw if spec else coll),
                     gpus_per_node=base.gpus_per_node if spec else
                     int(profile.get("device_count", 1)),
                     dense_pair_s=float(profile.get("dense_attention_pair_s") or 0.0),
                     dense_pair_head_dim=int(profile.get("dense_attention_head_dim") or 16))
        if profile.get("matmul_half_width") is not None:  # measured: narrow matmuls' rates
            hw = replace(hw, half_width=float(profile["matmul_half_width"]))
    elif spec is not None:  # layer points only, on a known GPU: its spec's peak
        hw = spec
    else:
        raise UserError(f"the hardware profile of {profile.get('device')!r} has no measured "
                        f"peak (re-run scripts/profile_hardware.py on that device)")
    if profile.get("points"):
        hw = hw.with_profile(HardwareProfile.from_json(profile, hw.peak_flops), call_tokens)
    return hw
