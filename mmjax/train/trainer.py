"""The training loop: data -> step -> metrics -> async checkpoints, resumable.

Everything is gin-configurable (`train.*`, `named_model_config.*`, `OptimizerSettings.*`,
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

from mmjax.data.layout import AssemblyLayout
from mmjax.data.batch_shapes import BatchShapes, batch_shapes
from mmjax.data.synthetic import SyntheticConfig, SyntheticDataset
from mmjax.data.sources import configured_source, eval_source
from mmjax.data.tokenizer import tokenizer
from mmjax.errors import UserError
from mmjax.models.config import MLLMConfig, config_to_dict
from mmjax.models.hf.pretrained import (PretrainedError, load_into_model,
                                        prepare_pretrained)
from mmjax.models.mllm import MultimodalModel, trainable_filter
from mmjax.planner.plan import Plan
from mmjax.train.auto_plan import auto_plan
from mmjax.train.checkpoint import Checkpointer, NonFiniteState
from mmjax.train.config import named_model_config, pretrained
from mmjax.train.inputs import model_inputs
from mmjax.train.logical_state import (pipeline_global_logical, pipeline_load_logical,
                                       restore_target, single_from_logical, single_logical)
from mmjax.train.optimizer import learning_rate_schedule, optimizer_from_settings
from mmjax.train.progress import Progress as StepProgress
from mmjax.train.progress import console as progress_console
from mmjax.train.step import TrainState, make_loss_fn, make_train_step, split_model
from mmjax.train.validate import check_data_path, check_train_settings

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@gin.configurable
def data_layout(cfg: MLLMConfig, seq_len: int = 256, packing: str = "pad",
                vision_caps=(64, 256, 1024), audio_frame_caps=(128, 256, 512, 1024),
                gen_num_queries: int = 16, special=None) -> AssemblyLayout:
    """`special`: a tokenizer's special ids (`Tokenizer.special_tokens()`), else reserved."""
    return AssemblyLayout.from_config(cfg, seq_len, packing, tuple(vision_caps),
                                      tuple(audio_frame_caps), gen_num_queries, special)


def fit_vocab(cfg: MLLMConfig, tok, tps=(1,)) -> MLLMConfig:
    """The model's vocabulary covers the tokenizer: rounded up to a multiple of 128 and of
    every tp (the embedding is split by tp); a larger, divisible vocabulary is kept."""
    from mmjax.data.tokenizer import padded_vocab

    v = cfg.llm.vocab_size
    if v >= tok.vocab_size and v == padded_vocab(v, tps):
        return cfg
    return cfg.replace(llm=dataclasses.replace(cfg.llm, vocab_size=padded_vocab(tok.vocab_size,
                                                                                tps)))


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


class SingleProgram:
    """Plain jit of the whole model on the default device (the parity reference). Reads
    the global batches every plan reads (train/single_data.py: the pipeline path's loader
    over a real source, `loader_source.path` or the synthetic set), whole."""

    def __init__(self, cfg, layout, global_batch, schedule, dtype, seed, source=None,
                 attention_impl="auto", pretrained=None):
        from mmjax.train.single_data import LoaderBatches

        def grow(shapes, metas):
            return high_water(shapes, lambda hw: batch_shapes(
                [metas], _layout_at_least(layout, hw)))
        self.data = LoaderBatches(source if source is not None else train_source(cfg), cfg,
                                  layout, global_batch, grow)
        self.cfg = cfg
        mdl = MultimodalModel(cfg, jax.random.key(seed))
        if pretrained:
            encoders = {k: v for k, v in pretrained.items() if k != "llm"}
            load_into_model(mdl, pretrained.get("llm"), encoders)
        graphdef, trainable, frozen = split_model(mdl, trainable_filter(cfg))
        tx = optimizer_from_settings(schedule)
        self.state = TrainState(jnp.zeros((), jnp.int32), trainable, frozen, tx.init(trainable))
        self.step_fn = make_train_step(graphdef, tx, dtype, attention_impl,
                                       layout.llm_mask_family)
        self.graphdef, self.dtype, self.global_batch, self.eval_fn = graphdef, dtype, global_batch, None
        self.attention_impl = attention_impl
        self.num_trainable = sum(x.size for x in jax.tree.leaves(trainable))
        # batch shapes -> the step compiled ahead of time for them: compilation is seen
        # (and reported) when it happens, not hidden in a step's time
        self.compiled: dict = {}
        self.progress = None  # train/progress.py Progress, set by the trainer

    def data_state(self) -> dict:
        return {"batches": self.data.state()}

    def load(self, state: dict, data_state: dict, step: int) -> None:
        """A checkpoint of either path: a pipeline run's has no `batches` state; the single
        program then goes on from global batch `step` of its own stream."""
        self.state = single_from_logical(self.state, state)
        self.data.restore(data_state.get("batches", {"next_batch": step, "shapes": None}))

    def checkpoint_tree(self) -> dict:
        """Plan-independent named arrays (train/logical_state.py)."""
        return single_logical(self.state)

    def step(self):
        t_wait = time.perf_counter()
        batch, skipped = next(self.data), []
        if isinstance(batch, tuple):  # SourceBatches: (batch, skipped before assembly)
            batch, skipped = batch
        skipped = skipped + [(str(i), r) for i, r in batch.skipped]
        inputs = model_inputs(batch)
        leaves, treedef = jax.tree.flatten(inputs)
        key = (str(treedef), tuple((np.shape(x), str(np.asarray(x).dtype)) for x in leaves))
        compile_s = 0.0
        if key not in self.compiled:
            sh = batch.shapes
            what = (f"the training step for {sh.rows} rows x {batch.tokens.shape[1]} tokens"
                    + "".join(f", {n} {k} x {c}" for n, c, k in sh.encoders)
                    + (f", {sh.gen} generated images" if sh.gen else "")
                    + ("" if not self.compiled else " (new batch shapes)"))
            if self.progress is not None:
                self.progress.compiling(what)
            t = time.perf_counter()
            self.compiled[key] = self.step_fn.lower(self.state, inputs).compile()
            compile_s = time.perf_counter() - t
            if self.progress is not None:
                self.progress.compiled(what, compile_s)
        t0 = time.perf_counter()
        self.state, m = self.compiled[key](self.state, inputs)
        m = {k: float(v) for k, v in jax.device_get(m).items()}  # one sync, after dispatch
        m["step_time_s"] = time.perf_counter() - t0
        m["compile_s"] = compile_s
        m["data_wait_s"] = t0 - t_wait
        m["tokens"] = int(np.count_nonzero(batch.doc))
        m["tokens_trained"] = int(batch.num_target_tokens)
        m["skipped"] = len(skipped)
        m["skipped_list"] = skipped
        return m

    def evaluate(self, source, max_batches: int, layout) -> float:
        """Mean loss per trained token over the held-out set's first global batches
        (`eval_batches`: the same samples every plan evaluates)."""
        from mmjax.data.batch_shapes import batch_shapes
        from mmjax.train.single_data import LoaderBatches

        if self.eval_fn is None:
            loss_fn = make_loss_fn(self.graphdef, self.dtype, self.attention_impl,
                                   layout.llm_mask_family)
            self.eval_fn = jax.jit(lambda s, b: loss_fn(s.trainable, s.frozen, b)[1]["lm_loss"])
        data = LoaderBatches(source, self.cfg, layout, self.global_batch,
                             lambda _, metas: batch_shapes([metas], layout), shuffle=False)
        total, count = 0.0, 0
        try:
            for _ in range(eval_batches(source, max_batches, self.global_batch)):
                batch, _ = next(data)
                n = batch.num_target_tokens
                total += float(self.eval_fn(self.state, model_inputs(batch))) * n
                count += n
        finally:
            data.close()
        return total / max(count, 1)

    def close(self):
        if hasattr(self.data, "close"):
            self.data.close()


def eval_batches(source, max_batches: int, global_batch: int) -> int:
    """How many held-out global batches an evaluation reads (at least one)."""
    return min(max_batches, max(1, len(source) // global_batch))


def write_trace(workdir: str, step: int, cfg, plan: Plan, trace: list[dict]) -> str:
    """`<workdir>/traces/step_<step>.json`: what scripts/replan.py reads."""
    path = os.path.join(workdir, "traces", f"step_{step}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"model": cfg.name, "plan": plan.to_json(), "trace": trace}, f)
    return path


def train_source(cfg):
    """The trainer's data source (gin): `loader_source.path` (an ArrayRecord file from
    scripts/make_dataset.py) or the gin-configured synthetic set."""
    from mmjax.data.loader import SyntheticSource, loader_source

    return loader_source(lambda: SyntheticSource(synthetic_dataset(cfg)))


class Pipelined:
    """A Plan on the pipeline runtime, fed by the grain loader (planning, balancing and
    assembly off the training path, in its prefetch thread or worker processes)."""

    def __init__(self, cfg, layout, plan, schedule, dtype, seed, source=None, pretrained=None):
        from mmjax.data.loader import Loader
        from mmjax.train.pipeline_step import PipelineStep

        self.step_fn = PipelineStep(cfg, plan, schedule, dtype, seed, pretrained=pretrained,
                                    llm_mask_family=layout.llm_mask_family)
        self.cfg, self.plan, self.global_batch = cfg, plan, plan.global_batch
        # gin: a real source (`llava_source.*`, `webdataset_source.*`), else
        # `loader_source.path` or the synthetic set (`train_source`); `Loader.*` (balance,
        # post_balance_policy, workers, ...).
        self.data = Loader(source if source is not None else train_source(cfg), cfg, plan,
                           layout, feeds=True)
        self.num_trainable = sum(x.size for x in jax.tree.leaves(
            [st.trainable for st in self.step_fn.runtime.stages.values()]))
        self.progress, self.steps_run = None, 0  # train/progress.py Progress

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

    def step(self, trace: bool = False):
        """One training step; `trace`: time every action alone (pipeline/trace.py "serial")
        and return the records under "trace"."""
        t_wait = time.perf_counter()
        gb = next(self.data)
        feeds = [mb.inputs["feed"] for mb in gb.microbatches]
        first = self.steps_run == 0
        if first and self.progress is not None:  # the stages compile inside the first step
            self.progress.compiling("the pipeline's stage programs (inside the first step)")
        t0 = time.perf_counter()
        m = self.step_fn(feeds, trace=trace)
        m["step_time_s"] = time.perf_counter() - t0
        self.steps_run += 1
        m["compile_s"] = m["step_time_s"] if first else 0.0
        if first and self.progress is not None:
            self.progress.compiled("the first pipelined step", m["step_time_s"])
        m["data_wait_s"] = t0 - t_wait
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
                feeds = [mb.inputs["feed"] for mb in next(data).microbatches]
                lm = self.step_fn.runtime.evaluate(feeds).losses()["lm_loss"]
                tokens = sum(f.num_target_tokens for f in feeds)
                total += lm * tokens
                count += tokens
        finally:
            data.close()
        return total / max(count, 1)

    def close(self):
        self.data.close()


def parse_trace_steps(trace_steps: str | None, plan: str | None) -> tuple[int, int]:
    """`train.trace_steps` "A:B" -> (A, B), 1-based inclusive; None -> an empty range."""
    if trace_steps is None:
        return (1, 0)
    a, sep, b = str(trace_steps).partition(":")
    if not (sep and a.isdigit() and b.isdigit() and 1 <= int(a) <= int(b)):
        raise UserError(f"train.trace_steps={trace_steps!r}: use 'A:B' with 1 <= A <= B, "
                        f"e.g. '3:4'")
    if plan is None:
        raise UserError("train.trace_steps traces the pipeline runtime's actions: add "
                        "--plan=manual (or a Plan JSON); the single program is one XLA "
                        "program (profile it with jax.profiler)")
    return int(a), int(b)


class TrainingStopped(RuntimeError):
    """Training cannot usefully continue (one-line reason; checkpoints are intact)."""


def truncate_metrics(path: str, upto: int, one_per_step: bool = True) -> None:
    """Keep the rows of JSONL `path` with step <= `upto` (rows past the restored checkpoint
    were written by the interrupted run and are about to be redone); `one_per_step`: the
    last row of each step only (metrics.jsonl; skipped.jsonl has one row per sample).
    Rewritten atomically: a temporary file then os.replace, so a kill leaves the old or the
    new file, never half of one."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = f.readlines()
    kept: dict = {}  # step -> its last row (files from older versions repeat), or row order
    for n, line in enumerate(lines):
        try:
            row = json.loads(line)
        except ValueError:  # a row cut short by a kill mid-write
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= upto:
            key = row["step"] if one_per_step else (row["step"], n)
            kept[key] = line if line.endswith("\n") else line + "\n"
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(kept[k] for k in sorted(kept))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _last_good(ckpt) -> str:
    ckpt.wait()
    step = ckpt.latest_step()
    return f"step {step} in {ckpt.directory}" if step is not None else "none yet"


RUN_INFO = "run.json"


def write_run_info(workdir: str, cfg: MLLMConfig, plan: Plan | None, seed: int,
                   pretrained: dict | None = None) -> None:
    """DIR/run.json: the model config, plan, seed and pretrained directories a checkpoint
    belongs to (what scripts/export_hf.py rebuilds the model from)."""
    info = {"model": config_to_dict(cfg), "plan": None if plan is None else plan.to_json(),
            "seed": seed, "pretrained": {k: os.path.abspath(v) for k, v in
                                         (pretrained or {}).items()}}
    with open(os.path.join(workdir, RUN_INFO), "w") as f:
        json.dump(info, f, indent=1)


def _check_pretrained_vocab(cfg: MLLMConfig, dirs: dict) -> None:
    """A pretrained LLM keeps its vocabulary: a tokenizer that needs another is an error."""
    if "llm" in dirs:
        from mmjax.models.hf import config_for
        want = config_for(dirs["llm"]).vocab_size
        if cfg.llm.vocab_size != want:
            raise PretrainedError(f"pretrained: the tokenizer / tp need vocab_size "
                                  f"{cfg.llm.vocab_size}, the LLM checkpoint has {want}; use "
                                  f"the checkpoint's tokenizer and a tp dividing {want}")


def _data(cfg: MLLMConfig, tok):
    """The layout (with the tokenizer's special ids) and the configured real source."""
    layout = data_layout(cfg, special=tok.special_tokens() if tok is not None else None)
    return layout, configured_source(cfg, tok)


def use_compilation_cache(workdir: str, setting: str) -> str | None:
    """Point JAX's persistent compilation cache at `setting` (see `train`); -> the path."""
    if not isinstance(setting, str):
        raise UserError(f"train.compilation_cache_dir={setting!r}: use a directory, \"\" "
                        f"(default: <workdir>/compilation_cache) or \"off\"")
    if setting == "off":
        return None
    path = setting or os.environ.get("JAX_COMPILATION_CACHE_DIR") or os.path.join(
        workdir, "compilation_cache")
    jax.config.update("jax_compilation_cache_dir", path)
    return path


@gin.configurable
def train(workdir: str, model: MLLMConfig | None = None, steps: int = 30,
          global_batch: int = 8, compute_dtype: str = "float32", seed: int = 0,
          checkpoint_every: int = 10, progress: bool = True,
          stop_after: int | None = None, plan: str | None = None,
          eval_every: int = 0, attention_impl: str | None = None,
          trace_every: int = 0, keep_checkpoints: int = 3, keep_every: int | None = None,
          max_bad_steps: int = 5, trace_steps: str | None = None,
          compilation_cache_dir: str = "") -> list[dict]:
    """Train `model` for `steps` steps (this invocation stops early after `stop_after`
    steps, as a preemption would; a rerun resumes); returns this run's metric records.

    `plan`: None trains the whole model as one program on the default device; "manual"
    uses the gin-bound `manual_plan`; "auto" plans at start-up for the devices present
    and the run's data (train/auto_plan.py); any other value is a Plan JSON file
    (scripts/plan.py --json). A plan runs on the pipeline runtime over all devices.
    `eval_every` > 0: every that many steps (and at the end), the validation loss on the
    held-out `eval_source.*` set goes into the step's metrics as `eval_loss`.
    `attention_impl` (models/attention.py `bam_attention`: auto, dense, chunked, pallas,
    cudnn) sets every unit's attention; with a plan it replaces each unit's plan field.
    `trace_every` = N > 0 (with a plan): every N-th step runs traced and writes
    `<workdir>/traces/step_<n>.json` (model, Plan, serial trace) for scripts/replan.py.
    `trace_steps` = "A:B" (with a plan): steps A..B (1-based, inclusive) run traced and
    write those files too (scripts/train.py --trace_steps renders each as a timeline).

    Checkpoints: every `checkpoint_every` steps; the newest `keep_checkpoints` are kept, and
    every multiple of `keep_every` permanently. A resume takes the newest checkpoint that
    verifies (train/checkpoint.py), naming and setting aside any that do not.

    A step whose loss or gradient norm is not finite is not applied (counted in
    `nonfinite_steps`); `max_bad_steps` of them in a row stop the run (TrainingStopped)
    with the last good checkpoint intact. On resume metrics.jsonl keeps only the rows up to
    the restored step, so every step appears once.

    `compilation_cache_dir`: JAX's persistent compilation cache, so a resume or rerun loads
    its programs instead of compiling them: "" (default) uses $JAX_COMPILATION_CACHE_DIR if
    set, else `<workdir>/compilation_cache`; "off" disables it; any other value is the
    directory."""
    check_train_settings(steps, global_batch, compute_dtype, _DTYPES, seed, checkpoint_every,
                         progress, stop_after, plan, keep_checkpoints, keep_every, max_bad_steps)
    if trace_every < 0:
        raise UserError(f"train.trace_every={trace_every}: use 0 (off) or N >= 1")
    trace_range = parse_trace_steps(trace_steps, plan)
    use_compilation_cache(workdir, compilation_cache_dir)
    check_data_path()
    cfg = model or named_model_config()
    dirs = pretrained()  # gin: pretrained.<unit> = "/hf/checkpoint/dir"
    if dirs:  # configs from config.json; files, names and shapes checked before any work
        cfg = prepare_pretrained(cfg, dirs)
    tok = tokenizer()
    if tok is not None:
        cfg = fit_vocab(cfg, tok)
    _check_pretrained_vocab(cfg, dirs)
    schedule = learning_rate_schedule(steps)
    dtype = _DTYPES[compute_dtype]
    held_out = eval_source(cfg, tok) if eval_every else None
    if eval_every and held_out is None:
        raise UserError("train.eval_every needs a held-out set: set eval_source.json_path "
                        "(a LLaVA JSON/JSONL) or eval_source.urls (WebDataset shards)")
    if attention_impl is not None:
        from mmjax.models.attention import choose_implementation

        choose_implementation(attention_impl, 1, 1, dtype)  # reject a bad name up front
    if plan is None:
        layout, source = _data(cfg, tok)
        runner = SingleProgram(cfg, layout, global_batch, schedule, dtype, seed, source,
                               attention_impl or "auto", dirs)
    else:
        from mmjax.train.pipeline_step import manual_plan

        if plan == "manual":
            the_plan = manual_plan(global_batch=global_batch, model=cfg)
        elif plan == "auto":  # planned for the source this run reads
            real = _data(cfg, tok)[1]
            the_plan = auto_plan(cfg, global_batch, real if real is not None
                                 else train_source(cfg))
            progress_console().print("auto plan: " + "; ".join(
                f"{u.name} dp={u.dp} tp={u.tp} pp={u.pp}" for u in the_plan.units))
        else:
            the_plan = Plan.load(plan)
        if the_plan.global_batch != global_batch:
            raise UserError(f"plan global_batch={the_plan.global_batch} differs from "
                            f"train.global_batch={global_batch}: make them equal")
        if tok is not None:
            cfg = fit_vocab(cfg, tok, [u.tp for u in the_plan.units])
        if attention_impl is not None:
            the_plan = dataclasses.replace(the_plan, units=tuple(
                dataclasses.replace(u, attention_impl=attention_impl) for u in the_plan.units))
        the_plan.validate(cfg, jax.device_count())
        layout, source = _data(cfg, tok)
        _check_pretrained_vocab(cfg, dirs)
        runner = Pipelined(cfg, layout, the_plan, schedule, dtype, seed, source, dirs)
    os.makedirs(workdir, exist_ok=True)
    if jax.process_index() == 0:  # what scripts/generate.py rebuilds the model and data from
        with open(os.path.join(workdir, "config.gin"), "w") as f:
            f.write(gin.config_str())
        write_run_info(workdir, cfg, None if plan is None else the_plan, seed, dirs)
    console = progress_console()
    # Multi-process (mmjax.launch): every process runs the loop; process 0 writes the
    # metrics. Checkpoints: each process writes the shards it holds (orbax multi-host, one
    # commit when all have written), in the plan-independent layout.
    lead = jax.process_index() == 0
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), keep_checkpoints, keep_every,
                        log=lambda msg: console.print(msg, markup=False) if lead else None)
    if jax.process_count() > 1 and lead:
        console.print(f"{jax.process_count()} processes: metrics from process 0, "
                      "checkpoints from all")
    start, skipped, nonfinite = 0, 0, 0
    found = ckpt.restore_latest(getattr(runner, "restore_target", runner.checkpoint_tree)())
    if found is not None:
        latest, state, data_state = found
        runner.load(state, data_state, latest)
        start, skipped = latest, int(data_state.get("skipped_samples", 0))
        nonfinite = int(data_state.get("nonfinite_steps", 0))
        console.print(f"resumed from {workdir}/checkpoints step {latest}")
    where = "one program" if plan is None else f"plan {plan} on {jax.device_count()} devices"
    console.print(f"[bold]{cfg.name}[/]: {runner.num_trainable:,} trainable parameters, "
                  f"{steps} steps of {global_batch} samples, {where}")

    report = StepProgress(console, steps, start, global_batch, enabled=progress and lead)
    runner.progress = report
    records, in_a_row = [], 0
    metrics_path = os.path.join(workdir, "metrics.jsonl")
    skipped_path = os.path.join(workdir, "skipped.jsonl")
    if lead:
        truncate_metrics(metrics_path, start)
        truncate_metrics(skipped_path, start, one_per_step=False)
    try:
        with open(metrics_path if lead else os.devnull, "a") as mf, \
                open(skipped_path if lead else os.devnull, "a") as sf:
            end = steps if stop_after is None else min(steps, start + stop_after)
            for step in range(start, end):
                traced = plan is not None and (
                    (trace_every > 0 and (step + 1) % trace_every == 0)
                    or trace_range[0] <= step + 1 <= trace_range[1])
                m = runner.step(trace=True) if traced else runner.step()
                if traced and lead:
                    write_trace(workdir, step + 1, cfg, the_plan, m.pop("trace"))
                skipped += m["skipped"]
                bad = bool(m["nonfinite"])
                nonfinite, in_a_row = nonfinite + bad, (in_a_row + 1) if bad else 0
                # tokens seen (every non-pad LLM position) and tokens trained (loss targets:
                # masked prompt tokens count in neither the loss nor the trained figure)
                rec = {"step": step + 1, "loss": m["loss"], "lm_loss": m["lm_loss"],
                       "diffusion_loss": m["diffusion_loss"], "grad_norm": m["grad_norm"],
                       "learning_rate": float(schedule(step)),
                       "tokens_per_s": m["tokens"] / m["step_time_s"],
                       "trained_tokens_per_s": m["tokens_trained"] / m["step_time_s"],
                       "tokens_seen": m["tokens"], "tokens_trained": m["tokens_trained"],
                       "step_time_s": m["step_time_s"], "data_wait_s": m["data_wait_s"],
                       "skipped_samples": skipped, "nonfinite_steps": nonfinite}
                if eval_every and ((step + 1) % eval_every == 0 or step + 1 == end):
                    rec["eval_loss"] = runner.evaluate(*held_out, layout)
                records.append(rec)
                mf.write(json.dumps(rec) + "\n")
                mf.flush()
                for name, reason in m["skipped_list"]:
                    sf.write(json.dumps({"step": step + 1, "id": name, "reason": reason}) + "\n")
                sf.flush()
                report.step(rec, m.get("compile_s", 0.0) > 0)
                if in_a_row >= max_bad_steps:
                    raise TrainingStopped(
                        f"{in_a_row} steps in a row ({step + 2 - in_a_row}..{step + 1}) had a "
                        f"non-finite loss or gradient norm (last: loss {rec['loss']}, grad_norm "
                        f"{rec['grad_norm']}); none was applied. Last good checkpoint: "
                        f"{_last_good(ckpt)} (lower the learning rate or check the data, then "
                        f"rerun to resume; train.max_bad_steps={max_bad_steps})")
                # a step in a bad streak changed no parameters: no checkpoint until one is good
                if ckpt is not None and not in_a_row and (
                        (step + 1) % checkpoint_every == 0 or step + 1 == end):
                    try:
                        ckpt.save(step + 1, runner.checkpoint_tree(),
                                  {**runner.data_state(), "skipped_samples": skipped,
                                   "nonfinite_steps": nonfinite})
                    except NonFiniteState as e:
                        raise TrainingStopped(f"step {step + 1}: {e}; last good checkpoint: "
                                              f"{_last_good(ckpt)} (lower the learning rate, "
                                              f"then rerun to resume)") from None
        if records:
            report.say("trained " + report.summary(len(records)))
    finally:
        if ckpt is not None:
            ckpt.close()
        if hasattr(runner, "close"):
            runner.close()
    return records
