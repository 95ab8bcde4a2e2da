"""A Plan on the pipeline runtime as the trainer drives it: the grain loader's feeds in,
one `PipelineStep` per global batch, validation by forward passes, traces for replanning."""
from __future__ import annotations

import json
import os
import time

import jax
import numpy as np

from mmjax.data.feed import gen_elements_per_image
from mmjax.data.sources import eval_batches
from mmjax.planner.plan import Plan
from mmjax.train.data_config import train_source
from mmjax.train.host_failures import agree_on_failures
from mmjax.train.logical_state import (pipeline_global_logical, pipeline_load_logical,
                                       restore_target)


class Pipelined:
    """A Plan on the pipeline runtime, fed by the grain loader (planning, balancing and
    assembly off the training path, in its prefetch thread or worker processes)."""

    def __init__(self, cfg, layout, plan, schedule, dtype, seed, source=None, pretrained=None,
                 steps: int | None = None, check_memory: bool = True):
        """`steps`: the run's length: the loader pads every feed to the shapes of all its
        global batches (up to `SHAPE_SCAN_MAX`, scanned from metadata at start-up), so no
        stage program compiles after the first step. `check_memory`: refuse a plan whose
        units the planner's memory model does not fit in a device, before anything is
        built (train/memory_check.py)."""
        from mmjax.data.loader import Loader
        from mmjax.train.memory_check import check_plan
        from mmjax.train.pipeline_step import PipelineStep

        self.memory_line = check_plan(cfg, plan, source if source is not None
                                      else train_source(cfg), jax.local_devices()[0],
                                      check_memory)  # this process's (memory_stats)

        self.step_fn = PipelineStep(cfg, plan, schedule, dtype, seed, pretrained=pretrained,
                                    llm_mask_family=layout.llm_mask_family)
        self.cfg, self.plan, self.global_batch = cfg, plan, plan.global_batch
        self.layout = layout
        # gin: a real source (`llava_source.*`, `webdataset_source.*`), else
        # `loader_source.path` or the synthetic set (`train_source`); `Loader.*` (balance,
        # post_balance_policy, workers, ...).
        # several processes: each host decodes only its own DP ranks' samples
        self.local = (None if jax.process_count() == 1 else frozenset(
            i for i, d in enumerate(jax.devices()) if d.process_index == jax.process_index()))
        self.data = Loader(source if source is not None else train_source(cfg), cfg, plan,
                           layout, feeds=True, local_devices=self.local,
                           **({} if steps is None else {"num_steps": steps}))
        self.seen_shapes = set()  # feed shapes run so far: a new one compiles
        self.num_trainable = sum(x.size for x in jax.tree.leaves(
            [st.trainable for st in self.step_fn.runtime.stages.values()]))
        self.progress, self.steps_run, self.steps_traced = None, 0, 0  # Progress: trainer

    def data_state(self) -> dict:
        return {"loader": self.data.get_state()}

    def load(self, state: dict, data_state: dict, step: int) -> None:
        """A checkpoint of any plan (or of the single program: the loader then goes on from
        global batch `step` of its stream)."""
        pipeline_load_logical(self.step_fn, state)
        self.data.set_state(data_state.get("loader", {
            "step": step, "skipped_samples": data_state.get("skipped_samples", 0)}))

    def checkpoint_tree(self) -> dict:
        """Plan-independent named arrays (train/logical_state.py), the same on every
        process (stages held by other processes as arrays without local shards)."""
        return pipeline_global_logical(self.step_fn)

    def restore_target(self) -> dict:
        return restore_target(self.checkpoint_tree())

    def step(self, trace: bool = False, limits=(np.inf, np.inf)):
        """One training step; `trace`: time every action alone (pipeline/trace.py "serial")
        and return the records under "trace"."""
        t_wait = time.perf_counter()
        gb = next(self.data)
        if self.local is not None:  # the hosts' decode failures, agreed before the step
            from jax.experimental import multihost_utils

            self.data.skipped_samples += agree_on_failures(
                gb, multihost_utils.process_allgather, gen_elements_per_image(self.layout))
        feeds = [mb.feed for mb in gb.microbatches]
        first = self.steps_run == 0
        if first and self.progress is not None:  # the stages compile inside the first step
            self.progress.compiling("the pipeline's stage programs (inside the first step)")
        t0 = time.perf_counter()
        m = self.step_fn(feeds, trace=trace, limits=limits)
        m["step_time_s"] = time.perf_counter() - t0
        self.steps_run += 1
        m["compile_s"] = m["step_time_s"] if first else 0.0
        if first and self.progress is not None:
            self.progress.compiled("the first pipelined step", m["step_time_s"])
        m["data_wait_s"] = t0 - t_wait
        new = {f.shapes for f in feeds} - self.seen_shapes
        if new and not first:
            m["compile_reason"] = (f"{len(new)} new microbatch shapes outside the floor "
                                   f"scanned at start-up (Loader.shape_scan_steps="
                                   f"{self.data.shape_scan_steps})")
        elif trace and self.steps_traced == 0:
            m["compile_reason"] = "the first traced step: each action runs alone"
        self.seen_shapes |= {f.shapes for f in feeds}
        self.steps_traced += bool(trace)
        m["tokens"] = int(sum(np.count_nonzero(f.llm["doc"]) for f in feeds))
        m["tokens_trained"] = int(sum(f.num_target_tokens for f in feeds))
        m["skipped"] = gb.skipped_samples
        m["skipped_list"] = list(gb.skipped)
        return m

    def evaluate(self, source, max_batches: int, layout) -> float:
        """Mean loss per trained token over the held-out set's first global batches, by
        forward passes alone on this plan (`PipelineRuntime.evaluate`); the same samples
        as the single program's `evaluate`, so both report the same `eval_loss`."""
        from mmjax.data.loader import Loader

        n = eval_batches(source, max_batches, self.global_batch)
        data = Loader(source, self.cfg, self.plan, layout, feeds=True, shuffle=False,
                      num_steps=n)
        total, count = 0.0, 0
        try:
            for _ in range(n):
                feeds = [mb.feed for mb in next(data).microbatches]
                lm = self.step_fn.runtime.evaluate(feeds).losses()["lm_loss"]
                tokens = sum(f.num_target_tokens for f in feeds)
                total += lm * tokens
                count += tokens
        finally:
            data.close()
        return total / max(count, 1)

    def close(self):
        self.data.close()


def write_trace(workdir: str, step: int, cfg, plan: Plan, trace: list[dict]) -> str:
    """`<workdir>/traces/step_<step>.json`: what scripts/replan.py reads."""
    path = os.path.join(workdir, "traces", f"step_{step}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"model": cfg.name, "plan": plan.to_json(), "trace": trace}, f)
    return path
