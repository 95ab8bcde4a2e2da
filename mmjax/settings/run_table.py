"""The run's settings: `train.*` (the run spec), the model, LoRA, pretrained checkpoints,
the optimizer and learning rate, and the plan's (`auto_plan.*`, `manual_plan.*`)."""
from __future__ import annotations

from mmjax.models.attention_names import IMPLEMENTATIONS as _ATTENTION
from mmjax.planner.hardware import HARDWARE
from mmjax.planner.layout_choice import LAYOUTS as _AUTO_LAYOUTS
from mmjax.planner.plan import REMAT_POLICIES
from mmjax.schedule.named import SCHEDULES
from mmjax.settings.setting import _BOOL, _PROGRAM, Setting, _float, _int
from mmjax.train.colocated_plan import LAYOUTS as _MANUAL_LAYOUTS
from mmjax.train.colocated_plan import ZERO_STAGES

HARDWARE_NAMES = tuple(HARDWARE)
COMPUTE_DTYPES = ("float32", "bfloat16")  # train/trainer.py maps them to JAX dtypes

RUN_SETTINGS: dict[str, dict[str, Setting]] = {
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
    "learning_rate_schedule": {
        "total_steps": _PROGRAM, "peak_lr": _float(1e-3, 0, 10, open_lo=True),
        "warmup_steps": _int(5), "min_lr_ratio": _float(0.1, 0, 1)},
    "OptimizerSettings": {
        "weight_decay": _float(0.01, 0, 10), "clip_norm": _float(1.0, 0, 1e9,
                                                                  fix="0 turns clipping off"),
        "b1": _float(0.9, 0, 1, open_hi=True), "b2": _float(0.95, 0, 1, open_hi=True),
        "eps": _float(1e-8, 0, 1, open_lo=True)},
}

PLAN_SETTINGS: dict[str, dict[str, Setting]] = {
    "auto_plan": {
        "cfg": _PROGRAM, "global_batch": _PROGRAM, "source": _PROGRAM,
        "num_devices": _int(None, 1, 1 << 20, none=True, needs="auto"),
        "hardware_name": Setting("choice", None, choices=HARDWARE_NAMES, none=True, needs="auto"),
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
}
