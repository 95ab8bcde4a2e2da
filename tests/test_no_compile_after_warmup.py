"""No stall after warm-up on the documented paths: the README's 8-device example (encoder
dp 2, LLM pp 2, 30 steps) traces and compiles nothing after its first step, because the
loader pads every feed to the shapes of its first 64 global batches, scanned from their
metadata at start-up (counted with jax.monitoring, independently of the trainer). Any
compilation after warm-up is said on the console (train/compile_watch.py)."""
import os

import gin
import jax
import jax.numpy as jnp
import pytest

from mmjax.train.compile_watch import COMPILE_EVENT, CompileWatch, watched_step
from mmjax.train.runner import StepMetrics

REPO = os.path.join(os.path.dirname(__file__), os.pardir)
TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
EXAMPLE = ['manual_plan.dp = {"vision": 2}', 'manual_plan.pp = {"llm": 2}',
           'manual_plan.tp = {"generator": 1}', 'train.plan = "manual"']


def _parse(extra):
    from mmjax.cli import register_configurables

    register_configurables()
    gin.parse_config_files_and_bindings([os.path.join(REPO, "configs", "tiny.gin")],
                                        EXAMPLE + extra, finalize_config=False)


@pytest.mark.slow
def test_the_readme_8_device_example_compiles_nothing_after_its_first_step(tmp_path):
    from mmjax.train.trainer import train

    workdir = str(tmp_path / "tiny_pp")
    metrics = os.path.join(workdir, "metrics.jsonl")
    late = []  # (event, step rows written when it fired)

    def listener(event, duration, **kw):
        if event in (COMPILE_EVENT, TRACE_EVENT) and os.path.exists(metrics):
            with open(metrics) as f:
                rows = sum(1 for line in f if line.strip())
            if rows:
                late.append((event, rows))

    _parse(["train.progress = False"])
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        records = train(workdir)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
        gin.clear_config()
    assert [r["step"] for r in records] == list(range(1, 31))
    assert late == [], late


def test_the_example_needs_the_whole_runs_floor():
    """The same run's first 16 global batches (the old scan) miss shapes that later ones
    need (step 18 recompiled); the default floor (`SHAPE_SCAN_STEPS` batches, whatever the
    run's length) covers every batch of the 30."""
    from mmjax.data.loader import Loader
    from mmjax.data.sample_stream import SHAPE_SCAN_STEPS
    from mmjax.train.data_config import data_layout, train_source
    from mmjax.train.manual_plan import manual_plan
    from mmjax.train.config import named_model_config

    _parse([])
    try:
        cfg = named_model_config()
        plan = manual_plan(global_batch=8, model=cfg).chosen
        loader = Loader.build(train_source(cfg), cfg, plan, data_layout(cfg),
                        num_steps=30)
        assert loader.stream.scan_steps == SHAPE_SCAN_STEPS >= 30  # not the run's length
        b = loader.builder
        whole = loader.feed_floor()
        first16 = b.scan_floor(16)
        b.floor = None
        later = [mb.feed.shapes for k in range(16, 30) for mb in b(k).microbatches]
    finally:
        gin.clear_config()
    assert any(s.union(first16) != first16 for s in later)
    assert all(s.union(whole) == whole for s in later)


class _Runner:
    """A runner whose second step compiles a new program."""

    def __init__(self):
        self.n = 0

    def step(self, trace=False):
        self.n += 1
        jax.jit(lambda x: x * self.n)(jnp.ones(self.n + 100)).block_until_ready()
        return StepMetrics(0.0, 0.0, 0.0, 0.0, compile_reason="a new shape")


def test_a_compile_after_warm_up_is_said_with_its_reason():
    said, runner = [], _Runner()
    first = watched_step(runner, 1, False, said.append, warm=False)
    assert said == [] and first.compile_s == 0  # warm-up: the runner's own report
    m = watched_step(runner, 2, False, said.append, warm=True)
    assert m.compile_s > 0 and len(said) == 1, said
    assert said[0].startswith("step 2: compiled") and said[0].endswith("(a new shape)")
    with CompileWatch() as w:
        pass
    assert w.count == 0
