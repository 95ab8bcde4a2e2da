"""The LLM split by whole packed rows (data/row_deal.py, `Loader.balance = {"llm": "rows"}`):
every sample once, whole rows per rank, at most ceil(rows / dp) rows on any rank; with a row
budget of dp x rows a multi-rank plan fills like one rank (issue 41 item 2, no JAX)."""
import numpy as np
import pytest

from mmjax.data.batch_plan import plan_global_batch, unit_policies
from mmjax.data.batch_shapes import pack_rows
from mmjax.data.packing_fill import llm_fill
from mmjax.data.row_budget import fill_rows
from mmjax.data.row_deal import deal_rows
from mmjax.errors import UserError
from mmjax.planner.plan import Plan
from test_packing_fill import MODEL, _llava_batch


@pytest.mark.parametrize("seed", range(6))
def test_whole_rows_dealt(seed):
    rng = np.random.default_rng(seed)
    seq = 64
    lengths = rng.integers(1, seq + 1, int(rng.integers(1, 90)))
    dp = int(rng.integers(1, 9))
    split = deal_rows(lengths, dp, seq)
    split.check(lengths.size, dp, "rows")
    row_of = np.asarray(pack_rows(lengths.tolist(), seq, "pack"))
    rows = int(row_of.max()) + 1
    rank_of = np.empty(lengths.size, np.int64)
    for r, items in enumerate(split.by_rank()):
        rank_of[items] = r
        assert np.all(np.diff(items) > 0)  # batch order within a rank
        if items.size:  # the rank's own packing needs no more rows than it was dealt
            assert max(pack_rows(lengths[items].tolist(), seq, "pack")) + 1 <= -(-rows // dp)
    for row in range(rows):  # a row's samples share a rank
        assert np.unique(rank_of[row_of == row]).size == 1


def test_rows_is_the_llms_under_packing():
    with pytest.raises(UserError, match="the LLM's split"):
        unit_policies({"vision": "rows"}, MODEL)
    with pytest.raises(UserError, match="packing='pack'"):
        unit_policies({"llm": "rows"}, MODEL, packing="pad")


@pytest.mark.parametrize("seq_len,dp,rows,low", [(2048, 8, 8, 0.95), (4096, 8, 4, 0.98)])
def test_budget_over_ranks_fills_like_one_rank(seq_len, dp, rows, low):
    """A row budget of dp x `rows` (LLaVA-like samples, one microbatch): rows dealt fill the
    budget exactly; OrchMLLM §5.1's token balance rounds each rank up to more rows."""
    layout, cand = _llava_batch(seq_len, 600)
    keep = fill_rows([m.llm_length for m in cand], dp * rows, seq_len)
    metas = [cand[i] for i in keep]
    tokens = sum(m.llm_length for m in metas)
    plan = Plan.uniform(MODEL, len(metas), 1, dp=dp)
    got = {}
    for policy in ("rows", "orchmllm"):
        (mp,) = plan_global_batch(metas, MODEL, plan, layout,
                                  unit_policies({"llm": policy}, MODEL))
        got[policy] = (mp.shapes["llm"].rows, llm_fill([mp], metas, layout, dp))
    assert got["rows"] == (rows, tokens / (dp * rows * seq_len))
    assert got["rows"][1] >= low
    assert got["orchmllm"][0] > rows and got["orchmllm"][1] < 0.8
