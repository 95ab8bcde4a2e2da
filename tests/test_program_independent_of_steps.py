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
    from mmjax.train.single_program import _NO_LIMITS, SingleProgram

    out = {}
    try:
        for steps in (1, 4):
            cfg, layout, source = _setup(steps)
            run = SingleProgram(cfg, layout, 8, learning_rate_schedule(steps), jnp.float32,
                                0, source)
            try:
                batch, _ = next(run.data)
                text = run.step_fn.lower(run.abstract, run.abstract_frozen,
                                         run.inputs(batch), _NO_LIMITS,
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

        one = LoaderBatches(source, cfg, layout, 8,
                            lambda s, m: grow_shapes(s, m, layout), scan_steps=1)
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
    from mmjax.train.run_setup import run_plan

    floors = []
    try:
        for steps in (1, 4):
            cfg, layout, source = _setup(steps, ['manual_plan.dp = {"vision": 2}',
                                                 'manual_plan.pp = {"llm": 2}'])
            plan, cfg = run_plan("manual", cfg, None, {}, 8, None)
            loader = Loader(source, cfg, plan, layout, num_steps=steps)
            floors.append(loader.feed_floor())
            loader.close()
    finally:
        gin.clear_config()
    assert floors[0] == floors[1] is not None
