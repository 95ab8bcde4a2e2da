"""`pretrained.adapter` on a disaggregated plan: the peft adapter's tensors (and a part it
saved whole, peft's `modules_to_save`) read into the stages that hold them, by the names
the single program gives them (train/logical_state.py `stage_param_name`), so a plan
starts from the parameters the single program starts from. docs/lora.md."""
from __future__ import annotations

import jax
import numpy as np

from mmjax.errors import UserError
from mmjax.train.logical_state import path_keys, stage_param_name


def _put(plan, sid, tree, named: dict, used: set):
    """`tree` (a stage's placed parameters) with the leaves `named` holds replaced, each on
    the leaf's own sharding and dtype (a leaf of another process's stage: left abstract)."""
    def one(path, leaf):
        name = stage_param_name(plan, sid, path_keys(path))
        if name not in named:
            return leaf
        arr = named[name]
        if tuple(leaf.shape) != arr.shape:
            raise UserError(f"pretrained.adapter: tensor for {name} has shape {arr.shape}, "
                            f"the model {tuple(leaf.shape)} (an adapter of another base?)")
        used.add(name)
        if not isinstance(leaf, jax.Array):
            return leaf
        host = np.asarray(arr, leaf.dtype)
        return jax.make_array_from_callback(leaf.shape, leaf.sharding, lambda i: host[i])
    return jax.tree_util.tree_map_with_path(one, tree)


def adapter_into_stages(cfg, plan, trainable: dict, frozen: dict, adapter_dir: str,
                        whole: bool) -> tuple[dict, dict]:
    """({StageId: trainable}, {StageId: frozen}) with the peft adapter at `adapter_dir`
    applied (`whole`: the run started from a whole LLaVA or Qwen2-VL, `pretrained.model`)."""
    from mmjax.models.hf.peft import model_adapter

    _, arrays = model_adapter(cfg, adapter_dir, whole)
    named = {".".join(str(k) for k in path): a for path, a in arrays.items()}
    used: set = set()
    trainable = {sid: _put(plan, sid, tr, named, used) for sid, tr in trainable.items()}
    frozen = {sid: _put(plan, sid, fr, named, used) for sid, fr in frozen.items()}
    missing = sorted(set(named) - used)
    if missing:
        raise UserError(f"pretrained.adapter: {len(missing)} tensors have no place in the "
                        f"plan's stages, e.g. {missing[0]} (an adapter of another base?)")
    return trainable, frozen
