"""The single program's placement: the whole model's step on one device, the parity
reference (train/placement.py `Placement`; the runner is train/whole_model.py). It reads the
global batches every plan reads (train/single_data.py: the pipeline path's loader over a
real source, `loader_source.path`, or the synthetic set), whole.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

from mmjax.data.batch_shapes import BatchShapes, grow_shapes
from mmjax.models.mllm import MultimodalModel
from mmjax.parallel.sharded_init import init_states
from mmjax.train.inputs import model_inputs
from mmjax.train.memory_check import check_single_program
from mmjax.train.state import WHOLE_MODEL, TrainState, whole_model_state
from mmjax.train.step import make_train_step


def round_counts(shapes: BatchShapes, multiple: int) -> BatchShapes:
    """Rows, encoder buffer counts and generated images rounded up to `multiple` (padding),
    so a data-parallel split over that many ranks is even."""
    up = lambda n: -(-n // multiple) * multiple
    return BatchShapes(up(shapes.rows), tuple((n, up(c), k) for n, c, k in shapes.encoders),
                       up(shapes.gen) if shapes.gen else 0)


def whole_batches(source, cfg, layout, global_batch: int, multiple: int = 1):
    """The run's global batches assembled whole (`LoaderBatches`), their counts rounded up to
    `multiple` (a co-located mesh's data-parallel ranks). The shapes start at the high-water
    shapes of the first `Loader.shape_scan_steps` global batches, scanned from metadata
    whatever the run's length, so the step compiles once and runs of any length share it."""
    from mmjax.train.single_data import LoaderBatches

    def grow(shapes, metas):
        return round_counts(grow_shapes(shapes, metas, layout), multiple)
    return LoaderBatches.from_gin(source, layout, global_batch, grow)


class OneDevice:
    """The step on `device` (default: this process's first); its compiled step is stored
    and loaded untraced (train/program_cache.py)."""

    program_cache = True

    def __init__(self, device=None):
        self.device = device if device is not None else jax.local_devices()[0]
        self.devices = [self.device]

    def batches(self, source, cfg, layout, global_batch: int):
        return whole_batches(source, cfg, layout, global_batch)

    def memory_line(self, cfg, data, layout, abstract: TrainState, abstract_frozen, dtype,
                    attention_impl: str, global_batch: int, check_memory: bool) -> str | None:
        if data.floor is None:
            return None
        count = lambda t: sum(x.size for x in jax.tree.leaves(t))
        est = check_single_program(cfg, data.floor, layout.seq_len,
                                   count(abstract.stages[WHOLE_MODEL].master),
                                   count(abstract_frozen), dtype, attention_impl, global_batch,
                                   self.device, refuse=check_memory)
        return (f"memory: the step needs about {est['peak'] / 1e9:.2f} GB (estimate) of "
                f"{est['device'] / 1e9:.1f} GB on {self.device.platform}:{self.device.id}")

    def shardings(self, abstract: TrainState, abstract_frozen) -> tuple[Any, Any]:
        on = lambda _: SingleDeviceSharding(self.device)
        return jax.tree.map(on, abstract), jax.tree.map(on, abstract_frozen)

    def init(self, cfg, key, filters: tuple, tx, shardings: tuple) -> tuple[TrainState, Any]:
        """One jitted init program (parallel/sharded_init.py), not an eager op per
        parameter: one compile, then a persistent-cache hit. Committed to the device as a
        restored checkpoint's arrays are, so a fresh run and its resume lower to the same
        program (one persistent-cache entry)."""
        trainable, frozen = init_states(MultimodalModel, (cfg,), key, filters)
        state = whole_model_state(trainable, jax.jit(tx.init)(trainable),
                                  jnp.zeros((), jnp.int32))
        return self.put((state, frozen), shardings)

    def fetch(self, tree) -> Any:
        return tree  # one device's arrays merge into a model as they are

    def put(self, tree, shardings) -> Any:
        return jax.device_put(tree, self.device)

    def step_fn(self, graphdef, tx, dtype, attention_impl: str, mask_family: str, tx_at,
                abstract: TrainState) -> Any:
        return make_train_step(graphdef, tx, dtype, attention_impl, mask_family, tx_at=tx_at)

    def inputs(self, batch) -> dict:
        return model_inputs(batch)

    def step_extra(self, key, compiled) -> dict:
        return {}
