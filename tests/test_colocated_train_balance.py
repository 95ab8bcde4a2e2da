"""The trainer's loader settings reach a co-located run (`train`, in process): with
`Loader.balance = "orchmllm"` each phase is post-balanced by its
`Loader.post_balance_policy` (OrchMLLM Algorithms 1, 2, 4, 5; two runs cover all four, per
phase) and, with `Loader.ranks_per_node`, the LLM's mini-batches are placed node-wise
(Algorithm 3). Each run gives the single program's losses (rtol 1e-5), compiles nothing
after its first step (per-phase shapes and the all-to-all's capacity scanned up front),
and the metrics' all-to-all bytes across nodes equal those counted from the sample
layouts. Settings the layout cannot honour are one line (fast tests)."""
import os

import gin
import jax
import numpy as np
import pytest

import mmjax.data.loader  # noqa: F401  (registers Loader with gin)
import mmjax.train.manual_plan  # noqa: F401  (registers manual_plan with gin)
from mmjax.errors import UserError
from mmjax.models.config import with_overrides
from mmjax.models.tiny import tiny
from mmjax.train.compile_watch import COMPILE_EVENT

BASE = ["Loader.reserve = 4", "Loader.seed = 5", "data_layout.seq_len = 128"]
COLO = ['manual_plan.layout = "colocated"', 'Loader.balance = "orchmllm"']
TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
STEPS = 3


def small_tiny():
    return with_overrides(tiny(), {"llm.num_layers": 2, "encoders.vision.encoder.num_layers": 1,
                                   "generator.num_layers": 1})


def _parse(bindings):
    gin.clear_config()
    with gin.unlock_config():
        gin.parse_config(BASE + bindings)


def _train(workdir, bindings, plan="manual", global_batch=8):
    """(records, compile / trace events after the first metrics row)."""
    from mmjax.train.trainer import train

    metrics = os.path.join(workdir, "metrics.jsonl")
    late = []

    def listener(event, duration, **kw):
        if event in (COMPILE_EVENT, TRACE_EVENT) and os.path.exists(metrics) and \
                os.path.getsize(metrics):
            late.append(event)

    _parse(bindings)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        records = train(workdir, model=small_tiny(), steps=STEPS, global_batch=global_batch,
                        progress=False, plan=plan, checkpoint_every=100)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
        gin.clear_config()
    return records, late


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    records, _ = _train(str(tmp_path_factory.mktemp("single")), [], plan=None)
    return [r["loss"] for r in records]


@pytest.mark.slow
@pytest.mark.parametrize("algos", [{"vision": "sum", "llm": "padded"},
                                   {"vision": "sum_square", "llm": "conv"}])
def test_colocated_run_per_phase_policies_match_single(tmp_path, single, algos):
    records, late = _train(str(tmp_path / "run"),
                           COLO + [f"Loader.post_balance_policy = {algos!r}"])
    np.testing.assert_allclose([r["loss"] for r in records], single, rtol=1e-5)
    assert late == [], late


@pytest.mark.slow
def test_colocated_run_with_encoder_tp_matches_single(tmp_path, single):
    """The runner with the vision encoder at tp 2 inside the LLM's tp 4, ZeRO-3, each
    phase post-balanced by its own policy: the single program's losses, nothing compiled
    after the first step."""
    records, late = _train(str(tmp_path / "run"), COLO + [
        'manual_plan.tp = {"vision": 2, "llm": 4}', "manual_plan.zero_stage = 3",
        "Loader.post_balance_policy = {'vision': 'conv', 'llm': 'sum'}"])
    np.testing.assert_allclose([r["loss"] for r in records], single, rtol=1e-5)
    assert late == [], late


def _inter_node_bytes(cfg, rpn: int, tp: int, row_bytes: int) -> list[int]:
    """Per step, the bytes of encoder->LLM rows whose encoder rank (device r) and LLM rank
    (devices j*tp .. j*tp+tp-1, one node) sit on different nodes, counted from the sample
    layouts the loader plans (independent of the exchange's tables): forward, every tp
    replica receives the row; backward, one replica returns its gradient."""
    from mmjax.data.colocated_batch import plan_phases
    from mmjax.data.loader_settings import loader_settings
    from mmjax.data.sample_stream import SampleStream
    from mmjax.train.colocated_data import phase_settings
    from mmjax.train.data_config import layout_and_source, train_source

    _parse(COLO + [f"Loader.ranks_per_node = {rpn}"])
    try:
        lay, _ = layout_and_source(cfg, None)
        stream_settings, balance = loader_settings()
        stream = SampleStream(train_source(cfg), lay, 8, stream_settings)
        st = phase_settings(balance, cfg, lay, 8, tp)
        out = []
        for k in range(STEPS):
            gs = stream.samples(k)
            metas = [lay.rules.meta(s) for s in gs.samples]
            pp = plan_phases(metas, lay, 8, 8 // tp, st.policies, node_wise=st.node_wise)
            assert "perm" in pp.plan.node_wise  # node-wise ran
            llm = {s: r for r, b in enumerate(pp.plan.phases["llm"].batches) for s in b}
            rows = 0
            for e, ph in pp.plan.phases.items():
                if e != "llm":
                    rows += sum(ph.rows[s] for r, b in enumerate(ph.batches) for s in b
                                if r // rpn != llm[s] * tp // rpn)
            out.append((tp + 1) * rows * row_bytes)
    finally:
        gin.clear_config()
    return out


@pytest.mark.slow
def test_colocated_run_node_wise_ledger_counts_inter_node_bytes(tmp_path, single):
    """Node-wise on 4 nodes of 2 devices, the LLM at dp 4 x tp 2 (its two samples per rank
    come from encoder ranks that need not share its node): losses as the single program's,
    each step's `a2a_inter_node_payload_bytes` (the rows the tables deliver) equal to the
    layouts' count, and `a2a_inter_node_bytes` (read from the compiled step's HLO) what the
    staged exchanges send at the run's scanned capacities."""
    rpn, tp = 2, 2
    records, late = _train(str(tmp_path / "run"), COLO + [
        f"Loader.ranks_per_node = {rpn}", f'manual_plan.tp = {{"llm": {tp}}}'])
    np.testing.assert_allclose([r["loss"] for r in records], single, rtol=1e-5)
    assert late == [], late
    cfg = small_tiny()
    want = _inter_node_bytes(cfg, rpn, tp, cfg.llm.hidden_size * 4)
    got = [r["a2a_inter_node_payload_bytes"] for r in records]
    assert got == want and sum(got) > 0, (got, want)
    sent = [r["a2a_inter_node_bytes"] for r in records]
    assert len(set(sent)) == 1 and sent[0] >= max(got), (sent, got)  # one program
    assert sent[0] == _sent_from_caps(cfg, rpn, tp)


def _sent_from_caps(cfg, rpn: int, tp: int, global_batch: int = 8) -> int:
    """Inter-node bytes the staged exchanges send per step at the capacities the runner's
    start-up scan (`Loader.shape_scan_steps` global batches, whatever the run's length) fixes (`exchange_stages.caps_bytes`, forward and backward, every
    encoder)."""
    from mmjax.parallel.exchange_stages import Topology, caps_bytes
    from mmjax.parallel.fsdp import colocated_mesh
    from mmjax.train.colocated_data import phase_batches
    from mmjax.train.colocated_plan import Colocation
    from mmjax.train.data_config import layout_and_source, train_source

    _parse(COLO + [f"Loader.ranks_per_node = {rpn}"])
    try:
        lay, _ = layout_and_source(cfg, None)
        mesh = colocated_mesh(jax.devices(), Colocation(tp=tp))
        data = phase_batches(train_source(cfg), cfg, lay, global_batch, mesh)  # the run's scan
        caps = data.floor_capacity
        data.close()
    finally:
        gin.clear_config()
    row = cfg.llm.hidden_size * 4
    return len(lay.encoders) * sum(caps_bytes(c, Topology(8, rpn), row)["inter_node"]
                                   for c in caps)


@pytest.mark.slow
def test_node_wise_placement_lowers_the_compiled_inter_node_bytes(tmp_path):
    """The tiny co-located run, 8 CPU devices read as 2 nodes of 4, OrchMLLM balancing
    (`sum`), global batch 32: with the LLM's mini-batches placed node-wise (Algorithm 3)
    the compiled step's encoder->LLM exchanges send at most 0.8 of the inter-node bytes of
    the plain placement on the same nodes (`node_wise_method = "identity"`), read from
    XLA's optimized HLO of each run's step, and the two runs log the same losses."""
    runs = {}
    for method in ("identity", "local"):
        records, late = _train(str(tmp_path / method), COLO + [
            "Loader.ranks_per_node = 4", f'Loader.node_wise_method = "{method}"'],
            global_batch=32)
        assert late == [], late
        runs[method] = records
    # the same mathematics summed on other ranks: float32 rounding of a loss over ~8k
    # positions, eps32 * sqrt(L) ~ 1e-5 relative
    np.testing.assert_allclose([r["loss"] for r in runs["local"]],
                               [r["loss"] for r in runs["identity"]], rtol=1e-5)
    sent = {m: r[0]["a2a_inter_node_bytes"] for m, r in runs.items()}
    assert 0 < sent["local"] <= 0.8 * sent["identity"], sent


def _check(bindings, units=None):
    from mmjax.train.colocated_data import check_colocated_loader
    from mmjax.train.data_config import layout_and_source

    cfg = small_tiny()
    _parse(bindings)
    try:
        lay, _ = layout_and_source(cfg, None)
        return check_colocated_loader(cfg, lay, 8, 2)
    finally:
        gin.clear_config()


def test_loader_settings_become_per_phase_policies():
    st = _check(['Loader.balance = {"vision": "orchmllm", "llm": "orchmllm"}',
                 'Loader.post_balance_policy = {"vision": "conv", "llm": "padded"}',
                 "Loader.ranks_per_node = 4", 'Loader.node_wise_method = "local"'])
    assert st.policies == {"vision": "conv", "llm": "padded"}
    assert (st.ranks_per_node, st.node_wise.method) == (4, "local") and st.balanced
    assert not _check([]).balanced  # every phase "none": the plain batches
    assert _check([]).exchange == "staged"  # "auto" off GPU
    assert _check(['Loader.exchange = "staged"']).exchange == "staged"


@pytest.mark.parametrize("binding,words", [
    ('Loader.balance = "disttrain"', "Loader.balance['vision']='disttrain'"),
    ('data_layout.packing = "pack"\nLoader.balance = {"llm": "rows"}',
     "Loader.balance['llm']='rows'"),
    ("Loader.ranks_per_node = 3", "Loader.ranks_per_node=3"),
    ("Loader.ranks_per_node = 1", "Loader.ranks_per_node=1"),  # not a multiple of tp 2
    ('Loader.balance = {"llm": "orchmllm", "generator": "none"}',
     "Loader.balance['generator']='none'"),
    ('Loader.post_balance_policy = {"llm": "sum", "generator": "conv"}',
     "Loader.post_balance_policy['generator']='conv'"),
    pytest.param('Loader.exchange = "ragged"', "Loader.exchange='ragged' needs a GPU",
                 marks=pytest.mark.skipif(jax.default_backend() == "gpu", reason="GPU")),
])
def test_settings_the_colocated_layout_cannot_honour(binding, words):
    with pytest.raises(UserError) as e:
        _check([binding])
    msg = str(e.value)
    assert msg.startswith(words) and "\n" not in msg, msg


def test_phase_batches_scan_covers_the_run_and_resumes_exactly():
    """The start-up scan's per-phase floors and all-to-all capacity cover every batch of
    the run (nothing grows, so nothing compiles after warm-up); `state` / `restore`
    continue with the same batch, bit for bit (host side, nothing compiled)."""
    from mmjax.parallel.fsdp import colocated_mesh
    from mmjax.train.colocated_data import phase_batches
    from mmjax.train.colocated_plan import Colocation
    from mmjax.train.data_config import layout_and_source, train_source

    cfg = small_tiny()
    _parse(COLO + ["Loader.ranks_per_node = 4", 'Loader.node_wise_method = "local"',
                   'Loader.post_balance_policy = {"vision": "conv", "llm": "sum_square"}'])
    try:
        lay, _ = layout_and_source(cfg, None)
        mesh = colocated_mesh(jax.devices(), Colocation(tp=2))
        data = phase_batches(train_source(cfg), cfg, lay, 8, mesh, scan_steps=3)
        floor, cap = data.floor, data.floor_capacity
        got = [next(data)[0] for _ in range(3)]
        assert data.shapes == floor and data.capacity == cap
        assert all(b.capacity == cap and b.phases.shapes == floor for b in got)
        assert all(b.shapes == data.global_floor() for b in got)  # the memory check's
        assert data.settings.policies == {"vision": "conv", "llm": "sum_square"}
        state = data.state()
        after = next(data)[0]
        data.restore(state)
        again = next(data)[0]
        data.close()
    finally:
        gin.clear_config()
    for k in ("tokens", "targets", "loss_mask", "gather_vision"):
        np.testing.assert_array_equal(after.phases.inputs[k], again.phases.inputs[k])
    assert after.phases.plan.phases["llm"].batches == again.phases.plan.phases["llm"].batches
    assert len(after.phases.plan.phases["llm"].batches) == 4  # the LLM at dp 4 x tp 2
