"""Accelerator specs used by the analytic cost model (DistTrain §5.1: communication time is
volume / bandwidth; compute time is FLOPs / achieved throughput).

Bandwidths are per GPU and unidirectional, in bytes/s. `nic_bw` is the node's scale-out
bandwidth divided by its GPUs (A800 nodes in DistTrain §8: 4x200 Gb/s RoCE, 300 GB/s bidirectional
NVLink; H100 nodes in OrchMLLM §8: 8x400 Gb/s InfiniBand, 900 GB/s bidirectional NVLink).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from mmjax.errors import UserError

if TYPE_CHECKING:
    from mmjax.planner.hardware_profile import HardwareProfile


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float  # dense bf16 FLOP/s per GPU
    hbm_bytes: float  # usable memory per GPU
    nvlink_bw: float  # intra-node, per GPU, one direction
    nic_bw: float  # inter-node, per GPU, one direction
    gpus_per_node: int = 8
    max_efficiency: float = 0.75  # best achieved fraction of peak for wide matmuls
    # achieved HBM bandwidth (bytes read + written per second) of memory-bound kernels
    hbm_bw: float = 2.0e12
    half_width: float = 384.0  # per-GPU hidden width at which efficiency is half of the best
    # a measured HardwareProfile (planner/hardware_profile.py) replacing the assumed curve,
    # read at max(the piece's tokens per sample, call_tokens): the tokens one layer call
    # runs together (a microbatch's packed rows), which set the matmuls' M dimension
    profile: HardwareProfile | None = field(default=None, compare=False, repr=False)
    call_tokens: float = 0.0
    # XLA's dense attention, forward + backward, seconds per (query, key, head) pair at head
    # dim `dense_pair_head_dim` (measured: train/device_measure.py; 0: not measured)
    dense_pair_s: float = 0.0
    dense_pair_head_dim: int = 16

    def efficiency(self, local_width: float, tokens: float = 0.0,
                   kind: str = "gelu_full") -> float:
        """Achieved fraction of peak for a layer whose per-GPU hidden width is `local_width`:
        narrow (ViT-sized or heavily tensor-split) layers run far below peak (DistTrain §2.2).
        With a measured profile: its efficiency at this width and token count."""
        if self.profile is not None:
            return self.profile.efficiency(kind, local_width, max(tokens, self.call_tokens))
        return self.max_efficiency * local_width / (local_width + self.half_width)

    def with_profile(self, profile, call_tokens: float = 0.0) -> "Hardware":
        """This hardware priced by a measured `HardwareProfile` (its peak stays this one's:
        the profile's efficiencies are fractions of it)."""
        return replace(self, name=f"{self.name} (profiled: {profile.device})", profile=profile,
                       call_tokens=call_tokens)

    def group_bw(self, group_span: int) -> float:
        """Bandwidth of a collective over `group_span` consecutive GPUs."""
        return self.nvlink_bw if group_span <= self.gpus_per_node else self.nic_bw


GB = 1e9
A800 = Hardware("A800", peak_flops=312e12, hbm_bytes=80 * GB, nvlink_bw=150e9,
                nic_bw=4 * 200e9 / 8 / 8)
# H100 / H200 HBM: a device-to-device copy measured 3.0 / 4.3 TB/s (read + written)
H100 = Hardware("H100", peak_flops=989e12, hbm_bytes=80 * GB, nvlink_bw=450e9,
                nic_bw=8 * 400e9 / 8 / 8, hbm_bw=3.0e12)
H200 = Hardware("H200", peak_flops=989e12, hbm_bytes=141 * GB, nvlink_bw=450e9,
                nic_bw=8 * 400e9 / 8 / 8, hbm_bw=4.3e12)
HARDWARE = {"a800": A800, "h100": H100, "h200": H200}


def hardware(name: str) -> Hardware:
    key = name.lower()
    if key not in HARDWARE:
        raise UserError(f"unknown hardware {name!r}; choose one of {sorted(HARDWARE)}")
    return HARDWARE[key]


# device kind (as jax names it, upper-cased) -> spec; A100s price as A800s (same chip)
DEVICE_KINDS = (("H200", H200), ("H100", H100), ("A800", A800), ("A100", A800))


def hardware_of_device(device_kind: str) -> Hardware | None:
    """The spec of a device by its kind string ("NVIDIA H100 80GB HBM3"), None if unknown."""
    kind = device_kind.upper()
    return next((hw for key, hw in DEVICE_KINDS if key in kind), None)
