"""LoRA adapters as pure-dict entries: which base weight each adapter sits beside, the
adapters of a module alone, and the merge W + A B * scale (Hu et al., LoRA §4.1: no extra
inference latency once merged) into a module of the same config without LoRA."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import nnx

from mmjax.models.lora import LoRAParam

# the decoder layer's base weight of each adapted projection (models/llm.py)
DECODER_WEIGHTS = {"q": "wq", "k": "wk", "v": "wv", "o": "wo", "gate": "w_gate", "up": "w_up",
                   "down": "w_down"}


def flat_params(module) -> dict:
    """{path tuple: array} of every nnx.Param (adapters included) of `module`."""
    return {tuple(p): v[...] for p, v in nnx.to_flat_state(nnx.state(module, nnx.Param))}


def adapter_sites(module) -> dict:
    """{adapter path (ends at the `LoRA` module): (base weight path, scale)} of `module`:
    a `Dense`'s adapter sits beside its kernel, a decoder layer's beside the projection's
    weight (`DECODER_WEIGHTS`)."""
    out = {}
    for path, _ in nnx.to_flat_state(nnx.state(module, LoRAParam)):
        if path[-1] != "a":
            continue
        site, parent = tuple(path[:-1]), tuple(path[:-3])
        owner = _get(module, parent)
        base = parent + (("kernel",) if hasattr(owner, "kernel")
                         else (DECODER_WEIGHTS[str(site[-1])],))  # an adapter's name
        out[site] = (base, _get(module, site).scale)
    return out


def _get(module, path: tuple):
    node = module
    for p in path:
        node = node[p] if isinstance(p, int) or isinstance(node, nnx.Dict) else getattr(node, p)
    return node


def adapter_arrays(module) -> dict:
    """{adapter path + ("a" | "b"): array} of `module`'s LoRA weights."""
    return {tuple(p): v[...] for p, v in nnx.to_flat_state(nnx.state(module, LoRAParam))}


def without_lora(cfg):
    """`cfg` (an LLMConfig, VisionConfig or MLLMConfig) with every `lora` set to None."""
    if hasattr(cfg, "llm"):
        encs = tuple(dataclasses.replace(
            e, encoder=without_lora(e.encoder) if hasattr(e.encoder, "lora") else e.encoder,
            projector=dataclasses.replace(e.projector, lora=None)) for e in cfg.encoders)
        return cfg.replace(llm=without_lora(cfg.llm), encoders=encs)
    return dataclasses.replace(cfg, lora=None) if hasattr(cfg, "lora") else cfg


def merged_flat(module) -> dict:
    """{path: array} of the base weights with every adapter merged (W + A B * scale, in
    float32, cast back to W's dtype); adapters left out; other weights untouched."""
    flat = flat_params(module)
    for site, (base, scale) in adapter_sites(module).items():
        a = np.asarray(jax.device_get(flat.pop(site + ("a",))), np.float32)
        b = np.asarray(jax.device_get(flat.pop(site + ("b",))), np.float32)
        w = np.asarray(jax.device_get(flat[base]))
        flat[base] = (w.astype(np.float32) + (a @ b) * np.float32(scale)).astype(w.dtype)
    return flat


def merged_module(module, cfg):
    """-> (a module of `without_lora(cfg)` holding `merged_flat(module)`, that config):
    the adapters folded into their base weights, an `LLM` or a `MultimodalModel` alike."""
    from mmjax.models.hf.checkpoint import apply_to_module
    from mmjax.models.llm import LLM
    from mmjax.models.mllm import MultimodalModel

    base = without_lora(cfg)
    if isinstance(module, LLM):
        new = nnx.eval_shape(lambda: LLM(base, jax.random.key(0), module.start, module.end))
    else:
        new = nnx.eval_shape(lambda: MultimodalModel(base, jax.random.key(0)))
    tree: dict = {}
    for path, v in merged_flat(module).items():
        node = tree
        for p in path[:-1]:
            node = node.setdefault(p, {})
        node[path[-1]] = v
    apply_to_module(new, tree)
    for attr in ("hf_source", "hf_image_token"):
        if hasattr(module, attr):
            setattr(new, attr, getattr(module, attr))
    return new, base
