"""Per-action timing of one pipeline step: the runtime's tracing modes.

A trace is a list of {stage, kind, microbatch, chunk, start, end, virtual_stage} (seconds,
host clock), the format `scripts/timeline.py` renders and `SimResult.trace()` emits; `stage`
is the physical stage (its sub-mesh), `virtual_stage` the model chunk's stage id.

- "serial": wait for every action before dispatching the next. Each action runs alone,
  so its [start, end] is its isolated cost (what cost tables and the simulator want), but
  the step is serialised and shows no overlap between stages.
- "overlap": dispatch stays asynchronous. One waiter thread per sub-mesh blocks on each
  action's outputs in dispatch order and stamps its completion; an action starts at the
  later of its dispatch and the previous completion on its mesh (a device runs its work in
  dispatch order). The timeline shows stages running concurrently, as they do untraced.
"""
from __future__ import annotations

import queue
import threading
import time

import jax

MODES = ("serial", "overlap")


def trace_mode(trace) -> str | None:
    """`run(trace=...)`: False/None -> no trace, True -> "serial", or a name in MODES."""
    if trace is False or trace is None:
        return None
    if trace is True:
        return "serial"
    if trace not in MODES:
        raise ValueError(f"trace={trace!r}: use False, True (= 'serial') or one of {MODES}")
    return trace


def completion_marker(tree):
    """Arrays whose readiness means the action finished, safe to wait on later: outputs
    that a later call may donate (accumulated gradients) are represented by a one-element
    slice taken now, which runs after the action on the same devices."""
    return jax.tree.map(lambda a: a.reshape(-1)[:1] if a.ndim else a + 0, tree)


class SerialTracer:
    def __init__(self):
        self.records: list[dict] = []

    def start(self) -> float:
        return time.perf_counter()

    def done(self, group: str, entry: dict, t0: float, outputs) -> None:
        if outputs is not None:
            jax.block_until_ready(outputs)
        self.records.append({**entry, "start": t0, "end": time.perf_counter()})

    def finish(self) -> list[dict]:
        return self.records


class OverlapTracer:
    def __init__(self):
        self.records: list[dict] = []
        self.queues: dict[str, queue.Queue] = {}
        self.threads: list[threading.Thread] = []
        self.errors: list[BaseException] = []

    def start(self) -> float:
        return time.perf_counter()

    def _wait_loop(self, q: queue.Queue) -> None:
        last_end = 0.0
        while True:
            item = q.get()
            if item is None:
                return
            record, t_dispatch, outputs = item
            try:
                if outputs is not None:
                    jax.block_until_ready(outputs)
            except BaseException as e:  # reported by finish(), never lost in the thread
                self.errors.append(e)
            end = time.perf_counter()
            record["start"] = max(t_dispatch, min(last_end, end))
            record["end"] = last_end = end

    def done(self, group: str, entry: dict, t0: float, outputs) -> None:
        if group not in self.queues:
            q = self.queues[group] = queue.Queue()
            t = threading.Thread(target=self._wait_loop, args=(q,), daemon=True)
            t.start()
            self.threads.append(t)
        record = dict(entry)
        self.records.append(record)
        self.queues[group].put((record, t0, outputs))

    def finish(self) -> list[dict]:
        for q in self.queues.values():
            q.put(None)
        for t in self.threads:
            t.join()
        if self.errors:
            raise RuntimeError("a traced action failed on its devices") from self.errors[0]
        return self.records


def make_tracer(mode: str | None):
    if mode is None:
        return None
    return SerialTracer() if mode == "serial" else OverlapTracer()
