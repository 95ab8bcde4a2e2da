"""The co-located step's inputs for one global batch with per-phase balancing (OrchMLLM §5-6):
the batch assembled in each phase's balanced layout (data/colocated_batch.py), placed on the
co-located mesh (each unit's leaves over its dp axes, parallel/fsdp.py), plus per encoder
the staged exchange's index tables under `rearrange.ROUTE_KEY`, which the runner's seam
(`rearrange.phase_route`) reads. Each unit is data-parallel over the mesh's axes but its
own tp axes (dp = devices / tp): an encoder at tp 1 over every device, one at tp t over
devices / t ranks of t devices (every tp replica of a rank holds its block, one replica
sends each row to the LLM, every replica receives its gradient back), the LLM over its
own. `colo` (train/colocated_plan.py `Colocation`) gives each unit's tp; without it the
LLM takes the mesh's "tp" axis and the encoders none."""
from __future__ import annotations

from typing import cast

from jax.sharding import Mesh

from mmjax.data.batch_plan import NodeWise
from mmjax.data.colocated_batch import PhaseBatch, phase_batch
from mmjax.parallel.fsdp import batch_axes, place_batch
from mmjax.parallel.rearrange import ROUTE_KEY, TrafficLedger, exchange, route_tables


def encoder_axes(mesh: Mesh, encoders, colo=None) -> dict[str, tuple[str, ...]]:
    """Per encoder (slot name), its dp axes on the co-located mesh."""
    return {e: batch_axes(mesh, e, colo) for e in encoders}


def llm_axes(mesh: Mesh, colo=None) -> tuple[str, ...]:
    """The LLM's dp axes on the co-located mesh."""
    return batch_axes(mesh, "llm", colo)


def _ranks(mesh: Mesh, axes) -> int:
    n = 1
    for a in axes:
        n *= mesh.shape[a]
    return n


def encoder_ranks(mesh: Mesh, encoders, colo=None) -> dict[str, int]:
    """Per encoder, its dp on the co-located mesh (devices / its tp)."""
    return {e: _ranks(mesh, a) for e, a in encoder_axes(mesh, encoders, colo).items()}


def llm_ranks(mesh: Mesh, colo=None) -> int:
    """The LLM's dp on the co-located mesh (devices / tp)."""
    return _ranks(mesh, llm_axes(mesh, colo))


def colocated_route(mesh: Mesh, colo=None):
    """The `route` to hand `train.colocated.colocated_loss_fn` for balanced inputs: every
    encoder's outputs, blocked over its own dp axes, to the LLM's layout by the tables in
    `batch[ROUTE_KEY]` (one staged exchange each, the inverse in the backward; `rearrange`). A
    batch without tables is already in one layout: returned as is."""
    dst = llm_axes(mesh, colo)

    def route(enc_outputs: dict, batch) -> dict:
        tables = batch.get(ROUTE_KEY) if hasattr(batch, "get") else None
        if tables is None:
            return enc_outputs
        return {e: exchange(x, tables[e], mesh, batch_axes(mesh, e, colo), dst)
                for e, x in enc_outputs.items()}
    return route


def place_phase_batch(pb: PhaseBatch, mesh: Mesh, capacity: tuple | None = None,
                      ledger: TrafficLedger | None = None,
                      row_bytes: int | None = None, colo=None,
                      ranks_per_node: int | None = None, kind: str = "staged") -> dict:
    """A `PhaseBatch` as the co-located step's inputs: its leaves placed on the mesh, the
    encoders' exchange tables under `ROUTE_KEY` (see `balanced_inputs`; `kind`: "staged"
    or "ragged", `rearrange.plan_exchange`)."""
    if ledger is not None and row_bytes is None:
        raise ValueError("balanced_inputs: a ledger needs row_bytes (hidden size x dtype bytes)")
    inputs = place_batch(mesh, pb.inputs, colo)
    dst = llm_axes(mesh, colo)
    tables = {}
    for e, axes in encoder_axes(mesh, pb.routes, colo).items():
        tables.update(route_tables({e: pb.routes[e]}, mesh, axes, dst, capacity, ledger,
                                   None if ledger is None else {e: int(cast(int, row_bytes))},
                                   ranks_per_node, kind))
    inputs[ROUTE_KEY] = tables
    return inputs


def balanced_inputs(samples, layout, mesh: Mesh, policies, *, ranks_per_node: int = 0,
                    floors=None, capacity: tuple | None = None,
                    ledger: TrafficLedger | None = None,
                    row_bytes: int | None = None, colo=None,
                    kind: str = "staged") -> tuple[dict, PhaseBatch]:
    """(placed step inputs, the PhaseBatch) for `samples` (module docstring). `floors`: a
    previous PhaseBatch's `shapes` (pad up to them: one compile per run); `capacity`: the
    exchanges' static (forward, backward) rows per shift (None: this batch's own,
    bucketed), staged over nodes of `ranks_per_node`; `ledger`: counts each exchange's
    bytes per link class, `row_bytes` per row (the LLM's hidden size x the compute dtype's
    bytes); `kind`: the exchange's form, "staged" or "ragged" (GPU)."""
    encs = [slot.name for slot in layout.encoders]
    pb = phase_batch(samples, layout, encoder_ranks(mesh, encs, colo), llm_ranks(mesh, colo),
                     policies, node_wise=NodeWise(ranks_per_node), floors=floors,
                     devices=mesh.devices.size)
    return place_phase_batch(pb, mesh, capacity, ledger, row_bytes, colo,
                             ranks_per_node or None, kind), pb
