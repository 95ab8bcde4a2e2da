"""Per-phase layouts of one global batch in the co-located layout, and the row routes that take
each encoder's outputs to the LLM's layout (OrchMLLM §5-6; host side, no JAX).

Every phase (each encoder, the LLM) runs on the same d data-parallel ranks, but with its own
layout: which samples each rank holds, chosen by the phase's post-balancing policy (Batch
Post-Balancing, OrchMLLM §5.1: Algorithms 1, 2, 4, 5 in data/balance) or, with "none", the
original mini-batches (sample k loaded by rank k * d // n). Encoder E's rank holds its
samples' output rows back to back; an LLM rank holds the rows of E for its samples that have
E's modality, in LLM order. `routes[E]` maps every LLM (rank, row) to the encoder (rank, row)
that fills it: rearrangement composition (§6), one all-to-all per encoder
(parallel/rearrange.py), never back through the original instances.

Node-wise rearrangement (§5.2.2, Algorithm 3), with `node_wise.ranks_per_node` set and the LLM's d a
multiple of it above one node: the LLM's balanced mini-batches are permuted over ranks so the
largest per-rank inter-node volume of the encoder->LLM all-to-all (every encoder's output
bytes together, from their real source ranks) is least. That is the traffic the runner sends.
Deterministic (every host plans the same): `NodeWise` (data/batch_plan.py), the plan's own
settings and step (`node_wise_split`); a MILP answer is taken only when proven optimal. Units may be tensor-parallel (on n devices,
a phase at dp d has tp n / d; rank r on devices r*n/d .. (r+1)*n/d - 1, as the co-located
mesh lays them out): each encoder output counts at the LLM rank holding its encoder rank's
first device (encoder rank r at dp d_e: LLM rank r * d // d_e) and a node holds
ranks_per_node * d / n LLM ranks; a layout whose tp groups do not fit whole in nodes is
skipped and `node_wise["skipped"]` says so.
"""
from __future__ import annotations

from typing import Any

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from mmjax.data.balance import POLICIES as POST_BALANCE_POLICIES
from mmjax.data.batch_plan import NodeWise, balanced_split, node_wise_split
from mmjax.data.rank_split import RankSplit
from mmjax.data.routes import Routes

LAYOUT_POLICIES = ("none",) + POST_BALANCE_POLICIES


@dataclass(frozen=True)
class PhaseLayout:
    """One phase's samples per rank (global batch indices, in order) and each sample's rows
    in that phase's buffers; `capacity` rows per rank (static: the compiled shape)."""

    unit: str
    batches: tuple[tuple[int, ...], ...]
    rows: Mapping[int, int]
    capacity: int

    @property
    def num_ranks(self) -> int:
        return len(self.batches)

    def rank_rows(self) -> list[int]:
        return [sum(self.rows[s] for s in b) for b in self.batches]

    def offsets(self) -> dict[int, tuple[int, int]]:
        """sample -> (rank, first row) in this layout."""
        out = {}
        for r, b in enumerate(self.batches):
            o = 0
            for s in b:
                out[s] = (r, o)
                o += self.rows[s]
        return out

    def pack(self, per_sample: Mapping[int, np.ndarray], dtype=None) -> np.ndarray:
        """Host gather: `[ranks * capacity, ...]` with each rank's samples' rows back to back
        (zeros after them), from `per_sample[s]` of shape `[rows[s], ...]`."""
        some = next(iter(per_sample.values()))
        out = np.zeros((self.num_ranks * self.capacity,) + some.shape[1:],
                       dtype or some.dtype)
        for s, (r, o) in self.offsets().items():
            out[r * self.capacity + o:r * self.capacity + o + self.rows[s]] = per_sample[s]
        return out


@dataclass(frozen=True)
class ColocatedLayout:
    """Every phase's layout, per encoder the routes of its outputs into the LLM's layout and
    that encoder's rows laid out as the LLM holds them, and what node-wise did."""

    phases: dict[str, PhaseLayout]
    routes: dict[str, Routes]
    llm_rows: dict[str, PhaseLayout]
    node_wise: dict = field(default_factory=dict)


def original_batches(samples: Sequence[int], n: int, d: int) -> list[list[int]]:
    """The loaded mini-batches: sample k of the global batch (n samples) is on rank k*d//n."""
    out: list[list[int]] = [[] for _ in range(d)]
    for s in samples:
        out[min(s * d // n, d - 1)].append(s)
    return out


def _split(lengths: np.ndarray, members: list[int], n: int, d: int, policy: str) -> RankSplit:
    """The phase's `members` over its `d` ranks: as loaded ("none"), else post-balanced."""
    if policy == "none":
        return RankSplit.from_lists(original_batches(members, n, d))
    split = balanced_split(lengths[members], d, policy)
    return RankSplit(np.asarray(members, dtype=np.int64)[split.items], split.counts)


def _capacity(unit: str, need: int, given: Mapping[str, int] | None) -> int:
    if given is None or unit not in given:
        return max(need, 1)
    cap = int(given[unit])
    if cap < need:
        raise ValueError(f"capacity[{unit!r}]={cap} rows per rank is below this batch's "
                         f"{need} (raise it)")
    return cap


def _per_phase(value, phases, name: str) -> dict:
    if isinstance(value, (str, int)):
        return {p: value for p in phases}
    missing = set(phases) - set(value)
    if missing:
        raise ValueError(f"{name}: no entry for phases {sorted(missing)}")
    return dict(value)


def plan_colocated_layout(lengths: Mapping[str, Sequence[float]],
                          out_rows: Mapping[str, Sequence[int]],
                          num_ranks: int | Mapping[str, int], policies: str | Mapping[str, str],
                          *, llm: str = "llm", row_bytes: Mapping[str, int] | None = None,
                          node_wise: NodeWise | None = None,
                          capacity: Mapping[str, int] | None = None,
                          devices: int | None = None) -> ColocatedLayout:
    """Plan one global batch's co-located layouts (module docstring).

    `lengths[phase][s]`: sample s's cost for the phase (tokens; an encoder's 0 = the sample
    lacks its modality); `lengths[llm]` covers every sample. `out_rows[E][s]`: rows encoder
    E's output has for sample s (its projected tokens; 0 with no modality). `num_ranks`: d
    per phase (or one d). `policies`: "none" or a post-balancing policy, per phase or one
    for all. `row_bytes[E]`: bytes of one output row (hidden size x dtype), the node-wise
    volumes' unit (default 1 each). `capacity[key]`: static rows per rank for a phase's
    buffer (key E: the encoder's outputs; key f"{llm}/{E}": E's rows in the LLM's layout);
    default: this batch's fullest rank. `devices`: the mesh's device count, which every
    phase's dp divides (its tp = devices / dp; default: the largest dp). `node_wise`: the
    node-wise step's settings (default `NodeWise()`: off).
    """
    encoders, phases, x, rows = _checked_columns(lengths, out_rows, llm)
    node_wise = node_wise or NodeWise()
    dps = _per_phase(num_ranks, phases, "num_ranks")
    pols = _per_phase(policies, phases, "policies")
    for p, pol in pols.items():
        if pol not in LAYOUT_POLICIES:
            raise ValueError(f"policies[{p!r}]={pol!r}: use one of {LAYOUT_POLICIES}")
    n = len(x[llm])
    phase_layouts: dict[str, PhaseLayout] = {}
    for e in encoders:
        members = np.flatnonzero(x[e] > 0).tolist()
        batches = _split(x[e], members, n, dps[e], pols[e]).lists()
        r = {s: int(rows[e][s]) for s in members}
        need = max((sum(r[s] for s in b) for b in batches), default=0)
        phase_layouts[e] = PhaseLayout(e, tuple(map(tuple, batches)), r,
                                       _capacity(e, need, capacity))
    llm_split = _split(x[llm], list(range(n)), n, dps[llm], pols[llm])
    info: dict = {}
    llm_nw = dataclasses.replace(node_wise, ranks_per_node=_llm_ranks_per_node(
        node_wise.ranks_per_node, phases if encoders else [], dps, llm, devices, info))
    if llm_nw.spans(dps[llm]):
        llm_split = _node_wise(llm_split, phase_layouts, rows, row_bytes, dps[llm], llm_nw,
                               info)
    llm_batches = llm_split.lists()
    lengths_llm = {s: int(x[llm][s]) for s in range(n)}
    phase_layouts[llm] = PhaseLayout(llm, tuple(map(tuple, llm_batches)), lengths_llm,
                                     _capacity(llm, max(max(
                                         (sum(lengths_llm[s] for s in b) for b in llm_batches),
                                         default=0), 1), capacity))
    routes, llm_rows = _routes(phase_layouts, encoders, llm_batches, llm, capacity)
    return ColocatedLayout(phase_layouts, routes, llm_rows, info)


def _checked_columns(lengths, out_rows, llm: str):
    """(encoders, phases, float64 lengths per phase, int64 output rows per encoder), every
    column of the batch's length, an encoder's rows > 0 exactly where its length is."""
    if llm not in lengths:
        raise ValueError(f"lengths: no entry for the LLM phase {llm!r}")
    encoders = [p for p in lengths if p != llm]
    for e in encoders:
        if e not in out_rows:
            raise ValueError(f"out_rows: no entry for encoder {e!r}")
    phases = [*encoders, llm]
    n = len(lengths[llm])
    x = {p: np.asarray(lengths[p], dtype=np.float64) for p in phases}
    rows = {e: np.asarray(out_rows[e], dtype=np.int64) for e in encoders}
    for p in phases:
        if x[p].shape != (n,):
            raise ValueError(f"lengths[{p!r}] has {x[p].size} entries; the batch has {n}")
    for e in encoders:
        if rows[e].shape != (n,):
            raise ValueError(f"out_rows[{e!r}] has {rows[e].size} entries; the batch has {n}")
        if np.any((rows[e] > 0) != (x[e] > 0)):
            raise ValueError(f"out_rows[{e!r}] and lengths[{e!r}] disagree on which samples "
                             f"have the modality")
    return encoders, phases, x, rows


def _llm_ranks_per_node(rpn: int, phases, dps, llm: str, devices, info: dict) -> int:
    """LLM ranks per node for the node-wise step (0: none), when every phase's tp group
    (devices / dp) lies whole in nodes of `rpn` devices; else 0 and `info["skipped"]`
    says why. `phases` empty: no encoder, nothing to place."""
    if not rpn or not phases:
        return 0
    d = dps[llm]
    devs = int(devices) if devices else max(dps.values())
    tps = [devs // dps[p] for p in phases if devs % dps[p] == 0]
    if len(tps) == len(phases) and (rpn * d) % devs == 0 and all(rpn % t == 0 for t in tps):
        return rpn * d // devs
    info["skipped"] = (f"every phase's dp must divide the {devs} devices and "
                       f"ranks_per_node={rpn} hold whole tp groups of every phase")
    return 0


def _routes(phase_layouts, encoders, llm_batches, llm: str, capacity):
    """Per encoder, its output rows' route from the encoder's layout to the LLM's
    (`Routes`) and the rows' layout on the LLM ranks (`PhaseLayout` f"{llm}/{E}")."""
    routes, llm_rows = {}, {}
    for e in encoders:
        src = phase_layouts[e]
        r = dict(src.rows)
        dst_batches = tuple(tuple(s for s in b if s in r) for b in llm_batches)
        need = max((sum(r[s] for s in b) for b in dst_batches), default=0)
        dst = PhaseLayout(f"{llm}/{e}", dst_batches, r,
                          _capacity(f"{llm}/{e}", need, capacity))
        llm_rows[e] = dst
        so, do = src.offsets(), dst.offsets()
        pairs = [(so[s][0], so[s][1] + k, do[s][0], do[s][1] + k)
                 for s in r for k in range(r[s])]
        routes[e] = Routes.from_pairs(src.num_ranks, src.capacity, dst.num_ranks,
                                      dst.capacity, pairs)
    return routes, llm_rows


def _node_wise(llm_split: RankSplit, enc_layouts, rows, row_bytes, llm_dp: int,
               node_wise: NodeWise, info: dict) -> RankSplit:
    """Algorithm 3 on the encoder->LLM all-to-all (`node_wise_split`): items are (encoder,
    sample) outputs at their encoder rank (counted at the LLM rank holding its first
    device: encoder rank r of dp d_e at r * `llm_dp` // d_e), sized in bytes; the new
    batches are the LLM's balanced mini-batches."""
    src: list[Any] = []
    size: list[float] = []
    item_of: dict[Any, Any] = {}
    for e, lay in enc_layouts.items():
        rb = 1 if row_bytes is None else int(row_bytes[e])
        for r, b in enumerate(lay.batches):
            for s in b:
                item_of.setdefault(s, []).append(len(src))
                src.append(r * llm_dp // lay.num_ranks)
                size.append(float(rows[e][s] * rb))
    items = RankSplit.from_lists([[i for s in b for i in item_of.get(s, ())]
                                  for b in llm_split.lists()])
    return node_wise_split(llm_split, items, np.asarray(src, dtype=np.int64), size,
                           node_wise, info)


def phase_loads(layout: PhaseLayout, lengths: Sequence[float]) -> tuple[float, float]:
    """(max, mean) over ranks of the phase's tokens per rank (`lengths` per sample)."""
    x = np.asarray(lengths, dtype=np.float64)
    loads = [float(x[list(b)].sum()) if b else 0.0 for b in layout.batches]
    return max(loads), float(np.mean(loads))
