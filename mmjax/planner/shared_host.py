"""A pipelined plan's predicted step on one host's forced devices (no JAX): the CPU check of
the planner's time model (`scripts/bench_runtime.py`).

Two things differ from a GPU cluster, and both are priced from measurements:
- XLA's dense attention on the runtime's static shapes: every LLM row is `seq_len` tokens
  and every image its buffer's capacity (the "pad" layout), and each layer computes
  heads x S^2 pairs at the device's measured time per pair (`step_model.dense_attention_s`)
  instead of the real tokens' attention FLOPs, and the layers' elementwise passes at the
  measured streaming bandwidth (`elementwise.py`);
- the devices are threads sharing the host's cores: the step takes at least the device-
  seconds of compute of all devices together, times the cores one device keeps busy
  (measured), over the host's cores - the 1F1B schedule's makespan assumes every device
  has its own processor;
- one host thread dispatches every action of the schedule: each costs the measured host CPU
  per action (profile field `action_host_cpu_s`, train/dispatch_probe.py), on a core too.
"""
from __future__ import annotations

import dataclasses

from mmjax.models.units import is_llm
from mmjax.planner.costs import UnitCost
from mmjax.planner.elementwise import FORWARD_ACCESSES, accesses, elementwise_s
from mmjax.planner.evaluate import Choice
from mmjax.planner.schedule_time import schedule_time
from mmjax.planner.step_model import dense_attention_s, unit_seconds
from mmjax.planner.unit_work import ACT_BYTES
from mmjax.planner.workload import Workload


def padded_workload(wl: Workload, seq_len: int, caps: tuple[int, ...]) -> Workload:
    """`wl` as the pad layout's static shapes hold it: each sample one row of `seq_len`
    tokens, each image in the smallest buffer capacity of `caps` that holds it."""
    fit = lambda n: min((c for c in caps if c >= n), default=n)
    return dataclasses.replace(
        wl, llm_tokens=(seq_len,) * wl.num_samples,
        encoder_tokens={name: tuple(tuple(fit(n) for n in s) for s in per)
                        for name, per in wl.encoder_tokens.items()})


def dense_costs(model, wl: Workload, hw, costs: tuple[UnitCost, ...],
                act_bytes: int = ACT_BYTES, remat: dict | None = None) -> tuple[UnitCost, ...]:
    """`costs` (the planner's, on the padded workload `wl`, priced under the units' `remat`
    policies {unit: policy}) with each LLM and encoder unit's attention repriced as XLA's
    dense attention at the measured time per pair, and every unit's elementwise passes
    (`elementwise.py`, activations of `act_bytes` bytes) added, both split over tp like the
    rest of the layer; unchanged without a measured pair time."""
    if hw.dense_pair_s <= 0:
        return costs
    out = []
    for c in costs:
        r = (remat or {}).get(c.name, "none")
        delta = elementwise_s(model, wl, c.name, hw, r, act_bytes)
        fwd = delta * FORWARD_ACCESSES / accesses(2, r)
        sizes = ([(n,) for n in wl.llm_tokens] if is_llm(c.name)
                 else wl.encoder_tokens.get(c.name))
        if sizes:
            dense = sum(dense_attention_s(model, c.name, n, hw, remat=r) for s in sizes
                        for n in s)
            att = dense / len(sizes) - unit_seconds(model, wl, hw, c.name, r)[1]
            passes = 4 if r in ("dots", "full") else 3  # forward, backward, re-run forward
            delta, fwd = delta + att, fwd + att / passes
        out.append(dataclasses.replace(
            c, time_s={tp: t + delta / tp for tp, t in c.time_s.items()},
            fwd_s={tp: t + fwd / tp for tp, t in c.fwd_s.items()}))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class SharedHostTime:
    schedule_s: float  # the 1F1B makespan, each device on its own processor
    compute_s: float  # device-seconds of compute of all devices in one step
    cores_bound_s: float  # (compute_s x cores one device keeps busy + host_s) / the cores
    num_actions: int = 0  # forward and backward actions of the schedule in one step
    host_s: float = 0.0  # num_actions x the host CPU seconds of dispatching one action

    @property
    def step_s(self) -> float:
        return max(self.schedule_s, self.cores_bound_s, self.host_s)  # one thread dispatches

    @property
    def cpu_s(self) -> float:
        """CPU seconds of the step's process: every device's compute and the dispatching."""
        return self.compute_s + self.host_s


def schedule_actions(choices: dict[str, Choice], num_microbatches: int) -> int:
    """Actions one step dispatches: a forward and a backward per microbatch on every
    (virtual) pipeline stage of every unit (a stage's dp and tp ranks are one mesh)."""
    return 2 * num_microbatches * sum(c.pp * c.vpp for c in choices.values())


def shared_host_time(costs: tuple[UnitCost, ...], choices: dict[str, Choice],
                     global_batch: int, hw, cores: int, busy_cores: float,
                     action_host_s: float = 0.0, num_microbatches: int | None = None
                     ) -> SharedHostTime:
    """The step of `choices` on one host whose devices share `cores` cores, each device
    keeping `busy_cores` of them busy while it computes alone, one thread dispatching its
    actions at `action_host_s` CPU seconds each; `num_microbatches`: the runtime's (None:
    the planner's schedule's, global batch / LLM dp)."""
    sched = schedule_time(costs, choices, global_batch, hw)
    work = sum(global_batch * c.time_s[choices[c.name].tp] * choices[c.name].tp
               for c in costs)
    m = num_microbatches or global_batch // choices["llm"].dp
    actions = schedule_actions(choices, m)
    host = actions * action_host_s
    return SharedHostTime(sched, work, (work * min(busy_cores, cores) + host) / cores,
                          actions, host)
