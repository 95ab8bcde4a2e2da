"""What this machine's devices achieve, measured (DistTrain §3: "profile, then orchestrate"):
the dense matmul peak per dtype, the memory bandwidth of a streaming kernel, and the
all-reduce bus bandwidth over every device present (on a CPU, the devices
`--xla_force_host_platform_device_count` forces). The JSON section it returns is what
`planner/measured_hardware.py` turns into the `Hardware` a CPU (or any) run is priced with,
so MFU and predicted step times are against what the device measured, not a GPU's spec.
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mmjax.planner.profile import best_time

# square matmul sides and streamed bytes: the GPU's are large enough to reach its peak,
# the CPU's finish in about a second on two cores
MATMUL_SIDES = {"gpu": (4096, 8192), "cpu": (512, 1024)}
STREAM_BYTES = {"gpu": 1 << 30, "cpu": 1 << 26}
COLLECTIVE_BYTES = {"gpu": 1 << 28, "cpu": 1 << 24}
DENSE_HEAD_DIM = 16  # the head dim dense attention's per-pair time is measured at


def matmul_peak(device, dtype, sides=(512, 1024), repeats: int = 5) -> float:
    """Best FLOP/s of an n x n x n matmul (2 n^3 FLOPs) over `sides`, on `device`."""
    mm = jax.jit(lambda a, b: a @ b)
    best = 0.0
    for n in sides:
        a = jax.device_put(jnp.ones((n, n), dtype), device)
        best = max(best, 2.0 * n ** 3 / best_time(mm, a, a, repeats=repeats))
    return best


def memory_bandwidth(device, nbytes: int = 1 << 26, repeats: int = 5) -> float:
    """Bytes read + written per second by an elementwise pass over `nbytes` of float32
    (the quantity `Hardware.hbm_bw` is)."""
    x = jax.device_put(jnp.ones((nbytes // 4,), jnp.float32), device)
    t = best_time(jax.jit(lambda v: v * 1.5 + 1.0), x, repeats=repeats)
    return 2.0 * x.size * 4 / t


def collective_bandwidth(devices, nbytes: int = 1 << 24, repeats: int = 5) -> float | None:
    """All-reduce bus bandwidth over `devices` (bytes per device per second, one direction:
    the ring's 2 (n - 1) / n x bytes / time, what `Hardware.nvlink_bw` is); None for one
    device."""
    n = len(devices)
    if n < 2:
        return None
    mesh = Mesh(np.array(devices), ("d",))
    per = nbytes // 4
    x = jax.device_put(jnp.ones((n, per), jnp.float32), NamedSharding(mesh, P("d")))
    allreduce = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "d"), mesh=mesh,
                                      in_specs=P("d"), out_specs=P("d")))
    t = best_time(allreduce, x, repeats=repeats)
    return 2.0 * (n - 1) / n * per * 4 / t


def dense_attention_grad(device, seq: int = 256, heads: int = 4,
                         head_dim: int = DENSE_HEAD_DIM, rows: int = 4):
    """(jitted forward + backward of XLA's dense attention, its arguments, the (query, key,
    head) pairs one call computes): models/attention.py `bam_attention` as the models call
    it (the bitfield mask built per pair from each row's token metadata, float32 logits;
    one causal text document per row), at the tiny models' layers' size."""
    from mmjax.models.attention import bam_attention
    from mmjax.models.attention_mask import TokenMeta

    x = jax.device_put(jnp.ones((rows, seq, heads, head_dim), jnp.float32), device)
    ones = jnp.ones((rows, seq), jnp.int32)
    meta = jax.device_put(TokenMeta(ones, ones, 0 * ones,
                                    jnp.broadcast_to(jnp.arange(seq), (rows, seq))), device)
    grad = jax.jit(jax.grad(
        lambda q, k, v, m: bam_attention(q, k, v, m, implementation="dense").sum(),
        argnums=(0, 1, 2)))
    return grad, (x, x, x, meta), rows * heads * seq * seq


def dense_attention_pair_s(device, repeats: int = 5) -> float:
    """Seconds per (query, key, head) pair of XLA's dense attention forward + backward: it
    computes and keeps every pair of the [S, S] matrix per head, so its time goes with
    heads x S^2, not with FLOPs (planner/step_model.py prices dense units with it)."""
    grad, args, pairs = dense_attention_grad(device)
    # milliseconds a call: many repeats, so a loaded machine's stalls do not set it
    return best_time(grad, *args, repeats=4 * repeats) / pairs


def busy_cores(device, calls: int = 20) -> float:
    """Cores one device keeps busy while it computes alone: process CPU seconds per call of
    a dense attention step (the tiny models' layers' size) over its fastest wall time (CPU
    seconds do not grow when other processes take the cores; wall time does) - how much of
    the host one forced CPU device takes (planner/shared_host.py)."""
    import time

    grad, args, _ = dense_attention_grad(device)
    jax.block_until_ready(grad(*args))
    best, cpu = float("inf"), 0.0
    for _ in range(calls):
        wall0, cpu0 = time.perf_counter(), time.process_time()
        jax.block_until_ready(grad(*args))
        best = min(best, time.perf_counter() - wall0)
        cpu += time.process_time() - cpu0
    return cpu / calls / best


def measure_device(devices=None, dtypes=("float32", "bfloat16"), repeats: int = 5,
                   sides=None, stream_bytes: int | None = None,
                   collective_bytes: int | None = None) -> dict:
    """The measured section of a hardware profile for `devices` (default: all present):
    {"device", "platform", "device_count", "matmul_peak_flops": {dtype: FLOP/s},
    "memory_bw", "collective_bw", "memory_bytes", "dense_attention_pair_s",
    "dense_attention_head_dim", "cpu_cores", "device_busy_cores"}."""
    devices = list(devices or jax.devices())
    dev = devices[0]
    kind = "gpu" if dev.platform == "gpu" else "cpu"
    stats = dev.memory_stats() or {}
    memory = stats.get("bytes_limit")
    if memory is None and dev.platform == "cpu":
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "device": str(dev.device_kind), "platform": dev.platform,
        "device_count": len(devices),
        "matmul_peak_flops": {d: matmul_peak(dev, jnp.dtype(d), sides or MATMUL_SIDES[kind],
                                             repeats) for d in dtypes},
        "memory_bw": memory_bandwidth(dev, stream_bytes or STREAM_BYTES[kind], repeats),
        "collective_bw": collective_bandwidth(devices,
                                              collective_bytes or COLLECTIVE_BYTES[kind],
                                              repeats),
        "memory_bytes": memory,
        "dense_attention_pair_s": dense_attention_pair_s(dev, repeats=repeats),
        "dense_attention_head_dim": DENSE_HEAD_DIM,
        "cpu_cores": len(os.sched_getaffinity(0)),
        "device_busy_cores": busy_cores(dev),
    }
