"""Every gin setting's type and range, in one table (no JAX), checked before any work.

`SETTINGS[configurable][parameter]` is a `Setting`: its kind (int, float, bool, str, a
choice, a path, a per-unit dict), its bounds, whether None is allowed, its default, and the
mode it needs (a plan, `--plan=auto`, an evaluation set) when it has no effect otherwise.
Choice lists come from the modules that act on them. `bound` is the one place gin's bindings
are read back (outside gin's own calls).
`check_bound_settings` walks gin's bindings of every configurable (`gin.get_bindings`) and
raises `UserError("<setting>=<value>: <why> (<fix>)")` for the first bad one: wrong type,
out of range, an unknown key inside a dict or `**overrides`, a parameter the program sets
itself, or a setting that this mode never reads. scripts/train.py prints it as
`error: ...` and exits 2 before anything is written.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

from mmjax.data.balance import POLICIES as _POST_BALANCE
from mmjax.data.batch_plan import NODE_WISE_METHODS as _NODE_WISE
from mmjax.data.batch_plan import POLICIES as _BALANCE
from mmjax.data.chat import LOSS_ON as _LOSS_ON
from mmjax.data.layout import PACKINGS as _PACKING
from mmjax.data.synthetic import KINDS as _KINDS
from mmjax.data.token_distribution import METHODS as _CP_METHODS
from mmjax.errors import UserError, shown
from mmjax.values import is_int
from mmjax.models.attention_names import IMPLEMENTATIONS as _ATTENTION
from mmjax.planner.hardware import HARDWARE
from mmjax.planner.layout_choice import LAYOUTS as _AUTO_LAYOUTS
from mmjax.planner.plan import REMAT_POLICIES
from mmjax.planner.vae_placement import PLACEMENTS as _VAE_PLACEMENTS
from mmjax.train.colocated_plan import LAYOUTS as _MANUAL_LAYOUTS
from mmjax.schedule.named import SCHEDULES
from mmjax.train.colocated_plan import ZERO_STAGES

INT_MAX = (1 << 31) - 1


@dataclass(frozen=True)
class Setting:
    """kind: "int" | "float" | "bool" | "str" | "choice" | "file" | "dir" | "ints" (a
    non-empty list of ints) | "strs" (a string or a list of them) | "names" (a name or a
    list of them, empty allowed) | "program" (set by the
    program: a binding has no effect) | "plan" (None, "manual", "auto" or a Plan JSON file)
    | "span" ("A:B", 1 <= A <= B). `lo` / `hi` bound numbers (`open_lo` / `open_hi`
    exclusive); `per_unit`: a dict unit -> value is accepted too; `needs`: "plan", "auto"
    or "eval", the mode without which a value other than `default` has no effect;
    `off_or_above_one`: a number that is 0 (off) or > 1."""
    kind: str
    default: object = None
    lo: float | None = None
    hi: float | None = None
    open_lo: bool = False
    open_hi: bool = False
    choices: tuple = ()
    none: bool = False
    per_unit: bool = False
    needs: str | None = None
    fix: str = ""
    off_or_above_one: bool = False


def _int(default, lo=0, hi=INT_MAX, **kw):
    return Setting("int", default, lo, hi, **kw)


def _float(default, lo=None, hi=None, **kw):
    return Setting("float", default, lo, hi, **kw)


_PROGRAM = Setting("program")
_BOOL = {True: Setting("bool", True), False: Setting("bool", False)}

_HARDWARE = tuple(HARDWARE)
COMPUTE_DTYPES = ("float32", "bfloat16")  # train/trainer.py maps them to JAX dtypes

_PLAN = "add --plan=auto, --plan=manual or --plan=PLAN.json, or drop the setting"
SETTINGS: dict[str, dict[str, Setting]] = {
    "train": {
        "dry_run": _PROGRAM,
        "steps": _int(30, 1), "global_batch": _int(8, 1, 1 << 20),
        "compute_dtype": Setting("choice", "float32", choices=COMPUTE_DTYPES),
        "seed": _int(0), "checkpoint_every": _int(10, 1), "progress": _BOOL[True],
        "stop_after": _int(None, 1, none=True),
        "plan": Setting("plan", None, none=True,
                        fix="a Plan JSON from scripts/plan.py --json, 'auto', or 'manual' with "
                            "manual_plan.* bindings"),
        "eval_every": _int(0), "attention_impl": Setting("choice", None, choices=_ATTENTION,
                                                         none=True),
        "trace_every": _int(0, needs="plan"), "keep_checkpoints": _int(3, 1),
        "keep_every": _int(None, 1, none=True), "max_bad_steps": _int(5, 1),
        "trace_steps": Setting("span", None, none=True, needs="plan", fix="e.g. '3:4'"),
        "spike_factor": _float(100.0, 0, 1e6, off_or_above_one=True,
                               fix="0 turns the guard off; else a step above that many times "
                                   "the median is held back, e.g. 100"),
        "spike_window": _int(20, 2, 100_000),
        "check_memory": _BOOL[True],
        "compilation_cache_dir": Setting("str", ""),
        "replan_every": _int(0, needs="plan",
                             fix="0 turns it off, N >= 1 re-plans every N steps"),
        "replan_min_gain": _float(1.10, 1, 100, open_lo=True, needs="replan",
                                  fix="e.g. 1.10 for a 10% predicted speed-up"),
        "startup_timeout": _float(600.0, 1, 86400,
                                  fix="seconds processes wait for each other at start-up"),
        "schedule": Setting("choice", "1f1b", choices=SCHEDULES, needs="plan"),
    },
    "named_model_config": {"name": Setting("str", "tiny"), "overrides": Setting("dict", None,
                                                                                 none=True)},
    "lora": {"units": Setting("names", (), fix="parts of the model, e.g. ['llm']"),
             "rank": _int(8, 1, 1 << 16, needs="lora"),
             "alpha": _float(16.0, 0, 1e6, open_lo=True, needs="lora"),
             "targets": Setting("names", ("q", "k", "v", "o"), needs="lora",
                                fix="projection names, e.g. ['q', 'v'] or ['attention', 'mlp']"),
             "dropout": _float(0.0, 0, 1, open_hi=True, needs="lora"),
             "rslora": Setting("bool", False, needs="lora")},
    "pretrained": {},  # **units: unit name -> HF checkpoint directory (`_check_pretrained`)
    "data_layout": {
        "cfg": _PROGRAM, "special": _PROGRAM, "seq_len": _int(256, 8, 1 << 22),
        "packing": Setting("choice", "pad", choices=_PACKING),
        "vision_caps": Setting("ints", (64, 256, 1024), 1, 1 << 24),
        "audio_frame_caps": Setting("ints", (128, 256, 512, 1024), 1, 1 << 24),
        "gen_num_queries": _int(16, 1, 4096)},
    "synthetic_dataset": {
        "cfg": _PROGRAM, "kind": Setting("choice", "laion", choices=_KINDS), "seed": _int(0),
        "bad_fraction": _float(0.0, 0, 1, open_hi=True)},  # + SyntheticConfig **overrides
    "learning_rate_schedule": {
        "total_steps": _PROGRAM, "peak_lr": _float(1e-3, 0, 10, open_lo=True),
        "warmup_steps": _int(5), "min_lr_ratio": _float(0.1, 0, 1)},
    "OptimizerSettings": {
        "weight_decay": _float(0.01, 0, 10), "clip_norm": _float(1.0, 0, 1e9,
                                                                  fix="0 turns clipping off"),
        "b1": _float(0.9, 0, 1, open_hi=True), "b2": _float(0.95, 0, 1, open_hi=True),
        "eps": _float(1e-8, 0, 1, open_lo=True)},
    "auto_plan": {
        "cfg": _PROGRAM, "global_batch": _PROGRAM, "source": _PROGRAM,
        "num_devices": _int(None, 1, 1 << 20, none=True, needs="auto"),
        "hardware_name": Setting("choice", None, choices=_HARDWARE, none=True, needs="auto"),
        "data_samples": _int(256, 1, 1 << 20, needs="auto"),
        "layout": Setting("choice", "disaggregated", choices=_AUTO_LAYOUTS, needs="auto")},
    "manual_plan": {  # read only with --plan=manual (scripts/train.py refuses a --gin_param)
        "model": _PROGRAM, "global_batch": _PROGRAM, "num_microbatches": _int(2, 1),
        **{k: _int(None, 1, none=True, per_unit=True) for k in (
            "dp", "tp", "pp", "cp", "num_chunks", "tp_chunks", "cp_head_groups", "fsdp_group")},
        "overlap_tp": Setting("bool", None, none=True, per_unit=True),
        "tp_bidirectional": Setting("bool", None, none=True, per_unit=True),
        "remat": Setting("choice", None, choices=REMAT_POLICIES, none=True, per_unit=True),
        "attention_impl": Setting("choice", None, choices=_ATTENTION, none=True, per_unit=True),
        "layout": Setting("choice", "disaggregated", choices=_MANUAL_LAYOUTS),
        "zero_stage": Setting("choice", None, choices=ZERO_STAGES, none=True, per_unit=True,
                              fix="1: optimizer state sharded, 2: also the gradients, 3: "
                                  "also the parameters")},
    "loader_source": {"default": _PROGRAM, "path": Setting("file", None, none=True,
                      fix="write the dataset with scripts/make_dataset.py --out=PATH")},
    "tokenizer": {"path": Setting("dir", None, none=True,
                                  fix="a directory holding tokenizer.json")},
    "Loader": {  # data/loader_settings.py: StreamSettings + BalanceSettings
        "num_steps": _PROGRAM,
        "balance": Setting("choice", "none", choices=_BALANCE, per_unit=True, needs="plan"),
        "post_balance_policy": Setting("choice", "sum", choices=_POST_BALANCE, per_unit=True,
                                       needs="plan"),
        "ranks_per_node": _int(0, 0, 1 << 16, needs="plan"), "seed": _int(0),
        "reserve": _int(None, 0, 1 << 20, none=True,
                        fix="a few times the bad samples expected per global batch, e.g. 8"),
        "shuffle": _BOOL[True], "num_workers": _int(0, 0, 256, needs="plan"),
        "prefetch": _int(2, 2, 256, needs="plan"),
        "cp_method": Setting("choice", "lpt", choices=_CP_METHODS, needs="plan"),
        "cp_block": _int(128, 1, 1 << 20, needs="plan"),
        "node_wise_method": Setting("choice", "auto", choices=_NODE_WISE, needs="plan"),
        "node_wise_time_limit": _float(0.2, 0, 3600, open_lo=True, needs="plan"),
        "node_wise_max_milp_ranks": _int(32, 1, 1 << 16, needs="plan"),
        "hardware": Setting("choice", "h100", choices=_HARDWARE, needs="plan"),
        "shape_scan_steps": _int(None, 0, 1 << 20, none=True, needs="plan",
                                 fix="None scans the whole run (up to 1024 global batches)"),
        "producers": _int(0, 0, 256, fix="0 preprocesses in this process"),
        "producer_addresses": Setting("strs", None, none=True,
                                      fix='"HOST:PORT" of `python -m mmjax.data.producer`'),
        "producer_cpus": Setting("ints", None, 0, 1 << 16, none=True),
        "producer_timeout": _float(300.0, 0, 86400, open_lo=True),
        "max_bad_fraction": _float(0.5, 0, 1, open_lo=True,
                                   fix="a share in (0, 1], e.g. 0.2; 1 never stops"),
        "row_budget": _int(None, 1, 1 << 20, none=True,
                           fix="LLM rows a global batch fills; None takes global_batch "
                               "samples a step")},
    "vae": {"path": Setting("dir", None, none=True,
                            fix="a diffusers AutoencoderKL directory (config.json + safetensors)"),
            "placement": Setting("choice", "auto", choices=_VAE_PLACEMENTS),
            "hardware": Setting("choice", "h100", choices=_HARDWARE),
            "step_time_s": _float(0.0, 0, 1e6)},
    "llava_source": {
        "model": _PROGRAM, "tokenizer": _PROGRAM, "max_tokens": _PROGRAM,
        "json_path": Setting("file", None, none=True, fix="a LLaVA .json or .jsonl file"),
        "image_root": Setting("str", "", needs="llava"),
        "audio_root": Setting("str", None, none=True, needs="llava"),
        "chat_template": Setting("str", None, none=True, needs="llava"),
        "loss_on": Setting("choice", "assistant", choices=_LOSS_ON, needs="llava"),
        "image_processor": Setting("str", None, none=True, needs="llava"),
        "audio_processor": Setting("str", None, none=True, needs="llava"),
        "index_workers": _int(8, 1, 256, needs="llava"), "output_images": _PROGRAM},
    "webdataset_source": {
        "model": _PROGRAM, "tokenizer": _PROGRAM, "max_tokens": _PROGRAM, "urls": Setting("strs", None, none=True),
        "chat_template": Setting("str", "plain", needs="webdataset"),
        "loss_on": Setting("choice", "assistant", choices=_LOSS_ON, needs="webdataset"),
        "image_processor": Setting("str", None, none=True, needs="webdataset"),
        "index_workers": _int(8, 1, 256, needs="webdataset")},
    "eval_source": {
        "model": _PROGRAM, "tokenizer": _PROGRAM,
        "json_path": Setting("file", None, none=True, needs="eval"),
        "image_root": Setting("str", "", needs="eval"),
        "urls": Setting("strs", None, none=True, needs="eval"),
        "chat_template": Setting("str", None, none=True, needs="eval"),
        "loss_on": Setting("choice", "assistant", choices=_LOSS_ON, needs="eval"),
        "image_processor": Setting("str", None, none=True, needs="eval"),
        "audio_processor": Setting("str", None, none=True, needs="eval"),
        "max_batches": _int(4, 1, 1 << 20, needs="eval")},
}

# the model's sizes (`SyntheticConfig.for_model`): another value makes every sample undecodable
_MODEL = Setting("program", fix="the synthetic set takes it from the model")

# synthetic_dataset's **overrides: SyntheticConfig fields (data/synthetic.py)
SYNTHETIC_OVERRIDES: dict[str, Setting] = {
    "vocab_size": _int(512, 300, 1 << 24), "patch_size": _MODEL,
    "image_side_median": _float(4.0, 0, 1e4, open_lo=True),
    "image_side_sigma": _float(0.5, 0, 10), "image_side_range": Setting("range", (1, 16), 1, 4096),
    "max_images": _int(6, 0, 1024), "image_count_p": _float(0.55, 0, 1, open_lo=True),
    "text_len_median": _float(20.0, 0, 1e6, open_lo=True), "text_len_sigma": _float(0.8, 0, 10),
    "text_len_range": Setting("range", (1, 256), 1, 1 << 22), "n_mels": _MODEL,
    "frames_median": _float(96.0, 0, 1e6, open_lo=True), "frames_sigma": _float(0.6, 0, 10),
    "frames_range": Setting("range", (8, 1000), 1, 1 << 22),
    "latent_shape": _MODEL, "gen_queries": _int(16, 1, 4096),
    "gen_fraction": _float(0.0, 0, 1), "too_long_tokens": _int(1 << 15, 1, 1 << 30)}

_WHAT = {"int": "an int", "float": "a number", "bool": "True or False", "str": "a string",
         "file": "a file path", "dir": "a directory path", "dict": "a dict",
         "ints": "a non-empty list of ints", "strs": "a string or a list of strings",
         "names": "a name or a list of names",
         "range": "a pair (lo, hi) of ints with lo <= hi", "ints3": "three ints"}


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _num(x) -> str:
    return f"{x:,}" if is_int(x) and x >= 10_000 else f"{x:g}"


def _range_text(s: Setting, value=None) -> str:
    """The accepted range; the implicit upper bound (INT_MAX) only for a value above it."""
    lo = "" if s.lo is None else f"{'>' if s.open_lo else '>='} {_num(s.lo)}"
    above = _is_num(value) and value > s.hi if s.hi is not None else False
    hi = "" if s.hi is None or (s.hi == INT_MAX and not above) else \
        f"{'<' if s.open_hi else '<='} {_num(s.hi)}"
    return " and ".join(x for x in (lo, hi) if x)


def _in_range(v, s: Setting) -> bool:
    if s.lo is not None and (v < s.lo or (s.open_lo and v == s.lo)):
        return False
    return s.hi is None or not (v > s.hi or (s.open_hi and v == s.hi))


def problem(value, s: Setting) -> str | None:
    """Why `value` is not a valid value of `s` (None: it is)."""
    if value is None and s.none:
        return None
    k = s.kind
    if k == "choice":
        if not any(type(value) is type(c) and value == c for c in s.choices):
            return f"must be one of {list(s.choices)}" + (" or None" if s.none else "")
        return None
    if k in ("int", "float"):
        ok = is_int(value) if k == "int" else (_is_num(value) and math.isfinite(value))
        if not ok or not _in_range(value, s):
            extra = ", or None" if s.none else ""
            return f"must be {_WHAT[k]} {_range_text(s, value)}{extra}".rstrip()
        if s.off_or_above_one and 0 < value <= 1:
            return "must be 0 (off) or > 1"
        return None
    if k == "plan":
        if not isinstance(value, str):
            return "must be a Plan JSON path, 'manual', 'auto' or None"
        return None if value in ("manual", "auto") or os.path.isfile(value) else "no such file"
    if k == "span":
        a, sep, b = value.partition(":") if isinstance(value, str) else ("", "", "")
        span = bool(sep) and a.isdigit() and b.isdigit() and 1 <= int(a) <= int(b)
        return None if span else "use 'A:B' with 1 <= A <= B"
    if k == "bool":
        return None if isinstance(value, bool) else "must be True or False"
    if k in ("str", "file", "dir"):
        if not isinstance(value, str) or (k != "str" and not value):
            return f"must be {_WHAT[k]}" + (" or None" if s.none else "")
        if k == "file" and not os.path.isfile(value):
            return "no such file"
        if k == "dir" and not os.path.isdir(value):
            return "no such directory"
        return None
    if k == "dict":
        if not isinstance(value, dict):
            return "must be a dict"
        return None if value else "an empty dict changes nothing (drop the binding)"
    if k in ("ints", "range", "ints3"):
        items = list(value) if isinstance(value, (list, tuple)) else None
        want = {"range": 2, "ints3": 3}.get(k)
        if (not items or (want and len(items) != want)
                or not all(is_int(x) and _in_range(x, s) for x in items)
                or (k == "range" and items[0] > items[1])):
            return f"must be {_WHAT[k]}, each {_range_text(s)}"
        return None
    if k == "names":  # an empty list: none
        names = bool(isinstance(value, str) and value or isinstance(value, (list, tuple)) and all(
            isinstance(x, str) and x for x in value))
        return None if names else f"must be {_WHAT[k]}"
    if k == "strs":
        if isinstance(value, str) and value:
            return None
        if isinstance(value, (list, tuple)) and value and all(
                isinstance(x, str) and x for x in value):
            return None
        return "must be a path or URL pattern, or a non-empty list of them"
    raise AssertionError(k)


def check(name: str, value, s: Setting, units=None) -> None:
    """Raise `UserError("name=value: why (fix)")` when `value` is not valid for `s`."""
    if s.kind == "program":
        effect = s.fix or "a binding has no effect"
        raise UserError(f"{name}={shown(value)}: set by the program itself ({effect}; drop the "
                        f"binding)")
    if s.per_unit and isinstance(value, dict):
        unknown = [u for u in value if units is not None and u not in units]
        if unknown:
            raise UserError(f"{name}={shown(value)}: unknown unit(s) {unknown} (the model's units "
                            f"are {list(units)})")
        for u, v in value.items():
            unit_why = problem(v, s)
            if unit_why:
                raise UserError(f"{name}[{u!r}]={shown(v)}: {unit_why} "
                                f"({s.fix or 'see its docstring'})")
        return
    why = problem(value, s)
    if why:
        fix = s.fix or (f"the default is {s.default!r}" if s.default is not None else
                        "see the docstring of " + name.split(".")[0])
        raise UserError(f"{name}={shown(value)}: {why} ({fix})")


_NEEDS = {"plan": _PLAN, "auto": "add --plan=auto, or drop the setting",
          "eval": "set train.eval_every=N, or drop the setting",
          "replan": "set train.replan_every=N with a plan, or drop the setting",
          "llava": "set llava_source.json_path, or drop the setting",
          "webdataset": "set webdataset_source.urls, or drop the setting",
          "lora": "set lora.units, or drop the setting"}
_READ = {"plan": "read only with a plan", "auto": "read only with --plan=auto",
         "eval": "read only when train.eval_every > 0",
         "replan": "read only when train.replan_every > 0",
         "llava": "read only with llava_source.json_path",
         "webdataset": "read only with webdataset_source.urls",
         "lora": "read only with lora.units"}


def _modes(plan, eval_every, replan_every) -> set[str]:
    """The modes this run is in (what `Setting.needs` names)."""
    modes = {"plan"} if plan is not None else set()
    if plan == "auto" or (plan is not None and replan_every):
        modes.add("auto")  # re-planning plans with auto_plan's settings too
    if eval_every:
        modes.add("eval")
    if replan_every:
        modes.add("replan")
    if bound("llava_source.json_path"):
        modes.add("llava")
    if bound("webdataset_source.urls"):
        modes.add("webdataset")
    if bound("lora.units"):
        modes.add("lora")
    return modes


def check_bound_settings(units, plan=None, eval_every=0, replan_every=0) -> None:
    """Every gin binding of every configurable in `SETTINGS`: type, range, unknown keys,
    program-set parameters and settings this mode does not read (see the module doc).
    `units`: the model's unit names (for per-unit dicts and `pretrained.*`)."""
    import gin

    modes = _modes(plan, eval_every, replan_every)
    for conf, table in SETTINGS.items():
        try:
            bindings = gin.get_bindings(conf)
        except ValueError:  # the configurable is not registered in this program
            continue
        for key, value in bindings.items():
            name = f"{conf}.{key}"
            if conf == "pretrained":
                _check_pretrained(name, key, value, units)
                continue
            if conf == "synthetic_dataset" and key not in table:
                s = SYNTHETIC_OVERRIDES.get(key)
                if s is None:
                    raise UserError(f"{name}={shown(value)}: synthetic_dataset has no setting "
                                    f"{key!r} (its settings: kind, seed, bad_fraction and the "
                                    f"SyntheticConfig fields {sorted(SYNTHETIC_OVERRIDES)})")
                check(name, value, s)
                continue
            s = table.get(key)
            if s is None:  # gin refuses unknown parameters of fixed signatures at parse
                raise UserError(f"{name}={shown(value)}: {conf} has no setting {key!r}")
            check(name, value, s, units)
            if s.needs is not None and s.needs not in modes and value != s.default:
                raise UserError(f"{name}={shown(value)}: {_READ[s.needs]}, so it would have no "
                                f"effect in this run ({_NEEDS[s.needs]})")


def _check_pretrained(name: str, unit: str, value, units) -> None:
    if units is not None and unit not in units and unit not in ("model", "adapter"):
        raise UserError(f"{name}={shown(value)}: the model has no unit {unit!r} (its units are "
                        f"{list(units)}, `model` for a whole LLaVA / Qwen2-VL checkpoint, or "
                        f"`adapter` for a peft LoRA adapter)")
    if value is not None and not isinstance(value, str):
        raise UserError(f"{name}={shown(value)}: must be the path of a Hugging Face checkpoint "
                        f"directory")
    if value and not os.path.isdir(value):
        raise UserError(f"{name}={shown(value)}: no such directory (a Hugging Face checkpoint "
                        f"directory with config.json and *.safetensors)")


def check_args(conf: str, units=None, **values) -> None:
    """A configurable's arguments as called (gin-bound, passed or defaults), by the same
    table (`units`: the model's unit names, for per-unit dicts)."""
    table = SETTINGS[conf]
    for key, value in values.items():
        check(f"{conf}.{key}", value, table[key], units)


def bound(name: str, default=None):
    """gin's binding of `name` ("configurable.parameter"), or `default` when it is not
    bound: the one place a module reads a binding back instead of receiving it."""
    import gin

    conf, _, key = name.rpartition(".")
    try:
        return gin.get_bindings(conf).get(key, default)
    except ValueError:  # the configurable is not registered in this program
        return default


def synthetic_fields() -> list[str]:
    """SyntheticConfig's field names the overrides table must cover (tests)."""
    from mmjax.data.synthetic import SyntheticConfig

    return [f.name for f in dataclasses.fields(SyntheticConfig) if f.name != "bad_fraction"]
