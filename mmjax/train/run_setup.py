"""What a run builds before its first step: the model config and tokenizer (with the
pretrained checkpoints' sizes), the run's Plan, and `train.dry_run`'s check of all of it."""
from __future__ import annotations

import dataclasses

import jax

from mmjax.data.tokenizer import tokenizer
from mmjax.errors import UserError, first_line
from mmjax.models.config import MLLMConfig
from mmjax.models.hf.pretrained import expand_whole_model, prepare_pretrained, whole_base
from mmjax.planner.plan import Plan
from mmjax.train.config import named_model_config, pretrained
from mmjax.train.data_config import fit_vocab, layout_and_source, train_source
from mmjax.train.lora_setup import ADAPTER, with_adapter, with_lora
from mmjax.train.progress import console as progress_console
from mmjax.train.validate import check_pretrained_vocab
from mmjax.models.units import VAE_UNIT, has_llm
from mmjax.schedule.named import named_schedule
from mmjax.schedule.stage_graph import StageGraph
from mmjax.train.vae_latents import place_vae


def dry_run_build(cfg, tok, dirs, plan, global_batch, attention_impl, schedule,
                  dtype=None, check_memory: bool = False, chosen: Plan | None = None,
                  pipeline_schedule: str = "1f1b") -> None:
    """What a run builds before its first step, short of parameters and programs: the
    plan, the optimizer, the data source and the first global batch (selected and planned
    from metadata, decoded and assembled: `batch_check.check_global_batch`, at most its
    first 512 samples), so a setting that would break them fails here; with
    `check_memory` and one program (`plan` None), the run's memory check at the first
    global batch's shapes, before anything is decoded (train/memory_check.py
    `check_single_program`: the run refuses the same way).
    `chosen`: the Plan `plan` names, already built (`run_plan`'s `chosen`); with a plan,
    `pipeline_schedule` is built over it (a schedule the plan cannot run fails here)."""
    from mmjax.data.batch_check import check_global_batch
    from mmjax.data.global_batch import GlobalBatchBuilder
    from mmjax.data.loader import Loader
    from mmjax.data.sample_stream import SampleStream
    from mmjax.train.optimizer import optimizer_from_settings

    optimizer_from_settings(schedule)
    float(schedule(0))
    layout, source = layout_and_source(cfg, tok)
    source = source if source is not None else train_source(cfg)
    memory = None
    data: GlobalBatchBuilder | SampleStream
    if plan is not None:  # the plan's batch planner over the stream
        the_plan = run_plan(plan, cfg, tok, dirs, global_batch, attention_impl, chosen)[0]
        named_schedule(pipeline_schedule, StageGraph.from_plan(the_plan),
                       the_plan.num_microbatches)
        data = Loader.build(source, cfg, the_plan, layout).builder
    else:  # one program: the stream's samples, assembled
        data = SampleStream.from_gin(source, layout, global_batch)
        if check_memory:
            def memory(metas):
                _check_single_program_memory(cfg, layout, metas, global_batch, dtype,
                                             attention_impl)
    check_global_batch(data, 0, on_metadata=memory)


def _check_single_program_memory(cfg, layout, metas, global_batch, dtype,
                                 attention_impl) -> None:
    """`check_single_program` (refusing) at the shapes of global batch 0's metadata
    `metas` (a run pads to at least these) with the model's abstract parameter counts:
    nothing allocated, nothing decoded."""
    from mmjax.data.batch_shapes import grow_shapes
    from mmjax.models.mllm import MultimodalModel, trainable_filter
    from mmjax.parallel.sharded_init import abstract_split
    from mmjax.train.memory_check import check_single_program

    _, tr, fr = abstract_split(MultimodalModel, (cfg,), jax.random.key(0),
                               (trainable_filter(cfg), ...))
    count = lambda t: sum(x.size for x in jax.tree.leaves(t))  # noqa: E731
    check_single_program(cfg, grow_shapes(None, metas, layout), layout.seq_len, count(tr),
                         count(fr), dtype, attention_impl or "auto", global_batch,
                         jax.local_devices()[0], refuse=True)


def model_and_tokenizer(model: MLLMConfig | None):
    """(model config, tokenizer or None, pretrained dirs): the gin-named model, its sizes
    from the pretrained checkpoints' config.json, its vocabulary covering the tokenizer."""
    cfg = model or named_model_config()
    # gin: pretrained.<unit> = "/hf/checkpoint/dir"; pretrained.model: a whole checkpoint
    dirs = pretrained()
    adapter = dirs.pop(ADAPTER, None)  # a peft adapter to continue training (lora_setup.py)
    dirs = expand_whole_model(dirs)
    if dirs:  # configs from config.json; files, names and shapes checked before any work
        cfg = prepare_pretrained(cfg, dirs)
    tok = tokenizer()
    if tok is not None:
        cfg = fit_vocab(cfg, tok, pretrained=has_llm(dirs) or "model" in dirs)
    check_pretrained_vocab(cfg, dirs)
    cfg = with_lora(cfg)  # gin's lora.*: adapters on the parts it names
    if adapter is not None:
        cfg = with_adapter(cfg, adapter, whole_base(dirs) is not None)
    cfg, vae_dir, decision = place_vae(cfg)
    if decision is not None:  # "auto": the planner's choice and why
        progress_console().print(f"vae placement: {'device (a frozen unit)' if vae_dir else 'host'}"
                                 f" -- {decision.reason}", markup=False, highlight=False)
    if vae_dir is not None:  # the VAE unit's weights, read like a pretrained unit's
        dirs = {**dirs, VAE_UNIT: vae_dir}
    if adapter is not None:  # read after the base, into the adapters (hf/pretrained.py)
        dirs = {**dirs, ADAPTER: adapter}
    return cfg, tok, dirs


def run_plan(plan: str, cfg: MLLMConfig, tok, dirs: dict, global_batch: int,
             attention_impl: str | None, chosen: Plan | None = None) -> tuple[Plan, MLLMConfig]:
    """The run's Plan (`chosen`: the one `manual_plan` or `auto_plan` built for the layout;
    else the Plan JSON `plan`), validated, and the config its tp sizes need. A Plan JSON
    that fails a check says first when it was made for another model."""
    if chosen is not None:
        return prepared_plan(chosen, cfg, tok, dirs, global_batch, attention_impl)
    try:
        return prepared_plan(Plan.load(plan), cfg, tok, dirs, global_batch, attention_impl)
    except UserError as e:
        raise another_models_plan(plan, cfg.name, e) from None


def another_models_plan(path: str, model: str, error: UserError) -> UserError:
    """A Plan JSON this run refuses, said first as what it is when scripts/plan.py made it
    for another model (its "model" field): the one line names both models and the fix,
    then the first thing that failed; `error` itself otherwise."""
    import json

    try:
        with open(path) as f:
            made_for = json.load(f).get("model")
    except (OSError, ValueError, AttributeError):
        return error
    if made_for is None or made_for == model:
        return error
    return UserError(f"--plan={path} was made for model {made_for!r}, this run trains "
                     f"{model!r}: plan this model (scripts/plan.py --gin_file=<this run's "
                     f"gin file> --json={path}) ({first_line(error)})")


def prepared_plan(the_plan: Plan, cfg: MLLMConfig, tok, dirs: dict, global_batch: int,
              attention_impl: str | None, same_config: bool = False):
    """`the_plan` validated for the run, and the config its tp sizes need (`same_config`:
    a plan to switch to must train the running config, e.g. the same padded vocabulary)."""
    if the_plan.global_batch != global_batch:
        raise UserError(f"plan global_batch={the_plan.global_batch} differs from "
                        f"train.global_batch={global_batch}: make them equal")
    if tok is not None:
        fitted = fit_vocab(cfg, tok, [u.tp for u in the_plan.units],
                           pretrained=has_llm(dirs) or "model" in dirs)
        if same_config and fitted != cfg:
            raise UserError(f"the plan's tp sizes need vocab_size {fitted.llm.vocab_size}, "
                            f"the run trains {cfg.llm.vocab_size}")
        cfg = fitted
    if attention_impl is not None:
        the_plan = dataclasses.replace(the_plan, units=tuple(
            dataclasses.replace(u, attention_impl=attention_impl) for u in the_plan.units))
    the_plan.validate(cfg, jax.device_count())
    check_pretrained_vocab(cfg, dirs)
    return the_plan, cfg
