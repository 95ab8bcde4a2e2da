"""The single-program trainer: the whole model as one jitted step on the default device
(the parity reference), fed the global batches every plan reads."""
from __future__ import annotations

import concurrent.futures
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import SingleDeviceSharding

from mmjax.data.batch_shapes import BatchShapes, grow_shapes
from mmjax.data.sources import eval_batches
from mmjax.data.skipped import Skipped
from mmjax.data.stream_position import (STATE_KEY, resume_notice, stored_position,
                                        stream_state)
from mmjax.models.hf.pretrained import load_pretrained_dirs
from mmjax.models.mllm import MultimodalModel, trainable_filter
from mmjax.parallel.sharded_init import abstract_split, init_split
from mmjax.train.data_config import train_source
from mmjax.train.inputs import model_inputs
from mmjax.train.logical_state import single_from_logical, single_logical
from mmjax.train.memory_check import check_single_program
from mmjax.train import program_cache
from mmjax.train.optimizer import applied_updates, optimizer_from_settings, rate_as_input
from mmjax.train.runner import StepMetrics
from mmjax.train.state import WHOLE_MODEL, TrainState, whole_model_state
from mmjax.train.step import make_loss_fn, make_train_step, split_model


def round_counts(shapes: BatchShapes, multiple: int) -> BatchShapes:
    """Rows, encoder buffer counts and generated images rounded up to `multiple` (padding),
    so a data-parallel split over that many ranks is even."""
    up = lambda n: -(-n // multiple) * multiple
    return BatchShapes(up(shapes.rows), tuple((n, up(c), k) for n, c, k in shapes.encoders),
                       up(shapes.gen) if shapes.gen else 0)



_NO_LIMITS = np.full(2, np.inf, np.float32)  # the spike guard's limits, off


class SingleProgram:
    """Plain jit of the whole model on the default device (the parity reference). Reads
    the global batches every plan reads (train/single_data.py: the pipeline path's loader
    over a real source, `loader_source.path` or the synthetic set), whole. `state` is the
    run's TrainState (train/state.py: one stage, the whole model; `data` the batch
    position); `frozen` the frozen parameters, the step's fixed input."""

    # compiled steps stored and loaded untraced (train/program_cache.py); a subclass whose
    # step differs in ways the key does not name turns it off
    program_cache = True

    def __init__(self, cfg, layout, global_batch, schedule, dtype, seed, source=None,
                 attention_impl="auto", pretrained=None,
                 check_memory: bool = True, count_multiple: int = 1, data=None):
        """The batch shapes are scanned from metadata over the first
        `Loader.shape_scan_steps` global batches, whatever the run's length, so the step
        compiles once and runs of any length share one cached program.
        `check_memory`: refuse (UserError) a step whose estimated peak memory at those
        shapes exceeds the device's, before anything is compiled (train/memory_check.py).
        `data`: another iterator of the run's global batches (the co-located runner's
        per-phase batches, train/colocated_data.py); no memory estimate then."""
        from mmjax.train.single_data import LoaderBatches

        def grow(shapes, metas):  # count_multiple: the co-located runner's dp
            return round_counts(grow_shapes(shapes, metas, layout), count_multiple)
        self.data = data if data is not None else LoaderBatches.from_gin(
            source if source is not None else train_source(cfg), layout, global_batch, grow)
        self.cfg = cfg
        filters = (trainable_filter(cfg), ...)
        tx = optimizer_from_settings(schedule)
        key = jax.random.key(seed)
        graphdef, tr, fr = abstract_split(MultimodalModel, (cfg,), key, filters)
        device = jax.local_devices()[0]  # the same in one process; addressable in any
        self.device = device
        self.memory_line = None
        if data is None and self.data.floor is not None:
            count = lambda t: sum(x.size for x in jax.tree.leaves(t))
            est = check_single_program(cfg, self.data.floor, layout.seq_len, count(tr),
                                       count(fr), dtype, attention_impl, global_batch, device,
                                       refuse=check_memory)
            self.memory_line = (f"memory: the step needs about {est['peak'] / 1e9:.2f} GB "
                                f"(estimate) of {est['device'] / 1e9:.1f} GB on "
                                f"{device.platform}:{device.id}")

        def fresh() -> tuple[TrainState, object]:
            # one jitted init program (parallel/sharded_init.py), not an eager op per
            # parameter: one compile, then a persistent-cache hit
            _, trainable, frozen = init_split(MultimodalModel, (cfg,), key, filters)
            if pretrained:
                mdl = nnx.merge(graphdef, trainable, frozen)
                load_pretrained_dirs(mdl, pretrained)
                _, trainable, frozen = split_model(mdl, filters[0])
            # committed to the device as a restored checkpoint's arrays are, so a fresh
            # run and its resume lower to the same program (one persistent-cache entry)
            return jax.device_put((whole_model_state(trainable, jax.jit(tx.init)(trainable),
                                                     jnp.zeros((), jnp.int32)), frozen), device)
        # made on first use: a resume restores into `abstract` and, with no frozen
        # parameters to take from the init, never runs it
        self._fresh, self._state = fresh, None
        self._frozen = None if jax.tree.leaves(fr) else fr  # none: nothing to make
        on_device = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                   sharding=SingleDeviceSharding(device))
        self.abstract = jax.tree.map(on_device, whole_model_state(
            tr, jax.eval_shape(tx.init, tr), jax.ShapeDtypeStruct((), jnp.int32)))
        self.abstract_frozen = jax.tree.map(on_device, fr)
        if pretrained:
            self._make()  # its errors before any work
        # the learning rate an input: the program does not depend on train.steps
        tx_at, self.rate_at = rate_as_input(schedule)
        self.step_fn = make_train_step(graphdef, tx, dtype, attention_impl,
                                       layout.llm_mask_family, tx_at=tx_at)
        self.mask_family = layout.llm_mask_family
        self.graphdef, self.dtype, self.global_batch, self.eval_fn = graphdef, dtype, global_batch, None
        self.attention_impl = attention_impl
        self.num_trainable = sum(x.size for x in jax.tree.leaves(tr))
        # batch shapes -> the step compiled ahead of time for them: compilation is seen
        # (and reported) when it happens, not hidden in a step's time
        self.compiled: dict = {}
        self.progress = None  # train/progress.py Progress, set by the trainer
        self.max_bad_fraction = self.data.max_bad_fraction

    def _make(self) -> None:
        """Run the init: the fresh state (unless one is set) and the frozen parameters."""
        state, self._frozen = self._fresh()
        if self._state is None:
            self._state = state._replace(data=self.data.state())

    @property
    def state(self) -> TrainState:
        if self._state is None:
            self._make()
        return self._state

    @state.setter
    def state(self, value: TrainState) -> None:
        self._state = value

    @property
    def frozen(self):
        """The frozen parameters (the step's fixed input), from the init."""
        if self._frozen is None:
            self._make()
        return self._frozen

    def load(self, arrays: dict, data_state: dict, step: int) -> str | None:
        """A checkpoint of any layout, its data state in the resume schema or an older one
        (`stream_state`): the stream goes on at its stored position.
        -> one line naming the data settings that changed since the position was stored
        (`resume_notice`)."""
        position = stored_position(data_state)
        self.data.restore(stream_state(data_state, step))
        self.state = single_from_logical(self.abstract, arrays)._replace(data=self.data.state())
        return resume_notice(position, step, self.global_batch, self.data.layout.seq_len)

    def restore_target(self) -> dict:
        """The checkpoint's names, shapes and shardings, without running the init."""
        return single_logical(self.abstract)

    def checkpoint(self) -> tuple[dict, dict]:
        """(plan-independent named arrays (train/logical_state.py), the data position)."""
        return single_logical(self.state), {STATE_KEY: self.state.data}

    def _compile(self, inputs):
        """The step compiled for `inputs`' shapes, lowered from the abstract state (the
        state's shapes and placement), so a fresh run's init (its own jitted program)
        compiles and runs in a thread meanwhile: XLA compiles without the GIL, and the two
        compilations take the longer one's time on two cores, not the sum. A program an
        earlier run stored (train/program_cache.py) is loaded instead, untraced."""
        rate = None if self.rate_at is None else np.float32(0)
        made = None
        if self._state is None or self._frozen is None:
            made = concurrent.futures.ThreadPoolExecutor(1, "mmjax-init").submit(self._make)
        try:
            args = (self.abstract, self.abstract_frozen, inputs, _NO_LIMITS, rate)
            cache = self.program_cache and (jax.config.jax_compilation_cache_dir or None)
            key = self._program_key(args) if cache else ""
            tree = jax.tree.structure((args, {}))
            compiled = (program_cache.load(cache, key, tree, [self.device]) if cache
                        else None)
            if compiled is None:
                if made is None:
                    args = (self._state._replace(data={}), self._frozen, *args[2:])
                with program_cache.compiling() as from_jax_cache:
                    compiled = self.step_fn.lower(*args).compile()
                if not from_jax_cache:
                    program_cache.store(cache, key, compiled)
        finally:
            if made is not None:
                made.result()
        return compiled

    def _program_key(self, args) -> str:
        """`program_cache.program_key` of the step at `args` (abstract state, frozen,
        inputs, limits, rate): the model, the step's settings, every leaf's shape, dtype
        and placement."""
        def leaf(x):
            return (np.shape(x), str(getattr(x, "dtype", type(x).__name__)),
                    str(getattr(x, "sharding", "")))
        return program_cache.program_key(
            "single_program.train_step", str(self.device), repr(self.cfg), str(self.dtype),
            str(self.attention_impl), str(self.mask_family), str(self.rate_at is None),
            str(jax.tree.structure((args, {}))), repr(jax.tree.map(leaf, args)))

    def inputs(self, batch):
        """The step's inputs for a host batch (the co-located runner places them)."""
        return model_inputs(batch)

    def step(self, trace: bool = False, limits=(np.inf, np.inf)) -> StepMetrics:
        """One step; `limits` = (max loss, max gradient norm) of the loss-spike guard.
        `trace` records a plan's pipeline actions: one program has none (`trace` None)."""
        t_wait = time.perf_counter()
        batch, skipped = next(self.data), []
        if isinstance(batch, tuple):  # SourceBatches: (batch, skipped before assembly)
            batch, skipped = batch
        skipped = skipped + [Skipped.at_assembly(i, r) for i, r in batch.skipped]
        inputs = self.inputs(batch)
        leaves, treedef = jax.tree.flatten(inputs)
        key = (str(treedef), tuple((np.shape(x), str(np.asarray(x).dtype) if np.isscalar(x)
                                     else str(x.dtype)) for x in leaves))
        compile_s = 0.0
        self.last_key = key  # the compiled program this step runs (self.compiled[key])
        if key not in self.compiled:
            sh = batch.shapes
            what = (f"the training step for {sh.rows} rows x {batch.tokens.shape[1]} tokens"
                    + "".join(f", {n} {k} x {c}" for n, c, k in sh.encoders)
                    + (f", {sh.gen} generated images" if sh.gen else "")
                    + ("" if not self.compiled else " (new batch shapes)"))
            if self.progress is not None:
                self.progress.compiling(what)
            t = time.perf_counter()
            self.compiled[key] = self._compile(inputs)
            compile_s = time.perf_counter() - t
            if self.progress is not None:
                self.progress.compiled(what, compile_s)
        # the schedule's rate after the updates applied so far (optax's count)
        rate = None if self.rate_at is None else self.rate_at(
            applied_updates(self.state.stages[WHOLE_MODEL].opt))
        t0 = time.perf_counter()
        new, m = self.compiled[key](self.state._replace(data={}), self.frozen, inputs,
                                    np.asarray(limits, np.float32), rate)
        self.state = new._replace(data=self.data.state())
        m = jax.device_get(m)  # one sync, after dispatch
        return StepMetrics(
            float(m["loss"]), float(m["lm_loss"]), float(m["diffusion_loss"]),
            float(m["grad_norm"]), nonfinite=bool(m["nonfinite"]), spike=bool(m["spike"]),
            step_time_s=time.perf_counter() - t0, compile_s=compile_s,
            data_wait_s=t0 - t_wait - compile_s,  # the wait for data alone
            tokens=int(np.count_nonzero(batch.doc)),
            tokens_trained=int(batch.num_target_tokens), llm_slots=int(batch.doc.size),
            skipped=len(skipped),
            skipped_list=skipped)

    def evaluate(self, source, max_batches: int, layout) -> float:
        """Mean loss per trained token over the held-out set's first global batches
        (`eval_batches`: the same samples every plan evaluates)."""
        from mmjax.data.batch_shapes import batch_shapes
        from mmjax.train.single_data import LoaderBatches

        if self.eval_fn is None:
            loss_fn = make_loss_fn(self.graphdef, self.dtype, self.attention_impl,
                                   layout.llm_mask_family)
            self.eval_fn = jax.jit(lambda s, fr, b: loss_fn(s.stages[WHOLE_MODEL].master, fr,
                                                            b)[1]["lm_loss"])
        data = LoaderBatches.from_gin(source, layout, self.global_batch,
                                      lambda _, metas: batch_shapes([metas], layout),
                                      scan_steps=0, shuffle=False)  # each at its own shapes
        total, count = 0.0, 0
        try:
            for _ in range(eval_batches(source, max_batches, self.global_batch)):
                batch, _ = next(data)
                n = batch.num_target_tokens
                total += float(self.eval_fn(self.state._replace(data={}), self.frozen,
                                            self.inputs(batch))) * n
                count += n
        finally:
            data.close()
        return total / max(count, 1)

    def close(self):
        self.data.close()
