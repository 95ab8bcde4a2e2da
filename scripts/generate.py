#!/usr/bin/env python
"""Generate text from a trained checkpoint, through the run's own tokenizer, chat template
and image / audio processors:

  python scripts/generate.py --workdir=/tmp/llava_run --image=cat.jpg --prompt="What colour is it?"

Reads WORKDIR/config.gin (written by scripts/train.py) and the newest checkpoint of a
single-program run; decodes with a KV cache: greedy by default, or --temperature / --top_p.
"""
from __future__ import annotations

import argparse
import os
import sys

import gin

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from mmjax.errors import UserError  # noqa: E402

STOP_TOKENS = ("<|eot_id|>", "<|im_end|>", "<|end_of_text|>", "<|endoftext|>")


def _bound(name: str, default=None):
    try:
        return gin.query_parameter(name)
    except ValueError:
        return default


def prompt_sample(tok, chat, image_proc, audio_proc, prompt: str, image: str | None,
                  audio: str | None):
    """The user turn (with its placeholders) rendered with the generation prompt -> Sample."""
    import numpy as np
    from PIL import Image

    from mmjax.data.preprocess import load_audio
    from mmjax.data.sample import Sample, Segment

    content = ("<image>\n" if image else "") + ("<audio>\n" if audio else "") + prompt
    rendered = chat([{"from": "human", "value": content}], add_generation_prompt=True)
    segs = []
    for kind, ids, _ in rendered.pieces:
        if kind == "text":
            segs.append(Segment("text", ids))
        elif kind == "image":
            with Image.open(image) as im:
                segs.append(Segment("image", np.ascontiguousarray(
                    image_proc(im).transpose(1, 2, 0))))
        else:
            wave = load_audio(audio, audio_proc.sampling_rate)
            segs.append(Segment("audio", np.ascontiguousarray(
                audio_proc(wave, padding="longest").T)))
    return Sample(0, tuple(segs))


def check_inputs(cfg, a) -> None:
    """A model with an image or audio encoder gets that input (a prompt without it is a
    question about nothing: the model answers with noise), unless --text_only says so."""
    given = {"image": a.image, "audio": a.audio}
    for e in cfg.encoders:
        if e.modality in given and given[e.modality] is None and not a.text_only:
            raise UserError(f"--{e.modality}: model {cfg.name} reads {e.modality}s; pass "
                            f"--{e.modality}=FILE (or --text_only for a prompt without one)")
    for mod, path in given.items():
        if path is not None and all(e.modality != mod for e in cfg.encoders):
            raise UserError(f"--{mod}: model {cfg.name} has no {mod} encoder (drop --{mod})")


def restore_model(cfg, workdir: str, step: int | None):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from mmjax.models.mllm import MultimodalModel, trainable_filter
    from mmjax.train.checkpoint import Checkpointer
    from mmjax.train.logical_state import single_from_logical, single_logical
    from mmjax.train.optimizer import learning_rate_schedule, optimizer_from_settings
    from mmjax.train.step import TrainState, split_model

    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"))
    step = step or ckpt.latest_step()
    if step is None:
        raise UserError(f"no checkpoint in {workdir}/checkpoints (train first, or pass --workdir "
                 f"of a finished run)")
    model = MultimodalModel(cfg, jax.random.key(0))
    graphdef, trainable, frozen = split_model(model, trainable_filter(cfg))
    tx = optimizer_from_settings(learning_rate_schedule(_bound("train.steps", 30)))
    like = TrainState(jnp.zeros((), jnp.int32), trainable, frozen, tx.init(trainable))
    try:
        named, _ = ckpt.restore(step, single_logical(like))  # the trainer's layout
        state = single_from_logical(like, named)
    except (ValueError, KeyError) as e:
        raise UserError(f"{workdir} step {step} is not a single-program checkpoint of this model "
                 f"({type(e).__name__}: {e}); generate reads runs trained without --plan")
    finally:
        ckpt.close()
    return nnx.merge(graphdef, state.trainable, state.frozen), step


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--image", default=None)
    ap.add_argument("--audio", default=None)
    ap.add_argument("--max_new_tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top_p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--step", type=int, default=None, help="checkpoint step (default newest)")
    ap.add_argument("--text_only", action="store_true",
                    help="a prompt without the model's image / audio input, on purpose")
    a = ap.parse_args(argv)
    conf = os.path.join(a.workdir, "config.gin")
    for path, what in ((conf, "--workdir (no config.gin: not a scripts/train.py run)"),
                       (a.image, "--image"), (a.audio, "--audio")):
        if path is not None and not os.path.isfile(path):
            raise UserError(f"{what}: {path} not found")
    if not 0.0 < a.top_p <= 1.0 or a.temperature < 0 or a.max_new_tokens < 1:
        raise UserError("need 0 < --top_p <= 1, --temperature >= 0, --max_new_tokens >= 1")

    from mmjax.data.layout import check_sample
    from mmjax.data.assemble import assemble
    from mmjax.data.chat import ChatFormat
    from mmjax.data.sources import default_processors
    from mmjax.models.decode import generate
    from mmjax.train.config import named_model_config
    from mmjax.train.inputs import model_inputs
    from mmjax.data.tokenizer import tokenizer
    from mmjax.train.data_config import data_layout, fit_vocab
    from mmjax.cli import register_configurables

    register_configurables()  # every configurable config.gin may bind
    gin.parse_config_file(conf)
    tok = tokenizer()
    if tok is None:
        raise UserError("the run has no tokenizer.path (synthetic data): nothing to decode to text")
    cfg = fit_vocab(named_model_config(), tok)
    check_inputs(cfg, a)
    layout = data_layout(cfg, special=tok.special_tokens())
    image_proc, audio_proc = default_processors(cfg, _bound("llava_source.image_processor"),
                                                _bound("llava_source.audio_processor"))
    chat = ChatFormat(tok, _bound("llava_source.chat_template"),
                      _bound("llava_source.loss_on", "assistant"))
    sample = prompt_sample(tok, chat, image_proc, audio_proc, a.prompt, a.image, a.audio)
    why = check_sample(sample, layout)
    if why:
        raise UserError(f"the prompt cannot be fed to this model: {why}")
    batch = model_inputs(assemble([sample], layout))
    prompt_len = int((batch["doc"][0] == 1).sum()) - 1  # the document's eos is not prompt
    model, step = restore_model(cfg, a.workdir, a.step)
    stop = {tok.special_tokens().eos} | {tok.tok.token_to_id(t) for t in STOP_TOKENS
                                         if tok.tok.token_to_id(t) is not None}
    ids = generate(model, batch, prompt_len, a.max_new_tokens, tuple(stop), a.temperature,
                   a.top_p, a.seed, vocab=tok.vocab_size)
    print(tok.decode(ids))
    return 0


if __name__ == "__main__":
    from mmjax.cli import run_main

    sys.exit(run_main(main))
