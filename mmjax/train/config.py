"""gin entry points for model configs: a named config plus dotted-path overrides."""
from __future__ import annotations

import gin

from mmjax.errors import UserError
from mmjax.models.config import MLLMConfig, with_overrides
from mmjax.models.tiny import TINY_CONFIGS


def all_config_names() -> list[str]:
    from mmjax.models import named

    return sorted(set(TINY_CONFIGS) | set(named.NAMED_CONFIGS))


@gin.configurable
def named_model_config(name: str = "tiny", overrides: dict | None = None) -> MLLMConfig:
    """`named_model_config.name = "disttrain/mllm_9b"` in gin; overrides like
    `{"llm.num_layers": 2, "encoders.vision.frozen": True}`."""
    if name in TINY_CONFIGS:
        cfg = TINY_CONFIGS[name]()
    else:
        from mmjax.models import named

        if name not in named.NAMED_CONFIGS:
            raise UserError(f"named_model_config.name={name!r} is unknown (choose one of "
                            f"{all_config_names()})")
        cfg = named.NAMED_CONFIGS[name]()
    return with_overrides(cfg, overrides)


@gin.configurable
def pretrained(**units) -> dict[str, str]:
    """Local HF checkpoint directories per unit, e.g. `pretrained.llm = "/models/llama3-8b"`,
    `pretrained.vision = "/models/clip-vit-l-336"` (unit names: 'llm' and the encoders'), or
    the whole model from one LlavaForConditionalGeneration directory:
    `pretrained.model = "/models/llava-1.5-7b-hf"`."""
    return {unit: path for unit, path in units.items() if path}
