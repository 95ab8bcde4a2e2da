"""`WholeModelRunner`: the whole model as one jitted step (train/runner.py `Runner`), on a
placement (train/placement.py): one device (`single_program.OneDevice`, the parity
reference) or a co-located mesh (`colocated.ColocatedMesh`). The runner holds the run's
`TrainState` (train/state.py: one stage, the whole model; `data` the batch position) and
the frozen parameters (the step's fixed input); the placement says where they live, how
the step is built and how a batch reaches it.
"""
from __future__ import annotations

import concurrent.futures
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mmjax.data.skipped import Skipped
from mmjax.data.stream_position import (STATE_KEY, resume_notice, stored_position,
                                        stream_state)
from mmjax.models.hf.pretrained import load_pretrained_dirs
from mmjax.models.mllm import MultimodalModel, trainable_filter
from mmjax.parallel.sharded_init import abstract_split
from mmjax.train import program_cache
from mmjax.train.data_config import train_source
from mmjax.train.held_out import held_out_loss
from mmjax.train.logical_state import single_from_logical, single_logical
from mmjax.train.optimizer import applied_updates, optimizer_from_settings, rate_as_input
from mmjax.train.placement import Placement
from mmjax.train.program_prefetch import Prefetch
from mmjax.train.runner import StepMetrics
from mmjax.train.state import WHOLE_MODEL, TrainState, whole_model_state
from mmjax.train.step import make_loss_fn, split_model

NO_LIMITS = np.full(2, np.inf, np.float32)  # the spike guard's limits, off


class WholeModelRunner:
    """The whole model's steps on `placement`, over the global batches every plan reads
    (`placement.batches`). `state` is the run's TrainState; `frozen` the frozen parameters."""

    def __init__(self, cfg, layout, global_batch: int, schedule, dtype, seed: int,
                 placement: Placement, source=None, attention_impl: str = "auto",
                 pretrained: dict | None = None, check_memory: bool = True):
        """The batch shapes are scanned from metadata over the first
        `Loader.shape_scan_steps` global batches, whatever the run's length, so the step
        compiles once. `check_memory`: refuse (UserError) a step whose estimated peak
        memory at those shapes exceeds the device's, before anything is compiled."""
        self.placement, self.cfg, self.dtype = placement, cfg, dtype
        self.global_batch, self.attention_impl = global_batch, attention_impl
        self.mask_family = layout.llm_mask_family
        self.filters = (trainable_filter(cfg), ...)
        self.tx, self.key = optimizer_from_settings(schedule), jax.random.key(seed)
        # stored programs load in threads meanwhile (the data's shape scan, the abstract
        # build): the init's, and the step's of the last run like this one
        placement.prefetch_init(cfg, self.key, self.filters)
        self._prefetch = Prefetch.remembered(
            program_cache.cache_dir() if placement.program_cache else None,
            f"single_program.train_step {cfg!r} {dtype} {attention_impl} {global_batch}",
            placement.devices)
        self.data = placement.batches(source if source is not None else train_source(cfg),
                                      cfg, layout, global_batch)
        try:
            self._build(cfg, layout, schedule, seed, pretrained, check_memory)
        except BaseException:
            self.data.close()
            raise

    def _build(self, cfg, layout, schedule, seed: int, pretrained: dict | None,
               check_memory: bool) -> None:
        """Everything but the data stream: the abstract state on the placement, the memory
        check, the step; the init itself only with pretrained files (else on first use)."""
        global_batch, dtype, attention_impl = self.global_batch, self.dtype, self.attention_impl
        placement = self.placement
        self.pretrained = pretrained
        self.graphdef, tr, fr = abstract_split(MultimodalModel, (cfg,), self.key, self.filters)
        abstract = whole_model_state(tr, jax.eval_shape(self.tx.init, tr),
                                     jax.ShapeDtypeStruct((), jnp.int32))
        self.shardings = placement.shardings(abstract, fr)
        on = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
        self.abstract = jax.tree.map(on, abstract, self.shardings[0])
        self.abstract_frozen = jax.tree.map(on, fr, self.shardings[1])
        self.memory_line = placement.memory_line(cfg, self.data, layout, self.abstract,
                                                 self.abstract_frozen, dtype, attention_impl,
                                                 global_batch, check_memory)
        # made on first use: a resume restores into `abstract` and, with no frozen
        # parameters to take from the init, never runs it
        self._state: TrainState | None = None
        self._frozen = None if jax.tree.leaves(fr) else self.abstract_frozen
        if pretrained:
            self._make()  # its errors before any work
        # the learning rate an input: the program does not depend on train.steps
        tx_at, self.rate_at = rate_as_input(schedule)
        self.step_fn = placement.step_fn(self.graphdef, self.tx, dtype, attention_impl,
                                         self.mask_family, tx_at, self.abstract)
        self.eval_fn: Any = None
        self.num_trainable = sum(x.size for x in jax.tree.leaves(tr))
        # batch shapes -> the step compiled ahead of time for them: compilation is seen
        # (and reported) when it happens, not hidden in a step's time
        self.compiled: dict = {}
        self.last_key: tuple = ()  # the compiled program the last step ran
        self.progress: Any = None  # train/progress.py Progress, set by the trainer
        self.max_bad_fraction: float = self.data.max_bad_fraction

    def _fresh(self) -> tuple[TrainState, Any]:
        """(a fresh TrainState, the frozen parameters): the init from the seed, then the
        pretrained files loaded over it."""
        state, frozen = self.placement.init(self.cfg, self.key, self.filters, self.tx,
                                            self.shardings)
        if not self.pretrained:
            return state, frozen
        mdl = nnx.merge(self.graphdef,
                        *self.placement.fetch((state.stages[WHOLE_MODEL].master, frozen)))
        load_pretrained_dirs(mdl, self.pretrained)
        _, tr, fr = split_model(mdl, self.filters[0])
        state = whole_model_state(tr, jax.jit(self.tx.init)(tr), state.step)
        return self.placement.put((state, fr), self.shardings)

    def _make(self) -> None:
        """Run the init: the fresh state (unless one is set) and the frozen parameters."""
        state, self._frozen = self._fresh()
        if self._state is None:
            self._state = state._replace(data=self.data.state())

    @property
    def state(self) -> TrainState:
        if self._state is None:
            self._make()
        assert self._state is not None
        return self._state

    @state.setter
    def state(self, value: TrainState) -> None:
        self._state = value

    @property
    def frozen(self) -> Any:
        """The frozen parameters (the step's fixed input), from the init."""
        if self._frozen is None:
            self._make()
        return self._frozen

    def load(self, arrays: dict, data_state: dict, step: int) -> str | None:
        """A checkpoint of any layout, its data state in the resume schema or an older one
        (`stream_state`): the stream goes on at its stored position. -> one line naming
        the data settings that changed since the position was stored (`resume_notice`)."""
        position = stored_position(data_state)
        self.data.restore(stream_state(data_state, step))
        state = single_from_logical(self.abstract, arrays)._replace(data={})
        self.state = self.placement.put(state, self.shardings[0])._replace(
            data=self.data.state())
        return resume_notice(position, step, self.global_batch, self.data.layout.seq_len)

    def restore_target(self) -> dict:
        """The checkpoint's names, shapes and shardings, without running the init."""
        return single_logical(self.abstract)

    def checkpoint(self) -> tuple[dict, dict]:
        """(plan-independent named arrays (train/logical_state.py), the data position)."""
        return single_logical(self.state), {STATE_KEY: self.state.data}

    def _compile(self, inputs) -> Any:
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
            args: tuple = (self.abstract, self.abstract_frozen, inputs, NO_LIMITS, rate)
            cache = program_cache.cache_dir() if self.placement.program_cache else None
            key = self._program_key(args) if cache else ""
            tree = jax.tree.structure((args, {}))
            compiled = (program_cache.load(cache, key, tree, self.placement.devices,
                                           self._prefetch.take(key)) if cache else None)
            if compiled is None:
                if made is None:
                    args = (self.state._replace(data={}), self._frozen, *args[2:])
                with program_cache.compiling() as from_jax_cache:
                    compiled = self.step_fn.lower(*args).compile()
                if cache:
                    program_cache.store(cache, key, compiled, bool(from_jax_cache))
            self._prefetch.remember(key)
        finally:
            if made is not None:
                made.result()
        return compiled

    def _program_key(self, args) -> str:
        """`program_cache.program_key` of the step at `args` (abstract state, frozen,
        inputs, limits, rate): the model, the step's settings, the argument tree (its
        paths) and every leaf's shape, dtype and placement, in the tree's order."""
        def leaf(x):
            return (np.shape(x), str(getattr(x, "dtype", type(x).__name__)),
                    str(getattr(x, "sharding", "")))
        return program_cache.program_key(
            "single_program.train_step", ",".join(map(str, self.placement.devices)),
            repr(self.cfg), str(self.dtype), str(self.attention_impl), str(self.mask_family),
            str(self.rate_at is None), str(jax.tree.structure((args, {}))),
            repr([leaf(x) for x in jax.tree.leaves(args)]))

    def _compiled_for(self, batch, inputs) -> float:
        """Compile the step for `inputs`' shapes unless done; -> the seconds it took (0:
        compiled before). `self.last_key`: the program for these shapes."""
        leaves, treedef = jax.tree.flatten(inputs)
        key = (str(treedef), tuple((np.shape(x), str(np.asarray(x).dtype) if np.isscalar(x)
                                     else str(x.dtype)) for x in leaves))
        self.last_key = key
        if key in self.compiled:
            return 0.0
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
        return compile_s

    def step(self, trace: bool = False, limits=(np.inf, np.inf)) -> StepMetrics:
        """One step; `limits` = (max loss, max gradient norm) of the loss-spike guard.
        `trace` records a plan's pipeline actions: one program has none (`trace` None)."""
        t_wait = time.perf_counter()
        batch, skipped = next(self.data)
        skipped = skipped + [Skipped.at_assembly(i, r) for i, r in batch.skipped]
        inputs = self.placement.inputs(batch)
        compile_s = self._compiled_for(batch, inputs)
        # the schedule's rate after the updates applied so far (optax's count)
        rate = None if self.rate_at is None else self.rate_at(
            applied_updates(self.state.stages[WHOLE_MODEL].opt))
        t0 = time.perf_counter()
        compiled = self.compiled[self.last_key]
        new, m = compiled(self.state._replace(data={}), self.frozen, inputs,
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
            skipped=len(skipped), skipped_list=skipped,
            extra=self.placement.step_extra(self.last_key, compiled))

    def evaluate(self, source, max_batches: int, layout) -> float:
        """`held_out_loss` by the jitted loss, each held-out batch at its own shapes."""
        from mmjax.data.batch_shapes import batch_shapes
        from mmjax.train.single_data import LoaderBatches

        if self.eval_fn is None:
            loss_fn = make_loss_fn(self.graphdef, self.dtype, self.attention_impl,
                                   layout.llm_mask_family)
            self.eval_fn = jax.jit(lambda s, fr, b: loss_fn(s.stages[WHOLE_MODEL].master, fr,
                                                            b)[1]["lm_loss"])

        def loss_and_tokens(item) -> tuple[float, int]:
            batch = item[0]
            loss = self.eval_fn(self.state._replace(data={}), self.frozen,
                                self.placement.inputs(batch))
            return float(loss), batch.num_target_tokens

        return held_out_loss(
            source, max_batches, self.global_batch,
            lambda _: LoaderBatches.from_gin(source, layout, self.global_batch,
                                             lambda _, metas: batch_shapes([metas], layout),
                                             scan_steps=0, shuffle=False),
            loss_and_tokens)

    def close(self) -> None:
        self.data.close()
