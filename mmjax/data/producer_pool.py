"""The trainer's side of disaggregated preprocessing (DistTrain §4.2): an ordered iterator of
`fn(step)` for steps start, start+1, ... computed by producer processes (no JAX).

`local` producers are started on this host (`python -m mmjax.data.producer`, optionally pinned
to `cpus`); `addresses` are producers started elsewhere. Step s goes to the live producer
`live[s % len(live)]`. The pool keeps the steps [next, next + prefetch * producers) requested
and nothing beyond (backpressure: a slow trainer stops the producers after `prefetch` batches
each; a slow producer shows up as the trainer's data wait). Results are a pure function of
the step, so who computes a step never changes what the trainer receives:
- a local producer that dies is restarted and its outstanding steps re-requested;
- a remote producer whose connection drops (ZeroMQ socket monitor; heartbeats catch a host
  that vanishes) or that does not answer within `timeout` seconds is dropped and its steps
  reassigned to the others (to this process if none is left); if it comes back on the same
  address it is re-initialised and takes a share again;
- a new pool (a trainer restart, a resumed run) starts a new session on every producer.
"""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
import uuid
from typing import Any

from mmjax.data.producer import READY_LINE, endpoint


def _package_root() -> str:
    import mmjax.data
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(mmjax.data.__file__))))


def spawn_local(cpus: list[int] | None = None, wait_s: float = 120.0):
    """Start a producer process on 127.0.0.1 (free port) -> (Popen, endpoint)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([_package_root()] + [p for p in [
        env.get("PYTHONPATH")] if p])
    env.setdefault("JAX_PLATFORMS", "cpu")
    cmd = [sys.executable, "-m", "mmjax.data.producer", "--listen=127.0.0.1:0",
           f"--parent_pid={os.getpid()}"]
    if cpus:
        cmd.append("--cpus=" + ",".join(map(str, cpus)))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None  # stdout=PIPE
    assert proc.stdout is not None  # stdout=PIPE
    line = proc.stdout.readline()
    if not line.startswith(READY_LINE):
        proc.kill()
        raise RuntimeError(f"a local producer did not start (it printed {line!r}); run "
                           f"`python -m mmjax.data.producer --listen=127.0.0.1:0` to see why")
    return proc, line[len(READY_LINE):].strip()


class _Producer:
    def __init__(self, pool, ep: str, proc=None, name: str = ""):
        self.pool, self.ep, self.proc, self.name = pool, ep, proc, name or ep
        self.sid = b""
        self.ready = False
        self.alive = True
        self.outstanding: dict[int, float] = {}  # step -> time requested
        # zmq sockets once connect() ran (zmq is imported lazily, so typed loosely)
        self.sock: Any = None
        self.monitor: Any = None
        self.connect()

    def connect(self) -> None:
        import zmq

        self.close_sockets()
        self.sock = self.pool.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 10000)
        self.monitor = self.sock.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self.sock.connect(self.ep)
        self.init()

    def init(self) -> None:
        self.sid = uuid.uuid4().bytes[:8]
        self.ready, self.outstanding, self.t_init = False, {}, time.monotonic()
        self.sock.send_multipart([b"init", self.sid, self.pool.payload])

    def request(self, step: int) -> None:
        self.outstanding[step] = time.monotonic()
        self.sock.send_multipart([b"get", self.sid, b"%d" % step])

    def close_sockets(self) -> None:
        if self.sock is not None:
            self.sock.disable_monitor()
            self.monitor.close(linger=0)
            self.sock.close(linger=0)
            self.sock = self.monitor = None

    def stop(self) -> None:
        self.close_sockets()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class ProducerPool:
    """Iterator of fn(step), step = start, start + 1, ... < stop (see the module doc)."""

    def __init__(self, fn, start: int, stop: int, local: int = 0, addresses=(),
                 prefetch: int = 2, timeout: float = 300.0, cpus=()):
        import zmq

        if local < 0 or (local == 0 and not addresses):
            raise ValueError("ProducerPool: need local > 0 producers or some addresses")
        self.fn, self.next, self.stop_step = fn, start, stop
        self.prefetch, self.timeout, self.cpus = prefetch, timeout, list(cpus)
        self.payload = pickle.dumps(fn, protocol=pickle.HIGHEST_PROTOCOL)
        self.ctx = zmq.Context()
        self.results: dict[int, object] = {}
        self.restarts = 0
        self.reassigned = 0
        self.producers: list[_Producer] = []
        try:
            for i in range(local):
                proc, ep = spawn_local(self.cpus)
                self.producers.append(_Producer(self, ep, proc, f"local producer {i}"))
            for a in addresses:
                self.producers.append(_Producer(self, endpoint(a), None, f"producer {a}"))
        except BaseException:
            self.close()
            raise
        self.window = prefetch * len(self.producers)

    # ------------------------------------------------------------------ assignment

    def live(self) -> list[_Producer]:
        return [p for p in self.producers if p.alive]

    def owner(self, step: int):
        live = self.live()
        return live[step % len(live)] if live else None

    def positions(self) -> list[list[int]]:
        """Per producer, the steps it has been asked for and not yet delivered."""
        return [sorted(p.outstanding) for p in self.producers]

    def _fill(self) -> None:
        """Request every step of [next, next + window) not yet held or requested."""
        asked = {s for p in self.producers for s in p.outstanding}
        for s in range(self.next, min(self.next + self.window, self.stop_step)):
            if s in self.results or s in asked:
                continue
            p = self.owner(s)
            if p is None:  # nobody left: this process computes it (same result)
                self.results[s] = self.fn(s)
            else:
                p.request(s)

    # ------------------------------------------------------------------ health

    def _lost(self, p: _Producer, why: str) -> None:
        """Restart a local producer; drop a remote one and reassign its steps."""
        steps = sorted(p.outstanding)
        if p.proc is not None:
            p.stop()
            p.proc, p.ep = spawn_local(self.cpus)
            p.connect()
            self.restarts += 1
            for s in steps:
                p.request(s)
            return
        p.alive, p.outstanding = False, {}
        self.reassigned += len(steps)
        print(f"warning: {p.name}: {why}; its steps {steps} go to the other producers",
              file=sys.stderr, flush=True)

    def _check(self) -> None:
        import zmq
        from zmq.utils.monitor import recv_monitor_message

        now = time.monotonic()
        for p in self.producers:
            if p.proc is not None and p.proc.poll() is not None:
                self._lost(p, f"exited with code {p.proc.returncode}")
                continue
            while True:
                try:
                    ev = recv_monitor_message(p.monitor, zmq.NOBLOCK)
                except zmq.Again:
                    break
                if ev["event"] == zmq.EVENT_DISCONNECTED and p.alive and p.proc is None:
                    self._lost(p, "connection lost")
                elif ev["event"] == zmq.EVENT_CONNECTED and not p.alive:
                    p.alive = True  # it came back: a new session, then a share again
                    p.init()
            if p.alive and p.proc is None:
                oldest = min(p.outstanding.values(), default=None)
                waiting = oldest if p.ready else (p.t_init if p.outstanding else None)
                if waiting is not None and now - waiting > self.timeout:
                    self._lost(p, f"no answer in {self.timeout:.0f} s")

    # ------------------------------------------------------------------ receiving

    def _receive(self, p: _Producer, frames) -> None:
        kind, sid = frames[0].bytes, frames[1].bytes
        if sid != p.sid:
            return  # an earlier session's answer
        if kind == b"ready":
            p.ready = True
            return
        step = int(frames[2].bytes)
        p.outstanding.pop(step, None)
        if kind == b"error":
            raise pickle.loads(frames[3].bytes)
        if step >= self.next and step not in self.results:  # zero-copy: arrays view frames
            self.results[step] = pickle.loads(frames[3].buffer,
                                              buffers=[f.buffer for f in frames[4:]])

    def __iter__(self):
        return self

    def __next__(self):
        import zmq

        if self.next >= self.stop_step:
            raise StopIteration
        while self.next not in self.results:
            self._fill()
            if self.next in self.results:
                break
            poller = zmq.Poller()
            for p in self.producers:
                poller.register(p.sock, zmq.POLLIN)
            for sock, _ in poller.poll(200):
                p = next(q for q in self.producers if q.sock is sock)
                while True:
                    try:
                        self._receive(p, sock.recv_multipart(zmq.NOBLOCK, copy=False))
                    except zmq.Again:
                        break
            self._check()
        out = self.results.pop(self.next)
        self.next += 1
        self._fill()
        return out

    def close(self) -> None:
        for p in self.producers:
            p.stop()
        self.producers = []
        self.ctx.term()
