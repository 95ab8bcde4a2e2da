"""Runs of another length compile the same programs (issue 41 item 1): the default tiny
run's shape floor is scanned over a fixed number of global batches (not `train.steps`),
and the single program takes the learning rate as an input (the schedule's horizon is no
constant of it), so `train.steps=1` and `train.steps=4` lower to the same step program,
one entry in the machine's compilation cache. Host-side: shapes and lowered text, nothing
compiled."""
import os

import gin
import jax.numpy as jnp
import numpy as np
import pytest

from mmjax.cli import parse_gin

REPO = os.path.join(os.path.dirname(__file__), os.pardir)
TINY = os.path.join(REPO, "configs", "tiny.gin")


def _setup(steps: int, extra=()):
    gin.clear_config()
    parse_gin([TINY], [f"train.steps = {steps}", *extra], finalize=False)
    from mmjax.train.data_config import layout_and_source, train_source
    from mmjax.train.run_setup import model_and_tokenizer

    cfg, tok, _ = model_and_tokenizer(None)
    layout, source = layout_and_source(cfg, tok)
    return cfg, layout, source if source is not None else train_source(cfg)


@pytest.fixture(scope="module")
def single_programs():
    """(floor, lowered step text, the rate fed at update 0 and 2) for train.steps 1 and 4."""
    from mmjax.train.optimizer import learning_rate_schedule
    from mmjax.train.single_program import OneDevice
    from mmjax.train.whole_model import NO_LIMITS, WholeModelRunner

    out = {}
    try:
        for steps in (1, 4):
            cfg, layout, source = _setup(steps)
            run = WholeModelRunner(cfg, layout, 8, learning_rate_schedule(steps),
                                   jnp.float32, 0, OneDevice(), source)
            try:
                batch, _ = next(run.data)
                text = run.step_fn.lower(run.abstract, run.abstract_frozen,
                                         run.placement.inputs(batch), NO_LIMITS,
                                         np.float32(0)).as_text()
                rates = (run.rate_at(0), run.rate_at(2))
                out[steps] = (run.data.floor, batch.shapes, text, rates)
            finally:
                run.close()
    finally:
        gin.clear_config()
    return out


def test_one_and_four_steps_pad_to_the_same_shapes(single_programs):
    (f1, b1, _, _), (f4, b4, _, _) = single_programs[1], single_programs[4]
    assert f1 == f4 and b1 == b4
    # the floor is more than one batch's shapes: a scan bounded by train.steps=1 would
    # have padded less (and compiled another program)
    from mmjax.data.batch_shapes import grow_shapes

    cfg, layout, source = _setup(1)
    try:
        from mmjax.train.single_data import LoaderBatches

        one = LoaderBatches.from_gin(source, layout, 8, lambda s, m: grow_shapes(s, m, layout),
                                     scan_steps=1)
        one.close()
    finally:
        gin.clear_config()
    assert one.floor != f1


def test_one_and_four_steps_lower_the_same_step_program(single_programs):
    (_, _, t1, r1), (_, _, t4, r4) = single_programs[1], single_programs[4]
    assert t1 == t4
    # the schedules differ: the rate, an input, carries the difference
    assert r1 != r4


def test_a_plans_feed_floor_does_not_depend_on_the_runs_length():
    from mmjax.data.loader import Loader
    from mmjax.train.manual_plan import manual_plan
    from mmjax.train.run_setup import run_plan

    floors = []
    try:
        for steps in (1, 4):
            cfg, layout, source = _setup(steps, ['manual_plan.dp = {"vision": 2}',
                                                 'manual_plan.pp = {"llm": 2}'])
            plan, cfg = run_plan("manual", cfg, None, {}, 8, None,
                                 manual_plan(global_batch=8, model=cfg).chosen)
            loader = Loader.build(source, cfg, plan, layout, num_steps=steps)
            floors.append(loader.feed_floor())
            loader.close()
    finally:
        gin.clear_config()
    assert floors[0] == floors[1] is not None


@pytest.mark.slow
def test_a_second_run_of_another_length_loads_the_step_from_the_machines_cache(tmp_path):
    """Two default runs in fresh workdirs, train.steps 2 then 3, with no cache setting
    (the machine's, here under a fresh XDG_CACHE_HOME): the second writes no training step
    program of its own (it loaded the first's) and says so from its first line."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    env["PYTHONPATH"] = os.path.abspath(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    cache = tmp_path / "xdg" / "mmjax" / "jax-compilation"
    steps_cached, first_lines = [], []
    for steps in (2, 3):
        p = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "train.py"),
                            f"--workdir={tmp_path / f'run{steps}'}",
                            f"--gin_param=train.steps={steps}"], env=env, cwd=tmp_path,
                           capture_output=True, text=True, timeout=900)
        assert p.returncode == 0, p.stderr[-3000:]
        first_lines.append(p.stderr.splitlines()[0])
        steps_cached.append(sorted(n for n in os.listdir(cache)
                                   if n.startswith("jit_train_step")))
    assert len(steps_cached[0]) == 1 and steps_cached[1] == steps_cached[0]
    assert first_lines[0].startswith("compiling this run's programs (the parameters' init")
    assert first_lines[1].startswith("compiling this run's programs, or loading them from "
                                     "the compilation cache")
