"""One training step of a Plan on the pipeline runtime: schedule, global-norm clip, ZeRO-1.

Each stage with trainable parameters owns a ZeRO-1 optimizer on its sub-mesh
(parallel/zero.py): the float32 master weights (the stage's `trainable`) and the optimizer
state live only as 1/dp shards; the forward/backward read a compute copy. Per step and
stage: the runtime accumulates each dp rank's partial gradients locally over the
microbatches, then ONE reduce-scatter (`Zero1Optimizer.sync`, dispatched right after the
stage's last backward, so it overlaps the other stages' remaining backwards) and ONE
program with the AdamW update and the all-gather of the compute copy
(`Zero1Optimizer.step`); `dispatch_log` records those launches. The gradient norm used for
clipping is over ALL stages, so the update equals the single-program optimizer over the
whole model. Details: docs/design.md "One gradient sync per step".

Multi-process: a process keeps optimizers only for the stages with devices in it; the
global norm is reduced across processes (`_multiprocess_norm`), and on CPU each stage
update is waited on (gloo deadlock note in pipeline/runtime.py).
"""
from __future__ import annotations

import gin
import jax
import jax.numpy as jnp
import numpy as np

from mmjax.models.config import MLLMConfig
from mmjax.parallel.zero import Zero1Optimizer
from mmjax.pipeline.runtime import PipelineRuntime
from mmjax.pipeline.stage import rank_axes
from mmjax.planner.plan import Plan
from mmjax.train.optimizer import OptimizerSettings, optimizer_from_settings
from mmjax.train.colocated_plan import Colocation, check_layout
from mmjax.train.validate import check_manual_plan


@gin.configurable
def manual_plan(global_batch: int = 8, num_microbatches: int = 2, dp=None, tp=None, pp=None,
                cp=None, num_chunks=None, overlap_tp=None, model: MLLMConfig | None = None,
                remat=None, tp_chunks=None, tp_bidirectional=None, cp_head_groups=None,
                attention_impl=None, layout: str = "disaggregated", zero_stage=None,
                fsdp_group=None) -> Plan | Colocation:
    """A Plan from per-unit dicts, e.g. `manual_plan.pp = {"llm": 2}` or
    `manual_plan.remat = "dots"` / `manual_plan.attention_impl = "chunked"` in gin (a plain
    value applies to every unit). `layout = "colocated"`: a `Colocation` instead (every unit
    on all devices, `tp = {"llm": T}`, `zero_stage` 1-3 per unit, `fsdp_group` devices per
    FSDP group; train/colocated_plan.py)."""
    knobs = dict(dp=dp, tp=tp, pp=pp, cp=cp, num_chunks=num_chunks, overlap_tp=overlap_tp,
                 remat=remat, tp_chunks=tp_chunks, tp_bidirectional=tp_bidirectional,
                 cp_head_groups=cp_head_groups, attention_impl=attention_impl)
    check_manual_plan(model.unit_names, global_batch, num_microbatches, **knobs)
    colo = check_layout(model.unit_names, jax.device_count(), layout, zero_stage,
                        fsdp_group, **knobs)
    if colo is not None:
        return colo
    kw = {k: v for k, v in knobs.items() if v is not None}
    return Plan.uniform(model, global_batch, num_microbatches, **kw)


def _fold_loss(norm, loss_terms, max_loss=np.inf, max_norm=np.inf):
    """norm + 0 * sum(loss terms) on the norm's device: equal to `norm` when the loss is
    finite (and the loss and norm within the spike guard's limits), NaN when it is not, so
    one scalar tells every stage's update to skip."""
    dev = list(norm.devices())[0]
    total = sum((jnp.sum(jax.device_put(t, dev)) for t in loss_terms),
                jnp.zeros((), jnp.float32))
    folded = norm + 0.0 * total
    if np.isinf(max_loss) and np.isinf(max_norm):
        return folded
    calm = (total <= max_loss) & (norm <= max_norm)
    return jnp.where(calm, folded, jnp.nan)


def _norm_from_squares(squares, device=None):
    """sqrt of the sum of every stage's per-device squares (`Zero1Optimizer.sync`), each
    vector copied to one device and summed there in stage order: no collective program."""
    device = jax.local_devices()[0] if device is None else device
    total = jax.device_put(jnp.zeros((), jnp.float32), device)
    for sq in squares:
        if sq is not None:
            total = total + jnp.sum(jax.device_put(sq, device))
    return jnp.sqrt(total)


def _multiprocess_norm(squares) -> float:
    """`_norm_from_squares` when stages sit in different processes (None: a stage with no
    device here): each process adds the elements it holds, one `process_allgather` sums
    the contributions per stage, then every process adds the stages in order in float32."""
    from jax.experimental import multihost_utils

    mine = np.zeros(len(squares), np.float32)
    for k, sq in enumerate(squares):
        if sq is not None:
            sq = jax.block_until_ready(sq)
            mine[k] = sum(float(np.sum(np.asarray(sh.data))) for sh in sq.addressable_shards
                          if sh.replica_id == 0)
    per_stage = np.asarray(multihost_utils.process_allgather(mine)).sum(axis=0)
    total = np.float32(0)
    for v in per_stage:
        total = np.float32(total + v)
    return float(np.sqrt(total))


class PipelineStep:
    def __init__(self, cfg: MLLMConfig, plan: Plan, schedule, compute_dtype=jnp.float32,
                 seed: int = 0, settings: OptimizerSettings | None = None, devices=None,
                 pretrained: dict | None = None, llm_mask_family: str = "bam"):
        self.settings = settings or OptimizerSettings()
        self.runtime = PipelineRuntime(cfg, plan, devices, seed, compute_dtype, pretrained,
                                       llm_mask_family)
        tx = optimizer_from_settings(schedule, self.settings, clip=False)
        self.tx = tx  # every stage's transform (checkpoints: state shapes of remote stages)
        trained = [sid for sid, st in self.runtime.stages.items()
                   if st.mode.param_grads]
        self.trained = trained  # every process, same order: the global norm's terms
        pair = self.runtime.tied_embedding_stages()
        self.optimizers = {sid: Zero1Optimizer(
            tx, self.runtime.stages[sid].mesh, self.runtime.stages[sid].trainable,
            clip_norm=self.settings.clip_norm or None, donate=True,
            compute_dtype=compute_dtype,
            # the single model has one embedding: the last stage's copy is counted once
            norm_skip=("embed",) if pair is not None and sid == pair[1] else (),
            rank_axes=rank_axes(self.runtime.stages[sid].mesh))
            for sid in trained if self.runtime.stages[sid].local}
        self.opt_states = {}
        for sid, opt in self.optimizers.items():
            st = self.runtime.stages[sid]
            self.opt_states[sid] = opt.init(st.trainable)
            compute = self.runtime.params(sid)  # from the placed (replicated) params
            # the master weights keep only their ZeRO-1 shard on each device
            st.trainable = self.runtime.settle(
                jax.jit(lambda t: t, out_shardings=opt.master_shardings)(st.trainable))
            st.compute, st.compute_of = compute, st.trainable
        # (StageId, program) per launch of a gradient-sync or update program, this step;
        # `sync_after[sid]`: backward actions dispatched (all stages) before sid's sync
        self.dispatch_log: list[tuple] = []
        self.sync_after: dict = {}

    def __call__(self, feeds, trace: bool = False, limits=(np.inf, np.inf)) -> dict:
        """One step over `feeds`; `limits` = (max loss, max gradient norm): a finite step
        above either is not applied (the trainer's loss-spike guard; "spike" 1)."""
        stages = self.runtime.stages
        self.dispatch_log, self.sync_after = [], {}
        shards, squares = {}, {}
        backwards0 = sum(st.backward_calls for st in stages.values())

        def sync(sid, partials):  # one reduce-scatter per stage, right after its last B
            if sid not in self.optimizers:  # an untrained or remote stage
                return
            shards[sid], squares[sid] = self.runtime.settle(self.optimizers[sid].sync(partials))
            self.dispatch_log.append((sid, "reduce_scatter"))
            self.sync_after[sid] = sum(st.backward_calls for st in stages.values()) - backwards0

        res = self.runtime.run(feeds, trace=trace, on_grads=sync)
        max_loss, max_norm = (float(x) for x in limits)
        if jax.process_count() == 1:
            norm = _norm_from_squares([squares[sid] for sid in self.optimizers])
            guard = _fold_loss(norm, res.lm_loss + res.diffusion_loss, max_loss, max_norm)
        else:  # the norm and the losses are host values here already
            norm = _multiprocess_norm([squares.get(sid) for sid in self.trained])
            losses = res.losses()
            calm = losses["loss"] <= max_loss and norm <= max_norm
            guard = norm if np.isfinite(losses["loss"]) and calm else float("nan")
        # every stage's update is skipped on device when `guard` is not finite
        for sid, opt in self.optimizers.items():  # update + one all-gather per stage
            st = stages[sid]
            st.trainable, self.opt_states[sid], st.compute = self.runtime.settle(
                opt.step(st.trainable, shards.pop(sid), self.opt_states[sid], guard))
            st.compute_of = st.trainable
            self.dispatch_log.append((sid, "update_all_gather"))
        # the step's one host sync, after everything is dispatched
        out = res.losses() if jax.process_count() == 1 else losses
        out["grad_norm"] = float(norm)
        finite = bool(np.isfinite(out["loss"]) and np.isfinite(float(norm)))
        out["nonfinite"] = float(not finite)
        out["spike"] = float(finite and not np.isfinite(float(guard)))
        if trace:
            out["trace"] = res.trace
        return out

    # ---- checkpoint state -------------------------------------------------------------
    def state(self) -> dict:
        return {str(sid): {"params": self.runtime.stages[sid].trainable,
                           "opt": self.opt_states[sid]} for sid in self.optimizers}

    def load_state(self, state: dict) -> None:
        for sid in self.optimizers:
            self.runtime.stages[sid].trainable = state[str(sid)]["params"]
            self.opt_states[sid] = state[str(sid)]["opt"]
