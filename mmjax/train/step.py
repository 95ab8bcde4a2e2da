"""Single-program train step: loss, gradients of trainable parameters, optax update.

The state is train/state.py's `TrainState` with one stage (`WHOLE_MODEL`): the float32
trainable parameters (master weights), cast to `compute_dtype` inside the loss so gradients
flow back through the cast to the float32 copy, and their optimizer state. Frozen
parameters are a separate fixed input: no gradient, no optimizer state, never donated.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from mmjax.models.layers import cast_floats
from mmjax.models.lora import DROPOUT_SEED, dropout_key
from mmjax.parallel.zero import keep_if_nonfinite
from mmjax.train.state import WHOLE_MODEL, StageState, TrainState




def split_model(model, trainable_filter):
    """-> (graphdef, trainable params, everything else)."""
    return nnx.split(model, trainable_filter, ...)


def make_loss_fn(graphdef, compute_dtype=jnp.float32, attention_impl="auto",
                 llm_mask_family: str = "bam", route=None):
    """attention_impl: a `bam_attention` implementation, or a {unit: implementation} dict;
    llm_mask_family: `AssemblyLayout.llm_mask_family` of the batches; route: the model's
    encoder-outputs -> LLM hook (`MultimodalModel.__call__`)."""
    def loss_fn(trainable, frozen, batch):
        model = nnx.merge(graphdef, cast_floats(trainable, compute_dtype),
                          cast_floats(frozen, compute_dtype))
        if route is None:
            return model(batch, compute_dtype, attention_impl, llm_mask_family)
        return model(batch, compute_dtype, attention_impl, llm_mask_family, route)
    return loss_fn


def all_finite(tree) -> jax.Array:
    """True iff every element of every leaf is finite (a norm would overflow first)."""
    return jnp.all(jnp.stack([jnp.isfinite(x).all() for x in jax.tree.leaves(tree)] or
                             [jnp.array(True)]))


def make_train_step(graphdef, tx: optax.GradientTransformation, compute_dtype=jnp.float32,
                    attention_impl="auto", llm_mask_family: str = "bam", tx_at=None):
    """Jitted (state, frozen, batch[, limits]) -> (state, metrics), the state donated. A step whose loss, gradient norm or updated
    parameters are not finite is not applied (selected on device, no host sync);
    `metrics["nonfinite"]` is 1 for such a step, else 0; with `limits` = [max loss, max
    gradient norm] (the trainer's loss-spike guard) a finite step above either is not
    applied either (`metrics["spike"]` 1); `metrics["applied"]` says whether it was;
    `state.step` counts applied steps. `tx_at` (optimizer.py `rate_as_input`): the step
    takes the learning rate as a fifth input (`tx_at(lr)` updates), so its program does not
    depend on the schedule's horizon."""
    return jax.jit(train_step_fn(make_loss_fn(graphdef, compute_dtype, attention_impl,
                                              llm_mask_family), tx, tx_at=tx_at),
                   donate_argnums=(0,))


def train_step_fn(loss_fn, tx: optax.GradientTransformation, place_grads=None, tx_at=None):
    """The (state, frozen, batch, limits[, learning_rate]) -> (state, metrics) function
    `make_train_step` jits; `place_grads`: applied to the gradients before the update (the
    co-located runner's ZeRO-2/3 reduce-scatter as a sharding constraint); `tx_at`: with a
    `learning_rate` input, the update is `tx_at(learning_rate)`'s instead of `tx`'s."""
    def train_step(state: TrainState, frozen, batch, limits=None, learning_rate=None):
        old = state.stages[WHOLE_MODEL]
        with dropout_key(jax.random.fold_in(jax.random.key(DROPOUT_SEED), state.step)):
            (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(old.master, frozen,
                                                                           batch)
        if place_grads is not None:
            grads = place_grads(grads)
        norm = optax.tree.norm(grads)
        step_tx = tx if learning_rate is None or tx_at is None else tx_at(learning_rate)
        updates, opt_state = step_tx.update(grads, old.opt, old.master)
        trainable = optax.apply_updates(old.master, updates)
        finite = jnp.isfinite(loss) & jnp.isfinite(norm) & all_finite(trainable)
        # the loss-spike guard: `limits` = [max loss, max grad norm] (inf: off)
        calm = jnp.array(True) if limits is None else (loss <= limits[0]) & (norm <= limits[1])
        ok = finite & calm
        trainable, opt_state = keep_if_nonfinite(ok, (trainable, opt_state),
                                                 (old.master, old.opt))
        # `applied` is returned as is: an output keeps `ok` one materialised value. Consumed
        # only by the selects, XLA:CPU fuses its and-chain over every leaf's flag into each
        # leaf's select (HLO quadratic in the leaves; tests/test_nonfinite_guard.py)
        metrics = {"loss": loss, **aux, "grad_norm": norm,
                   "nonfinite": 1.0 - finite.astype(jnp.float32),
                   "spike": (finite & ~calm).astype(jnp.float32), "applied": ok}
        return TrainState({WHOLE_MODEL: StageState(trainable, opt_state)},
                          state.step + ok.astype(state.step.dtype)), metrics

    return train_step
