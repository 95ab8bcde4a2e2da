"""One resume schema (data/stream_position.py `stream_state`): a checkpoint's data state in
every older schema - a plan's "loader" ({"step", ...}), the single or co-located program's
"batches" ({"next_batch", "shapes" | "phase_shapes" + "capacity", ...}), each with or without
the stream position - restores each layout's data to the identical next global batch."""
import jax
import numpy as np
import pytest

from mmjax.data.batch_shapes import grow_shapes
from mmjax.data.loader import Loader
from mmjax.data.loader_settings import StreamSettings
from mmjax.data.sample_stream import SampleStream
from mmjax.data.stream_position import POSITION_KEYS, STATE_KEY, stream_state
from mmjax.planner.plan import Plan
from test_data_loader import CFG, LAYOUT, feed_arrays, source

STOP = 2  # the checkpoint's step: global batches 0, 1 trained, 2 next
SETTINGS = StreamSettings(seed=3, reserve=4, shape_scan_steps=3)


def _old(state: dict, key: str, position: bool) -> dict:
    """`state` (the one schema) as an older runner wrote it under `key`."""
    old = {k: v for k, v in state.items() if position or k not in POSITION_KEYS}
    if key == "batches":
        old["next_batch"] = old.pop("step")
    else:
        old["skipped_samples"] = 5  # an older loader's own total: the trainer's now
    return {key: old}


def _schemas(state: dict, key: str) -> list[dict]:
    return [{STATE_KEY: state}, _old(state, key, True), _old(state, key, False)]


def test_a_plans_older_loader_states_restore_to_the_same_next_batch():
    plan = Plan.uniform(CFG, 8, 2, dp={"vision": 2, "audio": 2, "llm": 2, "generator": 2})
    make = lambda: Loader.build(source(bad=0.2), CFG, plan, LAYOUT, seed=3, reserve=4,  # noqa: E731
                                shape_scan_steps=3)
    run = make()
    for _ in range(STOP):
        next(run)
    state, want = run.get_state(), next(run)
    run.close()
    assert state == {"step": STOP, "sample": 24, "global_batch": 8, "seq_len": LAYOUT.seq_len}
    for data_state in _schemas(state, "loader"):
        resumed = make()
        resumed.set_state(stream_state(data_state, STOP))
        got = next(resumed)
        resumed.close()
        assert got.sample_ids == want.sample_ids
        for a, b in zip(got.microbatches, want.microbatches):
            fa, fb = feed_arrays(a.feed), feed_arrays(b.feed)
            assert fa.keys() == fb.keys()
            assert all(np.array_equal(fa[k], fb[k]) for k in fa)


def test_the_single_programs_older_batch_states_restore_to_the_same_next_batch():
    from mmjax.train.single_data import LoaderBatches

    def make():
        stream = SampleStream(source(bad=0.2), LAYOUT, 8, SETTINGS)
        return LoaderBatches(stream, lambda shapes, metas: grow_shapes(shapes, metas, LAYOUT))

    run = make()
    for _ in range(STOP):
        next(run)
    state, (want, _) = run.state(), next(run)
    run.close()
    assert set(state) == {"step", "sample", "global_batch", "seq_len", "shapes"}
    for data_state in _schemas(state, "batches"):
        resumed = make()
        resumed.restore(stream_state(data_state, STOP))
        got, _ = next(resumed)
        resumed.close()
        assert got.shapes == want.shapes
        assert np.array_equal(got.tokens, want.tokens) and np.array_equal(got.doc, want.doc)


@pytest.mark.skipif(jax.device_count() < 4, reason="a co-located mesh of 4 devices")
def test_the_colocated_layouts_older_batch_states_restore_to_the_same_next_batch():
    from mmjax.data.batch_plan import NodeWise
    from mmjax.parallel.fsdp import colocated_mesh
    from mmjax.train.colocated_data import PhaseBatches, PhaseSettings
    from mmjax.train.colocated_plan import Colocation

    mesh = colocated_mesh(jax.devices()[:4], Colocation())
    settings = PhaseSettings({"vision": "sum", "audio": "conv", "llm": "sum"}, NodeWise(2))

    def make():
        return PhaseBatches(SampleStream(source(bad=0.2), LAYOUT, 8, SETTINGS), mesh, settings)

    run = make()
    for _ in range(STOP):
        next(run)
    state, (want, _) = run.state(), next(run)
    run.close()
    assert {"phase_shapes", "capacity"} <= set(state)
    for data_state in _schemas(state, "batches"):
        resumed = make()
        resumed.restore(stream_state(data_state, STOP))
        got, _ = next(resumed)
        resumed.close()
        assert got.capacity == want.capacity and got.phases.shapes == want.phases.shapes
        assert got.phases.plan.phases["llm"].batches == want.phases.plan.phases["llm"].batches
        assert all(np.array_equal(got.phases.inputs[k], want.phases.inputs[k])
                   for k in ("tokens", "doc"))


def test_a_checkpoint_without_a_stream_state_starts_at_its_step():
    assert stream_state({"skipped_samples": 3}, 7) == {"step": 7}


def test_the_loader_settings_defaults_are_the_settings_tables():
    import dataclasses

    from mmjax.data.loader_settings import BalanceSettings
    from mmjax.settings import SETTINGS

    table = SETTINGS["Loader"]
    for cls in (StreamSettings, BalanceSettings):
        for f in dataclasses.fields(cls):
            if f.name in table and table[f.name].kind != "program":
                want = table[f.name].default
                assert f.default == want, f.name
