"""optax AdamW with linear warmup + cosine decay and global-norm clipping.

Only trainable parameters get optimizer state; frozen modules have none (Cornstarch §3 frozen
status; DistTrain §8.3.1 frozen settings). `OptimizerSettings` is what gin binds; the single
program trainer chains clipping and AdamW, the pipeline trainer (one ZeRO-1 optimizer per
stage) clips every stage with the norm over all stages' gradients, so both match.
"""
from __future__ import annotations

from dataclasses import dataclass

import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax


@gin.configurable
def learning_rate_schedule(total_steps: int, peak_lr: float = 1e-3, warmup_steps: int = 5,
                           min_lr_ratio: float = 0.1):
    if total_steps < 1:
        raise ValueError(f"total_steps={total_steps} must be >= 1")
    warmup_steps = min(warmup_steps, max(total_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0 if warmup_steps else peak_lr, peak_value=peak_lr,
        warmup_steps=warmup_steps, decay_steps=max(total_steps, warmup_steps + 1),
        end_value=peak_lr * min_lr_ratio)


def learning_rate_table(schedule, steps: int) -> np.ndarray:
    """`schedule` at steps 0 .. steps-1 as one host array (one small program, run once)."""
    return np.asarray(jax.jit(jax.vmap(schedule))(jnp.arange(max(steps, 1))), np.float64)


@gin.configurable
@dataclass(frozen=True)
class OptimizerSettings:
    weight_decay: float = 0.01
    clip_norm: float = 1.0  # 0 disables clipping
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8


def make_optimizer(schedule, weight_decay: float = 0.01, clip_norm: float = 1.0,
                   b1: float = 0.9, b2: float = 0.95, eps: float = 1e-8):
    """chain(clip_by_global_norm, adamw); clip_norm=0 leaves clipping out."""
    parts = [optax.clip_by_global_norm(clip_norm)] if clip_norm else []
    parts.append(optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay))
    return optax.chain(*parts)


def optimizer_from_settings(schedule, s: OptimizerSettings | None = None, clip: bool = True):
    s = s or OptimizerSettings()
    return make_optimizer(schedule, s.weight_decay, s.clip_norm if clip else 0, s.b1, s.b2, s.eps)


def rate_as_input(schedule, settings: OptimizerSettings | None = None, clip: bool = True):
    """For a step program that does not depend on the run's length: (`tx_at`, `rate_at`),
    `tx_at(lr)` the settings' optimizer at learning rate `lr` (a traced scalar, the step's
    input), its state the same as `optimizer_from_settings(schedule)`'s, and `rate_at(count)`
    the schedule's rate after `count` applied updates (np.float32, one small jitted program):
    what `schedule(count)` gives inside the step. The schedule's horizon (train.steps) is
    then no constant of the step, so runs of other lengths share its compiled program.
    A constant `schedule` (a float): (None, None), the rate stays in the program.
    `settings` / `clip`: as `optimizer_from_settings`'s."""
    if not callable(schedule):
        return None, None
    s = settings or OptimizerSettings()
    at = jax.jit(schedule)
    return (lambda lr: optimizer_from_settings(lambda _count: lr, s, clip),
            lambda count: np.float32(at(np.int32(count))))


def applied_updates(opt_state) -> int:
    """The updates an optimizer state has applied: its schedule's count (0 without one)."""
    for leaf in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(
            x, optax.ScaleByScheduleState)):
        if isinstance(leaf, optax.ScaleByScheduleState):
            count = leaf.count
            if isinstance(count, jax.Array):
                count = count.addressable_data(0)
            return int(np.asarray(count))
    return 0

