"""What a run keeps in its workdir besides checkpoints: metrics rows cut back to the restored
step, run.json (what export and generation rebuild the model from), and the persistent
compilation cache."""
from __future__ import annotations

import json
import os

import jax

from mmjax.errors import UserError
from mmjax.models.config import MLLMConfig, config_to_dict
from mmjax.planner.plan import Plan


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
