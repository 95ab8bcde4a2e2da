"""Count the XLA compilations inside a block (jax.monitoring's backend-compile events), so
the trainer can say when a program compiles after warm-up instead of stalling silently.
The listener is registered for the block only and removed after it."""
from __future__ import annotations

import threading

import jax

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileWatch:
    """`with CompileWatch() as w: ...` -> `w.count` programs compiled, `w.seconds` spent
    (every thread's: XLA may compile on a helper thread)."""

    def __init__(self):
        self.count, self.seconds = 0, 0.0
        self._lock = threading.Lock()

    def _listen(self, event: str, duration_secs: float, **_: str | int) -> None:
        if event == COMPILE_EVENT:
            with self._lock:
                self.count += 1
                self.seconds += duration_secs

    def __enter__(self) -> "CompileWatch":
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_duration_listener(self._listen)


def watched_step(runner, n: int, trace: bool, say, warm: bool, limits=None):
    """`runner.step()`'s StepMetrics (train/runner.py), its compilations counted: once
    `warm` (a step of this invocation has run), any compilation the runner did not announce
    itself is said on the console with its seconds and reason, and kept out of the ETA
    (`compile_s`). `limits`: the loss-spike guard's bounds for this step."""
    with CompileWatch() as w:
        kw = {"trace": True} if trace else {}
        if limits is not None:  # the spike guard's bounds (train/spike_guard.py)
            kw["limits"] = limits
        m = runner.step(**kw)
    m.compiled_programs = w.count
    if warm and w.count and not m.compile_s:
        m.compile_s = w.seconds
        say(f"step {n}: compiled {w.count} programs after warm-up in {w.seconds:.1f} s"
            f" ({m.compile_reason or 'programs not compiled before'})")
    return m
