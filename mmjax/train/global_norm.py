"""The pipelined step's global gradient norm and its one skip signal.

Each trained stage's gradient sync (`Zero1Optimizer.sync`) gives per-device sums of squares;
the norm over ALL stages is formed from them (so every stage clips by the factor one
optimizer over the whole model would use), and the step's loss terms are folded into it:
one scalar that is not finite tells every stage's update to skip.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def fold_loss(norm, loss_terms, max_loss=np.inf, max_norm=np.inf):
    """norm + 0 * sum(loss terms) on the norm's device: equal to `norm` when the loss is
    finite (and the loss and norm within the spike guard's limits), NaN when it is not, so
    one scalar tells every stage's update to skip."""
    dev = list(norm.devices())[0]
    total = sum((jnp.sum(jax.device_put(t, dev)) for t in loss_terms),
                jnp.zeros((), jnp.float32))
    # one compiled program whatever the limits: the guard switching on after warm-up
    # (infinite limits becoming finite) compiles nothing mid-run
    return _guarded(norm, total, np.float32(max_loss), np.float32(max_norm))


@jax.jit
def _guarded(norm, total, max_loss, max_norm):
    calm = (total <= max_loss) & (norm <= max_norm)  # False for NaN: NaN either way
    return jnp.where(calm, norm + 0.0 * total, jnp.nan)


def norm_from_squares(squares, device=None):
    """sqrt of the sum of every stage's per-device squares (`Zero1Optimizer.sync`), each
    vector copied to one device and summed there in stage order: no collective program."""
    device = jax.local_devices()[0] if device is None else device
    total = jax.device_put(jnp.zeros((), jnp.float32), device)
    for sq in squares:
        if sq is not None:
            total = total + jnp.sum(jax.device_put(sq, device))
    return jnp.sqrt(total)


def multiprocess_norm(squares) -> float:
    """`norm_from_squares` when stages sit in different processes (None: a stage with no
    device here): each process adds the elements it holds, one `process_allgather` sums
    the contributions per stage, then every process adds the stages in order in float32."""
    from jax.experimental import multihost_utils

    mine = np.zeros(len(squares), np.float32)
    for k, sq in enumerate(squares):
        if sq is not None:
            sq = jax.block_until_ready(sq)
            mine[k] = sum(float(np.sum(np.asarray(sh.data))) for sh in sq.addressable_shards
                          if sh.replica_id == 0)
    per_stage = np.asarray(multihost_utils.process_allgather(mine)).sum(axis=0)
    total = np.float32(0)
    for v in per_stage:
        total = np.float32(total + v)
    return float(np.sqrt(total))
