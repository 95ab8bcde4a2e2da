"""Graceful preemption: SIGTERM (a cluster's notice) and SIGINT (Ctrl-C) finish the step in
flight, write its checkpoint, say where the run will resume and exit with `EXIT_PREEMPTED`.

The handler only records the signal (so a save in progress is never cut: the step loop
looks at the flag between steps). In a multi-process run every process must stop after
the same step, though each may see its signal at another moment: the loop asks
`requested()` after every step, one all-gather of the flags, and all stop when any has one.
A second Ctrl-C stops at once (KeyboardInterrupt, no checkpoint). A signal during start-up
(restore, init) stops the run before its first step. The grace period a
cluster must give between SIGTERM and SIGKILL: one step plus one checkpoint save
(docs/design.md "Preemption").
"""
from __future__ import annotations

import os
import signal
import threading

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped on request with a checkpoint; rerun to resume


class Preempted(Exception):
    """Raised by the step loop after the checkpoint of `step` is committed."""

    def __init__(self, signame: str, step: int, resume: int | None, where: str):
        self.signame, self.step, self.resume, self.where = signame, step, resume, where
        at = f"step {resume} ({where})" if resume else "step 0 (no checkpoint yet)"
        done = f"after step {step}" if step else "before its first step"
        super().__init__(f"{signame}: stopped {done}; the run will resume from {at}: rerun "
                         f"the same command")


class Preemption:
    """Context manager: while active, SIGTERM / SIGINT only set `signame` (main thread
    only; elsewhere signals keep their handlers)."""

    def __init__(self, lead: bool = True):
        self.signame: str | None = None
        self.lead, self.step = lead, 0
        self._old: dict = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}
        return False

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.signame is not None:
            if signum == signal.SIGINT:  # a second Ctrl-C: stop now
                raise KeyboardInterrupt
            return  # a repeated SIGTERM changes nothing: the checkpoint is on its way
        self.signame = name
        if self.lead:  # os.write: safe inside a signal handler, unlike print
            again = " (Ctrl-C again: stop now, no checkpoint)" if signum == signal.SIGINT else ""
            os.write(2, f"{name}: finishing step {self.step + 1}, then a checkpoint at step "
                        f"{self.step + 1}; the run will resume from there{again}\n".encode())

    def requested(self) -> bool:
        """Whether any process got a signal (the same answer on every process)."""
        import jax

        if jax.process_count() == 1:
            return self.signame is not None
        from mmjax.train.checkpoint_integrity import all_processes

        return not all_processes(self.signame is None)
