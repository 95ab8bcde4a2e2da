"""The processes of a multi-process run meet here before their first collective.

The first cross-process collective on CPU creates gloo's context (every process's
`connectFullMesh` through the coordination service's key-value store), and gloo gives that
rendezvous a fixed 30 s deadline (its context default; XLA exposes no setting for it). On a
loaded machine one process may still be estimating memory or compiling 30 s after another
reached the checkpointer's first barrier (orbax's `sync_global_processes`, a collective:
jax's `sync_global_devices`, an all-gather): it then died with
`Gloo context initialization failed: DEADLINE_EXCEEDED: GetKeyValue() timed out`. So the
processes first meet at a barrier of the coordination service itself (jax.distributed's
client, through orbax's public `multihost.get_barrier_sync_fn`), whose timeout is ours
(`train.startup_timeout`), and reach the collective together.
"""
from __future__ import annotations

DEFAULT_TIMEOUT_S = 600.0  # minutes of skew on a machine loaded many times over


class StartupTimeout(RuntimeError):
    """A peer did not reach the start-up barrier in time (one line: which, how long, what
    to raise)."""


def meet_peers(name: str, timeout_s: float) -> None:
    """Block until every process of the run reaches barrier `name` (once per run and name),
    at most `timeout_s` seconds; nothing with one process."""
    import jax

    if jax.process_count() == 1:
        return
    import orbax.checkpoint as ocp

    sync = ocp.multihost.get_barrier_sync_fn()
    try:
        sync(key=f"mmjax_{name}", timeout_ms=int(timeout_s * 1000))
    except Exception as e:  # noqa: BLE001 (the coordination service's DEADLINE_EXCEEDED)
        first = (str(e).splitlines() or [type(e).__name__])[0][:200]
        raise StartupTimeout(
            f"process {jax.process_index()} waited {timeout_s:g} s at the start-up barrier "
            f"({name}) and not every process arrived ({first}); on a loaded machine raise "
            f"train.startup_timeout, else see the other processes' output") from None
