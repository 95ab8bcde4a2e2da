"""Settings checked before any work, beyond each one's own check in the settings table
(mmjax/settings/): each bad value is a one-line UserError naming the setting and what it
accepts (scripts/train.py prints it as `error: ...` and exits 2, with no workdir written)."""
from __future__ import annotations

import os

from mmjax.errors import UserError
from mmjax.models.units import has_llm
from mmjax.settings import bound, check_args


def check_manual_plan(units, global_batch, num_microbatches, **knobs) -> None:
    """`manual_plan.*` as called, by the settings table: per-unit dicts name only the
    model's units; values have the types and ranges the plan accepts. `global_batch`: the
    run's (`train.global_batch`)."""
    check_args("train", global_batch=global_batch)
    check_args("manual_plan", units, num_microbatches=num_microbatches, **knobs)


def check_manual_batches(global_batch: int, num_microbatches: int, dp) -> None:
    """A manual (disaggregated) plan's batch split, in the user's settings: the global batch
    into `num_microbatches`, each microbatch over every unit's `dp` ranks."""
    if global_batch % num_microbatches:
        raise UserError(f"train.global_batch={global_batch} is not divisible by "
                        f"manual_plan.num_microbatches={num_microbatches}: use a global batch "
                        f"that is a multiple of {num_microbatches}, or a num_microbatches "
                        f"dividing {global_batch}")
    mb = global_batch // num_microbatches
    per_unit = dp if isinstance(dp, dict) else {} if dp is None else {None: dp}
    for unit, v in per_unit.items():
        if mb % v:
            where = "manual_plan.dp" + ("" if unit is None else f"[{unit!r}]")
            raise UserError(f"{where}={v} does not divide the microbatch size {mb} "
                            f"(train.global_batch={global_batch} / manual_plan."
                            f"num_microbatches={num_microbatches}): use a global batch "
                            f"that is a multiple of {num_microbatches * v}, or a dp "
                            f"dividing {mb}")


def gin_bound(name: str) -> bool:
    """Whether gin binds `name` ("configurable.param") to something other than None."""
    return bound(name) is not None


def check_data_path() -> None:
    """`loader_source.path`, when bound, must exist (for either training path)."""
    path = bound("loader_source.path")
    if path is not None and (not isinstance(path, str) or not os.path.exists(path)):
        raise UserError(f"loader_source.path={path!r}: no such file; write the dataset with "
                        f"scripts/make_dataset.py --out=PATH")


def check_min_gain(value) -> None:
    """`train.replan_min_gain`: the predicted speed-up a plan switch must promise."""
    check_args("train", replan_min_gain=value)


def check_pretrained_vocab(cfg, dirs: dict) -> None:
    """A pretrained LLM keeps its vocabulary: a tokenizer that needs another is an error."""
    if has_llm(dirs) or "model" in dirs:  # a whole LLaVA, or an LLM (Qwen2-VL's too)
        from mmjax.models.hf.pretrained import PretrainedError, pretrained_config
        which = {u: dirs[u] for u in ("model", "llm") if u in dirs}
        want = pretrained_config(cfg, which).llm.vocab_size
        if cfg.llm.vocab_size != want:
            raise PretrainedError(f"pretrained: the tokenizer / tp need vocab_size "
                                  f"{cfg.llm.vocab_size}, the LLM checkpoint has {want}; use "
                                  f"the checkpoint's tokenizer and a tp dividing {want}")
