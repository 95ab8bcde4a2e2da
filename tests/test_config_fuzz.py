"""Strict configuration: bad settings are one-line UserErrors naming the setting, before
any work; fuzzed plan JSONs, manual_plan / train bindings and dataset records either work or
give that one-line error (or DecodeError for a record), never another exception."""
import copy
import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest

from helpers import make_cfg
from mmjax.data.records import DecodeError, decode_record, encode_record
from mmjax.data.synthetic import SyntheticConfig, SyntheticDataset
from mmjax.errors import UserError
from mmjax.planner.plan import Plan
from mmjax.train.manual_plan import manual_plan
from mmjax.train.run_spec import RunSpec

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = make_cfg()
VALUES = [None, "x", "full", "dots", -1, 0, 1, 2, 3, 4, 8, 1.5, True, False, [], {}, [1, 2],
          [2, 2], {"llm": 2}, {"visoin": 2}, "1"]


def _one_line_user_error(fn):
    """-> True if fn() worked, False if it raised a one-line UserError; else the test fails."""
    try:
        fn()
        return True
    except UserError as e:  # gin may add "In call to configurable ..." lines: not printed
        first, *rest = str(e).splitlines()
        assert first and all(x.strip().startswith("In call to configurable") for x in rest), e
        return False


def _mutate_plan(d, rng):
    d = copy.deepcopy(d)
    for _ in range(rng.randint(1, 3)):
        where = rng.random()
        if where < 0.6 and isinstance(d.get("units"), list) and d["units"]:
            u = rng.choice(d["units"])
            if not isinstance(u, dict):
                continue
            key = rng.choice(sorted(u) + ["bogus"])
            if rng.random() < 0.3:
                u.pop(key, None)
            else:
                u[key] = rng.choice(VALUES)
        elif where < 0.9:
            key = rng.choice(["units", "global_batch", "num_microbatches", "kind", "predicted",
                              "extra"])
            if rng.random() < 0.3:
                d.pop(key, None)
            else:
                d[key] = rng.choice(VALUES)
        elif isinstance(d.get("units"), list):
            d["units"].append(copy.deepcopy(rng.choice(d["units"])) if d["units"] else 1)
    return d


def test_fuzzed_plan_jsons_work_or_give_one_line_errors():
    rng = random.Random(0)
    base = json.loads(json.dumps(Plan.uniform(CFG, 8, 2, dp={"vision": 2}, pp={"llm": 2})
                                 .to_json()))
    outcomes = [_one_line_user_error(lambda: Plan.from_json(_mutate_plan(base, rng))
                                     .validate(CFG, 8)) for _ in range(1200)]
    assert 50 < sum(outcomes) < 1150  # both outcomes are exercised


def test_fuzzed_manual_plan_bindings_work_or_give_one_line_errors():
    rng = random.Random(1)
    knobs = ["dp", "tp", "pp", "cp", "num_chunks", "overlap_tp", "remat", "tp_chunks",
             "tp_bidirectional", "cp_head_groups"]

    def one():
        kw = {k: rng.choice(VALUES) for k in rng.sample(knobs, rng.randint(0, 4))}
        gb, nmb = rng.choice([8, 8, 8, 0, 3, "8"]), rng.choice([2, 2, 4, 0, 3, None])
        return lambda: manual_plan(global_batch=gb, num_microbatches=nmb, model=CFG,
                                   **kw).chosen.validate(CFG, 8)

    outcomes = [_one_line_user_error(one()) for _ in range(1200)]
    assert 20 < sum(outcomes) < 1150


def test_fuzzed_train_settings_work_or_give_one_line_errors(tmp_path):
    rng = random.Random(2)
    names = ["steps", "global_batch", "compute_dtype", "seed", "checkpoint_every", "progress",
             "stop_after", "plan", "keep_checkpoints", "keep_every", "max_bad_steps"]
    good = dict(steps=4, global_batch=8, compute_dtype="float32", seed=0, checkpoint_every=2,
                progress=False, stop_after=None, plan=None, keep_checkpoints=3,
                keep_every=None, max_bad_steps=5)
    pool = VALUES + ["float32", "bfloat16", "manual", str(tmp_path / "nope.json")]
    outcomes = []
    for _ in range(1200):
        kw = dict(good)
        for k in rng.sample(names, rng.randint(0, 2)):
            kw[k] = rng.choice(pool)
        s = {k: kw[k] for k in names}
        outcomes.append(_one_line_user_error(lambda: RunSpec(**s)))
    assert 50 < sum(outcomes) < 1150


def test_fuzzed_records_decode_or_raise_decode_error():
    ds = SyntheticDataset("laion", SyntheticConfig.for_model(CFG), seed=5)
    raws = [encode_record(ds[i]) for i in range(8)]
    rng = np.random.default_rng(3)
    ok = 0
    for k in range(1000):
        raw = bytearray(raws[k % len(raws)])
        kind = k % 4
        if kind == 0:  # flipped bytes anywhere (header included)
            for at in rng.integers(0, len(raw), 4):
                raw[at] ^= int(rng.integers(1, 256))
        elif kind == 1:
            raw = raw[:int(rng.integers(0, len(raw)))]
        elif kind == 2:  # random garbage
            raw = bytearray(rng.integers(0, 256, int(rng.integers(0, 64)), dtype=np.uint8))
        else:  # a corrupted length field
            raw[0:4] = int(rng.integers(0, 1 << 31)).to_bytes(4, "little")
        try:
            decode_record(bytes(raw), 4, 16)
            ok += 1
        except DecodeError as e:
            assert "\n" not in str(e)
    assert ok < 1000


@pytest.mark.slow
def test_cli_bad_settings_exit_2_with_one_line_and_no_workdir(tmp_path):
    cases = [("train.checkpoint_every=0", "train.checkpoint_every=0: must be an int >= 1"),
             ("loader_source.path='/no/such.arrayrecord'",
              "loader_source.path='/no/such.arrayrecord': no such file"),
             ('manual_plan.dp={"visoin": 2}', "manual_plan.dp={'visoin': 2}: unknown unit(s) ['visoin']")]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    for i, (binding, needle) in enumerate(cases):
        work = tmp_path / f"run{i}"
        args = [sys.executable, os.path.join(REPO, "scripts", "train.py"), f"--workdir={work}",
                f"--gin_param={binding}"] + (["--plan=manual"] if "manual_plan" in binding
                                             else [])
        p = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 2, p.stderr[-2000:]
        lines = [x for x in p.stderr.splitlines() if x.startswith("error:")]
        assert len(lines) == 1 and needle in lines[0], p.stderr[-2000:]
        assert "Traceback" not in p.stderr and not work.exists()
