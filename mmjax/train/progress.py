"""Honest progress for the trainer: a line when a compilation starts and when it ends (with
its seconds), one line per step (loss, step time, tokens/s, samples/s, ETA) and a final
summary. Plain lines on stderr that never wrap, so a log file or a pipe reads like the
terminal (no 80-column wrap, no bar redrawn into the file)."""
from __future__ import annotations

import time

from rich.console import Console


def console() -> Console:
    """stderr, no soft wrapping at the terminal width (or rich's 80 columns when piped)."""
    return Console(stderr=True, soft_wrap=True)


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class Progress:
    """Per-step report lines; `enabled` False prints nothing (train.progress=False)."""

    def __init__(self, out: Console, steps: int, start: int, global_batch: int,
                 enabled: bool = True):
        self.out, self.steps, self.start, self.global_batch = out, steps, start, global_batch
        self.enabled = enabled
        self.t0 = time.perf_counter()
        self.compile_s = 0.0
        self.step_times: list[float] = []  # steps that compiled nothing
        self.first_loss = self.last_loss = None
        # train/preemption.py's `Preemption`: told what compiles, so a Ctrl-C meanwhile
        # says the run stops once the compilation finishes
        self.preemption = None

    def say(self, text: str) -> None:
        if self.enabled:
            self.out.print(text, markup=False, highlight=False)

    def compiling(self, what: str) -> None:
        if self.preemption is not None:
            self.preemption.compiling = what
        self.say(f"compiling {what} ...")

    def compiled(self, what: str, seconds: float) -> None:
        if self.preemption is not None:
            self.preemption.compiling = None
        self.compile_s += seconds
        self.say(f"compiled {what} in {seconds:.1f} s")

    def step(self, rec: dict, compiled_in_step: bool) -> None:
        """`rec`: the trainer's metrics record; `compiled_in_step`: its time included a
        compilation (left out of the ETA)."""
        if not compiled_in_step:
            self.step_times.append(rec["step_time_s"] + rec.get("data_wait_s", 0.0))
        if self.first_loss is None:
            self.first_loss = rec["loss"]
        self.last_loss = rec["loss"]
        n, dt = rec["step"], rec["step_time_s"]
        left = self.steps - n
        if self.step_times:
            recent = self.step_times[-10:]
            eta = _clock(left * sum(recent) / len(recent))
        else:
            eta = "?"
        self.say(f"step {n}/{self.steps}  loss {rec['loss']:.4f}  step {dt:.2f} s"
                 f"{' (compiling)' if compiled_in_step else ''}  "
                 f"{rec['tokens_per_s']:,.0f} tokens/s  {self.global_batch / dt:.1f} samples/s"
                 f"  ETA {eta}")

    def summary(self, done: int) -> str:
        """One line: steps, wall time, compile time, loss first -> last, mean step."""
        wall = time.perf_counter() - self.t0
        mean = sum(self.step_times) / len(self.step_times) if self.step_times else float("nan")
        loss = ("" if self.first_loss is None
                else f", loss {self.first_loss:.4f} -> {self.last_loss:.4f}")
        return (f"{done} steps in {wall:.1f} s (compiling {self.compile_s:.1f} s, mean step "
                f"{mean:.2f} s){loss}")
