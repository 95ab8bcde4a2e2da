"""Graceful preemption: SIGTERM (a cluster's notice) and SIGINT (Ctrl-C) finish the step in
flight, write its checkpoint, say where the run will resume and exit with `EXIT_PREEMPTED`.

The handler only records the signal (so a save in progress is never cut: the step loop
looks at the flag between steps). In a multi-process run every process must stop after
the same step, though each may see its signal at another moment: the loop asks
`requested()` after every step, one all-gather of the flags, and all stop when any has one.
A second Ctrl-C stops at once (one line, exit 130, no checkpoint), even inside a
compilation. A signal during start-up (compilation, restore, init) stops the run before
its first step. The grace period a
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


EXIT_INTERRUPTED = 130  # 128 + SIGINT: the second Ctrl-C, stopped at once


def stop_at_once() -> None:
    """The second Ctrl-C: one line and exit 130 now, from any thread and whatever the main
    thread is doing (an XLA compilation holds it for minutes; `os._exit` leaves no
    interpreter shutdown racing the runtime's threads: no traceback, no crash). No
    checkpoint of the step in flight; the last committed one stands."""
    os.write(2, b"SIGINT again: stopped at once, without a checkpoint of this step; rerun "
                b"the same command to resume from the last checkpoint\n")
    os._exit(EXIT_INTERRUPTED)


class Preemption:
    """Context manager: while active, SIGTERM / SIGINT only set `signame` (main thread
    only; elsewhere signals keep their handlers). The signals are also seen at once by a
    watcher thread (`signal.set_wakeup_fd`), since Python runs a handler only when the main
    thread next runs Python code, minutes later during a compilation: the watcher says
    what the run will do (`compiling`: what is compiling, set by the trainer's progress) and
    on a second SIGINT calls `stop_now` (`stop_at_once`)."""

    def __init__(self, lead: bool = True, stop_now=stop_at_once):
        self.signame: str | None = None
        self.lead, self.step = lead, 0
        self.compiling: str | None = None
        self.starting = True  # restoring / building, before the loop's first step
        self.stop_now = stop_now
        self._old: dict = {}
        self._fds = self._old_fd = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._handle)
            r, w = os.pipe()
            os.set_blocking(w, False)
            self._old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
            self._fds = (r, w)
            threading.Thread(target=self._watch, args=(r,), name="mmjax-signals",
                             daemon=True).start()
        return self

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}
        if self._fds is not None:
            signal.set_wakeup_fd(self._old_fd)
            os.close(self._fds[1])  # the watcher reads end-of-file and returns
            self._fds = None
        return False

    def _handle(self, signum, frame) -> None:
        """Python's handler (main thread, when it next runs Python): the flag only."""
        if self.signame is None:
            self.signame = signal.Signals(signum).name

    def _watch(self, fd: int) -> None:
        """The watcher thread: each byte on `fd` is a signal's number, written by the C
        handler the moment it arrives."""
        try:
            while byte := os.read(fd, 1):
                self._arrived(byte[0])
        finally:
            os.close(fd)

    def _arrived(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self.signame is not None and self._said:
            if signum == signal.SIGINT:  # a second Ctrl-C: stop now
                self.stop_now()
            return  # a repeated SIGTERM changes nothing: the checkpoint is on its way
        self.signame = self.signame or name
        self._said = True
        if self.lead:  # os.write: no lock shared with the main thread's prints
            again = " (Ctrl-C again: stop now, no checkpoint)" if signum == signal.SIGINT else ""
            n = self.step + 1
            if self.starting:
                what = (f"{name}: stopping before the first step, once start-up (restore, "
                        f"init) finishes")
            elif self.compiling:
                what = (f"{name}: stopping after the compilation in progress ({self.compiling})"
                        f" finishes (XLA's compile cannot be cut short; the program is then "
                        f"cached for the rerun), then step {n} and its checkpoint")
            else:
                what = (f"{name}: finishing step {n}, then a checkpoint at step {n}; the run "
                        f"will resume from there")
            os.write(2, f"{what}{again}\n".encode())

    _said = False  # the watcher has answered a first signal

    def requested(self) -> bool:
        """Whether any process got a signal (the same answer on every process)."""
        import jax

        if jax.process_count() == 1:
            return self.signame is not None
        from mmjax.train.checkpoint_integrity import all_processes

        return not all_processes(self.signame is None)
