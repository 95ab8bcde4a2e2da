#!/usr/bin/env python
"""Generate text from a trained checkpoint, through the run's own tokenizer, chat template
and image / audio processors:

  python scripts/generate.py --workdir=/tmp/llava_run --image=cat.jpg --prompt="What colour is it?"

Reads WORKDIR/config.gin and run.json (written by scripts/train.py) and the newest
checkpoint of the run (single program or plan; frozen pretrained units re-read from the files
the run recorded, checked unchanged); decodes with a KV cache: greedy by default, or
--temperature / --top_p. --output_image=PATH (a model with a generator and vae.path) then
draws: the DiT samples latents (--sampler ddim|ddpm, --diffusion_steps) conditioned on the
LLM after the reply, and the VAE decodes them to a PNG.
"""
from __future__ import annotations

import argparse
import os
import sys

import gin

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from mmjax.errors import UserError  # noqa: E402
from mmjax.settings import bound  # noqa: E402

STOP_TOKENS = ("<|eot_id|>", "<|im_end|>", "<|end_of_text|>", "<|endoftext|>")


def prompt_sample(tok, chat, image_proc, audio_proc, prompt: str, image: str | None,
                  audio: str | None, reply: str | None = None, image_out=None):
    """The user turn (with its placeholders) rendered with the generation prompt -> Sample;
    with `reply`, the whole exchange (user turn, assistant reply) as training renders it,
    followed by `image_out` (an image-output segment: latent shape, K queries) when given."""
    import numpy as np
    from PIL import Image

    from mmjax.data.preprocess import load_audio
    from mmjax.data.sample import Sample, Segment

    content = ("<image>\n" if image else "") + ("<audio>\n" if audio else "") + prompt
    turns = [{"from": "human", "value": content}]
    if reply is None:
        rendered = chat(turns, add_generation_prompt=True)
    else:
        rendered = chat(turns + [{"from": "gpt", "value": reply}])
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
    if image_out is not None:
        shape, k = image_out
        segs.append(Segment("image_out", np.zeros(shape, np.float32), num_queries=k))
    return Sample(0, tuple(segs))


def check_inputs(cfg, a) -> None:
    """A model with an image or audio encoder gets that input (a prompt without it is a
    question about nothing: the model answers with noise), unless --text_only says so or
    --output_image asks for a picture (the image-output records are text prompts)."""
    given = {"image": a.image, "audio": a.audio}
    text_ok = a.text_only or a.output_image is not None
    for e in cfg.encoders:
        if e.modality in given and given[e.modality] is None and not text_ok:
            raise UserError(f"--{e.modality}: model {cfg.name} reads {e.modality}s; pass "
                            f"--{e.modality}=FILE (or --text_only for a prompt without one)")
    for mod, path in given.items():
        if path is not None and all(e.modality != mod for e in cfg.encoders):
            raise UserError(f"--{mod}: model {cfg.name} has no {mod} encoder (drop --{mod})")


def restore_model(workdir: str, step: int | None):
    """(config, the whole model as trained, step): trainable arrays from the checkpoint of
    any run (single program or plan), frozen units from the pretrained files the run
    recorded, verified (mmjax/train/export.py `restore_model`)."""
    from mmjax.train.checkpoint import CheckpointMismatch, CheckpointUnusable
    from mmjax.train.export import restore_model as restore

    try:
        cfg, model, step, _ = restore(workdir, step)
    except (UserError, ValueError, FileNotFoundError, CheckpointUnusable) as e:
        why = str(e) if not isinstance(e, CheckpointMismatch) else f"{type(e).__name__}: {e}"
        raise UserError(f"{workdir}: {why}") from None
    return cfg, model, step


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
    ap.add_argument("--output_image", default=None,
                    help="also draw an image after the reply (a model with a generator and "
                         "vae.path): PNG written here")
    ap.add_argument("--sampler", default="ddim", choices=["ddim", "ddpm"])
    ap.add_argument("--diffusion_steps", type=int, default=50)
    ap.add_argument("--merge", action="store_true",
                    help="a LoRA run: merge the adapters into the base weights first (the same "
                         "tokens as unmerged, up to float rounding)")
    ap.add_argument("--text_only", action="store_true",
                    help="a prompt without the model's image / audio input, on purpose")
    a = ap.parse_args(argv)
    conf = os.path.join(a.workdir, "config.gin")
    for path, what in ((conf, "--workdir (no config.gin: not a scripts/train.py run)"),
                       (a.image, "--image"), (a.audio, "--audio")):
        if path is not None and not os.path.isfile(path):
            raise UserError(f"{what}: {path} not found")
    for bad, what in ((not 0.0 < a.top_p <= 1.0, f"--top_p={a.top_p}: use 0 < top_p <= 1"),
                      (not a.temperature >= 0, f"--temperature={a.temperature}: use >= 0 "
                                               f"(0: greedy)"),
                      (a.max_new_tokens < 1, f"--max_new_tokens={a.max_new_tokens}: use >= 1")):
        if bad:
            raise UserError(what)
    if a.output_image is not None and not 1 <= a.diffusion_steps <= 1000:
        raise UserError(f"--diffusion_steps={a.diffusion_steps}: use 1 .. 1000")
    if a.output_image is not None and not os.path.isdir(os.path.dirname(
            os.path.abspath(a.output_image))):
        raise UserError(f"--output_image={a.output_image}: its directory does not exist")

    from mmjax.data.layout import check_sample
    from mmjax.data.assemble import assemble
    from mmjax.data.chat import ChatFormat
    from mmjax.data.sources import default_processors
    from mmjax.models.decode import generate
    from mmjax.train.inputs import model_inputs
    from mmjax.data.tokenizer import tokenizer
    from mmjax.train.data_config import data_layout
    from mmjax.cli import register_configurables

    register_configurables()  # every configurable config.gin may bind
    gin.parse_config_file(conf)
    tok = tokenizer()
    if tok is None:
        raise UserError("the run has no tokenizer.path (synthetic data): nothing to decode to text")
    cfg, model, _ = restore_model(a.workdir, a.step)  # run.json's config, as trained
    if a.merge:
        if not cfg.lora_units():
            raise UserError("--merge: the run trained no LoRA adapters (drop --merge)")
        from mmjax.models.lora_merge import merged_module
        model, cfg = merged_module(model, cfg)
    check_inputs(cfg, a)
    layout = data_layout(cfg, special=tok.special_tokens())
    image_proc, audio_proc = default_processors(cfg, bound("llava_source.image_processor"),
                                                bound("llava_source.audio_processor"))
    chat = ChatFormat(tok, bound("llava_source.chat_template"),
                      bound("llava_source.loss_on", "assistant"))
    vae_path = bound("vae.path")
    if a.output_image is not None and (cfg.generator is None or not vae_path):
        raise UserError("--output_image: the run has no image output (its model has no "
                        "generator or its config.gin no vae.path)")
    sample = prompt_sample(tok, chat, image_proc, audio_proc, a.prompt, a.image, a.audio)
    why = check_sample(sample, layout)
    if why:
        raise UserError(f"the prompt cannot be fed to this model: {why}")
    batch = model_inputs(assemble([sample], layout))
    prompt_len = int((batch["doc"][0] == 1).sum()) - 1  # the document's eos is not prompt
    stop = {tok.special_tokens().eos} | {tok.tok.token_to_id(t) for t in STOP_TOKENS
                                         if tok.tok.token_to_id(t) is not None}
    ids = generate(model, batch, prompt_len, a.max_new_tokens, tuple(stop), a.temperature,
                   a.top_p, a.seed, vocab=tok.vocab_size)
    reply = tok.decode(ids)
    print(reply)
    if a.output_image is not None:
        draw(a, model, cfg, layout, tok, chat, image_proc, audio_proc, reply, vae_path)
    return 0


def draw(a, model, cfg, layout, tok, chat, image_proc, audio_proc, reply: str,
         vae_path: str) -> None:
    """The exchange as training renders it, then the image-output queries: the DiT samples
    latents conditioned on the LLM's states there; the VAE decodes them to a PNG."""
    from PIL import Image

    from mmjax.data.assemble import assemble
    from mmjax.models.hf.vae import load_vae_safetensors
    from mmjax.models.image_generation import generate_images
    from mmjax.train.inputs import model_inputs

    g = layout.gen
    sample = prompt_sample(tok, chat, image_proc, audio_proc, a.prompt, a.image, a.audio,
                           reply=reply, image_out=(g.data_shape, g.num_queries))
    try:
        vae, vae_cfg = load_vae_safetensors(vae_path)
    except (FileNotFoundError, UserError, ValueError) as e:
        raise UserError(f"vae.path={vae_path!r}: {e}") from None
    batch = model_inputs(assemble([sample], layout))
    pixels = generate_images(model, vae, batch, a.seed, a.diffusion_steps, a.sampler,
                             llm_mask_family=layout.llm_mask_family)
    Image.fromarray(pixels[0]).save(a.output_image, format="PNG")
    side = pixels.shape[1]
    print(f"wrote {a.output_image} ({side} x {side}, {a.sampler} {a.diffusion_steps} steps)")


if __name__ == "__main__":
    from mmjax.cli import run_main

    sys.exit(run_main(main))
