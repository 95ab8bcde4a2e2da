"""The training loop: data -> step -> metrics -> async checkpoints, resumable.

Everything is gin-configurable (`train.*`, `named_model_config.*`, `make_optimizer.*`,
`learning_rate_schedule.*`). Writes `workdir/metrics.jsonl` (one JSON object per step) and
orbax checkpoints under `workdir/checkpoints`; on start it resumes from the newest one,
including the data position, so an interrupted run continues bit-for-bit.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time

import gin
import jax
import jax.numpy as jnp
import numpy as np
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from mmjax.data.assemble import AssemblyLayout, BatchShapes, assemble, batch_shapes, check_sample
from mmjax.data.synthetic import SyntheticConfig, SyntheticDataset
from mmjax.models.config import MLLMConfig
from mmjax.models.mllm import MultimodalModel, trainable_filter
from mmjax.train.checkpoint import Checkpointer
from mmjax.train.config import named_model_config
from mmjax.train.inputs import model_inputs
from mmjax.train.optimizer import learning_rate_schedule, make_optimizer
from mmjax.train.step import TrainState, make_train_step, split_model

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@gin.configurable
def data_layout(cfg: MLLMConfig, seq_len: int = 256, packing: str = "pad",
                vision_caps=(64, 256, 1024), audio_frame_caps=(128, 256, 512, 1024),
                gen_num_queries: int = 16) -> AssemblyLayout:
    return AssemblyLayout.from_config(cfg, seq_len, packing, tuple(vision_caps),
                                      tuple(audio_frame_caps), gen_num_queries)


@gin.configurable
def synthetic_dataset(cfg: MLLMConfig, kind: str = "laion", seed: int = 0,
                      bad_fraction: float = 0.0, **overrides) -> SyntheticDataset:
    return SyntheticDataset(kind, SyntheticConfig.for_model(cfg, bad_fraction=bad_fraction,
                                                            **overrides), seed=seed)


def high_water(shapes: BatchShapes | None, need_fn) -> BatchShapes:
    """Static shapes that only grow: each encoder keeps the largest capacity seen so far
    (so buffer counts are computed at that capacity) and every count is the running max.
    jit then compiles a handful of shapes per run instead of one per batch."""
    if shapes is None:
        return need_fn(None)
    need = need_fn(shapes)
    encs = tuple((n, max(c0, c1), max(k0, k1))
                 for (n, c0, k0), (_, c1, k1) in zip(shapes.encoders, need.encoders))
    return BatchShapes(max(shapes.rows, need.rows), encs, max(shapes.gen, need.gen))


def _layout_at_least(layout: AssemblyLayout, shapes: BatchShapes | None) -> AssemblyLayout:
    if shapes is None:
        return layout
    kw = {}
    for slot in layout.encoders:
        cap = shapes.encoder(slot.name)[1]
        key = "vision_caps" if slot.modality == "image" else "audio_frame_caps"
        kw[key] = tuple(c for c in getattr(layout, key) if c >= cap)
    return dataclasses.replace(layout, **kw)


class SequentialBatches:
    """Global batch k = samples [k*B, (k+1)*B) of a random-access dataset; state = k."""

    def __init__(self, dataset, layout: AssemblyLayout, global_batch: int):
        self.dataset, self.layout, self.global_batch = dataset, layout, global_batch
        self.next_batch = 0
        self.shapes: BatchShapes | None = None

    def state(self) -> dict:
        return {"next_batch": self.next_batch}

    def restore(self, state: dict) -> None:
        self.next_batch = int(state["next_batch"])

    def __next__(self):
        start = self.next_batch * self.global_batch
        samples = [self.dataset[i] for i in range(start, start + self.global_batch)]
        self.next_batch += 1
        metas = [self.layout.rules.meta(s) for s in samples if check_sample(s, self.layout) is None]
        self.shapes = high_water(self.shapes, lambda hw: batch_shapes(
            [metas], _layout_at_least(self.layout, hw)))
        return assemble(samples, self.layout, shapes=self.shapes)


@gin.configurable
def train(workdir: str, model: MLLMConfig | None = None, steps: int = 30,
          global_batch: int = 8, compute_dtype: str = "float32", seed: int = 0,
          checkpoint_every: int = 10, progress: bool = True,
          stop_after: int | None = None) -> list[dict]:
    """Train `model` for `steps` steps (this invocation stops early after `stop_after`
    steps, as a preemption would; a rerun resumes); returns this run's metric records."""
    if compute_dtype not in _DTYPES:
        raise ValueError(f"train.compute_dtype={compute_dtype!r}: use one of {list(_DTYPES)}")
    if global_batch < 1 or steps < 1:
        raise ValueError("train.global_batch and train.steps must be >= 1")
    cfg = model or named_model_config()
    layout = data_layout(cfg)
    batches = SequentialBatches(synthetic_dataset(cfg), layout, global_batch)
    os.makedirs(workdir, exist_ok=True)
    console = Console(stderr=True)

    mdl = MultimodalModel(cfg, jax.random.key(seed))
    graphdef, trainable, frozen = split_model(mdl, trainable_filter(cfg))
    schedule = learning_rate_schedule(steps)
    tx = make_optimizer(schedule)
    state = TrainState(jnp.zeros((), jnp.int32), trainable, frozen, tx.init(trainable))
    step_fn = make_train_step(graphdef, tx, _DTYPES[compute_dtype])

    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"))
    start, skipped = 0, 0
    latest = ckpt.latest_step()
    if latest is not None:
        state, data_state = ckpt.restore(latest, state)
        batches.restore(data_state["batches"])
        start, skipped = latest, int(data_state.get("skipped_samples", 0))
        console.print(f"resumed from {workdir}/checkpoints step {latest}")
    n_params = sum(x.size for x in jax.tree.leaves(trainable))
    console.print(f"[bold]{cfg.name}[/]: {n_params:,} trainable parameters, "
                  f"{steps} steps of {global_batch} samples")

    records = []
    metrics_path = os.path.join(workdir, "metrics.jsonl")
    with open(metrics_path, "a") as mf, Progress(
            TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
            TextColumn("{task.fields[info]}"), TimeRemainingColumn(), console=console,
            disable=not progress) as bar:
        task = bar.add_task("train", total=steps, completed=start, info="")
        end = steps if stop_after is None else min(steps, start + stop_after)
        for step in range(start, end):
            batch = next(batches)
            skipped += len(batch.skipped)
            inputs = model_inputs(batch)
            t0 = time.perf_counter()
            state, m = step_fn(state, inputs)
            m = jax.device_get(m)  # one sync per step, after dispatch: the step time
            dt = time.perf_counter() - t0
            tokens = int(np.count_nonzero(batch.doc))
            rec = {"step": step + 1, "loss": float(m["loss"]), "lm_loss": float(m["lm_loss"]),
                   "diffusion_loss": float(m["diffusion_loss"]),
                   "grad_norm": float(m["grad_norm"]), "learning_rate": float(schedule(step)),
                   "tokens_per_s": tokens / dt, "step_time_s": dt,
                   "skipped_samples": skipped}
            records.append(rec)
            mf.write(json.dumps(rec) + "\n")
            mf.flush()
            bar.update(task, advance=1, info=f"loss {rec['loss']:.4f}")
            if (step + 1) % checkpoint_every == 0 or step + 1 == end:
                ckpt.save(step + 1, state, {"batches": batches.state(),
                                            "skipped_samples": skipped})
    ckpt.close()
    return records
