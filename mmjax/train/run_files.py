"""What a run keeps in its workdir besides checkpoints: metrics rows cut back to the restored
step, run.json (what export and generation rebuild the model from); and where the
persistent compilation cache lives (by default one per machine, shared by every run)."""
from __future__ import annotations

import json
import os

import gin
import jax

from mmjax.errors import UserError, shown
from mmjax.models.config import MLLMConfig
from mmjax.models.config_json import config_to_dict
from mmjax.planner.plan import Plan
from mmjax.train.progress import console as progress_console
from mmjax.train.run_report import pretrained_lines


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


def read_run_info(workdir: str) -> dict | None:
    """DIR/run.json as a dict, or None when there is none."""
    path = os.path.join(workdir, RUN_INFO)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def pretrained_sources(workdir: str, dirs: dict) -> dict:
    """The record of `dirs` for run.json. A run resuming from checkpoints must read the
    same pretrained content it trained with (frozen units are rebuilt from it): UserError
    in one line otherwise."""
    from mmjax.train import pretrained_sources as ps
    from mmjax.train.checkpoint import checkpoint_steps

    info = read_run_info(workdir) or {}
    before = info.get("pretrained_sources") or {}
    try:
        now = ps.record(dirs, before)
    except (UserError, ValueError, FileNotFoundError) as e:
        raise UserError(f"pretrained: {e}") from None
    if before and checkpoint_steps(os.path.join(workdir, "checkpoints")) \
            and not ps.same_sources(before, now):
        unit = min(u for u in set(before) | set(now) if u not in before or u not in now
                   or not ps.same_sources({u: before[u]}, {u: now[u]}))
        raise UserError(f"pretrained.{unit}: the checkpoints in {workdir} were trained from "
                        f"other pretrained weights than {dirs.get(unit, 'none')} (run.json's "
                        f"pretrained_sources): restore those files or use a new workdir")
    return now


def write_run_info(workdir: str, cfg: MLLMConfig, plan: Plan | None, seed: int,
                   pretrained: dict | None = None, sources: dict | None = None) -> None:
    """DIR/run.json: the model config, plan, seed and pretrained directories a checkpoint
    belongs to (what scripts/export_hf.py and generate.py rebuild the model from), and
    `sources`: the pretrained files' sizes and hashes (train/pretrained_sources.py)."""
    info = {"model": config_to_dict(cfg), "plan": None if plan is None else plan.to_json(),
            "seed": seed, "pretrained": {k: os.path.abspath(v) for k, v in
                                         (pretrained or {}).items()},
            "pretrained_sources": sources or {}}
    with open(os.path.join(workdir, RUN_INFO), "w") as f:
        json.dump(info, f, indent=1)


MACHINE_CACHE = os.path.join("mmjax", "jax-compilation")  # under the user's cache directory


def start_run_files(workdir: str, cfg: MLLMConfig, plan: Plan | None, seed: int, dirs: dict,
                    memory_line: str | None):
    """DIR/config.gin and DIR/run.json (what scripts/generate.py rebuilds the model and data
    from; process 0), the pretrained weights read and the runner's memory line said; ->
    `write_info(plan)`, which rewrites run.json for another plan."""
    os.makedirs(workdir, exist_ok=True)
    sources = pretrained_sources(workdir, dirs)  # a resume reads what the run trained with
    if jax.process_index() == 0:
        with open(os.path.join(workdir, "config.gin"), "w") as f:
            f.write(gin.config_str())
        write_run_info(workdir, cfg, plan, seed, dirs, sources)
        for line in pretrained_lines(cfg, dirs) + [memory_line]:
            if line:  # pretrained: read into the runner's fresh parameters
                progress_console().print(line, markup=False, highlight=False)
    return lambda p: write_run_info(workdir, cfg, p, seed, dirs, sources)


def machine_cache_dir() -> str:
    """The compilation cache every run on this machine shares by default:
    `$XDG_CACHE_HOME/mmjax/jax-compilation`, else `~/.cache/mmjax/jax-compilation`."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, MACHINE_CACHE)


def use_compilation_cache(setting: str) -> str | None:
    """Point JAX's persistent compilation cache at `setting` (see `train`): "" ->
    $JAX_COMPILATION_CACHE_DIR if set, else the machine's (`machine_cache_dir`), so a run
    loads what any earlier run on this machine compiled; "off" -> none; else that
    directory. -> the path."""
    if not isinstance(setting, str):
        raise UserError(f"train.compilation_cache_dir={setting!r}: use a directory, \"\" "
                        f"(default: {machine_cache_dir()}, shared by every run on this "
                        f"machine) or \"off\"")
    if setting == "off":
        return None
    path = setting or os.environ.get("JAX_COMPILATION_CACHE_DIR") or machine_cache_dir()
    longest = max((len(part.encode()) for part in path.split(os.sep)), default=0)
    if longest > 255 or len(os.path.abspath(path).encode()) > 4095:
        raise UserError(f"train.compilation_cache_dir={shown(path)}: a path of "
                        f"{len(path):,} characters, a name of {longest} bytes: the filesystem"
                        f" takes names of at most 255 bytes and paths of 4095 (use a shorter "
                        f"directory)")
    jax.config.update("jax_compilation_cache_dir", path)
    # every program cached, however fast it compiled (JAX's default skips those under 1 s:
    # a warm run compiled the init's and the optimizer's small programs again)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return path


def compiling_line(path: str | None) -> str:
    """What the run is about to do before its first step, said at once (a first run on a
    machine compiles silently for a minute or more otherwise): compile, or load from the
    cache at `path` (None: off) what an earlier run compiled."""
    if path is None:
        return ("compiling this run's programs (the parameters' init and the training step; "
                "compilation cache off: every run compiles them again)")
    try:
        entries = sum(1 for e in os.scandir(path) if e.is_file())
    except OSError:  # not made yet: nothing cached
        entries = 0
    if not entries:
        return (f"compiling this run's programs (the parameters' init and the training step;"
                f" a first run on this machine: often 1-4 min on a small CPU; cached in "
                f"{path} afterwards, so a later run with the same model and batch loads them)")
    return (f"compiling this run's programs, or loading them from the compilation cache "
            f"({entries:,} programs in {path}: seconds when an earlier run compiled them)")
