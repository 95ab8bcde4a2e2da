"""A pipeline stage's fixed parts, built once from the plan: its mesh, module structure,
frozen parameters and jitted programs (`Stage`), and the stage's initial trainable
parameters (from the seed, or its own layers of a pretrained checkpoint). The trainable
values then live in the training state (train/state.py), never here.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from mmjax.models.config import MLLMConfig
from mmjax.models.hf import pretrained as hf_pretrained
from mmjax.models.layers import cast_floats
from mmjax.models.lora import LoRAParam
from mmjax.models.mllm import trainable_filter
from mmjax.models.units import VAE_UNIT, is_encoder
from mmjax.parallel.sharded_init import abstract_split, init_split
from mmjax.parallel.tensor import state_shardings
from mmjax.parallel.zero_shards import zero_shardings
from mmjax.pipeline.multiprocess import holds_local_device, place_state
from mmjax.pipeline.stage import partial_shardings
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


@dataclass
class Stage:
    """One stage's fixed parts: its mesh, module structure, frozen parameters and programs.
    `abstract`: the trainable parameters' shapes, dtypes and (placed) shardings; the values
    live in the training state (train/state.py)."""

    id: StageId
    mesh: jax.sharding.Mesh
    dp: int
    graphdef: object
    abstract: object
    frozen: object
    mode: Backward
    fns: object = None
    backward_calls: int = 0    # backward programs dispatched (a diagnostic count)
    local: bool = True  # the mesh holds a device of this process
    gather: object = None      # jitted trainable -> compute (cast, all-gather over dp)
    zeros: object = None       # jitted () -> zero partial-gradient accumulators [dp, ...]


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


def stage_programs(st: Stage, dtype) -> None:
    """The stage's parameter programs: `gather` (fp32 params in any dp sharding -> the
    compute copy: compute dtype, replicated over dp, TP-sharded) and `zeros` (the step's
    float32 partial-gradient accumulators `[ranks, ...]`, ranks = dp or dp * cp)."""
    zero, zmesh = st.fns.zero_stage, st.fns.zero_mesh  # ZeRO-2/3: shard accumulators,
    compute_sh = (zero_shardings(st.abstract, zmesh) if zero == 3  # ZeRO-3 the weights
                  else state_shardings(st.abstract, st.mesh))
    st.gather = jax.jit(lambda t: cast_floats(t, dtype), out_shardings=compute_sh)
    if zero == 3 and st.local:
        st.frozen = jax.device_put(st.frozen, zero_shardings(st.frozen, zmesh))
    if st.mode.param_grads:
        abstract_tr = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                                   st.abstract)
        ranks = () if zero >= 2 else (st.fns.ranks,)
        sh = (zero_shardings(abstract_tr, zmesh) if zero >= 2
              else partial_shardings(abstract_tr, st.mesh))
        st.zeros = jax.jit(lambda: jax.tree.map(
            lambda a: jnp.zeros(ranks + tuple(a.shape), jnp.float32), abstract_tr),
            out_shardings=sh)
