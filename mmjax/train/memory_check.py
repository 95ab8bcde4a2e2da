"""Will the step fit? The single program's peak device memory estimated before anything is
compiled or allocated, from planner/memory.py's terms (DistTrain §5.1's weights, optimizer
state and activations, counted as planner/memory.py counts a stage's) at the run's largest
batch shapes, against the device's memory: a run that cannot fit stops with one line
naming the estimate and what to change, instead of compiling for minutes and dying with
RESOURCE_EXHAUSTED. An estimate, not XLA's own account: XLA fuses and reuses buffers, so
the real peak is usually lower (the check refuses only above the device's memory)."""
from __future__ import annotations

from typing import Any

import os
import re

from mmjax.errors import UserError
from mmjax.models.units import is_llm
from mmjax.planner import memory
from mmjax.planner.workload import Workload

GB = 1e9


def device_memory(device, shared_by: int = 1) -> tuple[float, str]:
    """(bytes, how it was read): the allocator's limit on an accelerator; for a CPU device
    the machine's physical memory over the `shared_by` devices that run on it at once."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return float(stats["bytes_limit"]), f"{device.device_kind} memory"
    host = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return host / shared_by, ("host memory" if shared_by == 1
                              else f"host memory shared by {shared_by} devices")


def _impl(attention_impl: str, length: int, dtype) -> str | None:
    """planner/memory.py's attention kind: "dense" keeps [S, S] buffers, None a tiled one."""
    from mmjax.models.attention import choose_implementation

    return "dense" if choose_implementation(attention_impl, length, length, dtype) == "dense" \
        else None


def _encoder_acts(cfg, name: str, cap: int, b: int, attention_impl, dtype,
                  tp: int = 1) -> memory.Acts:
    """One buffer of `cap` patches / frames through encoder `name` and its projector (one
    tp rank's share at tp `tp`)."""
    spec = cfg.encoder(name)
    c, p = spec.encoder, spec.projector
    in_dim = c.patch_dim if spec.modality == "image" else 2 * c.num_mel_bins
    out = cap / p.downsample if p.kind == "mlp" else p.num_queries
    return memory.encoder_acts(c, cap, cap * cap, tp, b, _impl(attention_impl, cap, dtype),
                               in_dim, out, cfg.llm.hidden_size)


def _kept(acts: memory.Acts, remat: str, layers: int, width_bytes: float) -> float:
    """Residuals a unit keeps under its per-layer remat (models/scan.py): every one ("none"),
    or each layer's input (`width_bytes`) plus the matmul outputs ("dots") and one layer
    recomputed at a time in the backward."""
    if remat == "none":
        return acts.none
    return acts.kept(remat) + layers * width_bytes + acts.none / max(layers, 1)


def single_program_bytes(cfg, shapes, seq_len: int, trainable: int, frozen: int, dtype,
                         attention_impl: str = "auto") -> dict:
    """Peak bytes of the whole model's training step on one device, at batch `shapes`
    (BatchShapes: LLM rows of `seq_len` tokens, per encoder (count, capacity) buffers,
    generated images) -> {"peak", "state", "activations", "work", "step"}. Each unit's
    per-layer remat (`remat` in its config), float32 master weights, AdamW moments and
    gradients, the compute copy in `dtype`; `llm.loss_chunk` keeps one chunk's float32
    logits instead of all of them."""
    import numpy as np

    b = np.dtype(dtype).itemsize
    copy = b if b != 4 else 0  # float32 compute reads the master weights themselves
    state = (memory.OPTIMIZER_BYTES + memory.ACC_BYTES + copy) * trainable \
        + memory.FROZEN_BYTES * frozen
    acts, work = 0.0, [0.0]
    rows = shapes.rows
    c = cfg.llm
    llm = memory.llm_acts(c, seq_len, seq_len * seq_len, 1, b,
                          _impl(attention_impl, seq_len, dtype))
    if c.loss_chunk:  # the fused head (llm_acts keeps no logits): one chunk's in flight
        work.append(3 * memory.F32 * min(c.loss_chunk, rows * seq_len) * c.vocab_size)
    acts += rows * (_kept(llm, c.remat, c.num_layers, b * seq_len * c.hidden_size)
                    + llm.boundary)
    work.append(rows * memory.SCORE_BUFFERS * llm.scores)
    for name, count, cap in shapes.encoders:
        e = _encoder_acts(cfg, name, cap, b, attention_impl, dtype)
        ec = cfg.encoder(name).encoder
        layers = getattr(ec, "depth", None) or ec.num_layers
        acts += count * (_kept(e, getattr(ec, "remat", "none"), layers,
                               b * cap * ec.hidden_size) + e.boundary)
        work.append(count * memory.SCORE_BUFFERS * e.scores)
    if cfg.generator is not None and shapes.gen:
        gc = cfg.generator
        g = memory.generator_acts(gc, shapes.gen, Workload.cond_tokens, 1, b,
                                  cond_dim=cfg.llm.hidden_size,
                                  impl=_impl(attention_impl, gc.num_patches, dtype))
        acts += _kept(g, gc.remat, gc.num_layers,
                      b * shapes.gen * gc.num_patches * gc.hidden_size) + g.boundary
        work.append(memory.SCORE_BUFFERS * g.scores)
    run = state + acts + max(work) + b * trainable  # + the parameter cotangents
    step = (memory.OPTIMIZER_BYTES + memory.STEP_BYTES + copy) * trainable \
        + memory.FROZEN_BYTES * frozen
    return {"peak": max(run, step), "state": state, "activations": acts, "work": max(work),
            "step": step}


def check_single_program(cfg, shapes, seq_len, trainable, frozen, dtype, attention_impl,
                         global_batch: int, device, refuse: bool = True) -> dict:
    """`single_program_bytes` with the device's bytes under "device"; with `refuse`, a
    UserError naming the estimate and the fix when it exceeds `device`'s memory."""
    est = single_program_bytes(cfg, shapes, seq_len, trainable, frozen, dtype, attention_impl)
    have, what = device_memory(device)
    est["device"] = have
    if refuse and est["peak"] > have:
        enc = "".join(f", {n} {k} x {c}" for n, c, k in shapes.encoders)
        raise UserError(
            f"the training step needs about {est['peak'] / GB:.1f} GB ({est['state'] / GB:.1f}"
            f" GB parameters and optimizer state, {est['activations'] / GB:.1f} GB activations"
            f" of {shapes.rows} rows x {seq_len} tokens{enc}) but {device.platform}:"
            f"{device.id} has {have / GB:.1f} GB of {what} (lower train.global_batch (now "
            f"{global_batch}) or data_layout.seq_len, or train over more devices with "
            f"recomputation: --plan=auto, or --plan=manual with manual_plan.remat; "
            f"train.check_memory=False runs anyway)")
    return est


# the device allocators' messages (XLA's BFC / TPU / GPU allocators) and the size they name;
# a RESOURCE_EXHAUSTED from anything else (tensorstore's "No space left on device" while
# writing a checkpoint, a gRPC quota) is not the device's memory
_ALLOCATOR = re.compile(r"Out of memory|out of memory|[Ff]ailed to allocate|"
                        r"[Ee]rror allocating device buffer|Attempting to allocate|"
                        r"Allocator \(\S+\) ran out of memory")
_SIZES = (re.compile(r"(?:allocate|allocating) (\d+) bytes"),
          re.compile(r"\((\d+)B\)"),
          re.compile(r"(?:allocate|allocating) (\d+(?:\.\d+)?)([KMGT])i?B?\b"))
_UNIT = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def allocator_request(text: str) -> int | None:
    """The bytes the allocator was asked for, as its message says (None when it does not)."""
    for pattern in _SIZES:
        m = pattern.search(text)
        if m:
            return int(float(m.group(1)) * (_UNIT[m.group(2)] if m.lastindex == 2 else 1))
    return None


def out_of_memory_line(err: BaseException) -> str | None:
    """One line for a device allocator's RESOURCE_EXHAUSTED (None for any other error)."""
    text = str(err)
    if "RESOURCE_EXHAUSTED" not in text and "Resource exhausted" not in text:
        return None
    if "os_error_code" in text or not _ALLOCATOR.search(text):
        return None
    req = allocator_request(text)
    size = f" ({req / GB:.1f} GB requested)" if req else ""
    return (f"error: the device ran out of memory{size}: lower train.global_batch or "
            f"data_layout.seq_len, recompute activations (manual_plan.remat = \"full\" with a "
            f"plan) or spread the model over more devices (--plan=auto); --debug shows the "
            f"traceback")


def check_plan(cfg, plan, source, device, refuse: bool = True,
               data_samples: int = 256, schedule: str = "1f1b") -> str:
    """The planner's bytes per device of each unit's first stage under `plan`
    (planner/evaluate.py `stage_bytes`: its samples per rank per microbatch, its remat, its
    ZeRO stage and FSDP group, and the runtime's in-flight microbatches; sample shapes from
    `data_samples` samples of the run's `source`) against `device`'s memory -> one console
    line; with `refuse`, a UserError naming the units that cannot fit and the settings to
    change. `schedule` (`train.schedule`): under "gpipe" every stage holds every
    microbatch's activations before its first backward."""
    import dataclasses

    from mmjax.data.data_spec import sample_workload
    from mmjax.planner.build import model_costs
    from mmjax.planner.evaluate import (Choice, pipeline_in_flight, remat_variant,
                                        stage_bytes)
    from mmjax.planner.knobs import with_zero
    from mmjax.train.auto_plan import device_hardware

    import jax

    have, what = device_memory(device, jax.local_device_count())
    hw = dataclasses.replace(device_hardware([device]), hbm_bytes=have)
    costs, _ = model_costs(cfg, hw, sample_workload(source, cfg, data_samples, name="run data"))
    choices = {u.name: Choice(u.tp, u.dp, u.pp, u.num_chunks, u.remat) for u in plan.units}
    m = plan.num_microbatches
    flight = (dict.fromkeys(choices, m) if schedule == "gpipe"
              else pipeline_in_flight(choices, m))
    need = {}
    for cost in costs:
        c, u = choices[cost.name], plan.unit(cost.name)
        cost = with_zero(cost, u.zero_stage, u.fsdp_group // (u.tp * u.cp) if u.fsdp_group
                         else 0)
        cost = remat_variant(cost, c, choices["llm"].dp, m, have)
        need[cost.name] = float(stage_bytes(cost, c.tp, c.dp, c.pp,
                                            plan.microbatch_size / c.dp, flight[cost.name],
                                            exact=True))
    over = {u: b for u, b in need.items() if b > have}
    if refuse and over:
        names = ", ".join(f"{u} {b / GB:.1f} GB" for u, b in over.items())
        raise UserError(
            f"the plan needs more memory per device than {device.platform}:{device.id}'s "
            f"{have / GB:.1f} GB of {what}: {names} (the planner's estimate for the run's "
            f"data; give those units more pp or tp, manual_plan.remat = \"full\", a higher "
            f"manual_plan.zero_stage, more "
            f"microbatches or a lower train.global_batch (now {plan.global_batch}); "
            f"--plan=auto plans to fit; train.check_memory=False runs anyway)")
    return ("memory per device (estimate): " + ", ".join(
        f"{u} {b / GB:.2f} GB" for u, b in need.items()) + f" of {have / GB:.1f} GB")


def _unit_params(tree, colo) -> dict:
    """{unit: (parameters, parameters under its layers)} of a parameter tree (one tp rank's
    share for the tp-split leaves of a unit with tp)."""
    import jax

    from mmjax.parallel.fsdp import unit_of
    from mmjax.parallel.tensor import path_names

    out: dict[str, Any] = {}

    def add(path, leaf):
        names = path_names(path)
        unit = unit_of(names)
        if unit is None:
            return
        n = float(leaf.size)
        tp = colo.tp_of(unit)
        if tp > 1 and len(leaf.shape) >= 2 and ("layers" in names or is_llm(unit)):
            n /= tp  # the projections' tp dimension (biases and norms: an upper bound)
        p, lay = out.get(unit, (0.0, 0.0))
        out[unit] = (p + n, lay + (n if "layers" in names else 0.0))
    jax.tree_util.tree_map_with_path(add, tree)
    return out


def colocated_loads(cfg, shapes, seq_len: int, trainable, frozen, colo, devices: int, dtype,
                    attention_impl: str = "auto") -> list:
    """planner/colocated_memory.py's `UnitLoad`s of the co-located step at batch `shapes`
    (the runner's padded global shapes: counts multiples of `devices`): per unit its
    parameters from the `trainable` / `frozen` trees, its ZeRO stage and dp from `colo`,
    samples per device and their activations under the attention implementation that runs."""
    import numpy as np

    from mmjax.planner.colocated_memory import UnitLoad

    b = np.dtype(dtype).itemsize
    tr, fr = _unit_params(trainable, colo), _unit_params(frozen, colo)
    loads = []

    def load(unit, layers, samples, acts, inputs, tp=1):
        t, tl = tr.get(unit, (0.0, 0.0))
        f, fl = fr.get(unit, (0.0, 0.0))
        loads.append(UnitLoad(unit, t, f, (tl + fl) / max(layers, 1), layers,
                              colo.stage(unit), devices // tp, samples, acts, inputs, b))

    llm = memory.llm_acts(cfg.llm, seq_len, seq_len * seq_len, colo.tp, b,
                          _impl(attention_impl, seq_len, dtype))
    # per token: tokens, targets, positions, sub, doc, bam, loss mask, one gather per encoder
    row = seq_len * 4 * (7 + len(shapes.encoders))
    load("llm", cfg.llm.num_layers, shapes.rows / (devices // colo.tp), llm, row, colo.tp)
    for name, count, cap in shapes.encoders:
        spec = cfg.encoder(name)
        c = spec.encoder
        in_dim = c.patch_dim if spec.modality == "image" else 2 * c.num_mel_bins
        tp = colo.tp_of(name)
        e = _encoder_acts(cfg, name, cap, b, attention_impl, dtype, tp)
        # per patch / frame: its values, two positions and a segment id
        load(name, getattr(c, "depth", None) or c.num_layers, count / (devices // tp), e,
             cap * (in_dim * 4 + 12), tp)
    if cfg.generator is not None and shapes.gen:
        g = memory.generator_acts(cfg.generator, 1, Workload.cond_tokens, 1, b,
                                  cond_dim=cfg.llm.hidden_size,
                                  impl=_impl(attention_impl, cfg.generator.num_patches, dtype))
        gc = cfg.generator  # latents and noise, query ids, timestep, valid flag
        latent = gc.latent_channels * gc.latent_size ** 2
        load("generator", gc.num_layers, shapes.gen / devices, g,
             4 * (2 * latent + Workload.cond_tokens + 2))
    return loads


def check_colocated(cfg, shapes, seq_len: int, trainable, frozen, colo, devices: int, dtype,
                    attention_impl: str, global_batch: int, device, refuse: bool = True,
                    exchange: float = 0.0, shared_by: int = 1) -> tuple:
    """The co-located step's peak bytes per device (planner/colocated_memory.py over
    `colocated_loads`; `exchange`: the encoder->LLM all-to-alls' buffers) against `device`'s
    memory (a CPU device's: the host's over the `shared_by` devices on it) -> (ColocatedMemory,
    one console line); with `refuse`, a UserError naming the estimate and the fix when it
    exceeds the device's memory."""
    import dataclasses

    from mmjax.planner.colocated_memory import colocated_memory

    est = colocated_memory(colocated_loads(cfg, shapes, seq_len, trainable, frozen, colo,
                                           devices, dtype, attention_impl))
    est = dataclasses.replace(est, exchange=exchange)
    have, what = device_memory(device, shared_by)
    if refuse and est.peak > have:
        raise UserError(
            f"the co-located step needs about {est.peak / GB:.2f} GB per device "
            f"({est.state / GB:.2f} GB parameters and optimizer state, "
            f"{(est.residuals + est.work) / GB:.2f} GB activations of {shapes.rows} rows x "
            f"{seq_len} tokens over {devices} devices) but {device.platform}:{device.id} has "
            f"{have / GB:.1f} GB of {what} (raise manual_plan.zero_stage (now "
            f"{colo.default_stage}), lower train.global_batch (now {global_batch}) or "
            f"data_layout.seq_len, or train over more devices; train.check_memory=False runs "
            f"anyway)")
    return est, (f"memory: the co-located step needs about {est.peak / 1e9:.3f} GB per device "
                 f"(estimate) of {have / 1e9:.1f} GB on {device.platform}:{device.id}")
