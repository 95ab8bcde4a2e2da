"""A pipeline stage's fixed parts, built once from the plan: its mesh, module structure,
frozen parameters and jitted programs (`Stage`), and the stage's initial trainable
parameters (from the seed, or its own layers of a pretrained checkpoint). The trainable
values then live in the training state (train/state.py), never here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, cast

import jax
import jax.numpy as jnp
from flax import nnx

from mmjax.models.config import MLLMConfig
from mmjax.models.hf import pretrained as hf_pretrained
from mmjax.models.layers import cast_floats
from mmjax.models.lora import LoRAParam
from mmjax.models.mllm import trainable_filter
from mmjax.models.units import VAE_UNIT, is_encoder, is_generator, is_vae
from mmjax.parallel.sharded_init import abstract_split, init_split
from mmjax.parallel.tensor import state_shardings
from mmjax.parallel.zero_shards import zero_shardings
from mmjax.pipeline.multiprocess import holds_local_device, place_state
from mmjax.pipeline.stage import StageFns, make_stage_fns, partial_shardings
from mmjax.schedule.stage_graph import Backward, StageId


def stage_filter(cfg: MLLMConfig, unit: str):
    if not is_encoder(unit):  # the LLM's or the generator's module alone
        if unit in cfg.lora_units():  # LoRA: its adapters train, its base is frozen
            return LoRAParam
        return nnx.Nothing if cfg.frozen(unit) else nnx.Param
    return trainable_filter(cfg)


EAGER_INIT_BYTES = 256 << 20  # smaller stages are built eagerly and placed (no compile)


def stage_state(make_module, args, key, filters, mesh):
    """(graphdef, trainable, frozen) of a stage on its mesh. A stage of EAGER_INIT_BYTES or
    more is made by one jitted program straight into its shards (parallel/sharded_init.py:
    no process ever holds it whole); a smaller one is built eagerly and placed, which
    costs no compile per stage and device assignment; both give the same bits. A mesh wholly in other processes: shapes and shardings only."""
    if not holds_local_device(mesh):
        return abstract_split(make_module, args, key, filters, mesh)
    _, *abstract = abstract_split(make_module, args, key, filters)
    if sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract)) >= EAGER_INIT_BYTES:
        return init_split(make_module, args, key, filters, mesh)
    graphdef, *states = nnx.split(make_module(*args, key), *filters)
    return (graphdef, *(place_state(st, mesh) for st in states))


@dataclass(frozen=True, eq=False)  # compared by identity: it holds arrays and programs
class Stage:
    """One stage's fixed parts, built in one go (`build_stage`): its mesh, module structure,
    frozen parameters and programs. `abstract`: the trainable parameters' shapes, dtypes and
    (placed) shardings; the values live in the training state (train/state.py). `fns`: its
    jitted programs (pipeline/stage.py `StageFns`; like `jax.jit`'s own cache, they memoise
    the residual layout of each input signature they trace). `local`: the mesh holds a
    device of this process. `gather`: jitted fp32 trainable -> compute
    copy (cast, all-gathered over dp); `zeros`: jitted () -> the step's zero partial-gradient
    accumulators (None for a stage without parameter gradients)."""

    id: StageId
    mesh: jax.sharding.Mesh
    dp: int
    graphdef: object
    abstract: object
    frozen: object
    mode: Backward
    fns: StageFns
    local: bool
    gather: Callable
    zeros: Callable | None

    @property
    def zero_mesh(self):
        """Where the stage's ZeRO state lives: its mesh, or its FSDP-group view."""
        return self.fns.zero_mesh

    @property
    def zero_stage(self) -> int:
        return self.fns.zero_stage


def build_stage(cfg: MLLMConfig, up, sid: StageId, made: tuple[Callable, tuple, Any, tuple],
                mesh, mode: Backward, pretrained: dict, dtype,
                llm_mask_family: str) -> tuple[Stage, object]:
    """(the `Stage`, its initial trainable parameters) of virtual stage `sid` of unit plan
    `up` on `mesh`: `made` = (module maker, its args, key, filters); the parameters from the
    seed, or its own layers of the `pretrained` checkpoints ({unit or "model": directory})."""
    gd, tr, fr = stage_state(*made, mesh)
    if is_vae(sid.unit):  # frozen, whole: the diffusers checkpoint onto its mesh
        fr = load_vae_stage(pretrained, fr, mesh)
    elif "model" in pretrained and not is_generator(sid.unit):
        tr, fr = load_pretrained_stage(cfg, up, sid, pretrained["model"], tr, fr, True)
    elif sid.unit in pretrained:
        tr, fr = load_pretrained_stage(cfg, up, sid, pretrained[sid.unit], tr, fr)
    local = holds_local_device(mesh)
    fns = make_stage_fns(cfg, up, gd, mode, dtype, mesh, llm_mask_family=llm_mask_family)
    abstract = abstract_params(tr)
    gather, zeros, fr = _programs(fns, abstract, fr, mesh, mode, local, dtype)
    return Stage(sid, mesh, up.dp, gd, abstract, fr, mode, fns, local, gather, zeros), tr


def abstract_params(tree):
    """Shapes, dtypes and shardings of `tree`'s arrays (what a stage keeps of its
    parameters)."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                       sharding=a.sharding),
                        tree)


def load_pretrained_stage(cfg: MLLMConfig, up, sid: StageId, path, tr, fr, whole: bool = False):
    """A stage's placed states with its layers of the HF checkpoint at `path` (`whole`: a
    whole-model LLaVA checkpoint, `pretrained.model`)."""
    start, end = up.stage_layers(sid.index % up.pp, sid.index // up.pp)
    plan, root = hf_pretrained.stage_load_plan(path, cfg, sid.unit, start, end, whole)
    tr, fr = (hf_pretrained.load_stage_state(tr, plan, root),
              hf_pretrained.load_stage_state(fr, plan, root))
    proj = None if whole else hf_pretrained.projector_plan(path, cfg, sid.unit)  # Qwen2-VL
    if proj is not None and end == cfg.num_layers(sid.unit):  # the merger, on the last stage
        root = ("projectors", sid.unit)
        tr, fr = (hf_pretrained.load_stage_state(tr, proj, root),
                  hf_pretrained.load_stage_state(fr, proj, root))
    return tr, fr


def load_vae_stage(pretrained: dict, frozen, mesh):
    """The VAE unit's frozen state read from `pretrained[VAE_UNIT]` (a diffusers
    AutoencoderKL directory) and placed on its mesh; a runtime built without one (tests of
    the arithmetic alone) keeps the seed's weights."""
    path = pretrained.get(VAE_UNIT)
    if path is None or not holds_local_device(mesh):
        return frozen
    from mmjax.models.hf.vae import load_vae_safetensors

    module, _ = load_vae_safetensors(path)
    return place_state(nnx.state(module), mesh)


def _programs(fns: StageFns, abstract, frozen, mesh, mode: Backward, local: bool, dtype):
    """-> (gather, zeros, frozen): `gather` (fp32 params in any dp sharding -> the compute
    copy: compute dtype, replicated over dp, TP-sharded; ZeRO-3: dp-sharded), `zeros` (the
    step's float32 partial-gradient accumulators `[ranks, ...]`, ranks = dp or dp * cp;
    ZeRO-2/3: the shards; None without parameter gradients) and the frozen state (ZeRO-3:
    sharded like the weights)."""
    # the ZeRO mesh is None only without a stage mesh, at ZeRO stage 1, where it is not read
    zero, zmesh = fns.zero_stage, cast(jax.sharding.Mesh, fns.zero_mesh)
    compute_sh = (zero_shardings(abstract, zmesh) if zero == 3
                  else state_shardings(abstract, mesh))
    gather = jax.jit(lambda t: cast_floats(t, dtype), out_shardings=compute_sh)
    if zero == 3 and local:
        frozen = jax.device_put(frozen, zero_shardings(frozen, zmesh))
    if not mode.param_grads:
        return gather, None, frozen
    abstract_tr = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), abstract)
    ranks = () if zero >= 2 else (fns.ranks,)
    sh = (zero_shardings(abstract_tr, zmesh) if zero >= 2
          else partial_shardings(abstract_tr, mesh))
    zeros = jax.jit(lambda: jax.tree.map(
        lambda a: jnp.zeros(ranks + tuple(a.shape), jnp.float32), abstract_tr),
        out_shardings=sh)
    return gather, zeros, frozen
