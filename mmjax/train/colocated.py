"""The co-located runner (OrchMLLM's layout): every unit on one mesh of all devices, each
data-parallel over it (the LLM and each encoder at dp x tp with its own tp), with FSDP
(ZeRO-1/2/3) per unit.

The step is one jitted SPMD program over the mesh (GSPMD): the encoders' forward over all
ranks, the encoder outputs moved to the LLM's layout (`route`, the per-phase balancing
seam), the LLM's forward and backward, the generator, then the encoders' backward, in
dataflow order. Frozen units have no gradients and no optimizer state (their parameters are
the step's `frozen` input). The interface is `SingleProgram`'s: the same loader, global
batches, plan-independent checkpoints (train/logical_state.py) and evaluation, so a run
switches between this layout, its ZeRO stages and the other runners on resume.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mmjax.models.hf.pretrained import load_pretrained_dirs
from mmjax.models.mllm import MultimodalModel, trainable_filter
from mmjax.models.scan import layer_weights
from mmjax.parallel.fsdp import (colocated_mesh, gather_layer, gather_outside_layers,
                                 place_batch, tree_shardings)
from mmjax.parallel.phase_inputs import colocated_route, place_phase_batch
from mmjax.parallel.hlo_traffic import collective_bytes
from mmjax.parallel.rearrange import BACKWARD_SCOPE, FORWARD_SCOPE, TrafficLedger
from mmjax.train.colocated_data import BalancedBatch, PhaseBatches
from mmjax.train.colocated_plan import Colocation
from mmjax.train.data_config import train_source
from mmjax.train.memory_check import check_colocated
from mmjax.train.runner import StepMetrics
from mmjax.train.optimizer import optimizer_from_settings, rate_as_input
from mmjax.train.single_program import SingleProgram
from mmjax.train.state import WHOLE_MODEL, TrainState, whole_model_state
from mmjax.train.step import make_loss_fn, split_model, train_step_fn


def to_llm_layout(enc_outputs: dict, batch=None) -> dict:
    """The encoder outputs in the encoder phase's layout -> the LLM phase's layout. Without
    per-phase balancing both phases split the global batch alike: the identity. With it,
    `parallel.rearrange.phase_route` (one all-to-all per encoder, tables in the batch)."""
    return enc_outputs


def state_shardings(abstract: TrainState, mesh, colo: Colocation) -> TrainState:
    """Per-leaf NamedShardings of the single program's TrainState under the co-located
    ZeRO stages."""
    (stage,) = abstract.stages.values()
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return whole_model_state(tree_shardings(stage.master, mesh, colo, "params"),
                             tree_shardings(stage.opt, mesh, colo, "opt"), rep)


def frozen_shardings(frozen, mesh, colo: Colocation):
    """Per-leaf NamedShardings of the frozen parameters (placed as parameters are)."""
    return tree_shardings(frozen, mesh, colo, "params")


def colocated_loss_fn(graphdef, mesh, colo: Colocation, dtype=jnp.float32, attention_impl="auto",
                      llm_mask_family="bam", route=to_llm_layout):
    """(trainable, frozen, batch) -> (loss, aux) with each layer's weights gathered in the
    layer scan and the rest at the start (no-ops for units whose parameters are whole)."""
    base = make_loss_fn(graphdef, dtype, attention_impl, llm_mask_family, route)

    def loss_fn(trainable, frozen, batch):
        whole = lambda t: gather_outside_layers(t, mesh, colo)
        with layer_weights(gather_layer(mesh, colo)):
            return base(whole(trainable), whole(frozen), batch)
    return loss_fn


def colocated_step(graphdef, tx, mesh, colo: Colocation, abstract: TrainState,
                   dtype=jnp.float32, attention_impl="auto", llm_mask_family="bam",
                   route=to_llm_layout, tx_at=None):
    """The jitted (state, frozen, batch, limits[, learning_rate]) -> (state, metrics) step
    (`tx_at`: `train_step_fn`'s, the rate an input): gradients placed
    by the ZeRO stage (whole: all-reduce; sharded: reduce-scatter), the state kept on its
    co-located shardings (`abstract`'s), the old state donated."""
    (stage,) = abstract.stages.values()
    grads = tree_shardings(stage.master, mesh, colo, "grads")
    loss_fn = colocated_loss_fn(graphdef, mesh, colo, dtype, attention_impl, llm_mask_family, route)
    place = lambda g: jax.lax.with_sharding_constraint(g, grads)
    return jax.jit(train_step_fn(loss_fn, tx, place, tx_at), donate_argnums=(0,),
                   out_shardings=(state_shardings(abstract, mesh, colo), None))


class Colocated(SingleProgram):
    """`SingleProgram`'s interface over a co-located mesh of every device."""

    program_cache = False  # a mesh-sharded step: JAX's compilation cache only

    def __init__(self, cfg, layout, global_batch, schedule, dtype, seed, colo: Colocation,
                 source=None, attention_impl="auto", pretrained=None,
                 devices=None, check_memory: bool = True):
        devices = jax.devices() if devices is None else devices
        self.mesh = colocated_mesh(devices, colo)
        self.colo = colo
        # the loader's balancing settings (train/colocated_data.py): per-phase layouts and
        # the encoder->LLM all-to-all when any phase is balanced or node-wise is on
        phases = PhaseBatches(source if source is not None else train_source(cfg), cfg,
                              layout, global_batch, self.mesh, colo=colo)
        if not phases.settings.balanced:
            phases.close()
            phases = None
        self.phases = phases
        rpn = phases.settings.ranks_per_node if phases else 0
        # bytes the all-to-alls deliver per link class (nodes of `Loader.ranks_per_node`)
        self.ledger = TrafficLedger(rpn) if rpn else None
        self._sent: dict = {}  # compiled program key -> its exchanges' bytes (sent_bytes)
        self.row_bytes = cfg.llm.hidden_size * jnp.dtype(dtype).itemsize
        super().__init__(cfg, layout, global_batch, schedule, dtype, seed, source,
                         attention_impl, None, check_memory=False,
                         count_multiple=len(devices), data=phases)
        self.memory_line = None
        shapes = self.data.floor if phases is None else phases.global_floor()
        if shapes is not None:  # the step's peak per device before anything compiles
            caps = phases.floor_capacity if phases is not None else None
            exchange = 0.0 if caps is None else (  # send + receive, each encoder
                2 * max(sum(c) for c in caps) * self.row_bytes * len(cfg.encoders))
            _, self.memory_line = check_colocated(
                cfg, shapes, layout.seq_len, self.abstract.stages[WHOLE_MODEL].master,
                self.abstract_frozen,
                colo, len(devices), dtype, attention_impl, global_batch,
                jax.local_devices()[0], check_memory, exchange, len(jax.local_devices()))
        filters = (trainable_filter(cfg), ...)
        tx = optimizer_from_settings(schedule)
        self.shardings = state_shardings(self.abstract, self.mesh, colo)
        self.frozen_shardings = frozen_shardings(self.abstract_frozen, self.mesh, colo)
        on = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
        self.abstract = jax.tree.map(on, self.abstract, self.shardings)
        self.abstract_frozen = jax.tree.map(on, self.abstract_frozen, self.frozen_shardings)
        key = jax.random.key(seed)

        def init():
            _, tr, fr = nnx.split(MultimodalModel(cfg, key), *filters)
            return whole_model_state(tr, tx.init(tr), jnp.zeros((), jnp.int32)), fr
        init = jax.jit(init, out_shardings=(self.shardings, self.frozen_shardings))

        def fresh() -> tuple[TrainState, object]:
            state, frozen = init()
            if pretrained:
                mdl = nnx.merge(self.graphdef,
                                jax.device_get(state.stages[WHOLE_MODEL].master),
                                jax.device_get(frozen))
                load_pretrained_dirs(mdl, pretrained)
                _, tr, fr = split_model(mdl, filters[0])
                state = self.place(whole_model_state(tr, jax.jit(tx.init)(tr), state.step))
                frozen = jax.jit(lambda f: f, out_shardings=self.frozen_shardings)(fr)
            return state, frozen
        self._fresh, self._state = fresh, None
        if self._frozen is not None:  # no frozen leaves: its (empty) structure, placed
            self._frozen = self.abstract_frozen
        if pretrained:
            self._make()
        tx_at, self.rate_at = rate_as_input(schedule)
        self.step_fn = colocated_step(self.graphdef, tx, self.mesh, colo, self.abstract,
                                      dtype, attention_impl, layout.llm_mask_family,
                                      colocated_route(self.mesh, colo) if phases
                                      else to_llm_layout, tx_at)

    def place(self, state: TrainState) -> TrainState:
        """A TrainState (any placement) on the co-located shardings, its data kept."""
        placed = jax.jit(lambda s: s, out_shardings=self.shardings)(state._replace(data={}))
        return placed._replace(data=state.data)

    def inputs(self, batch):
        if isinstance(batch, BalancedBatch):  # per-phase layouts + the all-to-all tables
            return place_phase_batch(batch.phases, self.mesh, batch.capacity, self.ledger,
                                     self.row_bytes, self.colo, self.phases.ranks_per_node)
        return place_batch(self.mesh, super().inputs(batch), self.colo)

    def step(self, trace: bool = False, limits=(float("inf"), float("inf"))) -> StepMetrics:
        """`SingleProgram.step`; with `ranks_per_node` set, the step's encoder->LLM bytes per
        link class in its metrics: `a2a_{intra,inter}_node_bytes` what the compiled step's
        exchanges send (forward and backward, read from its HLO: `sent_bytes`),
        `a2a_*_payload_bytes` the rows the tables deliver (`TrafficLedger.payload`)."""
        before = dict(self.ledger.payload) if self.ledger else None
        m = super().step(trace, limits)
        if self.ledger:
            m.extra = {f"a2a_{k}_payload_bytes": v - before[k]
                       for k, v in self.ledger.payload.items()}
            m.extra.update({f"a2a_{k}_bytes": v for k, v in self.sent_bytes().items()})
        return m

    def sent_bytes(self) -> dict[str, int]:
        """Per link class (nodes of `Loader.ranks_per_node`), the bytes the last step's
        compiled program sends in its encoder->LLM exchanges, forward and backward: its
        collective operands read from XLA's optimized HLO (`parallel.hlo_traffic`), once
        per compiled program."""
        key = self.last_key
        if key not in self._sent:
            hlo = self.compiled[key].as_text()
            rpn = self.ledger.ranks_per_node
            n = self.mesh.devices.size
            got = [collective_bytes(hlo, rpn, s, n) for s in (FORWARD_SCOPE, BACKWARD_SCOPE)]
            self._sent[key] = {k: got[0][k] + got[1][k] for k in ("intra_node", "inter_node")}
        return self._sent[key]

    def load(self, state: dict, data_state: dict, step: int) -> str | None:
        notice = super().load(state, data_state, step)
        self.state = self.place(self.state)
        return notice
