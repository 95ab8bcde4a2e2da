"""PEFT LoRA adapters in and out: `adapter_config.json` + `adapter_model.safetensors` as
peft's `save_pretrained` writes them (key names: hf/peft_names.py; lora_A [r, in], lora_B
[out, r]). `apply_adapter` puts one on a module `hf.load` built (unmerged: the module's config
gains the `LoRAConfig`s it implies); `save_adapter` writes a module's adapters (and the parts
trained whole, as peft's `modules_to_save`)."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from safetensors.numpy import load_file

from mmjax.errors import UserError
from mmjax.models.config import LLMConfig, with_overrides
from mmjax.models.hf.checkpoint import _flatten, _fmt, apply_to_module, write_safetensors
from mmjax.models.hf.peft_names import (PREFIX, adapter_table, auto_mapping, is_qwen2_vl,
                                        model_modules, part_and_projection, runtime_entries)
from mmjax.models.lora_config import LoRAConfig
from mmjax.models.lora_merge import adapter_sites, flat_params
from mmjax.models.units import LLM_UNIT, is_llm

CONFIG_NAME, WEIGHTS_NAME = "adapter_config.json", "adapter_model.safetensors"
# peft's LoraConfig fields a plain LoRA adapter leaves at their defaults (peft 0.21)
_DEFAULTS: dict[str, Any] = {
    "alora_invocation_tokens": None, "alpha_pattern": {}, "arrow_config": None,
    "corda_config": None, "ensure_weight_tying": False, "eva_config": None,
    "exclude_modules": None, "inference_mode": True, "init_lora_weights": True,
    "kasa_config": None, "layer_replication": None, "layers_pattern": None,
    "layers_to_transform": None, "loftq_config": {}, "lora_bias": False,
    "lora_ga_config": None, "megatron_config": None, "megatron_core": "megatron.core",
    "monteclora_config": None, "qalora_group_size": 16, "rank_pattern": {},
    "revision": None, "target_parameters": None, "trainable_token_indices": None,
    "use_bdlora": None, "use_dora": False, "use_qalora": False, "velora_config": None,
    "bias": "none", "fan_in_fan_out": False, "peft_type": "LORA",
    "peft_version": "0.21.2"}
# settings of an adapter mmjax cannot apply as written, and the value it can
_MUST = {"peft_type": "LORA", "bias": "none", "fan_in_fan_out": False, "use_dora": False,
         "lora_bias": False, "rank_pattern": {}, "alpha_pattern": {}, "layers_to_transform": None,
         "layer_replication": None, "trainable_token_indices": None, "target_parameters": None}


def read_adapter(adapter_dir) -> tuple[dict, dict]:
    """(adapter_config.json, {tensor name: array}) of a peft adapter directory."""
    d = Path(adapter_dir)
    if not (d / CONFIG_NAME).is_file() or not (d / WEIGHTS_NAME).is_file():
        raise UserError(f"adapter {str(d)!r}: no {CONFIG_NAME} + {WEIGHTS_NAME} there (a "
                        f"peft LoRA adapter directory, as save_pretrained writes)")
    c = json.loads((d / CONFIG_NAME).read_text())
    for key, want in _MUST.items():
        if c.get(key, want) not in (want, None) or (want is None and c.get(key)):
            raise UserError(f"adapter {str(d)!r}: {key}={c.get(key)!r}; mmjax applies plain "
                            f"LoRA adapters ({key}={want!r})")
    return c, load_file(str(d / WEIGHTS_NAME))


def _match(cfg, tensors: dict) -> tuple[dict, bool]:
    """The adapter table whose module names the adapter's keys use (transformers' current
    or pre-4.52 LLaVA names)."""
    names = {k[len(PREFIX):].rsplit(".lora_", 1)[0] for k in tensors if ".lora_" in k}
    for old in (False, True) if not isinstance(cfg, LLMConfig) else (False,):
        table = adapter_table(cfg, old)
        if names <= set(table):
            return table, old
    unknown = sorted(names - set(adapter_table(cfg)))
    raise UserError(f"adapter keys name modules this model has no adaptable projection for, "
                    f"e.g. {unknown[:3]} (an adapter of another base model?)")


def adapter_arrays(cfg, adapter_dir) -> tuple[dict, dict]:
    """(config overrides {dotted path: LoRAConfig}, {our parameter path: array}) of a peft
    adapter for a model of `cfg`: the adapters (a = lora_A.T, b = lora_B.T) and any part
    saved whole (modules_to_save)."""
    c, tensors = read_adapter(adapter_dir)
    table, old = _match(cfg, tensors)
    arrays: dict[tuple, np.ndarray] = {}
    targets: dict[str, dict[str, list[str]]] = {}  # {part: {projection: module names}}
    for name, (path, _) in table.items():
        key = PREFIX + name + ".lora_A.weight"
        if key not in tensors:
            continue
        part, proj = part_and_projection(path)
        targets.setdefault(part, {}).setdefault(proj, []).append(name)
        site = _site(path)
        arrays[site + ("a",)] = np.ascontiguousarray(tensors.pop(key).T)
        arrays[site + ("b",)] = np.ascontiguousarray(tensors.pop(
            PREFIX + name + ".lora_B.weight").T)
    arrays.update(_modules_to_save(cfg, c, tensors, old))
    if tensors:
        raise UserError(f"adapter {str(adapter_dir)!r}: unexpected tensors {sorted(tensors)[:3]}")
    for part, projs in targets.items():
        counts = {p: len(names) for p, names in projs.items()}
        if len(set(counts.values())) > 1:
            raise UserError(f"adapter {str(adapter_dir)!r} adapts {counts} modules of {part!r} "
                            f"per projection: mmjax adapts the same projections in every layer")
    lora_cfg = lambda projs: LoRAConfig(int(c["r"]), float(c["lora_alpha"]), tuple(projs),
                                        float(c.get("lora_dropout") or 0.0),
                                        bool(c.get("use_rslora")))
    return {_override(cfg, part): lora_cfg(sorted(projs))
            for part, projs in targets.items()}, arrays


def apply_adapter(module, cfg, adapter_dir):
    """-> (module with the adapter applied, unmerged, config with its LoRAConfigs)."""
    over, arrays = adapter_arrays(cfg, adapter_dir)
    pure = _flatten(nnx.to_pure_dict(nnx.state(module, nnx.Param)))
    pure.update(arrays)
    new_cfg = with_overrides(cfg, over)
    new = _abstract(module, new_cfg)
    apply_to_module(new, _unflatten(pure))
    for attr in ("hf_source", "hf_image_token"):
        if hasattr(module, attr):
            setattr(new, attr, getattr(module, attr))
    new.peft_trained = (("vision.projector",) if any(p[0] == "projectors" for p in arrays)
                        else ())
    return new, new_cfg


def _site(base_path: tuple) -> tuple:
    """Our adapter's path beside the base weight `base_path`."""
    if base_path[-1] == "kernel":
        return base_path[:-1] + ("lora", base_path[-2])
    return base_path[:-1] + ("lora", part_and_projection(base_path)[1])


def _override(cfg, part: str) -> str:
    if isinstance(cfg, LLMConfig):
        return "lora"
    if is_llm(part):
        return "llm.lora"
    if part.endswith(".projector"):
        return f"encoders.{part.removesuffix('.projector')}.projector.lora"
    return f"encoders.{part}.encoder.lora"


def _modules_to_save(cfg, c: dict, tensors: dict, old: bool) -> dict:
    """{our path: array} of the parts the adapter saves whole (peft's modules_to_save: a
    LLaVA projector)."""
    wanted = c.get("modules_to_save") or []
    if not wanted:
        return {}
    if (isinstance(cfg, LLMConfig) or is_qwen2_vl(cfg)
            or list(wanted) != ["multi_modal_projector"]):
        raise UserError(f"adapter modules_to_save={wanted!r}: mmjax reads a LLaVA projector "
                        f"saved whole (['multi_modal_projector']) only")
    out = {}
    for e in runtime_entries(cfg, old):
        if e.path[0] == "projectors":
            out[e.path] = e.to_ours(np.asarray(tensors.pop(PREFIX + e.hf), np.float32))
    return out


def _abstract(module, cfg):
    from mmjax.models.llm import LLM
    from mmjax.models.mllm import MultimodalModel

    kind = LLM if isinstance(cfg, LLMConfig) else MultimodalModel
    return nnx.eval_shape(lambda: kind(cfg, jax.random.key(0)))


def _unflatten(flat: dict) -> dict:
    out: dict = {}
    for path, v in flat.items():
        node = out
        for p in path[:-1]:
            node = node.setdefault(p, {})
        node[path[-1]] = v
    return out


def save_adapter(module, config, out_dir, trained=None, base_model: str | None = None) -> list:
    """Write `module`'s LoRA adapters as peft's save_pretrained does. `trained`: parts
    trained whole saved beside them as peft's modules_to_save (a LLaVA "vision.projector";
    default: what the adapter the module was loaded with saved). `base_model`: the config's
    base_model_name_or_path (default: the checkpoint `hf.load` read)."""
    sites = adapter_sites(module)
    if not sites:
        raise UserError("save_adapter: the module has no LoRA adapters (load with adapter=, "
                        "or train with lora.units)")
    loras = _lora_configs(config)
    if len(set(loras.values())) != 1:
        raise UserError(f"save_adapter: the parts' LoRA settings differ ({loras}); one peft "
                        f"adapter holds one rank, alpha and dropout")
    rank, alpha, dropout, rslora = next(iter(loras.values()))
    inverse = {path: name for name, (path, _) in adapter_table(config).items()}
    flat = flat_params(module)
    tensors, modules = {}, set()
    for site, (base, _) in sorted(sites.items(), key=lambda kv: _fmt(kv[0])):
        name = inverse[base]
        modules.add(name)
        tensors[PREFIX + name + ".lora_A.weight"] = _host(flat[site + ("a",)]).T
        tensors[PREFIX + name + ".lora_B.weight"] = _host(flat[site + ("b",)]).T
    trained = getattr(module, "peft_trained", ()) if trained is None else tuple(trained)
    saved = _whole_parts(config, flat, trained)
    tensors.update(saved)
    out = Path(out_dir)
    files = write_safetensors({k: np.ascontiguousarray(v) for k, v in tensors.items()},
                              out / WEIGHTS_NAME)
    c = {**_DEFAULTS, "r": rank, "lora_alpha": _number(alpha), "lora_dropout": dropout,
         "use_rslora": rslora,
         "target_modules": _targets(config, modules),
         "modules_to_save": ["multi_modal_projector"] if saved else None,
         "base_model_name_or_path": base_model or _source_dir(module),
         "task_type": "CAUSAL_LM" if isinstance(config, LLMConfig) else None,
         "auto_mapping": None if isinstance(config, LLMConfig) else auto_mapping(config)}
    (out / CONFIG_NAME).write_text(json.dumps(dict(sorted(c.items())), indent=2))
    return files + [out / CONFIG_NAME]


def _source_dir(module) -> str | None:
    """The checkpoint directory `hf.load` read `module` from (a Qwen2-VL module's
    `hf_source` is JSON with its "dir")."""
    src = getattr(module, "hf_source", None)
    return json.loads(src).get("dir") if src and src.startswith("{") else src


def _lora_configs(cfg) -> dict:
    out = {LLM_UNIT: cfg.lora} if isinstance(cfg, LLMConfig) else {LLM_UNIT: cfg.llm.lora}
    for e in getattr(cfg, "encoders", ()):
        out[e.name] = getattr(e.encoder, "lora", None)
        out[e.name + ".projector"] = e.projector.lora
    return {k: (v.rank, v.alpha, v.dropout, v.rslora) for k, v in out.items() if v is not None}


def _targets(cfg, modules: set):
    """peft's target_modules: the module names' last parts for a lone LLM; for a whole
    model, a regex per adapted part (a tower's q_proj is not the LLM's)."""
    if isinstance(cfg, LLMConfig):
        return sorted({m.rsplit(".", 1)[1] for m in modules})
    parts: dict = {}
    for m in modules:
        prefix = next(p for p in model_modules(cfg).values() if m.startswith(p))
        parts.setdefault(prefix, set()).add(m[len(prefix):].rsplit(".", 1)[-1])
    return "|".join(f"{re.escape(p)}(?:.*\\.)?({'|'.join(sorted(s))})"
                    for p, s in sorted(parts.items()))


def _whole_parts(cfg, flat: dict, trained: tuple) -> dict:
    if not trained:
        return {}
    if isinstance(cfg, LLMConfig) or is_qwen2_vl(cfg) or tuple(trained) != ("vision.projector",):
        raise UserError(f"save_adapter: trained={trained!r}: peft's modules_to_save holds a "
                        f"LLaVA projector ('vision.projector') only (export a Qwen2-VL run "
                        f"that trained its merger whole with --merge)")
    return {PREFIX + e.hf: e.to_hf(_host(flat[e.path]))
            for e in runtime_entries(cfg) if e.path[0] == "projectors"}


def _host(x) -> np.ndarray:
    return np.asarray(jax.device_get(x), np.float32)


def _number(x: float):
    return int(x) if float(x).is_integer() else x


def model_adapter(cfg, adapter_dir, whole: bool) -> tuple[dict, dict]:
    """`adapter_arrays` for a `MultimodalModel` of `cfg`: a whole LLaVA's adapter (`whole`:
    the run started from `pretrained.model`) or its LLM's (a decoder's adapter)."""
    if whole:
        return adapter_arrays(cfg, adapter_dir)
    over, arrays = adapter_arrays(cfg.llm, adapter_dir)
    return ({"llm." + k: v for k, v in over.items()},
            {(LLM_UNIT,) + p: a for p, a in arrays.items()})


def put_arrays(module, arrays: dict) -> None:
    """Set the parameters at `arrays`' paths (shapes checked; dtype and placement kept)."""
    state = nnx.state(module, nnx.Param)
    flat = dict(nnx.to_flat_state(state))
    for path, arr in arrays.items():
        var = flat.get(path)
        if var is None or tuple(var.shape) != arr.shape:
            raise UserError(f"adapter tensor for {_fmt(path)}: the model has "
                            f"{None if var is None else tuple(var.shape)}, the adapter "
                            f"{arr.shape} (an adapter of another base?)")
        old = var[...]
        var.set_value(jax.device_put(np.asarray(arr, old.dtype), old.sharding)
                      if hasattr(old, "sharding") else np.asarray(arr, old.dtype))
    nnx.update(module, nnx.from_flat_state(flat))
