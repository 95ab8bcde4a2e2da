"""The co-located step's inputs for one global batch with per-phase balancing (OrchMLLM §5-6):
the batch assembled in each phase's balanced layout (data/colocated_batch.py), placed on the
co-located mesh (each unit's leaves over its dp axes, parallel/fsdp.py), plus per encoder
the all-to-all's index tables under `rearrange.ROUTE_KEY`, which the runner's seam
(`rearrange.phase_route`) reads. The encoders are data-parallel over every device, the LLM
over the mesh's LLM batch axes (dp = devices / tp)."""
from __future__ import annotations

from jax.sharding import Mesh

from mmjax.data.colocated_batch import PhaseBatch, phase_batch
from mmjax.parallel.fsdp import AXES, batch_axes, place_batch
from mmjax.parallel.rearrange import ROUTE_KEY, TrafficLedger, phase_route, route_tables


def phase_axes(mesh: Mesh) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(encoders' dp axes, the LLM's dp axes) of the co-located mesh."""
    return AXES, batch_axes(mesh, "llm")


def colocated_route(mesh: Mesh):
    """The `route` to hand `train.colocated.colocated_loss_fn` for balanced inputs."""
    return phase_route(mesh, *phase_axes(mesh))


def llm_ranks(mesh: Mesh) -> int:
    """The LLM's dp on the co-located mesh (devices / tp)."""
    enc_axes, llm_axes = phase_axes(mesh)
    n = mesh.devices.size
    return n // mesh.shape["tp"] if llm_axes != enc_axes else n


def place_phase_batch(pb: PhaseBatch, mesh: Mesh, capacity: int | None = None,
                      ledger: TrafficLedger | None = None,
                      row_bytes: int | None = None) -> dict:
    """A `PhaseBatch` as the co-located step's inputs: its leaves placed on the mesh, the
    encoders' all-to-all tables under `ROUTE_KEY` (see `balanced_inputs`)."""
    enc_axes, llm_axes = phase_axes(mesh)
    if ledger is not None and row_bytes is None:
        raise ValueError("balanced_inputs: a ledger needs row_bytes (hidden size x dtype bytes)")
    inputs = place_batch(mesh, pb.inputs)
    inputs[ROUTE_KEY] = route_tables(pb.routes, mesh, enc_axes, llm_axes, capacity, ledger,
                                     None if ledger is None else
                                     {e: int(row_bytes) for e in pb.routes})
    return inputs


def balanced_inputs(samples, layout, mesh: Mesh, policies, *, ranks_per_node: int = 0,
                    floors=None, capacity: int | None = None,
                    ledger: TrafficLedger | None = None,
                    row_bytes: int | None = None) -> tuple[dict, PhaseBatch]:
    """(placed step inputs, the PhaseBatch) for `samples` (module docstring). `floors`: a
    previous PhaseBatch's `shapes` (pad up to them: one compile per run); `capacity`: the
    all-to-alls' static rows per device pair (None: the busiest pair's, to a power of two);
    `ledger`: counts each exchange's bytes per link class, `row_bytes` per row (the LLM's
    hidden size x the compute dtype's bytes)."""
    pb = phase_batch(samples, layout, mesh.devices.size, llm_ranks(mesh), policies,
                     ranks_per_node=ranks_per_node, floors=floors)
    return place_phase_batch(pb, mesh, capacity, ledger, row_bytes), pb
