"""The co-located runner's global batches with per-phase balancing (OrchMLLM §4-6).

The trainer's loader settings reach the co-located layout here: `Loader.balance` and
`Loader.post_balance_policy` give each phase's policy ("orchmllm" with the unit's
algorithm: OrchMLLM Algorithms 1, 2, 4, 5; "none": the loaded mini-batches), and
`Loader.ranks_per_node` (with `node_wise_method` / `_time_limit` / `_max_milp_ranks`) turns
on the node-wise rearrangement of the LLM's mini-batches (§5.2.2, Algorithm 3). Each global
batch holds exactly the samples every plan trains at that step (the run's one
`SampleStream`, data/sample_stream.py) and is assembled in its per-phase layouts
(data/colocated_batch.py); the runner places it and the encoder->LLM all-to-all tables
(parallel/phase_inputs.py). No Loader and no plan: the settings are read once from gin
(`loader_settings`) and the stream built only when a phase is balanced.

The per-rank shapes of every phase and the exchanges' static capacities (rows per shift of
the staged exchange, parallel/exchange_stages.py, forward and backward) are scanned from
metadata over the run's first global batches up front and only grow, so the step compiles
once. A setting the co-located layout cannot honour is one
`UserError` line before any work.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from mmjax.data.batch_shapes import BatchShapes
from mmjax.data.batch_plan import NodeWise
from mmjax.data.colocated_batch import PhaseBatch, phase_batch, plan_phases
from mmjax.data.loader_settings import BalanceSettings, loader_settings
from mmjax.data.sample_stream import SampleStream
from mmjax.errors import UserError
from mmjax.models.units import LLM_UNIT, is_generator, is_llm
from mmjax.parallel.phase_inputs import encoder_axes, encoder_ranks, llm_axes, llm_ranks
from mmjax.parallel.exchange_stages import join_caps
from mmjax.parallel.ragged_exchange import exchange_kind
from mmjax.parallel.rearrange import exchange_caps
from mmjax.data.stream_position import settings_changed
from mmjax.train.loader_stream import LoaderStream


@dataclass(frozen=True)
class PhaseSettings:
    """Per phase (encoder slot names, "llm") its policy ("none" or an OrchMLLM algorithm),
    and the node-wise rearrangement (`NodeWise`; ranks_per_node 0: off)."""

    policies: dict
    node_wise: NodeWise = NodeWise()
    exchange: str = "staged"  # "staged" or "ragged" (`ragged_exchange.exchange_kind`)

    @property
    def ranks_per_node(self) -> int:
        return self.node_wise.ranks_per_node

    @property
    def balanced(self) -> bool:
        return self.ranks_per_node > 0 or any(p != "none" for p in self.policies.values())


def phase_settings(balance: BalanceSettings, cfg, layout, num_devices: int,
                   tp: int) -> PhaseSettings:
    """The loader's balancing settings as the co-located layout's per-phase policies
    (module docstring); one line naming the setting for any it cannot honour. `tp`: the
    largest tp of any unit (`Colocation.max_tp`: nodes hold whole tp groups)."""
    pol, algo = balance.policies(cfg, layout.packing), balance.algos(cfg)
    for u, p in pol.items():
        if p == "disttrain":
            raise UserError(f"Loader.balance[{u!r}]='disttrain': the co-located layout trains "
                            f"the global batch as one program, with no microbatches for "
                            f"DistTrain's reordering (use 'orchmllm' with "
                            f"Loader.post_balance_policy, or 'none')")
        if p == "rows":
            raise UserError(f"Loader.balance[{u!r}]='rows': the co-located layout balances "
                            f"each phase by OrchMLLM's post-balancing, not by the plan's LLM "
                            f"rows (use 'orchmllm' with Loader.post_balance_policy, or "
                            f"'none')")
    gens = [u for u in cfg.unit_names if is_generator(u)]
    for g in gens:  # it reads the LLM's hidden states where the LLM's layout put them
        for name, raw, got in (("balance", balance.balance, pol),
                               ("post_balance_policy", balance.post_balance_policy, algo)):
            if isinstance(raw, Mapping) and g in raw and raw[g] != got[LLM_UNIT]:
                raise UserError(f"Loader.{name}[{g!r}]={raw[g]!r}: in the co-located layout "
                                f"the generator runs in the llm's layout ({got[LLM_UNIT]!r}); "
                                f"drop the {g!r} entry")
    policies = {"llm": "none" if pol[LLM_UNIT] == "none" else algo[LLM_UNIT]}
    for slot in layout.encoders:
        policies[slot.name] = "none" if pol[slot.name] == "none" else algo[slot.name]
    rpn = balance.ranks_per_node
    if rpn and (rpn < 0 or num_devices % rpn or rpn % tp):
        raise UserError(f"Loader.ranks_per_node={rpn}: the co-located layout's {num_devices} "
                        f"devices must be whole nodes of it, each holding whole tp groups of "
                        f"tp {tp} (use a divisor of {num_devices} that {tp} divides, or 0)")
    return PhaseSettings(policies, balance.node_wise, exchange_kind(balance.exchange))


def check_colocated_loader(cfg, layout, num_devices: int, tp: int) -> PhaseSettings:
    """`phase_settings` of gin's `Loader.*` for a co-located run, checked before any work
    (the trainer and `--check` call this before building anything)."""
    return phase_settings(loader_settings()[1], cfg, layout, num_devices, tp)


@dataclass
class BalancedBatch:
    """One global batch in its per-phase layouts, what the trainer's step reads of a
    `Batch` (tokens, doc, counts, shapes for its compile line), and the exchanges' static
    capacities ((forward, backward) rows per shift)."""

    phases: PhaseBatch
    capacity: tuple
    skipped: tuple = ()

    @property
    def tokens(self) -> np.ndarray:
        return self.phases.inputs["tokens"]

    @property
    def doc(self) -> np.ndarray:
        return self.phases.inputs["doc"]

    @property
    def num_target_tokens(self) -> int:
        return int(self.phases.inputs["num_target_tokens"])

    @property
    def shapes(self) -> BatchShapes:
        """The whole step's shapes (every rank's blocks together)."""
        sh, n_llm = self.phases.shapes, len(self.phases.plan.phases["llm"].batches)
        encs = []
        for e, s in sh.items():
            if not is_llm(e):
                ranks = len(self.phases.plan.phases[e].batches)
                encs += [(n, c * ranks, k) for n, c, k in s.encoders if n == e]
        return BatchShapes(sh["llm"].rows * n_llm, tuple(encs), sh["llm"].gen * n_llm)


def phase_batches(source, cfg, layout, global_batch: int, mesh, colo=None,
                  scan_steps: int | None = None) -> "PhaseBatches | None":
    """The co-located run's balanced global batches on `mesh`, its settings gin's
    `Loader.*`; None when no phase is balanced and node-wise is off (the runner then reads
    plain batches, train/single_data.py). `scan_steps`: as `PhaseBatches`."""
    stream_settings, balance = loader_settings()
    ranks = phase_ranks(layout, mesh, colo)
    tp = mesh.devices.size // min([*ranks[0].values(), ranks[1]])
    settings = phase_settings(balance, cfg, layout, mesh.devices.size, tp)
    if not settings.balanced:
        return None
    stream = SampleStream(source, layout, global_batch, stream_settings)
    return PhaseBatches(stream, mesh, settings, colo, scan_steps)


def phase_ranks(layout, mesh, colo=None) -> tuple[dict, int]:
    """(encoder slot -> its dp, the LLM's dp) on the co-located `mesh`."""
    encs = [slot.name for slot in layout.encoders]
    return encoder_ranks(mesh, encs, colo), llm_ranks(mesh, colo)


class PhaseBatches(LoaderStream):
    """Iterator of (BalancedBatch, skipped [`Skipped`]) for the co-located runner on
    `mesh`, over the run's sample stream; `state` / `restore` resume exactly (the one
    resume schema: next batch, floors, capacity)."""

    def __init__(self, stream: SampleStream, mesh, settings: PhaseSettings, colo=None,
                 scan_steps: int | None = None):
        self.stream, self.layout, self.mesh, self.settings = stream, stream.layout, mesh, settings
        self.colo = colo
        encs = [slot.name for slot in self.layout.encoders]
        self.ranks = phase_ranks(self.layout, mesh, colo)
        self.axes = (encoder_axes(mesh, encs, colo), llm_axes(mesh, colo))
        self.max_bad_fraction = stream.settings.max_bad_fraction
        self.next_batch = 0
        scan = stream.scan_steps if scan_steps is None else scan_steps
        self.floor, self.floor_capacity = self._scan(scan)
        self.shapes, self.capacity = self.floor, self.floor_capacity
        self._it = None

    def _kw(self) -> dict:
        return dict(node_wise=self.settings.node_wise, devices=self.mesh.devices.size)

    @property
    def ranks_per_node(self) -> int | None:
        """The staged exchange's node size (None: one node of every device)."""
        return self.settings.ranks_per_node or None

    def _caps(self, routes, caps=None) -> tuple:
        """`caps` joined with every encoder's (forward, backward) exchange capacities."""
        src, dst = self.axes
        for e, r in routes.items():
            got = exchange_caps(r, self.mesh, src[e], dst, self.ranks_per_node,
                                self.settings.exchange)
            caps = got if caps is None else tuple(join_caps(a, b) for a, b in zip(caps, got))
        return caps

    def _scan(self, steps: int):
        """Per-phase shapes and the exchanges' capacities over global batches 0 .. steps-1,
        planned from their metadata (`GlobalBatchBuilder.scan`)."""
        floors, caps = None, None
        for _, _, columns in self.stream.scan(steps):
            pp = plan_phases(columns.metas(), self.layout, *self.ranks, self.settings.policies,
                             floors=floors, **self._kw())
            floors, caps = pp.shapes, self._caps(pp.routes, caps)
        return floors, caps

    def global_floor(self) -> BatchShapes | None:
        """The scanned per-rank floors as one step's global shapes (every rank's blocks
        together: the LLM's rows and generated images over its ranks, each encoder's
        buffers over its ranks)."""
        if self.floor is None:
            return None
        llm = self.floor["llm"]
        enc_ranks, ranks = self.ranks
        encs = tuple((n, c * enc_ranks[e], k) for e, s in self.floor.items() if not is_llm(e)
                     for n, c, k in s.encoders if n == e)
        return BatchShapes(llm.rows * ranks, encs, llm.gen * ranks)

    def state(self) -> dict:
        """The resume schema (data/stream_position.py) with the floors and capacities."""
        return {**self.stream.state(self.next_batch),
                "capacity": None if self.capacity is None else [list(c) for c in self.capacity],
                "phase_shapes": None if self.shapes is None else {
                    p: s.to_json() for p, s in self.shapes.items()}}

    def restore(self, state: dict) -> None:
        """A state in the resume schema, of this layout or another (`shapes`: not per
        phase; the floors scanned here); at its stored sample, its shapes and capacities
        only when reached with this global batch and sequence length."""
        self.close()
        self.next_batch = self.stream.resume(state)
        if settings_changed(state, self.stream.global_batch, self.layout.seq_len):
            state = {k: v for k, v in state.items() if k not in ("phase_shapes", "capacity")}
        ps = state.get("phase_shapes")
        self.shapes = self.floor if ps is None else {
            p: BatchShapes.from_json(s) for p, s in ps.items()}
        cap = state.get("capacity")  # an older run's all-to-all capacity (an int): rescan
        self.capacity = (tuple(tuple(int(x) for x in c) for c in cap)
                         if isinstance(cap, list) else self.floor_capacity)
        if self.capacity is not None and self.floor_capacity is not None and [
                len(c) for c in self.capacity] != [len(c) for c in self.floor_capacity]:
            self.capacity = self.floor_capacity  # stored by the other exchange form

    def __next__(self):
        if self._it is None:
            self._it = self.stream.deliver(self.stream.samples, self.next_batch)
        gs = next(self._it)
        pb = phase_batch(gs.samples, self.layout, *self.ranks, self.settings.policies,
                         floors=self.shapes, failed=gs.failed, **self._kw())
        self.shapes = pb.shapes
        self.capacity = self._caps(pb.routes, self.capacity)
        self.next_batch = gs.step + 1
        return BalancedBatch(pb, self.capacity), list(gs.skipped)
