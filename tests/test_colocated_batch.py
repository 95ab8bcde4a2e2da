"""data/colocated_batch.py without devices: the rows each LLM token gathers, after the
per-encoder routes, are exactly its own sample's encoder outputs in order, in every
balancing policy and with shape floors; the LLM rows hold the reference's tokens."""
import numpy as np
import pytest

from helpers import global_batch, make_cfg
from mmjax.data.batch_plan import NodeWise
from mmjax.data.assemble import assemble, item_rows
from mmjax.data.batch_shapes import BatchShapes
from mmjax.data.colocated_batch import phase_batch


@pytest.fixture(scope="module")
def data():
    cfg = make_cfg()
    lay, samples = global_batch(cfg, 16)
    return lay, samples


def _check(lay, samples, pb, d):
    metas = [lay.rules.meta(s) for s in samples]
    ref = assemble(samples, lay)
    inp = pb.inputs
    assert inp["num_target_tokens"] == ref.num_target_tokens
    assert inp["num_gen_elements"] == ref.num_gen_elements
    llm = [list(b) for b in pb.plan.phases["llm"].batches]
    rows = inp["tokens"].shape[0] // d
    for slot in lay.encoders:
        e = slot.name
        s_rows, d_rows = pb.rows_per_rank[e]
        # fake encoder outputs: each row names (sample, k-th token of that sample)
        enc = np.full((pb.routes[e].src_ranks * s_rows,), -1, np.int64)
        shapes = pb.shapes[e]
        for r, g in enumerate(pb.plan.phases[e].batches):
            k = {}
            for i, rr in zip([j for j in g for _ in range(metas[j].count(slot.modality))],
                             item_rows([metas[i] for i in g], lay, shapes)[e]):
                for x in rr:
                    enc[r * s_rows + x] = i * 100000 + k.setdefault(i, 0)
                    k[i] += 1
        moved = pb.routes[e].apply(enc[:, None])[:, 0]
        for r, g in enumerate(llm):
            for j, i in enumerate(g):  # pad packing: one sample per row
                row = r * rows + j
                np.testing.assert_array_equal(inp["tokens"][row], ref.tokens[i])
                gi = inp[f"gather_{e}"][row]
                got = moved[gi[gi >= 0]]
                n = int((ref.gather[e][i] >= 0).sum())
                np.testing.assert_array_equal(got, i * 100000 + np.arange(n))


@pytest.mark.parametrize("policy", ["none", "sum", "padded", "sum_square", "conv"])
def test_llm_tokens_gather_their_own_encoder_rows(data, policy):
    lay, samples = data
    _check(lay, samples, phase_batch(samples, lay, 8, 8, policy), 8)


def test_llm_dp4_floors_and_node_wise(data):
    lay, samples = data
    pb = phase_batch(samples, lay, 8, 4, "sum")
    _check(lay, samples, pb, 4)
    big = {u: BatchShapes(s.rows + 1, tuple((n, c, k + 1) for n, c, k in s.encoders),
                          s.gen + 1 if s.gen else 0) for u, s in pb.shapes.items()}
    pb2 = phase_batch(samples, lay, 8, 4, "sum", floors=big)
    assert pb2.shapes == big
    assert pb2.inputs["tokens"].shape[0] == 4 * big["llm"].rows
    _check(lay, samples, pb2, 4)
    nw4 = phase_batch(samples, lay, 8, 4, "sum", node_wise=NodeWise(4))
    assert "skipped" not in nw4.plan.node_wise and "perm" in nw4.plan.node_wise
    _check(lay, samples, nw4, 4)
    nw = phase_batch(samples, lay, 8, 8, "sum", node_wise=NodeWise(4))
    _check(lay, samples, nw, 8)
    assert sorted(nw.plan.phases["llm"].batches) == sorted(
        phase_batch(samples, lay, 8, 8, "sum").plan.phases["llm"].batches)


def test_bad_sample_is_named(data):
    lay, samples = data
    bad = samples[0].__class__(**{**samples[0].__dict__, "segments": []})
    with pytest.raises(ValueError, match="phase_batch: sample .* is bad"):
        phase_batch([bad] + samples[1:], lay, 8, 8, "sum")
