"""The `lora.*` gin settings: which parts of the model train as LoRA adapters (models/lora.py)
and with what rank, alpha, targets and scaling; `with_lora` puts them into the model config
(after the pretrained checkpoints' config.json set its sizes). docs/lora.md."""
from __future__ import annotations

import gin

from mmjax.errors import UserError
from mmjax.models.config import MLLMConfig, VisionConfig, with_overrides
from mmjax.models.lora_config import PROJECTIONS, LoRAConfig, tower_kind
from mmjax.models.units import is_llm

ADAPTER = "adapter"  # pretrained.adapter: a peft LoRA adapter to continue training


@gin.configurable
def lora(units=(), rank: int = 8, alpha: float = 16.0, targets=("q", "k", "v", "o"),
         dropout: float = 0.0, rslora: bool = False) -> tuple[tuple[str, ...], LoRAConfig]:
    """`lora.units`: the parts trained as adapters: "llm", an encoder's tower ("vision") or
    its projector ("vision.projector"); empty: no LoRA. The rest: `LoRAConfig`'s fields."""
    units = (units,) if isinstance(units, str) else tuple(units)
    targets = (targets,) if isinstance(targets, str) else tuple(targets)
    return units, LoRAConfig(rank, alpha, targets, dropout, rslora)


def lora_parts(cfg: MLLMConfig) -> list[str]:
    """The names `lora.units` accepts for `cfg`."""
    out = ["llm"]
    for e in cfg.encoders:
        if isinstance(e.encoder, VisionConfig):
            out.append(e.name)
        if e.projector.kind == "mlp":
            out.append(e.name + ".projector")
    return out


def _not_adapted(cfg: MLLMConfig, unit: str) -> str:
    """Why `unit` is not in `lora_parts(cfg)`, for the error line."""
    names = [e.name for e in cfg.encoders]
    enc = unit.removesuffix(".projector")
    if enc not in names:
        return "not a part of this model"
    spec = cfg.encoder(enc)
    if unit.endswith(".projector"):
        return (f"a {spec.projector.kind!r} projector: LoRA adapts kind='mlp' projectors "
                f"only (train it whole or freeze it)")
    return "an audio tower: LoRA adapts vision towers only (train it whole or freeze it)"


def with_lora(cfg: MLLMConfig, units=None, settings: LoRAConfig | None = None) -> MLLMConfig:
    """`cfg` with `settings` (default: gin's `lora.*` settings) on each of `units`
    (default: gin's `lora.units`)."""
    gin_units, gin_settings = lora()
    units = gin_units if units is None else units
    settings = gin_settings if settings is None else settings
    if not units:
        return cfg
    parts = lora_parts(cfg)
    bad = [u for u in units if u not in parts]
    if bad:
        raise UserError(f"lora.units={list(units)!r}: {bad[0]!r} is {_not_adapted(cfg, bad[0])}"
                        f" (use some of {parts})")
    over = {}
    for u in units:
        if is_llm(u):
            key, kind = "llm.lora", "llm"
        elif u.endswith(".projector"):
            key, kind = f"encoders.{u.removesuffix('.projector')}.projector.lora", "projector"
        else:
            key, kind = f"encoders.{u}.encoder.lora", tower_kind(cfg.encoder(u).encoder)
        if not settings.targets_in(kind):
            raise UserError(f"lora.targets={list(settings.targets)!r} names no projection of "
                            f"{u!r} (a {kind}'s are {list(PROJECTIONS[kind])})")
        over[key] = settings
    return with_overrides(cfg, over)


def with_adapter(cfg: MLLMConfig, adapter_dir: str, whole: bool) -> MLLMConfig:
    """`cfg` with the LoRA settings of the peft adapter `pretrained.adapter` names (a whole
    LLaVA's when the run starts from `pretrained.model`, else its LLM's); its values are
    read into the adapters after the base (hf/pretrained.py `load_pretrained_dirs`)."""
    from mmjax.models.hf.peft import model_adapter

    if cfg.lora_units():
        raise UserError(f"pretrained.adapter={adapter_dir!r} and lora.units={list(cfg.lora_units())}:"
                        f" the adapter sets the LoRA parts and settings; drop lora.*")
    try:
        over, _ = model_adapter(cfg, adapter_dir, whole)
    except UserError as e:
        raise UserError(f"pretrained.adapter: {e}") from None
    return with_overrides(cfg, over)
