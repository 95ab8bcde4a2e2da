"""RankSplit (data/rank_split.py) and the loader's array split (`batch_plan.split_unit`): the
same per-rank samples as the list API of data/balance/ on every policy, node-wise included."""
import numpy as np
import pytest

from mmjax.data import balance
from mmjax.data.batch_plan import NodeWise, split_unit
from mmjax.data.rank_split import RankSplit


def test_contiguous_and_lists():
    s = RankSplit.contiguous(7, 3)
    assert s.lists() == [[0, 1, 2], [3, 4], [5, 6]]
    assert [r.tolist() for r in s.by_rank()] == s.lists()
    assert s.rank(1).tolist() == [3, 4]
    assert RankSplit.from_lists(s.lists()).lists() == s.lists()


def test_permute_ranks_matches_batches_by_rank():
    rng = np.random.default_rng(0)
    for _ in range(20):
        d = int(rng.integers(1, 9))
        groups = [list(map(int, rng.permutation(int(rng.integers(0, 5))) + 10 * r))
                  for r in range(d)]
        perm = rng.permutation(d).tolist()
        got = RankSplit.from_lists(groups).permute_ranks(perm).lists()
        assert got == balance.batches_by_rank(groups, perm)
    with pytest.raises(ValueError, match="permutation"):
        RankSplit.contiguous(4, 2).permute_ranks([0, 0])


def test_check_names_the_assignment():
    with pytest.raises(ValueError, match=r"assignments\['llm'\] must split samples 0..3"):
        RankSplit.from_lists([[0, 1], [1, 3]]).check(4, 2, "assignments['llm']")
    RankSplit.from_lists([[3, 1], [0, 2]]).check(4, 2, "x")


@pytest.mark.parametrize("policy", balance.POLICIES)
def test_split_unit_matches_the_list_api(policy):
    rng = np.random.default_rng(1)
    costs = rng.integers(1, 500, 16 * 6).astype(np.float64)
    d = 16
    assert (split_unit(costs, d, "orchmllm", policy, NodeWise(0)).lists()
            == balance.post_balance(costs.tolist(), d, policy))
    groups = balance.post_balance(costs.tolist(), d, policy)
    src = [min(i * d // costs.size, d - 1) for i in range(costs.size)]
    perm = balance.node_wise_rearrange(src, groups, costs.tolist(), 4, method="local",
                                       require_optimal=True)
    node_wise = NodeWise(4, method="local")
    assert (split_unit(costs, d, "orchmllm", policy, node_wise).lists()
            == balance.batches_by_rank(groups, perm))


def test_split_unit_none_and_disttrain():
    costs = np.array([5.0, 1, 4, 2, 3, 9, 7])
    assert split_unit(costs, 3, "none", "sum", NodeWise()).lists() == [[0, 1, 2], [3, 4], [5, 6]]
    from mmjax.data.reorder import intra_reorder
    assert split_unit(costs, 3, "disttrain", "sum", NodeWise()).lists() == intra_reorder(costs, 3)
