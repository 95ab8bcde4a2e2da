"""A run compiles once: with OrchMLLM balancing every step has new per-rank assignments and
new natural shapes, but the loader pads every feed to the shape floor of the first steps, so
after the first step no program is traced or compiled again (jax.monitoring events)."""
import collections

import gin
import jax.numpy as jnp
import optax
import pytest
from jax._src import monitoring

from helpers import make_cfg
from mmjax.planner.plan import Plan
from mmjax.train.data_config import data_layout
from mmjax.train.pipelined import pipelined_runner


@pytest.mark.slow
def test_ten_balanced_steps_compile_only_in_the_first():
    counts = collections.Counter()

    def listener(event, duration, **kw):
        if event.startswith("/jax/core/compile/"):
            counts[event] += 1

    monitoring.register_event_duration_secs_listener(listener)
    try:
        cfg = make_cfg()
        plan = Plan.uniform(cfg, 8, 2, dp={"vision": 2, "llm": 2, "generator": 1},
                            pp={"llm": 2})
        with gin.unlock_config():
            gin.bind_parameter("Loader.balance", "orchmllm")
            gin.bind_parameter("Loader.shape_scan_steps", 10)
        run = pipelined_runner(cfg, data_layout(cfg), plan, optax.constant_schedule(1e-3),
                               jnp.float32, 0)
        per_step = []
        for _ in range(10):
            before = sum(counts.values())
            run.step()
            per_step.append(sum(counts.values()) - before)
        run.close()
        # without the floor the same ten global batches have several shapes (compiles)
        builder = run.data.builder
        builder.floor = None
        natural = {mb.feed.shapes for k in range(10)
                   for mb in builder(k).microbatches}
    finally:
        gin.clear_config()
        monitoring.unregister_event_duration_listener(listener)
    assert per_step[0] > 0, per_step  # the first step traces and compiles the programs
    assert per_step[1:] == [0] * 9, per_step
    assert len(natural) > 1, natural
