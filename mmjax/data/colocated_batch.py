"""One global batch assembled in per-phase layouts for the co-located runner (host, no JAX).

Each phase gets its own data-parallel layout (data/colocated_layout.py: OrchMLLM §5
post-balancing per phase, §5.2.2 node-wise placement of the LLM's mini-batches): encoder E's
inputs are its ranks' balanced samples, each rank's block assembled alone at shapes common
to E's ranks; the LLM's rows, gather indices and generator fields are its ranks' samples,
each rank's block assembled alone at the LLM ranks' common shapes. Blocks are concatenated
rank after rank along the leading axis, so a leaf sharded over the unit's dp axes puts each
rank's block on that rank. `routes[E]` (row granularity) maps every row of E's flattened
projected output as the LLM ranks expect it (what their `gather_E` indices point at, offset
by rank) to the row of the encoder rank that computes it: rearrangement composition (§6),
one all-to-all per encoder (parallel/rearrange.py). Loss normalisers are the global batch's,
so loss and gradients equal the single-device model's on the same samples.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from mmjax.data.assemble import assemble, item_rows, projected_size
from mmjax.data.batch_plan import NodeWise
from mmjax.data.batch_shapes import BatchShapes, batch_shapes
from mmjax.data.colocated_layout import ColocatedLayout, plan_colocated_layout
from mmjax.data.global_batch import mask_out_failed
from mmjax.data.layout import AssemblyLayout, check_sample
from mmjax.data.routes import Routes
from mmjax.data.sample import Sample

LLM_FIELDS = ("tokens", "targets", "loss_mask", "positions", "doc", "sub", "bam")


@dataclass
class PhaseBatch:
    """`inputs`: the step's input dict (train/inputs.py `model_inputs` keys), rank-blocked
    per phase; `routes[E]`: encoder E's rows to the LLM's; `plan`: the sample layouts."""

    inputs: dict
    routes: dict[str, Routes]
    plan: ColocatedLayout
    rows_per_rank: dict[str, tuple[int, int]]  # E -> (encoder rank rows, LLM rank rows)
    shapes: dict[str, BatchShapes]  # per phase, the per-rank shapes used (next floors)


def at_least(need: BatchShapes, floor: BatchShapes | None) -> BatchShapes:
    """`need` grown to `floor` field by field (the runner's high-water shapes: a larger
    capacity packs into no more buffers, so the max of both fits)."""
    if floor is None:
        return need
    encs = tuple((n, max(c0, c1), max(k0, k1))
                 for (n, c0, k0), (_, c1, k1) in zip(need.encoders, floor.encoders))
    return BatchShapes(max(need.rows, floor.rows), encs, max(need.gen, floor.gen))


def _concat(blocks: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(blocks, axis=0)


@dataclass
class PhasePlan:
    """One global batch's per-phase layouts from metadata alone (what `phase_batch`
    assembles): the sample layouts, each phase's rank groups and per-rank shapes, and the
    encoder->LLM routes at those shapes. The runner's start-up shape scan folds these."""

    plan: ColocatedLayout
    llm_groups: list[list[int]]
    enc_groups: dict[str, list[list[int]]]
    shapes: dict[str, BatchShapes]  # per phase, per-rank shapes (floors applied)
    routes: dict[str, Routes]
    rows_per_rank: dict[str, tuple[int, int]]


def plan_phases(metas, layout: AssemblyLayout, encoder_ranks: int | dict, llm_ranks: int,
                policies, *, node_wise: NodeWise | None = None,
                floors: dict[str, BatchShapes] | None = None,
                devices: int | None = None) -> PhasePlan:
    """The per-phase layouts, shapes and routes of samples with metadata `metas` (no
    sample data: the loader's shape scan calls this on metadata from the index).
    `encoder_ranks`: every encoder's dp, or per encoder slot (an encoder at tp t has
    devices / t ranks); `devices`: the mesh's (default: the largest dp); `node_wise`: the
    node-wise step (`plan_colocated_layout`)."""
    floors = floors or {}
    slots = list(layout.encoders)
    if not isinstance(encoder_ranks, dict):
        encoder_ranks = {slot.name: encoder_ranks for slot in slots}
    lengths = {"llm": [m.llm_length for m in metas]}
    out_rows = {}
    for slot in slots:
        lengths[slot.name] = [m.encoder_tokens(slot.modality) for m in metas]
        out_rows[slot.name] = [sum(s.num_llm_tokens for s in m.segments
                                   if s.modality == slot.modality) for m in metas]
    ranks = {slot.name: encoder_ranks[slot.name] for slot in slots}
    ranks["llm"] = llm_ranks
    plan = plan_colocated_layout(lengths, out_rows, ranks, policies, node_wise=node_wise,
                                 devices=devices)
    llm_groups = [list(b) for b in plan.phases["llm"].batches]
    llm_shapes = at_least(batch_shapes([[metas[i] for i in g] for g in llm_groups], layout),
                          floors.get("llm"))
    used = {"llm": llm_shapes}
    llm_rows = [item_rows([metas[i] for i in g], layout, llm_shapes) for g in llm_groups]
    enc_groups, routes, sizes = {}, {}, {}
    for slot in slots:
        e = slot.name
        d_rows = projected_size(slot, llm_shapes)
        groups = [list(b) for b in plan.phases[e].batches]
        enc_groups[e] = groups
        enc_shapes = at_least(batch_shapes([[metas[i] for i in g] for g in groups], layout),
                              floors.get(e))
        used[e] = enc_shapes
        s_rows = projected_size(slot, enc_shapes)
        where: dict[int, tuple[int, list]] = {}  # sample -> (encoder rank, rows per item)
        for r, g in enumerate(groups):
            it = iter(item_rows([metas[i] for i in g], layout, enc_shapes)[e])
            for i in g:
                where[i] = (r, [next(it) for _ in range(metas[i].count(slot.modality))])
        pairs: list[tuple[int, int, int, int]] = []
        for r, g in enumerate(llm_groups):
            it = iter(llm_rows[r][e])
            for i in g:
                dst = [next(it) for _ in range(metas[i].count(slot.modality))]
                if not dst:
                    continue
                er, src = where[i]
                for a, b in zip(src, dst):
                    pairs.extend((er, int(x), r, int(y)) for x, y in zip(a, b))
        routes[e] = Routes.from_pairs(ranks[e], s_rows, llm_ranks, d_rows, pairs)
        sizes[e] = (s_rows, d_rows)
    return PhasePlan(plan, llm_groups, enc_groups, used, routes, sizes)


def phase_batch(samples: list[Sample], layout: AssemblyLayout, encoder_ranks: int | dict,
                llm_ranks: int, policies, *, node_wise: NodeWise | None = None,
                floors: dict[str, BatchShapes] | None = None,
                failed: frozenset | set = frozenset(), devices: int | None = None) -> PhaseBatch:
    """Assemble `samples` (checked good) in per-phase layouts (module docstring).
    `policies`: "none" or a post-balancing policy, one for all phases or per phase name
    (the encoder slot names and "llm"). `floors[phase]`: per-rank shapes to pad up to
    (a previous `PhaseBatch.shapes`, so a run compiles once). `failed`: ids of samples
    that failed to decode (blanks of their shapes): their loss is masked out.
    `encoder_ranks` / `devices`: as `plan_phases`."""
    for s in samples:
        reason = check_sample(s, layout)
        if reason:
            raise ValueError(f"phase_batch: sample {s.id} is bad ({reason}); drop bad samples "
                             f"before planning the layouts")
    metas = [layout.rules.meta(s) for s in samples]
    pp = plan_phases(metas, layout, encoder_ranks, llm_ranks, policies, node_wise=node_wise,
                     floors=floors, devices=devices)
    llm_shapes = pp.shapes["llm"]
    llm_parts = []
    for g in pp.llm_groups:
        part = assemble([samples[i] for i in g], layout, llm_shapes, encoder_inputs=False)
        if failed:
            mask_out_failed(part, [samples[i] for i in g], failed)
        llm_parts.append(part)
    inputs: dict[str, Any] = {k: _concat([getattr(b, k) for b in llm_parts]) for k in LLM_FIELDS}
    inputs["bam"] = inputs["bam"].astype(np.int32)
    rows, seq = llm_parts[0].tokens.shape
    n_gen = sum(b.num_gen_elements for b in llm_parts)
    if llm_parts[0].gen is not None:
        for k in llm_parts[0].gen:
            # one layout: every part has gen when the first has
            blocks = [cast(dict, b.gen)[k] for b in llm_parts]
            if k == "gen_query":  # flattened [rows * seq] hidden-state indices, per rank
                blocks = [q + r * rows * seq for r, q in enumerate(blocks)]
            inputs[k] = _concat(blocks)
    inputs["encoders"] = {}
    for slot in layout.encoders:
        e = slot.name
        d_rows = pp.rows_per_rank[e][1]
        inputs[f"gather_{e}"] = _concat([np.where(b.gather[e] >= 0, b.gather[e] + r * d_rows, -1)
                                         for r, b in enumerate(llm_parts)])
        enc_parts = [assemble([samples[i] for i in g], layout, pp.shapes[e])
                     for g in pp.enc_groups[e]]
        inputs["encoders"][e] = {k: _concat([b.encoders[e][k] for b in enc_parts])
                                 for k in enc_parts[0].encoders[e]}
    inputs["num_target_tokens"] = np.float32(sum(b.num_target_tokens for b in llm_parts))
    inputs["num_gen_elements"] = np.float32(n_gen)
    return PhaseBatch(inputs, pp.routes, pp.plan, pp.rows_per_rank, pp.shapes)
