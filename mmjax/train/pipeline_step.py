"""One training step of a Plan on the pipeline runtime: schedule, global-norm clip, ZeRO-1.

Each stage with trainable parameters owns a ZeRO-1 optimizer on its sub-mesh
(parallel/zero.py): optimizer state sharded over the stage's dp, fp32 master weights. The
gradient norm used for clipping is over ALL stages, so the update equals the single-program
optimizer over the whole model.

Multi-process: a process keeps optimizers only for the stages with devices in it; the
global norm is reduced across processes (`multiprocess_grad_norm`), and on CPU each stage
update is waited on (gloo deadlock note in pipeline/runtime.py).
"""
from __future__ import annotations

import gin
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mmjax.models.config import MLLMConfig
from mmjax.parallel.zero import Zero1Optimizer, global_grad_norm, multiprocess_grad_norm
from mmjax.pipeline.runtime import PipelineRuntime
from mmjax.planner.plan import Plan
from mmjax.train.optimizer import OptimizerSettings, optimizer_from_settings
from mmjax.train.validate import check_manual_plan


@gin.configurable
def manual_plan(global_batch: int = 8, num_microbatches: int = 2, dp=None, tp=None, pp=None,
                cp=None, num_chunks=None, overlap_tp=None, model: MLLMConfig | None = None,
                remat=None, tp_chunks=None, tp_bidirectional=None, cp_head_groups=None,
                attention_impl=None) -> Plan:
    """A Plan from per-unit dicts, e.g. `manual_plan.pp = {"llm": 2}` or
    `manual_plan.remat = "dots"` / `manual_plan.attention_impl = "chunked"` in gin (a plain
    value applies to every unit)."""
    knobs = dict(dp=dp, tp=tp, pp=pp, cp=cp, num_chunks=num_chunks, overlap_tp=overlap_tp,
                 remat=remat, tp_chunks=tp_chunks, tp_bidirectional=tp_bidirectional,
                 cp_head_groups=cp_head_groups, attention_impl=attention_impl)
    check_manual_plan(model.unit_names, global_batch, num_microbatches, **knobs)
    kw = {k: v for k, v in knobs.items() if v is not None}
    return Plan.uniform(model, global_batch, num_microbatches, **kw)


def _fold_loss(norm, loss_terms):
    """norm + 0 * sum(loss terms) on the norm's device: equal to `norm` when the loss is
    finite, NaN when it is not, so one scalar tells every stage's update to skip."""
    dev = list(norm.devices())[0]
    total = sum((jax.device_put(t, dev) for t in loss_terms), jnp.zeros((), jnp.float32))
    return norm + 0.0 * total


class PipelineStep:
    def __init__(self, cfg: MLLMConfig, plan: Plan, schedule, compute_dtype=jnp.float32,
                 seed: int = 0, settings: OptimizerSettings | None = None, devices=None,
                 pretrained: dict | None = None):
        self.settings = settings or OptimizerSettings()
        self.runtime = PipelineRuntime(cfg, plan, devices, seed, compute_dtype, pretrained)
        tx = optimizer_from_settings(schedule, self.settings, clip=False)
        self.tx = tx  # every stage's transform (checkpoints: state shapes of remote stages)
        trained = [sid for sid, st in self.runtime.stages.items()
                   if st.mode.param_grads]
        self.trained = trained  # every process, same order: the global norm's terms
        self.optimizers = {sid: Zero1Optimizer(tx, self.runtime.stages[sid].mesh,
                                               self.runtime.stages[sid].trainable,
                                               clip_norm=self.settings.clip_norm or None)
                           for sid in trained if self.runtime.stages[sid].local}
        self.opt_states = {sid: opt.init(self.runtime.stages[sid].trainable)
                           for sid, opt in self.optimizers.items()}

    def __call__(self, feeds, trace: bool = False) -> dict:
        res = self.runtime.run(feeds, trace=trace)
        stages = self.runtime.stages
        if jax.process_count() == 1:
            norm = global_grad_norm([self._norm_terms(res.grads, sid)
                                     for sid in self.optimizers])
            guard = _fold_loss(norm, res.lm_loss + res.diffusion_loss)
        else:  # the norm and the losses are host values here already
            norm = multiprocess_grad_norm([self._norm_terms(res.grads, sid)
                                           for sid in self.trained])
            losses = res.losses()
            guard = norm if np.isfinite(losses["loss"]) else float("nan")
        # every stage's update is skipped on device when `guard` is not finite
        for sid, opt in self.optimizers.items():
            st = stages[sid]
            st.trainable, self.opt_states[sid] = self.runtime.settle(
                opt.update(st.trainable, res.grads[sid], self.opt_states[sid], guard))
        # the step's one host sync, after everything is dispatched
        out = res.losses() if jax.process_count() == 1 else losses
        out["grad_norm"] = float(norm)
        out["nonfinite"] = float(not np.isfinite(float(guard)))
        if trace:
            out["trace"] = res.trace
        return out

    def _norm_terms(self, grads: dict, sid):
        """A stage's gradients in the global norm; the last stage's copy of a tied
        embedding is left out (the single model has one embedding, counted once)."""
        g = grads.get(sid)
        pair = self.runtime.tied_embedding_stages()
        if g is None or pair is None or sid != pair[1]:
            return g
        return {k: v for k, v in nnx.to_pure_dict(g).items() if k != "embed"}

    # ---- checkpoint state -------------------------------------------------------------
    def state(self) -> dict:
        return {str(sid): {"params": self.runtime.stages[sid].trainable,
                           "opt": self.opt_states[sid]} for sid in self.optimizers}

    def load_state(self, state: dict) -> None:
        for sid in self.optimizers:
            self.runtime.stages[sid].trainable = state[str(sid)]["params"]
            self.opt_states[sid] = state[str(sid)]["opt"]
