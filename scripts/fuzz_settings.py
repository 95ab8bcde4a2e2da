#!/usr/bin/env python
"""Fuzz every setting: `python scripts/fuzz_settings.py [--mutations=1000] [--seed=0]
[--json=FILE]`. Each mutation is one hostile or valid value of one gin setting (every
configurable's parameters, SyntheticConfig overrides, model overrides, manual_plan.*) or of
one CLI flag of scripts/train.py, run in-process as `train.py --check` on configs/tiny.gin
(every check a run makes, the plan, the optimizer and the first global batch; no training).

Each value has an expectation that does not come from mmjax/settings.py: the default and
the other choices of a choice are valid; a value of another type, a negative or a huge
number, a junk string for a choice, an unknown key in a dict, a plan-only setting without
a plan, a program-set parameter are invalid; zero and small numbers are "either". The
outcome: accepted (exit 0), refused (exit 2, exactly one `error: ` line on stderr), a
traceback (anything else), a hang (no answer in --timeout s); and whether a refused run
left its workdir. Prints the table and writes the JSON.
"""
from __future__ import annotations

import argparse
import contextlib
import inspect
import io
import json
import os
import random
import signal
import sys
import tempfile
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
from mmjax.cpu_threads import force_cpu_devices  # noqa: E402

force_cpu_devices(8)

HUGE = [10 ** 12, 1e30]
NEG = [-1, -0.5, -3]
WRONG = ["abc", [1, 2], {"k": 1}, True]


def _configurables() -> dict:
    """configurable name -> its function (for the signature's defaults: the oracle's
    source of valid values, independent of the settings table)."""
    from mmjax.cli import register_configurables
    from mmjax.data import sources
    from mmjax.data import loader_settings, records, tokenizer
    from mmjax.train import (auto_plan, config, data_config, lora_setup, optimizer,
                             manual_plan, run_spec, vae_latents)

    register_configurables()
    return {"train": run_spec.RunSpec, "named_model_config": config.named_model_config,
            "pretrained": config.pretrained,
            "data_layout": data_config.data_layout,
            "synthetic_dataset": data_config.synthetic_dataset,
            "learning_rate_schedule": optimizer.learning_rate_schedule,
            "OptimizerSettings": optimizer.OptimizerSettings, "auto_plan": auto_plan.auto_plan,
            "loader_source": records.loader_source, "tokenizer": tokenizer.tokenizer,
            "Loader": loader_settings.LoaderSettings, "llava_source": sources.llava_source,
            "webdataset_source": sources.webdataset_source, "eval_source": sources.eval_source,
            "manual_plan": manual_plan.manual_plan, "vae": vae_latents.vae,
            "lora": lora_setup.lora}


def _cases(value, default, kind, program: bool, needs: str | None):
    """[(value, expected)] for a setting: expected "valid", "invalid" or "either"."""
    if program:
        return [(value, "invalid") for value in (default if default is not None else 1,
                                                  "abc")]
    out = []
    if default is not None:
        out.append((default, "valid"))
    if kind == "choice":
        out += [(c, "valid" if needs is None else "invalid") for c in value if c != default]
        out += [("junk", "invalid"), ("", "invalid"), (3, "invalid")]
    elif kind in ("int", "float"):
        out += [(v, "invalid") for v in NEG + HUGE] + [("abc", "invalid"), ([1], "invalid"),
                                                        (True, "invalid"), (0, "either"),
                                                        (1, "either"), (2, "either")]
        if kind == "int":
            out.append((2.5, "invalid"))
    elif kind == "bool":
        out += [(not default, "valid"), ("yes", "invalid"), (1, "invalid"), (None, "invalid")]
    elif kind in ("ints", "range", "ints3"):
        out += [([], "invalid"), ("abc", "invalid"), ([-1, 4], "invalid"), (5, "invalid"),
                ([10 ** 12], "invalid")]
    else:  # str / path
        out += [(3, "invalid"), ([1], "invalid"), ("/no/such/path", "either")]
    if needs is not None:
        out = [(v, "invalid" if e == "valid" and v != default else e) for v, e in out]
    return out


def mutations() -> list[dict]:
    """Every (setting or flag, value, expectation) the fuzz draws from."""
    from mmjax.settings import SETTINGS, SYNTHETIC_OVERRIDES

    funcs = _configurables()
    out = []
    for conf, table in SETTINGS.items():
        if conf == "pretrained":
            out += [dict(binding=f"pretrained.{u}", value=v, expect="invalid")
                    for u, v in (("llm", "/no/such/dir"), ("visoin", "/tmp"), ("llm", 3))]
            continue
        if conf == "manual_plan":  # read only with --plan=manual: its own cases below
            continue
        sig = inspect.signature(funcs[conf])
        for key, s in table.items():
            default = sig.parameters[key].default if key in sig.parameters else None
            default = None if default is inspect.Parameter.empty else default
            choices = s.choices if s.kind == "choice" else None
            for v, e in _cases(choices, default, s.kind, s.kind == "program", s.needs):
                if key == "attention_impl" and v in ("cudnn", "pallas"):
                    e = "either"  # cuDNN needs a GPU and a plain mask; Pallas is slow on CPU
                out.append(dict(binding=f"{conf}.{key}", value=v, expect=e))
                if s.needs == "plan" and e != "either" and s.kind != "program":
                    planned = "valid" if v == default or (choices and v in choices) else e
                    if key == "schedule" and v == "interleaved":
                        planned = "invalid"  # needs virtual stages: the default plan has none
                    out.append(dict(binding=f"{conf}.{key}", value=v, plan="manual",
                                    expect=planned))
    for key, s in SYNTHETIC_OVERRIDES.items():
        for v, e in _cases(None, s.default, s.kind, False, None):
            out.append(dict(binding=f"synthetic_dataset.{key}", value=v, expect=e))
    out.append(dict(binding="synthetic_dataset.vocab_sise", value=512, expect="invalid"))
    for ov, e in (({"llm.num_layers": 2}, "valid"), ({"llm.num_layerz": 2}, "invalid"),
                  ({"llm.num_layers": "2"}, "invalid"), ({"llm.num_layers": -1}, "invalid"),
                  ({"llm.norm_eps": -1e-6}, "invalid"), ({"encoders.visoin.frozen": True},
                                                          "invalid"),
                  ({"encoders.vision.frozen": 1}, "invalid"), ({"llm": 3}, "invalid"),
                  ({}, "invalid"), ({3: 1}, "invalid"), ("abc", "invalid")):
        out.append(dict(binding="named_model_config.overrides", value=ov, expect=e))
    out.append(dict(binding="named_model_config.name", value="tinyy", expect="invalid"))
    for knob in ("dp", "tp", "pp", "num_microbatches", "remat", "overlap_tp"):
        for v, e in ((0, "invalid"), (-1, "invalid"), ("x", "invalid"), ({"visoin": 2}, "invalid"),
                     (2.5, "invalid")):
            out.append(dict(binding=f"manual_plan.{knob}", value=v, plan="manual", expect=e))
        out.append(dict(binding=f"manual_plan.{knob}", value=1 if knob != "remat" else "full",
                        expect="invalid"))  # manual_plan.* without --plan=manual
    for flag, v, e in (("plan", "", "invalid"), ("plan", " ", "invalid"),
                       ("plan", "nope.json", "invalid"), ("plan", "manual", "valid"),
                       ("workdir", "", "invalid"), ("workdir", "@FILE", "invalid"),
                       ("trace_steps", "", "invalid"), ("trace_steps", "x", "invalid"),
                       ("trace_steps", "4:3", "invalid"), ("trace_steps", "0:1", "invalid"),
                       ("trace_steps", "1:2", "invalid"),  # without --plan
                       ("gin_file", "/no/such.gin", "invalid"), ("bogus_flag", "1", "invalid"),
                       ("gin_param", "trian.steps=3", "invalid"),
                       ("gin_param", "train.steps=", "invalid"), ("gin_param", "", "invalid"),
                       ("gin_param", "train.steps=3", "valid")):
        out.append(dict(flag=flag, value=v, expect=e))
    return out


def argv_of(m: dict, workdir: str, junk_file: str) -> list[str]:
    argv = ["--check", f"--workdir={workdir}"]
    if "flag" in m:
        v = junk_file if m["value"] == "@FILE" else m["value"]
        argv = [a for a in argv if not (m["flag"] == "workdir" and a.startswith("--workdir"))]
        argv.append(f"--{m['flag']}={v}")
    else:
        argv.append(f"--gin_param={m['binding']} = {m['value']!r}")
    if m.get("plan"):
        argv.append(f"--plan={m['plan']}")
    return argv


class _Hang(Exception):
    pass


def run_one(train, m: dict, root: str, k: int, timeout: int) -> dict:
    """One mutation in-process: its outcome, the error line, whether a workdir was left."""
    import gin

    from mmjax.cli import run_main

    workdir = os.path.join(root, f"run{k}")
    junk = os.path.join(root, "a_file")
    open(junk, "w").close()
    err = io.StringIO()
    gin.clear_config()

    def alarm(*_):
        raise _Hang()
    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(timeout)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            rc = run_main(train.main, argv_of(m, workdir, junk))
        lines = [x for x in err.getvalue().splitlines() if x.strip()]
        if rc == 0:
            outcome = "accepted"
        elif rc == 2 and len(lines) == 1 and lines[0].startswith("error: "):
            outcome = "refused"
        else:
            outcome = f"rc={rc} with {len(lines)} lines"
        line = lines[0] if lines else ""
    except _Hang:
        outcome, line = "hang", ""
    except SystemExit as e:  # argparse
        outcome, line = f"SystemExit({e.code})", err.getvalue().strip()[-300:]
    except Exception as e:  # noqa: BLE001 - a traceback is an outcome here
        outcome = "traceback"
        line = "".join(traceback.format_exception_only(type(e), e)).strip()[-300:]
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
        gin.clear_config()
    left = outcome != "accepted" and os.path.exists(workdir)
    return {**{k2: (v if isinstance(v, (int, float, str, bool, type(None))) else repr(v))
               for k2, v in m.items()}, "outcome": outcome, "line": line, "workdir_left": left}


def verdict(r: dict) -> str:
    """The row of the table a result counts in."""
    o, e = r["outcome"], r["expect"]
    if o in ("accepted", "refused"):
        if e == "invalid" and o == "accepted":
            return "invalid accepted"
        if e == "valid" and o == "refused":
            return "valid refused"
        return f"{e} {o}"
    return "hang" if o == "hang" else "traceback"


def fuzz(n: int, seed: int, timeout: int = 60, log=None) -> list[dict]:
    """`n` mutations drawn (seeded) from `mutations()`: every one of them once first, then
    repeats with another draw order, so n >= len(mutations()) covers all."""
    train = _load_train()
    pool = mutations()
    rng = random.Random(seed)
    order = list(range(len(pool)))
    rng.shuffle(order)
    picks = (order * (n // len(pool) + 1))[:n] if n >= len(pool) else rng.sample(order, n)
    results = []
    with tempfile.TemporaryDirectory() as root:
        for k, i in enumerate(picks):
            results.append(run_one(train, pool[i], root, k, timeout))
            if log and (k + 1) % 100 == 0:
                log(f"{k + 1}/{n}")
    return results


def _load_train():
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_cli",
                                                  os.path.join(REPO, "scripts", "train.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def table(results: list[dict]) -> dict:
    counts: dict[str, int] = {}
    for r in results:
        v = verdict(r)
        counts[v] = counts.get(v, 0) + 1
    counts["workdir left by a refused run"] = sum(r["workdir_left"] for r in results)
    return counts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--mutations", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=int, default=60, help="seconds before a mutation hangs")
    p.add_argument("--json", default="fuzz_settings.json")
    args = p.parse_args(argv)
    results = fuzz(args.mutations, args.seed, args.timeout,
                   log=lambda m: print(m, file=sys.stderr))
    counts = table(results)
    print(f"{args.mutations} mutations of {len(mutations())} distinct (seed {args.seed}):")
    print("| outcome | mutations |\n|---|---|")
    for k, v in sorted(counts.items()):
        print(f"| {k} | {v} |")
    bad = [r for r in results if verdict(r) in ("invalid accepted", "valid refused",
                                                "traceback", "hang") or r["workdir_left"]]
    for r in bad[:20]:
        print("  ", r)
    with open(args.json, "w") as f:
        json.dump({"seed": args.seed, "mutations": args.mutations, "counts": counts,
                   "results": results}, f, indent=1)
    print(f"wrote {args.json}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
