"""Every gin setting's type and range, in one table (no JAX), checked before any work.

`SETTINGS[configurable][parameter]` is a `Setting`: its kind (int, float, bool, str, a
choice, a path, a per-unit dict), its bounds, whether None is allowed, its default, and the
mode it needs (a plan, `--plan=auto`, an evaluation set) when it has no effect otherwise.
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

from mmjax.errors import UserError, shown

INT_MAX = (1 << 31) - 1


@dataclass(frozen=True)
class Setting:
    """kind: "int" | "float" | "bool" | "str" | "choice" | "file" | "dir" | "ints" (a
    non-empty list of ints) | "strs" (a string or a list of them) | "names" (a name or a
    list of them, empty allowed) | "program" (set by the
    program: a binding has no effect). `lo` / `hi` bound numbers (`open_lo` / `open_hi`
    exclusive); `per_unit`: a dict unit -> value is accepted too; `needs`: "plan", "auto"
    or "eval", the mode without which a value other than `default` has no effect."""
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


def _int(default, lo=0, hi=INT_MAX, **kw):
    return Setting("int", default, lo, hi, **kw)


def _float(default, lo=None, hi=None, **kw):
    return Setting("float", default, lo, hi, **kw)


_PROGRAM = Setting("program")
_BOOL = {True: Setting("bool", True), False: Setting("bool", False)}

_ATTENTION = ("auto", "dense", "chunked", "pallas", "cudnn")  # models/attention.py IMPLEMENTATIONS
_BALANCE = ("none", "disttrain", "orchmllm", "rows")  # data/batch_plan.py POLICIES
_POST_BALANCE = ("sum", "padded", "sum_square", "conv")  # data/balance POLICIES
_NODE_WISE = ("auto", "milp", "local", "greedy", "identity")  # data/batch_plan.py NODE_WISE_METHODS
_CP_METHODS = ("uniform", "zigzag", "lpt", "random")  # data/token_distribution.py METHODS
_HARDWARE = ("a800", "h100", "h200")  # planner/hardware.py HARDWARE
_LOSS_ON = ("assistant", "all")  # data/chat.py LOSS_ON
_KINDS = ("laion", "mix")  # data/synthetic.py KINDS
_PACKING = ("pad", "pack")

_PLAN = "add --plan=auto, --plan=manual or --plan=PLAN.json, or drop the setting"
SETTINGS: dict[str, dict[str, Setting]] = {
    "train": {
        "workdir": _PROGRAM, "model": _PROGRAM, "replanner": _PROGRAM, "dry_run": _PROGRAM,
        "steps": _int(30, 1), "global_batch": _int(8, 1, 1 << 20),
        "compute_dtype": Setting("choice", "float32", choices=("float32", "bfloat16")),
        "seed": _int(0), "checkpoint_every": _int(10, 1), "progress": _BOOL[True],
        "stop_after": _int(None, 1, none=True), "plan": Setting("str", None, none=True),
        "eval_every": _int(0), "attention_impl": Setting("choice", None, choices=_ATTENTION,
                                                         none=True),
        "trace_every": _int(0, needs="plan"), "keep_checkpoints": _int(3, 1),
        "keep_every": _int(None, 1, none=True), "max_bad_steps": _int(5, 1),
        "trace_steps": Setting("str", None, none=True, needs="plan"),
        "spike_factor": _float(100.0, 0, 1e6, fix="0 turns the guard off, else > 1, "
                               "e.g. 100"),
        "spike_window": _int(20, 2, 100_000),
        "check_memory": _BOOL[True],
        "compilation_cache_dir": Setting("str", ""),
        "replan_every": _int(0, needs="plan",
                             fix="0 turns it off, N >= 1 re-plans every N steps"),
        "replan_min_gain": _float(1.10, 1, 100, open_lo=True, needs="replan"),
        "startup_timeout": _float(600.0, 1, 86400),
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
        "layout": Setting("choice", "disaggregated",
                          choices=("disaggregated", "colocated", "auto"), needs="auto")},
    "loader_source": {"default": _PROGRAM, "path": Setting("file", None, none=True,
                      fix="write the dataset with scripts/make_dataset.py --out=PATH")},
    "tokenizer": {"path": Setting("dir", None, none=True,
                                  fix="a directory holding tokenizer.json")},
    "Loader": {
        "source": _PROGRAM, "model": _PROGRAM, "plan": _PROGRAM, "layout": _PROGRAM,
        "host_id": _PROGRAM, "num_hosts": _PROGRAM, "num_steps": _PROGRAM,
        "local_devices": _PROGRAM,
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
            "placement": Setting("choice", "auto", choices=("auto", "host", "device")),
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


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _num(x) -> str:
    return f"{x:,}" if _is_int(x) and x >= 10_000 else f"{x:g}"


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
        if not isinstance(value, str) or value not in s.choices:
            return f"must be one of {list(s.choices)}" + (" or None" if s.none else "")
        return None
    if k in ("int", "float"):
        ok = _is_int(value) if k == "int" else (_is_num(value) and math.isfinite(value))
        if not ok or not _in_range(value, s):
            extra = ", or None" if s.none else ""
            return f"must be {_WHAT[k]} {_range_text(s, value)}{extra}".rstrip()
        return None
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
                or not all(_is_int(x) and _in_range(x, s) for x in items)
                or (k == "range" and items[0] > items[1])):
            return f"must be {_WHAT[k]}, each {_range_text(s)}"
        return None
    if k == "names":  # an empty list: none
        ok = isinstance(value, str) and value or isinstance(value, (list, tuple)) and all(
            isinstance(x, str) and x for x in value)
        return None if ok else f"must be {_WHAT[k]}"
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
        why = s.fix or "a binding has no effect"
        raise UserError(f"{name}={shown(value)}: set by the program itself ({why}; drop the "
                        f"binding)")
    if s.per_unit and isinstance(value, dict):
        unknown = [u for u in value if units is not None and u not in units]
        if unknown:
            raise UserError(f"{name}={shown(value)}: unknown unit(s) {unknown} (the model's units "
                            f"are {list(units)})")
        for u, v in value.items():
            why = problem(v, s)
            if why:
                raise UserError(f"{name}[{u!r}]={shown(v)}: {why} ({s.fix or 'see its docstring'})")
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
    import gin

    def bound(conf, key):
        try:
            return bool(gin.get_bindings(conf).get(key))
        except ValueError:
            return False
    modes = {"plan"} if plan is not None else set()
    if plan == "auto" or (plan is not None and replan_every):
        modes.add("auto")  # re-planning plans with auto_plan's settings too
    if eval_every:
        modes.add("eval")
    if replan_every:
        modes.add("replan")
    if bound("llava_source", "json_path"):
        modes.add("llava")
    if bound("webdataset_source", "urls"):
        modes.add("webdataset")
    if bound("lora", "units"):
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
            bound = gin.get_bindings(conf)
        except ValueError:  # the configurable is not registered in this program
            continue
        for key, value in bound.items():
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


def check_train_args(**values) -> None:
    """The `train(...)` arguments as called (gin-bound or defaults), by the same table."""
    table = SETTINGS["train"]
    for key, value in values.items():
        check(f"train.{key}", value, table[key])


def synthetic_fields() -> list[str]:
    """SyntheticConfig's field names the overrides table must cover (tests)."""
    from mmjax.data.synthetic import SyntheticConfig

    return [f.name for f in dataclasses.fields(SyntheticConfig) if f.name != "bad_fraction"]
