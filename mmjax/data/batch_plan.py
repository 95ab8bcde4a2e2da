"""Planning a global batch from sample metadata alone (no JAX), identical on every host:
microbatches, each unit's split over its DP ranks by the balancing policy (DistTrain §6
reordering, OrchMLLM §5.1 post-balancing and §5.2.2 node-wise rearrangement), and each
unit's common shapes. Step 2 of data/loader.py's docstring."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from mmjax.data.layout import AssemblyLayout
from mmjax.data.batch_shapes import BatchShapes
from mmjax.data.balance import POLICIES as POST_BALANCE_POLICIES
from mmjax.data.balance import node_wise_rearrange_flat, post_balance_flat
from mmjax.data.meta_columns import MetaColumns
from mmjax.data.rank_split import RankSplit
from mmjax.data.reorder import inter_reorder
from mmjax.data.row_deal import deal_rows
from mmjax.data.sample import SampleMeta, TokenRules
from mmjax.data.shape_columns import ShapeColumns, shape_columns
from mmjax.data.unit_shapes import UnitShapes
from mmjax.errors import UserError
from mmjax.models.config import MLLMConfig
from mmjax.planner.costs import layer_times
from mmjax.planner.unit_work import unit_work
from mmjax.planner.hardware import H100, Hardware
from mmjax.planner.plan import Plan
from mmjax.planner.workload import workload_from_metas
from mmjax.models.units import (GENERATOR_UNIT, LLM_UNIT, has_generator, is_generator, is_llm,
                                is_vae)


POLICIES = ("none", "disttrain", "orchmllm", "rows")  # "rows": the LLM only (row_deal.py)
_NO_SLOTS = AssemblyLayout(0, 0, TokenRules())  # costs alone: no encoder slot's item sizes
NODE_WISE_METHODS = ("auto", "milp", "local", "greedy", "identity")


@dataclass
class MicrobatchPlan:
    """One microbatch: per unit how its samples split over the unit's DP ranks (`splits`,
    indices into `positions`, the global batch positions of the microbatch) and the unit's
    common shapes (`UnitShapes`: computed on first read). The moves between units follow
    from the splits (data/feed.py builds them; `balance.compose_rearrangement` is the
    sample-level map, OrchMLLM §6)."""

    positions: Sequence[int]  # a contiguous `range` of the global batch
    splits: dict[str, RankSplit]
    shapes: Mapping[str, BatchShapes]

    @property
    def ranks(self) -> dict[str, list[list[int]]]:
        """Per unit, per DP rank, the global batch positions it processes, in order."""
        pos = np.asarray(self.positions, dtype=np.int64)
        return {u: RankSplit(pos[s.items], s.counts).lists() for u, s in self.splits.items()}


def unit_costs(metas: list[SampleMeta], model: MLLMConfig,
               cols: ShapeColumns | None = None) -> dict[str, np.ndarray]:
    """Per unit, the size its DP split balances, one float64 per sample: the LLM's sequence
    tokens, an encoder's input tokens, the generator's generated images. From the global
    batch's metadata columns (`shape_columns`, one pass; given as `cols` when the caller
    has them); every microbatch and policy then slices these arrays."""
    if cols is None:
        cols = shape_columns(metas, _NO_SLOTS, tuple(e.modality for e in model.encoders))
    out = {LLM_UNIT: cols.llm.astype(np.float64)}
    if has_generator(model.unit_names):
        out[GENERATOR_UNIT] = cols.image_out.astype(np.float64)
    for e in model.encoders:
        out[e.name] = cols.encoder_tokens[e.modality].astype(np.float64)
    return out


@dataclass(frozen=True)
class NodeWise:
    """Node-wise rearrangement settings (OrchMLLM §5.2.2, Algorithm 3) for "orchmllm".

    `ranks_per_node` 0 disables it; a unit runs it only when its dp spans several nodes
    (dp > ranks_per_node and a multiple of it). `method`: "auto" (the MILP up to
    `max_milp_ranks` ranks, else, or when the MILP does not prove optimality within
    `time_limit` s, the better of greedy and its pairwise-swap local search), "milp",
    "local" (greedy + swaps, deterministic), "greedy".
    Every host must compute the same plan, so the loader only takes a MILP answer proven
    optimal (a time-limited incumbent depends on machine speed); otherwise greedy."""

    ranks_per_node: int = 0
    method: str = "auto"
    time_limit: float = 0.2
    max_milp_ranks: int = 32

    def spans(self, dp: int) -> bool:
        """Whether a unit of `dp` ranks spans several whole nodes (the step runs)."""
        rpn = self.ranks_per_node
        return bool(rpn) and dp > rpn and dp % rpn == 0

    def __post_init__(self):
        if self.method not in NODE_WISE_METHODS:
            raise UserError(f"Loader.node_wise_method={self.method!r}: use one of "
                            f"{NODE_WISE_METHODS}")
        if not self.time_limit > 0:
            raise UserError(f"Loader.node_wise_time_limit={self.time_limit!r}: use > 0 seconds")


def balanced_split(costs: np.ndarray, dp: int, algo: str) -> RankSplit:
    """OrchMLLM's post-balancing (§5.1, Appendix A) of the samples' `costs` over `dp` ranks
    by `algo`; the one split every layout's "orchmllm" phase takes."""
    return RankSplit(*post_balance_flat(costs, dp, algo))


def node_wise_split(split: RankSplit, items: RankSplit, src: np.ndarray, sizes,
                    node_wise: NodeWise, info: dict | None = None) -> RankSplit:
    """OrchMLLM §5.2.2 (Algorithm 3): `split`'s batches moved to other ranks so the largest
    per-rank inter-node volume is least. `items` (the same ranks): what batch i receives
    (indices into `src` / `sizes`: each item's source rank, in the new ranks' numbering, and
    its size). Only an answer every host computes alike is kept (a MILP proven optimal).
    `info` receives the solver's record and "perm"."""
    perm = node_wise_rearrange_flat(src, items.items, items.counts, sizes,
                                    node_wise.ranks_per_node, method=node_wise.method,
                                    time_limit=node_wise.time_limit,
                                    max_milp_ranks=node_wise.max_milp_ranks,
                                    require_optimal=True, info=info)
    if info is not None:
        info["perm"] = perm.tolist()
    return split.permute_ranks(perm)


def split_unit(costs: np.ndarray, dp: int, policy: str, algo: str,
               node_wise: NodeWise, seq_len: int = 0) -> RankSplit:
    """One unit's split of a microbatch over its `dp` ranks, as the loader computes it:
    `costs` (the microbatch's slice of `unit_costs`) -> indices into the microbatch per
    rank. "none": contiguous; "disttrain": DistTrain Algorithm 2 (§6.1, the same LPT as
    OrchMLLM Algorithm 1, see `reorder.intra_reorder`); "orchmllm": the post-balancing
    policy `algo` (OrchMLLM §5.1), then node-wise rearrangement (§5.2.2) when configured;
    "rows" (the LLM, `costs` its lengths): whole packed rows of `seq_len` dealt to ranks
    (row_deal.py)."""
    if policy == "rows":
        return deal_rows(costs.astype(np.int64), dp, seq_len)
    if policy == "none":
        return RankSplit.contiguous(costs.size, dp)
    if policy == "disttrain":
        return balanced_split(costs, dp, "sum")
    split = balanced_split(costs, dp, algo)
    if node_wise.spans(dp):
        n = costs.size
        src = np.minimum(np.arange(n) * dp // n, dp - 1)  # where the "none" split had them
        split = node_wise_split(split, split, src, costs, node_wise)
    return split


def rank_times(model: MLLMConfig, unit: str, metas: list[SampleMeta], tp: int = 1,
               hw: Hardware = H100, cond_tokens: int = 64) -> tuple[float, float]:
    """(forward, backward) seconds of `unit` on one DP rank processing `metas`, from the
    planner's analytic cost model (planner/costs.py: per-layer FLOPs incl. the attention
    quadratic term, frozen-aware backward, Cornstarch §4.2). The model is linear in the
    per-sample moments, so the average sample of a `Workload` of these samples times their
    count is exactly the sum over samples."""
    if not metas:
        return 0.0, 0.0
    wl = workload_from_metas("microbatch", metas, model, cond_tokens)
    lt = layer_times(unit_work(model, wl, unit), tp, hw)
    return len(metas) * sum(f for f, _ in lt), len(metas) * sum(b for _, b in lt)


def microbatch_costs(metas: list[SampleMeta], model: MLLMConfig, plan: Plan,
                     ranks: list[dict[str, list[list[int]]]], hw: Hardware = H100,
                     cond_tokens: int = 64):
    """Inputs of DistTrain's Algorithm 3 (DistTrain §6.2) for the microbatches whose per-unit
    rank splits are `ranks[j]`: (costs, stage_costs) for `reorder.inter_reorder`.

    costs[j] = (forward, backward) seconds of microbatch j "in the modality encoder and
    generator" (§6.2): the slowest DP rank of each unit (its straggler sets the stage time),
    the max over encoders (parallel encoders run side by side, Cornstarch §4.1) plus the
    generator. stage_costs models the pipeline: the encoder's pp stages take equal shares
    of costs[j] (scale 1 / pp), then the LLM's pp stages at a fixed time (scale 0, offset =
    the mean over microbatches of the LLM's slowest-rank time / pp: with fixed-length
    sequences every LLM microbatch takes the same time, §2.3). The generator's time is in
    costs[j] (as in the paper); a model without encoders puts the generator's stages last.
    """
    def unit_time(unit, r):
        u = plan.unit(unit)  # a cp group shares its rank's sequences (cp = 1 but the LLM)
        per_rank = [rank_times(model, unit, [metas[p] for p in g], u.tp, hw, cond_tokens)
                    for g in r[unit]]
        return (max(f for f, _ in per_rank) / u.cp, max(b for _, b in per_rank) / u.cp)

    costs, llm = [], []
    has_gen = has_generator(model.unit_names)
    for r in ranks:
        enc = [unit_time(e.name, r) for e in model.encoders]
        gen = unit_time("generator", r) if has_gen else (0.0, 0.0)
        f = max([x[0] for x in enc], default=0.0) + gen[0]
        b = max([x[1] for x in enc], default=0.0) + gen[1]
        costs.append((f, b))
        llm.append(unit_time("llm", r))
    u_llm = plan.unit("llm")
    n = max(len(llm), 1)
    fl = sum(x[0] for x in llm) / n / u_llm.pp
    bl = sum(x[1] for x in llm) / n / u_llm.pp
    llm_stages = [(0.0, fl, bl)] * u_llm.pp
    if model.encoders:
        pe = max(plan.unit(e.name).pp for e in model.encoders)
        return costs, [(1.0 / pe, 0.0, 0.0)] * pe + llm_stages
    pg = plan.unit("generator").pp if has_gen else 1
    return costs, llm_stages + ([(1.0 / pg, 0.0, 0.0)] * pg if has_gen else [])


def plan_global_batch(metas: "list[SampleMeta] | MetaColumns", model: MLLMConfig, plan: Plan,
                      layout: AssemblyLayout, policies: dict[str, str],
                      post_balance_policy="sum", ranks_per_node: int = 0, *,
                      node_wise: NodeWise | None = None, hardware: Hardware = H100
                      ) -> list[MicrobatchPlan]:
    """Deterministic plan of one global batch from metadata (every host gets the same):
    `metas` as `MetaColumns` (what the loader builds from its source's shapes) or a list of
    `SampleMeta`s.

    `post_balance_policy`: one OrchMLLM algorithm for every phase or a dict unit -> one of
    ("sum", "padded", "sum_square", "conv"). Under "disttrain" (any unit) the microbatches
    run in Algorithm 3's order over `microbatch_costs` (the planner's cost model)."""
    l = plan.num_microbatches
    n = len(metas)
    if n % l:
        raise ValueError(f"global batch of {n} samples not divisible by num_microbatches={l}")
    algos = post_balance_policies(post_balance_policy, model)
    if node_wise is None:
        node_wise = NodeWise(ranks_per_node)
    size = n // l
    mbs = [range(i * size, (i + 1) * size) for i in range(l)]  # no list of n ints a step
    if not isinstance(metas, MetaColumns):
        metas = MetaColumns.from_metas(metas)
    cols = shape_columns(metas, layout, tuple(e.modality for e in model.encoders))
    costs = unit_costs([], model, cols)
    llm_dp = plan.unit("llm").dp
    splits = []
    for i in range(l):
        mb_costs = {u: c[i * size:(i + 1) * size] for u, c in costs.items()}
        units = {}
        for unit in model.unit_names:
            if is_vae(unit):  # reads the generator's rows in their order: no split of its own
                continue
            if is_generator(unit) and plan.unit(unit).dp == llm_dp:
                continue  # follows the LLM's split: hidden states stay on their rank
            units[unit] = split_unit(mb_costs[unit], plan.unit(unit).dp, policies[unit],
                                     algos[unit], node_wise, layout.seq_len)
        if has_generator(model.unit_names) and not has_generator(units):
            units[GENERATOR_UNIT] = units[LLM_UNIT]
        splits.append(units)
    if l > 1 and any(p == "disttrain" for p in policies.values()):
        gen = layout.gen.num_queries if layout.gen is not None else 64
        ranks = [{u: [[pos[k] for k in g] for g in s.lists()] for u, s in units.items()}
                 for pos, units in zip(mbs, splits)]
        mb_costs, stages = microbatch_costs(metas.metas(), model, plan, ranks, hardware, gen)
        order = inter_reorder(mb_costs, len(stages), stage_costs=stages)
        mbs, splits = [mbs[j] for j in order], [splits[j] for j in order]
    out = []
    for pos, units in zip(mbs, splits):
        at = np.arange(size, dtype=np.int64) + (pos[0] if pos else 0)  # a contiguous slice
        out.append(MicrobatchPlan(pos, units, UnitShapes(cols, at, units, layout)))
    return out


# ---------------------------------------------------------------------------------------
# Global batches
# ---------------------------------------------------------------------------------------

def _per_unit(value, model: MLLMConfig, setting: str, allowed, default: str) -> dict[str, str]:
    """A per-unit choice from one name (every unit) or a dict unit -> name (units left out
    get `default`), validated against `allowed`, errors naming `setting`."""
    units = model.unit_names
    if isinstance(value, str):
        pol = {u: value for u in units}
    elif isinstance(value, Mapping):
        unknown = set(value) - set(units)
        if unknown:
            raise UserError(f"{setting}: unknown units {sorted(unknown)}; units are {units}")
        pol = {u: value.get(u, default) for u in units}
    else:
        raise UserError(f"{setting}={value!r}: use one of {allowed} or a dict unit -> one "
                        f"of them")
    for u, p in pol.items():
        if p not in allowed:
            raise UserError(f"{setting}[{u!r}]={p!r}: use one of {allowed}")
    return pol


def unit_policies(balance, model: MLLMConfig, packing: str = "pack") -> dict[str, str]:
    """`Loader.balance` per unit; "rows" (whole packed rows per rank, row_deal.py) is the
    LLM's alone and needs packed rows (`packing`)."""
    pol = _per_unit(balance, model, "Loader.balance", POLICIES, "none")
    for u, p in pol.items():
        if p == "rows" and (not is_llm(u) or packing != "pack"):
            raise UserError(f"Loader.balance[{u!r}]='rows': whole packed rows are the LLM's "
                            f"split under packed rows (data_layout.packing='pack'); use "
                            f"'orchmllm' for {u!r}" if not is_llm(u) else
                            f"Loader.balance['llm']='rows' needs data_layout.packing='pack' "
                            f"(now {packing!r}); use 'orchmllm'")
    return pol


def post_balance_policies(value, model: MLLMConfig) -> dict[str, str]:
    """`Loader.post_balance_policy`: one OrchMLLM algorithm for every phase, or a dict unit
    -> algorithm (units left out use "sum"): "sum" (Algorithm 1, unpadded linear cost),
    "padded" (Algorithm 2), "sum_square" (Algorithm 4, attention-heavy), "conv" (Algorithm
    5); OrchMLLM picks per phase by its cost model (OrchMLLM §5.1, Appendix A)."""
    return _per_unit(value, model, "Loader.post_balance_policy", POST_BALANCE_POLICIES, "sum")
