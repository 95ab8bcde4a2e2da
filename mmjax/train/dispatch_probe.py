"""The host's CPU cost of dispatching one pipeline action, measured beside a benchmark's steps.

A pipelined step dispatches every action of its schedule from one thread (the runtime's
`run`); each action places its host inputs on its stage's devices (one `device_put`), moves
the previous stage's activation over from that stage's mesh (a `Broker` exchange) and calls
an already-compiled program on the stage's parameters as a flat list of arrays
(pipeline/flat_calls.py). `DispatchProbe` does the same with the same calls on tiny arrays,
so the devices' compute is negligible and what is timed is the dispatching thread's CPU
(`time.thread_time`) per action; a benchmark calls `sample()` after each timed step, as it does the device probes
(train/beside_profile.py), and the planner's shared-host time takes the median as the
profile field `action_host_cpu_s` (planner/shared_host.py).
"""
from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mmjax.data.routes import Routes
from mmjax.parallel.broker import Broker


class DispatchProbe:
    """Dispatches `actions` probe actions per sample between two meshes of `mesh_size`
    devices each; a probe action: `host_inputs` host arrays placed, one activation moved
    between the meshes, one compiled program called on `leaves` arrays (a stage's
    parameters, and in a backward its residuals and gradient accumulators)."""

    def __init__(self, leaves: int = 16, host_inputs: int = 4, mesh_size: int = 2,
                 actions: int = 32, devices=None):
        devices = list(devices or jax.devices())
        if len(devices) < 2 * mesh_size:
            raise ValueError(f"DispatchProbe: needs {2 * mesh_size} devices, found "
                             f"{len(devices)} (lower mesh_size)")
        if min(leaves, host_inputs, actions) < 1:
            raise ValueError(f"DispatchProbe: leaves={leaves}, host_inputs={host_inputs}, "
                             f"actions={actions}: must be >= 1")
        meshes = [Mesh(np.array(devices[k * mesh_size:(k + 1) * mesh_size]).reshape(
            mesh_size, 1), ("dp", "tp")) for k in range(2)]  # as a stage's mesh
        self.shardings = [NamedSharding(m, P("dp")) for m in meshes]
        self.params = [[jax.device_put(jnp.full((mesh_size, 8), 1.0 + i / leaves), s)
                        for i in range(leaves)]
                       for s in self.shardings]  # as the runtime calls a stage: flat leaves
        self.brokers = [Broker(meshes[1 - k], meshes[k]) for k in range(2)]  # into mesh k
        self.routes = Routes.identity(mesh_size)
        self.host = np.ones((mesh_size, 8), np.float32)
        self.program = jax.jit(lambda params, x, side: sum(params) * 1e-3 + x + sum(side))
        self.host_inputs = host_inputs
        self.actions = actions
        self.samples: list[float] = []
        self.sample()  # compile and warm; this sample is not kept
        self.samples = []

    def sample(self) -> float:
        """Dispatch one round of actions, alternating meshes; keep and return the
        dispatching thread's CPU seconds per action (the devices' work waited on after)."""
        x = jax.device_put(self.host, self.shardings[0])
        t0 = time.thread_time()
        for k in range(self.actions):
            m = (k + 1) % 2
            side = jax.device_put([self.host] * self.host_inputs,
                                  [self.shardings[m]] * self.host_inputs)
            x = self.program(self.params[m], self.brokers[m].transfer(x, self.routes), side)
        per_action = (time.thread_time() - t0) / self.actions
        jax.block_until_ready(x)
        self.samples.append(per_action)
        return per_action

    def action_host_cpu_s(self) -> float:
        """The median over samples of the dispatching thread's CPU seconds per action."""
        if not self.samples:
            raise ValueError("DispatchProbe: no sample taken (call sample() beside each "
                             "timed step)")
        return statistics.median(self.samples)
