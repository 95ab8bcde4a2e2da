"""Real-data sources for the loader and the trainer (gin: `llava_source.*`,
`webdataset_source.*`; the ArrayRecord source is `loader_source.path`)."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

import gin

from mmjax.errors import UserError
from mmjax.data.preprocess import (ImageProcessor, NativeResizeProcessor,
                                   WhisperFeatureExtractor, load_processor)
from mmjax.data.qwen2_vl_processor import Qwen2VLImageProcessor
from mmjax.models.config import MLLMConfig, VisionConfig

if TYPE_CHECKING:
    from mmjax.data.sources.common import ChatRecordSource


def default_processors(model: MLLMConfig, image_processor: str | None,
                       audio_processor: str | None):
    """The configured processors, or the model's own: for a standard ViT (kind="vit") CLIP's
    (shortest edge to `image_size`, centre crop to `image_size` squared, CLIP mean/std, as
    LLaVA feeds CLIP ViT-L/14-336), for the packed ViT its native-aspect resize (its patch
    size and grid), for Qwen2-VL its own processor (smart resize, CLIP mean/std), and a
    Whisper extractor with the audio encoder's mel bins."""
    vision = [e.encoder for e in model.encoders if isinstance(e.encoder, VisionConfig)]
    audio = [e.encoder for e in model.encoders if not isinstance(e.encoder, VisionConfig)]
    if image_processor:
        img = load_processor(image_processor)
    elif vision and vision[0].kind == "qwen2_vl":
        v = vision[0]
        img = Qwen2VLImageProcessor(patch_size=v.patch_size, merge_size=v.spatial_merge_size,
                                    temporal_patch_size=v.temporal_patch_size)
    elif vision and vision[0].kind == "vit":
        side = vision[0].image_size
        img = ImageProcessor(size={"shortest_edge": side},
                             crop_size={"height": side, "width": side})
    else:
        img = (NativeResizeProcessor(vision[0].patch_size, vision[0].max_grid) if vision
               else NativeResizeProcessor())
    aud = (load_processor(audio_processor) if audio_processor else
           WhisperFeatureExtractor(feature_size=audio[0].num_mel_bins if audio else 80))
    return img, aud


@gin.configurable
def llava_source(model: MLLMConfig, tokenizer, json_path: str | None = None,
                 image_root: str = "", audio_root: str | None = None,
                 chat_template: str | None = None, loss_on: str = "assistant",
                 image_processor: str | None = None, audio_processor: str | None = None,
                 index_workers: int = 8, output_images=None, max_tokens: int | None = None):
    """A `LlavaSource` when `llava_source.json_path` is set, else None. `chat_template`:
    None uses the tokenizer's, or "llama3" / "qwen2" / "plain" / a Jinja string;
    `output_images`: the VAE latent encoder for records with an `output_image`;
    `max_tokens` (the run's seq_len, passed by the trainer): longer texts are `too_long`,
    judged before tokenizing (data/sources/common.py `EntryBuilder`)."""
    if not json_path:
        return None
    from mmjax.data.sources.llava import LlavaSource

    check_image_root("llava_source.image_root", image_root)
    img, aud = default_processors(model, image_processor, audio_processor)
    src = LlavaSource(json_path, tokenizer, img, aud, image_root, audio_root, chat_template,
                      loss_on, index_workers, output_images, max_tokens)
    src.missing_hint = image_root_hint("llava_source.image_root", image_root)
    return src


def check_image_root(setting: str, image_root: str) -> None:
    """A set image root that is no directory: one line naming the setting."""
    if image_root and not os.path.isdir(image_root):
        raise UserError(f"{setting}={image_root!r}: no such directory (from "
                        f"{os.getcwd()}): give the folder the JSON's image paths are "
                        f"relative to, best as an absolute path")


def image_root_hint(setting: str, image_root: str) -> str:
    """What a global batch short of usable samples says when images are missing."""
    where = os.path.abspath(image_root or ".")
    return (f"images not found under {setting}={image_root!r} ({where}): set it to the "
            f"folder the JSON's image paths are relative to, best as an absolute path")


@gin.configurable
def webdataset_source(model: MLLMConfig, tokenizer, urls=None, chat_template: str = "plain",
                      loss_on: str = "assistant", image_processor: str | None = None,
                      index_workers: int = 8, max_tokens: int | None = None):
    """A `WebDatasetSource` when `webdataset_source.urls` is set, else None (`max_tokens`:
    as `llava_source`'s)."""
    if not urls:
        return None
    from mmjax.data.sources.webdataset import WebDatasetSource

    img, aud = default_processors(model, image_processor, None)
    return WebDatasetSource(urls, tokenizer, img, aud, chat_template, loss_on, index_workers,
                            max_tokens)


def configured_source(model: MLLMConfig, tokenizer, output_images=None,
                      max_tokens: int | None = None):
    """The gin-configured real-data source (LLaVA or WebDataset), or None; `max_tokens`:
    the run's seq_len (a longer text is skipped as too_long before it is tokenized)."""
    llava = llava_source(model, tokenizer, output_images=output_images, max_tokens=max_tokens)
    wds = webdataset_source(model, tokenizer, max_tokens=max_tokens)
    if llava is not None and wds is not None:
        raise UserError("both llava_source.json_path and webdataset_source.urls are set: "
                         "keep one")
    return llava if llava is not None else wds


@gin.configurable
def eval_source(model: MLLMConfig, tokenizer, json_path: str | None = None,
                image_root: str = "", urls=None, chat_template: str | None = None,
                loss_on: str = "assistant", image_processor: str | None = None,
                audio_processor: str | None = None, max_batches: int = 4):
    """The held-out set for `train.eval_every` (a LLaVA file or WebDataset shards), or None;
    -> (source, max_batches)."""
    if json_path and urls:
        raise UserError("eval_source: set json_path or urls, not both")
    if not (json_path or urls):
        return None
    if max_batches < 1:
        raise UserError(f"eval_source.max_batches={max_batches}: use >= 1")
    img, aud = default_processors(model, image_processor, audio_processor)
    src: ChatRecordSource
    if json_path:
        from mmjax.data.sources.llava import LlavaSource

        check_image_root("eval_source.image_root", image_root)
        src = LlavaSource(json_path, tokenizer, img, aud, image_root, None, chat_template,
                          loss_on)
        src.missing_hint = image_root_hint("eval_source.image_root", image_root)
    else:
        from mmjax.data.sources.webdataset import WebDatasetSource

        src = WebDatasetSource(urls, tokenizer, img, aud, chat_template or "plain", loss_on)
    return src, max_batches


def eval_batches(source, max_batches: int, global_batch: int) -> int:
    """How many held-out global batches an evaluation reads (at least one)."""
    return min(max_batches, max(1, len(source) // global_batch))
