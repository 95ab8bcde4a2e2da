"""A device profile measured beside a benchmark's steps, under the steps' own conditions.

On a shared host (other processes take the cores) a profile measured a minute earlier
describes another machine: the step and the probes must see the same load. `ProbeSet`
compiles `train/device_measure.py`'s probes once (the matmul peak, the streaming memory
bandwidth, XLA's dense attention per (query, key, head) pair) and `sample()` times each of
them once; a benchmark calls it after every timed step, so probes and steps interleave.
`profile()` is the measured section of a hardware profile (`measure_device`'s keys) from
the probes' medians (the steps' statistic too), with the cores one device keeps busy as
the dense attention probe's process CPU seconds over its wall seconds.
"""
from __future__ import annotations

import os
import statistics
import time

import jax
import jax.numpy as jnp

from mmjax.train.device_measure import (DENSE_HEAD_DIM, MATMUL_SIDES, STREAM_BYTES,
                                        dense_attention_grad)


def _timed(fn, *args) -> tuple[float, float]:
    """(wall, process CPU) seconds of one call of `fn(*args)`."""
    wall0, cpu0 = time.perf_counter(), time.process_time()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - wall0, time.process_time() - cpu0


# widths of the narrow matmuls ([rows, w] x [w, 2 w]) whose rates set the efficiency curve
WIDTHS = (32, 64, 128, 256)


def half_width(peak: float, rates: dict) -> float:
    """The `Hardware.half_width` h of the curve rate(w) = peak w / (w + h) that fits the
    measured {width: FLOP/s} best: 1 / rate = (1 + h / w) / peak is linear in 1 / w, and h is
    its least-squares slope through the intercept 1 / peak (0 when every rate reaches peak)."""
    xs = [1.0 / w for w in rates]
    ys = [peak / r - 1.0 for r in rates.values()]
    return max(0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs))


class ProbeSet:
    """The device probes, compiled at construction, timed once per `sample()`."""

    def __init__(self, device=None, dtype: str = "float32", sides=None,
                 stream_bytes: int | None = None, widths=WIDTHS, rows: int = 2048):
        self.device = device or jax.devices()[0]
        kind = "gpu" if self.device.platform == "gpu" else "cpu"
        self.dtype = str(jnp.dtype(dtype))
        mm = jax.jit(lambda a, b: a @ b)
        self.matmuls = {n: (mm, jax.device_put(jnp.ones((n, n), dtype), self.device))
                        for n in (sides or MATMUL_SIDES[kind])}
        self.narrow = {w: (2.0 * rows * w * 2 * w, jax.device_put(jnp.ones((rows, w), dtype),
                                                                    self.device),
                           jax.device_put(jnp.ones((w, 2 * w), dtype), self.device))
                       for w in widths}
        self.stream = jax.device_put(
            jnp.ones(((stream_bytes or STREAM_BYTES[kind]) // 4,), jnp.float32), self.device)
        self.stream_fn = jax.jit(lambda v: v * 1.5 + 1.0)
        self.attention, self.attention_args, self.pairs = dense_attention_grad(self.device)
        self.samples: dict[str, list] = {}
        self.sample()  # compile and warm every probe; this sample is not kept
        self.samples = {}

    def sample(self) -> None:
        """Time every probe once (wall and process CPU seconds)."""
        for n, (fn, a) in self.matmuls.items():
            self._keep(f"matmul{n}", _timed(fn, a, a))
        for w, (_, x, y) in self.narrow.items():
            self._keep(f"narrow{w}", _timed(self.matmuls[next(iter(self.matmuls))][0], x, y))
        self._keep("stream", _timed(self.stream_fn, self.stream))
        self._keep("attention", _timed(self.attention, *self.attention_args))

    def _keep(self, name: str, wall_cpu: tuple[float, float]) -> None:
        self.samples.setdefault(name, []).append(wall_cpu[0])
        self.samples.setdefault(name + "_cpu", []).append(wall_cpu[1])

    def profile(self, basis: str = "wall") -> dict:
        """The measured section of a hardware profile from the probes' medians: rates per
        wall second ("wall": what the device did under the host's load) or per second of
        this process's CPU time ("cpu": the work itself, whatever share of the cores the
        process got; it prices a step's CPU time)."""
        if basis not in ("wall", "cpu"):
            raise ValueError(f"basis={basis!r}: 'wall' or 'cpu'")
        if not self.samples:
            raise ValueError("ProbeSet.profile(): no sample taken (call sample() beside "
                             "each timed step)")
        tail = "" if basis == "wall" else "_cpu"
        med = {k: statistics.median(self.samples[k + tail])
               for k in self.samples if not k.endswith("_cpu")}
        stats = self.device.memory_stats() or {}
        memory = stats.get("bytes_limit")
        if memory is None and self.device.platform == "cpu":
            memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        peak = max(2.0 * n ** 3 / med[f"matmul{n}"] for n in self.matmuls)
        rates = {w: flops / med[f"narrow{w}"] for w, (flops, _, _) in self.narrow.items()}
        busy = (statistics.median(self.samples["attention_cpu"])
                / statistics.median(self.samples["attention"]))
        return {
            "device": str(self.device.device_kind), "platform": self.device.platform,
            "device_count": len(jax.devices()), "basis": basis,
            "matmul_peak_flops": {self.dtype: peak},
            "matmul_half_width": half_width(peak, rates),
            "memory_bw": 2.0 * self.stream.size * 4 / med["stream"],
            "collective_bw": None, "memory_bytes": memory,
            "dense_attention_pair_s": med["attention"] / self.pairs,
            "dense_attention_head_dim": DENSE_HEAD_DIM,
            "cpu_cores": len(os.sched_getaffinity(0)),
            "device_busy_cores": busy,
            "probe_samples": self.samples,
            "measured_beside_steps": len(self.samples["stream"]),
        }
