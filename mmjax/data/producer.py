"""A preprocessing producer: a CPU process that builds global batches for trainers (no JAX).

DistTrain §4.2 disaggregates CPU preprocessing: producers on dedicated CPU processes or
hosts fetch, decode, resize and reorder each global batch and hand ready batches to the
trainers over RPC, so heavy image samples never compete with the training step.

    python -m mmjax.data.producer --listen=HOST:PORT [--cpus=2,3]

A producer holds no configuration of its own: a trainer connects (ZeroMQ DEALER -> this
ROUTER socket), sends `init` with the pickled batch function (the loader's
`GlobalBatchBuilder`, or its `samples` method for the single program) and then `get` requests
for the steps it wants from this producer; the producer answers each, in order, with
`fn(step)` (pickled). It computes only requested steps and the trainer bounds how many it
has outstanding (`data/producer_pool.py`), so neither side buffers without limit
(backpressure). Several trainers may share one producer (requests are served in arrival
order); a trainer that restarts sends a new `init` (a new session id) and stale requests of
its old session are dropped. Messages are pickles: run producers on a trusted network only.

Wire format (multipart frames): trainer -> producer `[b"init", sid, pickle(fn)]`,
`[b"get", sid, step]`; producer -> trainer `[b"ready", sid]`, `[b"batch", sid, step,
pickle(result), *buffers]` (pickle protocol 5: the arrays' bytes are separate frames, sent
and received without a copy; received arrays are writable views of the message),
`[b"error", sid, step, pickle(exception)]`.
"""
from __future__ import annotations

import argparse
import os
import pickle
import sys
import traceback
from collections import deque
from collections.abc import Callable
from typing import Any

READY_LINE = "mmjax producer listening on "


def endpoint(address: str) -> str:
    """HOST:PORT (or a full ZeroMQ endpoint) -> a tcp:// endpoint."""
    if "://" in address:
        return address
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"producer address {address!r}: use HOST:PORT, e.g. 10.0.0.5:5555")
    return f"tcp://{host}:{port}"


def _exception_payload(e: BaseException) -> bytes:
    try:
        return pickle.dumps(e, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # an exception holding something unpicklable: keep its text
        return pickle.dumps(RuntimeError("".join(traceback.format_exception(e))))


def serve(listen: str, cpus: list[int] | None = None, announce=print,
          parent_pid: int = 0) -> None:
    """Bind `listen` and serve trainers until killed (or, with `parent_pid`, until that
    process is gone: a local producer never outlives its trainer)."""
    import zmq

    if cpus:
        os.sched_setaffinity(0, set(cpus))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.SNDHWM, 0)  # bounded by the trainers' outstanding requests
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 10000)
    ep = endpoint(listen)
    if ep.endswith(":0"):  # a free port, reported on stdout (local producers)
        port = sock.bind_to_random_port(ep[:-2])
        ep = f"{ep[:-2]}:{port}"
    else:
        sock.bind(ep)
    announce(READY_LINE + ep, flush=True)
    sessions: dict[bytes, tuple[bytes, Callable[[int], Any]]] = {}
    pending: deque = deque()

    def receive(frames: list[bytes]) -> None:
        ident, kind, sid = frames[0], frames[1], frames[2]
        if kind == b"init":
            sessions[ident] = (sid, pickle.loads(frames[3]))
            sock.send_multipart([ident, b"ready", sid])
        elif kind == b"get" and sessions.get(ident, (None,))[0] == sid:
            pending.append((ident, sid, int(frames[3])))

    while True:
        if sock.poll(0 if pending else 1000):
            while True:
                try:
                    receive(sock.recv_multipart(zmq.NOBLOCK))
                except zmq.Again:
                    break
        if not pending:
            if parent_pid and os.getppid() != parent_pid:
                return
            continue
        ident, sid, step = pending.popleft()
        if sessions.get(ident, (None,))[0] != sid:
            continue  # the trainer re-initialised: the request is stale
        fn = sessions[ident][1]
        try:
            bufs: list = []  # the arrays' memory travels as frames of their own, uncopied
            out = pickle.dumps(fn(step), protocol=5, buffer_callback=bufs.append)
            sock.send_multipart([ident, b"batch", sid, b"%d" % step, out]
                                + [b.raw() for b in bufs], copy=False)
        except Exception as e:  # the trainer raises it, as the in-process loader would
            sock.send_multipart([ident, b"error", sid, b"%d" % step, _exception_payload(e)])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--listen", required=True,
                    help="HOST:PORT to serve on (PORT 0: a free port, printed on stdout)")
    ap.add_argument("--cpus", default="",
                    help="comma-separated CPU ids to pin this producer to (default: any)")
    ap.add_argument("--parent_pid", type=int, default=0,
                    help="exit when this process (the trainer that started it) is gone")
    a = ap.parse_args(argv)
    try:
        endpoint(a.listen)
        cpus = [int(c) for c in a.cpus.split(",") if c.strip()]
    except ValueError as e:
        print(f"error: --listen / --cpus: {e} (use --listen=HOST:PORT --cpus=2,3)",
              file=sys.stderr)
        return 2
    serve(a.listen, cpus, parent_pid=a.parent_pid)
    return 0


if __name__ == "__main__":
    sys.exit(main())
