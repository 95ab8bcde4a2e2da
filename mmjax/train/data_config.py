"""The trainer's data settings (gin): the assembly layout, the synthetic set, the source a
run reads and the vocabulary that covers its tokenizer."""
from __future__ import annotations

import dataclasses

import gin

from mmjax.data.layout import AssemblyLayout
from mmjax.data.sources import configured_source
from mmjax.data.synthetic import SyntheticConfig, SyntheticDataset
from mmjax.models.config import MLLMConfig
from mmjax.train.vae_latents import output_image_encoder


@gin.configurable
def data_layout(cfg: MLLMConfig, seq_len: int = 256, packing: str = "pad",
                vision_caps=(64, 256, 1024), audio_frame_caps=(128, 256, 512, 1024),
                gen_num_queries: int = 16, special=None) -> AssemblyLayout:
    """`special`: a tokenizer's special ids (`Tokenizer.special_tokens()`), else reserved."""
    return AssemblyLayout.from_config(cfg, seq_len, packing, tuple(vision_caps),
                                      tuple(audio_frame_caps), gen_num_queries, special)


def fit_vocab(cfg: MLLMConfig, tok, tps=(1,), pretrained: bool = False) -> MLLMConfig:
    """The model's vocabulary covers the tokenizer: rounded up to a multiple of 128 and of
    every tp (the embedding is split by tp); a larger, divisible vocabulary is kept.
    `pretrained`: the LLM's vocabulary is a checkpoint's (e.g. LLaVA-1.5's 32064): kept when
    it covers the tokenizer and every tp divides it."""
    from mmjax.data.tokenizer import padded_vocab

    v = cfg.llm.vocab_size
    if v >= tok.vocab_size and (v == padded_vocab(v, tps)
                                or pretrained and all(v % t == 0 for t in tps)):
        return cfg
    return cfg.replace(llm=dataclasses.replace(cfg.llm, vocab_size=padded_vocab(tok.vocab_size,
                                                                                tps)))


@gin.configurable
def synthetic_dataset(cfg: MLLMConfig, kind: str = "laion", seed: int = 0,
                      bad_fraction: float = 0.0, **overrides) -> SyntheticDataset:
    return SyntheticDataset(kind, SyntheticConfig.for_model(cfg, bad_fraction=bad_fraction,
                                                            **overrides), seed=seed)


def train_source(cfg):
    """The trainer's data source (gin): `loader_source.path` (an ArrayRecord file from
    scripts/make_dataset.py) or the gin-configured synthetic set."""
    from mmjax.data.records import SyntheticSource, loader_source

    return loader_source(lambda: SyntheticSource(synthetic_dataset(cfg)))


def layout_and_source(cfg: MLLMConfig, tok):
    """The layout (with the tokenizer's special ids) and the configured real source."""
    layout = data_layout(cfg, special=tok.special_tokens() if tok is not None else None)
    out = output_image_encoder(cfg, layout.gen.num_queries) if layout.gen is not None else None
    return layout, configured_source(cfg, tok, out, max_tokens=layout.seq_len)
