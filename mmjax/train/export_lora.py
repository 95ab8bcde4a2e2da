"""A LoRA run's export (scripts/export_hf.py --adapter / --merge): its adapters as a peft
adapter of the base it trained from, or the base with the adapters merged (then written as
any run is: train/export.py). docs/lora.md."""
from __future__ import annotations

from pathlib import Path

from flax import nnx

from mmjax.models import hf
from mmjax.models.hf.checkpoint import _flatten, save_extra
from mmjax.models.lora import LoRAParam
from mmjax.models.lora_merge import merged_module
from mmjax.models.mllm import trainable_filter
from mmjax.models.units import LLM_UNIT, is_llm


def lora_mode(cfg, adapter: bool, merge: bool) -> str | None:
    """"adapter", "merge" or None (a run without LoRA); ValueError for a mismatch."""
    units = cfg.lora_units()
    if adapter and merge:
        raise ValueError("--adapter and --merge: choose one (the adapter alone, or the base "
                         "with the adapter merged)")
    if (adapter or merge) and not units:
        raise ValueError(f"--{'adapter' if adapter else 'merge'}: the run trained no LoRA "
                         f"adapters (lora.units); export it without the flag")
    if units and not (adapter or merge):
        raise ValueError(f"the run trained LoRA adapters on {list(units)}: pass --adapter (a "
                         f"peft adapter of its base) or --merge (the base, adapters merged)")
    return "adapter" if adapter else "merge" if merge else None


def merged(cfg, model):
    """(config without LoRA, the model with its adapters merged: W + A B * scale)."""
    new, base = merged_module(model, cfg)
    return base, new


def export_adapter(cfg, model, out, dirs: dict) -> dict[str, Path]:
    """A LLaVA or Qwen2-VL run (`pretrained.model`): OUT/adapter over the whole model, a
    LLaVA projector saved whole (peft's modules_to_save) when it trained whole (a Qwen2-VL
    merger trained whole is refused: export with --merge). Otherwise the LLM's
    adapter in OUT/llm_adapter (LoRA on the LLM only), and every other trained parameter
    in OUT/mmjax_extra.safetensors, as a plain export writes them."""
    from mmjax.models.hf.pretrained import whole_base

    out, base = Path(out), whole_base(dirs)
    if base is not None:
        spec = cfg.encoder("vision")
        if not spec.frozen and getattr(spec.encoder, "lora", None) is None:
            raise ValueError("--adapter: the run trained the vision tower whole, which a peft "
                             "adapter does not hold; export with --merge")
        whole = () if spec.projector_frozen or spec.projector.lora else ("vision.projector",)
        if whole and spec.projector.kind == "patch_merger":
            raise ValueError("--adapter: the run trained the Qwen2-VL merger whole, which "
                             "mmjax's peft adapters do not hold; export with --merge")
        hf.save_adapter(model, cfg, out / "adapter", trained=whole, base_model=base)
        return {"adapter": out / "adapter"}
    units = cfg.lora_units()
    if len(units) != 1 or not is_llm(units[0]):
        raise ValueError(f"--adapter: adapters on {list(cfg.lora_units())}; without a whole "
                         f"LLaVA base (pretrained.model) a peft adapter holds the LLM's only: "
                         f"export with --merge")
    hf.save_adapter(model.llm, cfg.llm, out / "llm_adapter", trained=(),
                    base_model=dirs.get(LLM_UNIT))
    written = {"llm_adapter": out / "llm_adapter"}
    trained = nnx.state(model, nnx.All(trainable_filter(cfg), nnx.Not(LoRAParam)))
    return save_extra(out, {k: v for k, v in _flatten(nnx.to_pure_dict(trained)).items()
                            if not is_llm(k[0])}, written)
