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
from mmjax.parallel.sharded_init import init_states, lower_init_states
from mmjax.train import program_cache
from mmjax.train.inputs import model_inputs
from mmjax.train.memory_check import check_single_program
from mmjax.train.program_prefetch import Prefetch
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
    """The step on `device` (default: this process's first); its compiled step and init
    are stored and loaded untraced (train/program_cache.py), the init's in a thread from
    `prefetch_init` on (train/program_prefetch.py)."""

    program_cache = True

    def __init__(self, device=None):
        self.device = device if device is not None else jax.local_devices()[0]
        self.devices = [self.device]
        self._init_loading = Prefetch(None, None, self.devices)

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
        trainable, frozen = self._init_states(cfg, key, filters)
        state = whole_model_state(trainable, jax.jit(tx.init)(trainable),
                                  jnp.zeros((), jnp.int32))
        return self.put((state, frozen), shardings)

    def prefetch_init(self, cfg, key, filters: tuple) -> None:
        """Start loading the stored init program of (`cfg`, `key`'s type, `filters`) in a
        thread, if the program cache holds it: a fresh run's init then waits for no load.
        (A resume never runs the init: its load was work on another core, nothing more.)"""
        cache, pkey = self._init_key(cfg, key, filters)
        self._init_loading = Prefetch(cache, pkey, self.devices)

    def _init_key(self, cfg, key, filters: tuple) -> tuple[str | None, str]:
        """(the program cache's directory, the init program's key there); None: the init
        is not stored (the cache off, or a device other than the default one, where the
        jitted init runs)."""
        cache = program_cache.cache_dir()
        if cache is None or self.device != jax.local_devices()[0]:
            return None, ""
        return cache, program_cache.program_key(
            "single_program.init", str(self.device), repr(cfg), repr(filters),
            str(key.dtype), str(key.shape))

    def _init_states(self, cfg, key, filters: tuple) -> tuple:
        """(trainable, frozen) from the init program: stored (loaded untraced, usually by
        `prefetch_init` already) or compiled and stored; not stored (`_init_key`), the
        jitted `init_states` (JAX's own caches)."""
        cache, pkey = self._init_key(cfg, key, filters)
        if cache is None:
            return init_states(MultimodalModel, (cfg,), key, filters)
        tree = jax.tree.structure(((key,), {}))
        compiled = program_cache.load(cache, pkey, tree, self.devices,
                                      self._init_loading.take(pkey))
        if compiled is None:
            with program_cache.compiling() as from_jax_cache:
                compiled = lower_init_states(MultimodalModel, (cfg,), key, filters).compile()
            program_cache.store(cache, pkey, compiled, bool(from_jax_cache))
        return compiled(key)

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
