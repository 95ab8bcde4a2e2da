"""Async orbax checkpoints: train state (params, optimizer state, step) + data-iterator state.

The state pytree is saved by its flattened leaves ("leaf_00000", ...) and restored into the
tree structure of a freshly built state, so any pytree (nnx.State, optax namedtuples) round
trips without orbax needing to know its types. The manager keeps the newest `max_to_keep`
checkpoints; an interrupted save never replaces a finished one (orbax commits atomically).
"""
from __future__ import annotations

import os

import jax
import numpy as np
import orbax.checkpoint as ocp


class Checkpointer:
    def __init__(self, directory: str, max_to_keep: int = 3, async_save: bool = True):
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep,
                                               enable_async_checkpointing=async_save)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state, data_state: dict) -> None:
        leaves = jax.tree.leaves(state)
        tree = {f"leaf_{i:05d}": leaf for i, leaf in enumerate(leaves)}
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(tree), data=ocp.args.JsonSave(data_state)))

    def restore(self, step: int, like):
        """Restore into the structure (and shardings) of `like`; -> (state, data_state)."""
        leaves, treedef = jax.tree.flatten(like)
        abstract = {f"leaf_{i:05d}": ocp.utils.to_shape_dtype_struct(x) if hasattr(x, "sharding")
                    else np.asarray(x) for i, x in enumerate(leaves)}
        out = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore()))
        restored = [out["state"][f"leaf_{i:05d}"] for i in range(len(leaves))]
        return jax.tree.unflatten(treedef, restored), dict(out["data"])

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
