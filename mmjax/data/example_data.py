"""A small LLaVA-format data set and a tiny BPE tokenizer, written from scratch (no JAX, no
network): what `scripts/make_example_data.py` writes and the tests train on.

The set has real JPEG and PNG files of varied sizes and aspect ratios, multi-turn
conversations with a system prompt, a two-image sample, text-only samples, and on purpose
one corrupt (truncated) image and one missing image, which the loader must skip and name.
"""
from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from mmjax.data.chat import TEMPLATES

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                   "<|end_header_id|>", "<|eot_id|>"]
COLOURS = {"red": (220, 40, 30), "green": (40, 180, 60), "blue": (30, 60, 210),
           "yellow": (230, 210, 40), "purple": (140, 50, 170), "white": (245, 245, 245)}
SHAPES = ("square", "stripe", "dot")
# the generation example's VAE, trained on these pictures (scripts/make_example_vae.py)
TRAINED_VAE = os.path.join(os.path.dirname(os.path.realpath(__file__)), "example_vae_weights")


def write_tokenizer(out_dir: str, texts: list[str], vocab_size: int = 384,
                    template: str = "llama3") -> str:
    """Train a byte-level BPE on `texts` and write tokenizer.json + tokenizer_config.json
    (Llama-3 special tokens and chat template) into `out_dir`; returns `out_dir`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=LLAMA3_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
                   "chat_template": TEMPLATES[template]}, f, indent=1)
    return out_dir


def _picture(rng, h: int, w: int, colour: str, shape: str) -> np.ndarray:
    """An h x w RGB picture: a coloured shape on a noisy grey background."""
    img = np.full((h, w, 3), 110, np.float64) + rng.normal(0, 12, (h, w, 3))
    yy, xx = np.mgrid[0:h, 0:w]
    if shape == "square":
        m = (abs(yy - h / 2) < h / 4) & (abs(xx - w / 2) < w / 4)
    elif shape == "stripe":
        m = abs(yy - h / 2) < h / 8
    else:
        m = (yy - h / 2) ** 2 + (xx - w / 2) ** 2 < (min(h, w) / 4) ** 2
    img[m] = COLOURS[colour]
    return np.clip(img, 0, 255).astype(np.uint8)


def _conversation(rng, colour: str, shape: str, n_turns: int, system: bool) -> list[dict]:
    turns = [{"from": "system", "value": "You describe pictures briefly."}] if system else []
    qa = [("What colour is the shape?", f"The shape is {colour}."),
          ("What shape is it?", f"It is a {colour} {shape}."),
          ("Describe the picture.", f"A {colour} {shape} on a grey background.")]
    order = rng.permutation(len(qa))[:n_turns]
    for j, q in enumerate(order):
        question, answer = qa[q]
        turns.append({"from": "human", "value": ("<image>\n" if j == 0 else "") + question})
        turns.append({"from": "gpt", "value": answer})
    return turns


def write_llava_example(out: str, num_samples: int = 48, seed: int = 0,
                        num_val: int = 16) -> dict:
    """Write `out`/images/*.jpg|png, `out`/train.json (LLaVA format), `out`/val.json (a
    held-out split of `num_val` clean samples, images `val-*.png`, for `train.eval_every`)
    and `out`/tokenizer; returns {"json", "val_json", "image_root", "tokenizer", "bad"}."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    img_dir = os.path.join(out, "images")
    os.makedirs(img_dir, exist_ok=True)
    records: list[dict[str, Any]] = []
    texts: list[str] = []
    for i in range(num_samples):
        colour = list(COLOURS)[rng.integers(len(COLOURS))]
        shape = SHAPES[rng.integers(len(SHAPES))]
        rec: dict[str, Any] = {"id": f"sample-{i:04d}"}
        if i % 8 == 7:  # text-only
            rec["conversations"] = [{"from": "human", "value": f"Name a {shape} colour."},
                                    {"from": "gpt", "value": f"{colour.capitalize()}."}]
        else:
            h, w = (int(x) for x in rng.integers(12, 72, size=2))
            ext = "jpg" if i % 2 else "png"
            name = f"{i:04d}.{ext}"
            Image.fromarray(_picture(rng, h, w, colour, shape)).save(os.path.join(img_dir, name))
            rec["image"] = name
            rec["conversations"] = _conversation(rng, colour, shape, 1 + i % 3, i % 5 == 0)
        records.append(rec)
    # Two images in one sample.
    Image.fromarray(_picture(rng, 30, 50, "red", "dot")).save(os.path.join(img_dir, "pair.png"))
    records.append({"id": "two-images", "image": ["pair.png", "0001.jpg"], "conversations": [
        {"from": "human", "value": "<image>\n<image>\nWhat is in the first picture?"},
        {"from": "gpt", "value": "A red dot."}]})
    # Deliberately bad: a truncated JPEG and an image that does not exist.
    with open(os.path.join(img_dir, "0001.jpg"), "rb") as f:
        head = f.read(200)
    with open(os.path.join(img_dir, "corrupt.jpg"), "wb") as f:
        f.write(head)
    bad: list[dict[str, Any]]
    bad = [{"id": "corrupt-image", "image": "corrupt.jpg", "conversations": [
               {"from": "human", "value": "<image>\nWhat is this?"},
               {"from": "gpt", "value": "A broken file."}]},
           {"id": "missing-image", "image": "does_not_exist.png", "conversations": [
               {"from": "human", "value": "<image>\nWhat is this?"},
               {"from": "gpt", "value": "Nothing."}]}]
    records += bad
    for r in records:
        texts += [t["value"] for t in r["conversations"]]
    json_path = os.path.join(out, "train.json")
    with open(json_path, "w") as f:
        json.dump(records, f, indent=1)
    tok_dir = write_tokenizer(os.path.join(out, "tokenizer"), texts * 4)
    val_path = os.path.join(out, "val.json")
    with open(val_path, "w") as f:
        json.dump(_held_out(img_dir, num_val, seed), f, indent=1)
    return {"json": json_path, "val_json": val_path, "image_root": img_dir,
            "tokenizer": tok_dir, "bad": [r["id"] for r in bad]}


def _held_out(img_dir: str, n: int, seed: int) -> list[dict]:
    """`n` validation records like the training ones (own random stream and image names,
    so the training split does not depend on them)."""
    from PIL import Image

    rng = np.random.default_rng([seed, 7])
    records = []
    for i in range(n):
        colour = list(COLOURS)[rng.integers(len(COLOURS))]
        shape = SHAPES[rng.integers(len(SHAPES))]
        h, w = (int(x) for x in rng.integers(12, 72, size=2))
        name = f"val-{i:04d}.png"
        Image.fromarray(_picture(rng, h, w, colour, shape)).save(os.path.join(img_dir, name))
        records.append({"id": f"val-{i:04d}", "image": name,
                        "conversations": _conversation(rng, colour, shape, 1 + i % 2, False)})
    return records


def write_generation_example(out: str, num_samples: int = 256, seed: int = 1) -> dict:
    """Image-generation records next to the LLaVA example: `out`/train_gen.json, where each
    record asks for a red square (32 x 32, on its own noisy grey ground) and names it as its
    `output_image` (the generator's target),
    and `out`/vae/ (a tiny diffusers AutoencoderKL, 16 x 16 pixels -> 8 x 8 x 4 latents,
    trained on these pictures by scripts/make_example_vae.py; `vae.path`). Train with
    configs/examples/llava_gen_tiny.gin."""
    import shutil

    from PIL import Image

    rng = np.random.default_rng(seed)
    img_dir = os.path.join(out, "images")
    os.makedirs(img_dir, exist_ok=True)
    records = []
    for i in range(num_samples):  # one subject (each its own noisy ground): a minute of
        name = f"gen_{i:04d}.png"  # CPU training learns it, and the header's prompt draws it
        Image.fromarray(_picture(rng, 32, 32, "red", "square")).save(os.path.join(img_dir, name))
        records.append({"id": f"gen-{i:04d}", "output_image": name, "conversations": [
            {"from": "human", "value": "Draw a red square."},
            {"from": "gpt", "value": "Here is a red square."}]})
    json_path = os.path.join(out, "train_gen.json")
    with open(json_path, "w") as f:
        json.dump(records, f, indent=1)
    vae_dir = os.path.join(out, "vae")
    shutil.copytree(TRAINED_VAE, vae_dir, dirs_exist_ok=True)
    return {"json": json_path, "vae": vae_dir}
