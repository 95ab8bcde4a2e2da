#!/usr/bin/env python
"""Write a small LLaVA-format data set and a tiny BPE tokenizer for it:

  python scripts/make_example_data.py --out=/tmp/llava_example

OUT/train.json (LLaVA records: multi-turn, system prompts, two images in one sample,
text-only samples, and on purpose a corrupt and a missing image), OUT/val.json (a held-out
split for `train.eval_every`), OUT/images/*.jpg|png (varied sizes) and OUT/tokenizer/
(tokenizer.json + tokenizer_config.json with the Llama-3 chat template). Train on it with
configs/examples/llava_tiny.gin. Also OUT/train_gen.json (records whose `output_image` the
generator learns to draw) and OUT/vae/ (a tiny diffusers AutoencoderKL trained on those
pictures by scripts/make_example_vae.py):
configs/examples/llava_gen_tiny.gin.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mmjax.data.example_data import (write_generation_example,  # noqa: E402
                                     write_llava_example)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--num_samples", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num_val", type=int, default=16, help="held-out samples (val.json)")
    a = ap.parse_args(argv)
    if a.num_val < 1:
        ap.error("--num_val must be >= 1")
    if a.num_samples < 8:
        ap.error("--num_samples must be >= 8")
    try:
        os.makedirs(a.out, exist_ok=True)
        probe = os.path.join(a.out, ".mmjax_write_probe")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        from mmjax.errors import UserError

        raise UserError(f"--out={a.out}: cannot write there ({e.strerror}): give a "
                        f"directory you can write, e.g. /tmp/llava_example") from None
    info = write_llava_example(a.out, a.num_samples, a.seed, a.num_val)
    print(f"wrote {a.num_samples + 3} records to {info['json']} and {a.num_val} to "
          f"{info['val_json']} (images in "
          f"{info['image_root']}, tokenizer in {info['tokenizer']}); "
          f"deliberately bad: {', '.join(info['bad'])}")
    gen = write_generation_example(a.out, seed=a.seed + 1)
    print(f"wrote image-generation records (output_image) to {gen['json']} and the example VAE "
          f"to {gen['vae']} (configs/examples/llava_gen_tiny.gin)")
    return 0


if __name__ == "__main__":
    from mmjax.cli import run_main

    sys.exit(run_main(main))
