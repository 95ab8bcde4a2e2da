"""One action of a pipeline step on its stage (pipeline/runtime.py dispatches them in the
schedule's order): the forward of a (stage, microbatch), keeping its vjp residuals; its
backward, adding the parameter gradients into the step's accumulators and handing the
input cotangent upstream; the forward alone for validation; and the action's trace record.
A stage of another process is walked on shapes alone (jax.eval_shape), so every process
issues the same transfers in the same order.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import jax

from mmjax.data.feed import MicrobatchFeed
from mmjax.models.units import is_generator
from mmjax.pipeline.flat_calls import Flat, FlatCalls
from mmjax.pipeline.multiprocess import abstract
from mmjax.pipeline.step_result import StepResult
from mmjax.pipeline.trace import completion_marker
from mmjax.pipeline.transfers import Transfers
from mmjax.schedule.stage_graph import StageGraph, StageId


@dataclass
class StepState:
    """The in-flight state of one step (or one evaluation): per (stage, microbatch) host
    inputs, forward outputs, residuals and cotangents; per stage its parameters and frozen
    weights flattened once (`flat`) and its gradient accumulators kept flat until its last
    backward (`acc`); the result being filled. Made per call and dropped when it returns."""

    feeds: list
    totals: tuple  # (the step's trained tokens, generated elements): the loss normalisers
    params: dict
    count: int | None = None  # the applied-step count (LoRA dropout's masks); None: eval
    sides: dict = field(default_factory=dict)
    outputs: dict = field(default_factory=dict)
    residuals: dict = field(default_factory=dict)
    cotangents: dict = field(default_factory=dict)
    flat: dict = field(default_factory=dict)  # StageId -> (params, frozen) as `Flat`s
    acc: dict = field(default_factory=dict)  # StageId -> accumulators as a `Flat`
    result: StepResult = field(default_factory=StepResult)

    @classmethod
    def of(cls, feeds: list[MicrobatchFeed], params: dict,
           count: int | None = None) -> "StepState":
        return cls(feeds, (sum(f.num_target_tokens for f in feeds),
                           sum(f.num_gen_elements for f in feeds)), params, count)


class StageActions:
    """Forward, backward and evaluation of one (stage, microbatch) over `stages`
    {StageId: Stage}; `settle` finishes a dispatch where the runtime must (multi-process
    CPU); `last_llm` is the LLM's last virtual stage (it emits the LM loss)."""

    def __init__(self, stages: dict, graph: StageGraph, transfers: Transfers,
                 settle: Callable, last_llm: StageId, has_generator: bool):
        self.stages, self.graph, self.transfers, self.settle = stages, graph, transfers, settle
        self.last_llm, self.has_generator = last_llm, has_generator
        self.calls: dict[StageId, FlatCalls] = {}  # per stage, its programs on flat leaves

    def _calls(self, sid: StageId, step: StepState) -> tuple[FlatCalls, Flat, Flat]:
        """(the stage's flat-leaf programs, its parameters and frozen weights flattened once
        per step)."""
        st = self.stages[sid]
        calls = self.calls.get(sid)
        if calls is None or calls.fns is not st.fns:
            calls = self.calls[sid] = FlatCalls(st.fns)
        flat = step.flat.get(sid)
        if flat is None:
            flat = step.flat[sid] = (Flat.of(step.params[sid]), Flat.of(st.frozen))
        return (calls, *flat)

    def forward(self, sid: StageId, mb: int, step: StepState) -> None:
        st, side = self.stages[sid], step.sides[(sid, mb)]
        x = self.transfers.gather_input(sid, mb, step.outputs, step.feeds[mb])
        if st.local:  # keep the vjp residuals (pipeline/stage.py), not the input
            calls, params, frozen = self._calls(sid, step)
            y, res = self.settle(calls.forward(params, frozen, x, side))
        else:  # another process runs it; keep the shapes for the transfers and dx
            y, _ = jax.eval_shape(st.fns.forward, st.abstract, st.frozen, x, side)
            res = abstract(x)
        if self.graph.runs_backward(sid):
            step.residuals[(sid, mb)] = res
        del x
        if sid == self.last_llm:
            lm, y = (y if self.has_generator else (y, None))
            step.result.lm_loss.append(lm)
        elif is_generator(sid.unit) and not self.graph.successors(sid):
            step.result.diffusion_loss.append(y)
            y = None
        step.outputs[(sid, mb)] = y

    def backward(self, sid: StageId, mb: int, step: StepState, last: bool = True) -> None:
        """`last`: the stage's last backward of the step (its partials are final: they go
        back into `step.result.partials` as a tree)."""
        st, side = self.stages[sid], step.sides[(sid, mb)]
        dy = self.transfers.gather_cotangent(sid, mb, step.cotangents, step.feeds[mb])
        res = step.residuals.pop((sid, mb))
        grads = step.result.partials
        if st.local:
            calls, params, frozen = self._calls(sid, step)
            acc = step.acc.get(sid)
            if acc is None:
                acc = Flat.of(grads.get(sid, {}))
            leaves, dx = self.settle(calls.backward(params, frozen, side, res, dy, acc))
            if sid in grads:
                step.acc[sid] = acc = Flat(leaves, acc.treedef)
                if last:
                    grads[sid] = acc.tree()
        else:  # a cotangent has its primal's shape and dtype (res = abstract(x))
            dx = res if st.mode.input_grads else None
        if dx is not None:
            step.cotangents[(sid, mb)] = dx

    def apply(self, sid: StageId, mb: int, step: StepState) -> None:
        """The stage's forward alone (validation): nothing kept for a backward; its inputs
        are freed once read."""
        st, feed = self.stages[sid], step.feeds[mb]
        side = self.transfers.side(sid, feed, step.totals)
        x = self.transfers.gather_input(sid, mb, step.outputs, feed)
        if st.local:
            y = self.settle(st.fns.apply(step.params[sid], st.frozen, x, side))
        else:
            y = jax.eval_shape(st.fns.apply, st.abstract, st.frozen, x, side)
        if sid == self.last_llm:
            step.result.lm_loss.append(y[0] if self.has_generator else y)
        else:
            step.outputs[(sid, mb)] = y
        for p in self.graph.predecessors(sid):  # inputs are read once: free them
            step.outputs.pop((p, mb), None)

    def trace(self, tracer, sid: StageId, act, t0: float, step: StepState) -> None:
        """The action's record (pipeline/trace.py), on its physical stage's timeline."""
        st, mb = self.stages[sid], act.microbatch
        done = None
        if st.local:
            done = ((step.outputs.get((sid, mb)), step.residuals.get((sid, mb)))
                    if act.kind == "F" else
                    (step.cotangents.get((sid, mb)), _leaves(step.acc.get(sid))))
            done = completion_marker(done)
        phys, _ = self.graph.physical(sid)
        tracer.done(str(phys), {"stage": str(phys), "kind": act.kind, "microbatch": mb,
                                "chunk": act.chunk, "virtual_stage": str(sid)}, t0, done)


def _leaves(flat: Flat | None) -> list | None:
    return None if flat is None else flat.leaves
