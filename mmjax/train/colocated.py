"""The co-located placement (OrchMLLM's layout) of the whole-model runner
(train/whole_model.py): every unit on one mesh of all devices, each data-parallel over it
(the LLM and each encoder at dp x tp with its own tp), with FSDP (ZeRO-1/2/3) per unit.

The step is one jitted SPMD program over the mesh (GSPMD): the encoders' forward over all
ranks, the encoder outputs moved to the LLM's layout (`route`, the per-phase balancing
seam), the LLM's forward and backward, the generator, then the encoders' backward, in
dataflow order. Frozen units have no gradients and no optimizer state (their parameters are
the step's `frozen` input). The runner is the single program's: the same loader, global
batches, plan-independent checkpoints (train/logical_state.py) and evaluation, so a run
switches between this layout, its ZeRO stages and the other runners on resume.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from mmjax.models.mllm import MultimodalModel
from mmjax.models.scan import layer_weights
from mmjax.parallel.fsdp import (colocated_mesh, gather_layer, gather_split_products,
                                 place_batch, tree_shardings)
from mmjax.parallel.phase_inputs import colocated_route, place_phase_batch
from mmjax.parallel.hlo_traffic import collective_bytes
from mmjax.parallel.rearrange import BACKWARD_SCOPE, FORWARD_SCOPE, TrafficLedger
from mmjax.train.colocated_data import BalancedBatch, PhaseBatches, phase_batches
from mmjax.train.colocated_plan import Colocation
from mmjax.train.inputs import model_inputs
from mmjax.train.memory_check import check_colocated
from mmjax.train.single_program import whole_batches
from mmjax.train.state import WHOLE_MODEL, TrainState, whole_model_state
from mmjax.train.step import make_loss_fn, train_step_fn


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
    layer scan and the adaLN modulations outside it at the start (no-ops for units whose
    parameters are whole)."""
    base = make_loss_fn(graphdef, dtype, attention_impl, llm_mask_family, route)

    def loss_fn(trainable, frozen, batch):
        whole = lambda t: gather_split_products(t, mesh, colo)
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


class ColocatedMesh:
    """The step over a co-located mesh of `devices` (default: every device) under `colo`'s
    tp and ZeRO stages, with the per-phase balancing exchange when the loader's settings
    balance a phase or turn node-wise on (train/colocated_data.py). `cfg` and `dtype` size
    the exchange's rows. A mesh-sharded step: JAX's compilation cache only."""

    program_cache = False

    def __init__(self, colo: Colocation, cfg, dtype, devices=None):
        self.devices = list(jax.devices() if devices is None else devices)
        self.mesh = colocated_mesh(self.devices, colo)
        self.colo = colo
        self.row_bytes = cfg.llm.hidden_size * jnp.dtype(dtype).itemsize
        self.phases: PhaseBatches | None = None  # set by `batches` when balanced
        # bytes the all-to-alls deliver per link class (nodes of `Loader.ranks_per_node`)
        self.ledger: TrafficLedger | None = None
        self._payload: dict[str, int] = {}  # the ledger's payload after the last step
        self._ragged_sent: dict[str, int] = {}  # and its sent bytes (a ragged exchange)
        self._sent: dict = {}  # compiled program key -> its exchanges' bytes (sent_bytes)

    def batches(self, source, cfg, layout, global_batch: int):
        """Per-phase layouts and the encoder->LLM all-to-all when any phase is balanced or
        node-wise is on; else the global batches whole, counts rounded to the mesh's size."""
        phases = phase_batches(source, cfg, layout, global_batch, self.mesh, colo=self.colo)
        if phases is None:
            return whole_batches(source, cfg, layout, global_batch, len(self.devices))
        self.phases = phases
        rpn = phases.settings.ranks_per_node
        self.ledger = TrafficLedger(rpn) if rpn else None
        self._payload = dict(self.ledger.payload) if self.ledger else {}
        self._ragged_sent = dict(self.ledger.sent) if self.ledger else {}
        return phases

    def memory_line(self, cfg, data, layout, abstract: TrainState, abstract_frozen, dtype,
                    attention_impl: str, global_batch: int, check_memory: bool) -> str | None:
        """The step's peak per device before anything compiles (the exchange's send and
        receive buffers of every encoder included)."""
        phases = self.phases
        shapes = data.floor if phases is None else phases.global_floor()
        if shapes is None:
            return None
        caps = phases.floor_capacity if phases is not None else None
        exchange = 0.0 if caps is None else (
            2 * max(sum(c) for c in caps) * self.row_bytes * len(cfg.encoders))
        _, line = check_colocated(
            cfg, shapes, layout.seq_len, abstract.stages[WHOLE_MODEL].master, abstract_frozen,
            self.colo, len(self.devices), dtype, attention_impl, global_batch,
            jax.local_devices()[0], check_memory, exchange, len(jax.local_devices()))
        return line

    def shardings(self, abstract: TrainState, abstract_frozen) -> tuple[Any, Any]:
        return (state_shardings(abstract, self.mesh, self.colo),
                frozen_shardings(abstract_frozen, self.mesh, self.colo))

    def prefetch_init(self, cfg, key, filters: tuple) -> None:
        """Nothing: the init is a mesh-sharded program, in JAX's compilation cache only."""

    def init(self, cfg, key, filters: tuple, tx, shardings: tuple) -> tuple[TrainState, Any]:
        """One jitted program that makes every array as its shards."""
        def init():
            _, tr, fr = nnx.split(MultimodalModel(cfg, key), *filters)
            return whole_model_state(tr, tx.init(tr), jnp.zeros((), jnp.int32)), fr
        return jax.jit(init, out_shardings=shardings)()

    def fetch(self, tree) -> Any:
        return jax.device_get(tree)

    def put(self, tree, shardings) -> Any:
        return jax.jit(lambda t: t, out_shardings=shardings)(tree)

    def step_fn(self, graphdef, tx, dtype, attention_impl: str, mask_family: str, tx_at,
                abstract: TrainState) -> Any:
        route = (colocated_route(self.mesh, self.colo) if self.phases is not None
                 else to_llm_layout)
        return colocated_step(graphdef, tx, self.mesh, self.colo, abstract, dtype,
                              attention_impl, mask_family, route, tx_at)

    def inputs(self, batch) -> dict:
        if isinstance(batch, BalancedBatch):  # per-phase layouts + the all-to-all tables
            assert self.phases is not None
            return place_phase_batch(batch.phases, self.mesh, batch.capacity, self.ledger,
                                     self.row_bytes, self.colo, self.phases.ranks_per_node,
                                     self.phases.settings.exchange)
        return place_batch(self.mesh, model_inputs(batch), self.colo)

    def step_extra(self, key, compiled) -> dict:
        """With `ranks_per_node` set, the step's encoder->LLM bytes per link class:
        `a2a_{intra,inter}_node_bytes` what the compiled step's exchanges send (forward and
        backward, read from its HLO: `sent_bytes`; a ragged exchange's: the rows its tables
        send, `TrafficLedger.sent`), `a2a_*_payload_bytes` the rows the tables delivered
        this step (`TrafficLedger.payload`)."""
        if self.ledger is None:
            return {}
        now, sent = dict(self.ledger.payload), dict(self.ledger.sent)
        extra = {f"a2a_{k}_payload_bytes": v - self._payload[k] for k, v in now.items()}
        assert self.phases is not None
        if self.phases.settings.exchange == "ragged":  # its links carry the send sizes
            extra.update({f"a2a_{k}_bytes": v - self._ragged_sent.get(k, 0)
                          for k, v in sent.items()})
        else:
            extra.update({f"a2a_{k}_bytes": v
                          for k, v in self.sent_bytes(key, compiled).items()})
        self._payload, self._ragged_sent = now, sent
        return extra

    def sent_bytes(self, key, compiled) -> dict[str, int]:
        """Per link class (nodes of `Loader.ranks_per_node`), the bytes `compiled` sends in
        its encoder->LLM exchanges, forward and backward: its collective operands read from
        XLA's optimized HLO (`parallel.hlo_traffic`), once per compiled program."""
        if key not in self._sent:
            assert self.ledger is not None
            hlo, rpn = compiled.as_text(), self.ledger.ranks_per_node
            n = self.mesh.devices.size
            got = [collective_bytes(hlo, rpn, s, n) for s in (FORWARD_SCOPE, BACKWARD_SCOPE)]
            self._sent[key] = {k: got[0][k] + got[1][k] for k in ("intra_node", "inter_node")}
        return self._sent[key]
