"""Settings checked before any work: each bad value is a one-line UserError naming the
setting and what it accepts (scripts/train.py prints it as `error: ...` and exits 2, with
no workdir written)."""
from __future__ import annotations

import os

import gin

from mmjax.errors import UserError, shown
from mmjax.planner.plan import REMAT_POLICIES
from mmjax.settings import INT_MAX
from mmjax.models.units import has_llm

_INT_KNOBS = ("dp", "tp", "pp", "cp", "num_chunks", "tp_chunks", "cp_head_groups")
_BOOL_KNOBS = ("overlap_tp", "tp_bidirectional")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def positive_int(name: str, value, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not _is_int(value) or not 1 <= value <= INT_MAX:
        extra = ", or None" if allow_none else ""
        raise UserError(f"{name}={shown(value)}: must be an int >= 1 and <= "
                        f"{INT_MAX:,}{extra}")


def check_train_settings(steps, global_batch, compute_dtype, dtypes, seed, checkpoint_every,
                         progress, stop_after, plan, keep_checkpoints, keep_every,
                         max_bad_steps) -> None:
    """The `train.*` gin settings (see trainer.train)."""
    for name, v in (("steps", steps), ("global_batch", global_batch),
                    ("checkpoint_every", checkpoint_every),
                    ("keep_checkpoints", keep_checkpoints), ("max_bad_steps", max_bad_steps)):
        positive_int(f"train.{name}", v)
    positive_int("train.stop_after", stop_after, allow_none=True)
    positive_int("train.keep_every", keep_every, allow_none=True)
    if not isinstance(compute_dtype, str) or compute_dtype not in dtypes:
        raise UserError(f"train.compute_dtype={compute_dtype!r}: must be one of {list(dtypes)}")
    if not _is_int(seed) or seed < 0:
        raise UserError(f"train.seed={seed!r}: must be an int >= 0")
    if not isinstance(progress, bool):
        raise UserError(f"train.progress={progress!r}: must be True or False")
    if plan is not None and not isinstance(plan, str):
        raise UserError(f"train.plan={plan!r}: must be a Plan JSON path, 'manual', 'auto' "
                        f"or None")
    if plan not in (None, "manual", "auto") and not os.path.exists(plan):
        raise UserError(f"train.plan={plan!r}: no such file; pass a Plan JSON from "
                        "scripts/plan.py --json, 'auto', or 'manual' with manual_plan.* "
                        "bindings")


def check_manual_plan(units, global_batch, num_microbatches, **knobs) -> None:
    """`manual_plan.*`: per-unit dicts name only the model's units; values have the types
    and ranges the plan accepts."""
    positive_int("manual_plan.global_batch", global_batch)
    positive_int("manual_plan.num_microbatches", num_microbatches)
    for knob, value in knobs.items():
        if value is None:
            continue
        per_unit = value if isinstance(value, dict) else {"(every unit)": value}
        unknown = [u for u in per_unit if u != "(every unit)" and u not in units]
        if unknown:
            raise UserError(f"manual_plan.{knob}: unknown unit(s) {unknown}; the model's "
                            f"units are {list(units)}")
        for unit, v in per_unit.items():
            where = f"manual_plan.{knob}[{unit!r}]" if isinstance(value, dict) \
                else f"manual_plan.{knob}"
            if knob in _INT_KNOBS:
                positive_int(where, v)
            elif knob in _BOOL_KNOBS and not isinstance(v, bool):
                raise UserError(f"{where}={v!r}: must be True or False")
            elif knob == "remat" and (not isinstance(v, str) or v not in REMAT_POLICIES):
                raise UserError(f"{where}={v!r}: must be one of {list(REMAT_POLICIES)}")


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
    try:
        return gin.query_parameter(name) is not None
    except ValueError:  # not bound
        return False


def check_data_path() -> None:
    """`loader_source.path`, when bound, must exist (for either training path)."""
    if not gin_bound("loader_source.path"):
        return
    path = gin.query_parameter("loader_source.path")
    if not isinstance(path, str) or not os.path.exists(path):
        raise UserError(f"loader_source.path={path!r}: no such file; write the dataset with "
                        f"scripts/make_dataset.py --out=PATH")


def check_min_gain(value) -> None:
    """`train.replan_min_gain`: the predicted speed-up a plan switch must promise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 1:
        raise UserError(f"train.replan_min_gain={value!r}: must be a number > 1 "
                        f"(e.g. 1.10 for a 10% predicted speed-up)")


def check_replan_settings(replan_every, replan_min_gain, plan, replanner) -> None:
    """`train.replan_every` / `train.replan_min_gain` (and an explicit `replanner`)."""
    if not _is_int(replan_every) or replan_every < 0:
        raise UserError(f"train.replan_every={replan_every!r}: use 0 (off) or N >= 1")
    check_min_gain(replan_min_gain)
    if replan_every and plan is None:
        raise UserError("train.replan_every re-plans the pipeline runtime: add --plan=auto "
                        "or a plan JSON (the single program has no plan to change)")
    if replanner is not None and not replan_every:
        raise UserError("train(replanner=...) is used every train.replan_every steps: set "
                        "train.replan_every=N")


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
