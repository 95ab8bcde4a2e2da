"""Write a synthetic multimodal dataset as ArrayRecord + shape index for the loader.

  python scripts/make_dataset.py --out=data/tiny.arrayrecord      # fits configs/tiny.gin
  python scripts/make_dataset.py --model=tiny_valm --num_samples=64 --out=/tmp/valm.arrayrecord

`--model NAME` (a named config, default `tiny`: the default config's model) takes the
vocabulary, patch size, largest image grid, mel bins and latent shape from that model, so
the trainer can read the file (`--gin_param=loader_source.path="'data/tiny.arrayrecord'"`).
`--kind` defaults to what the model reads: `mix` (image, audio and text samples) for a
model with an audio encoder, `laion` (image-text) otherwise. `--model=none` writes generic
shapes from `--vocab_size`, `--patch_size`, `--max_grid`, `--n_mels`.

Images are stored as uint8 pixels and decoded/resized by the loader's worker processes
(DistTrain §4.2: preprocessing off the training path). `--corrupt_fraction` truncates some
records so the loader's skip path can be exercised.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mmjax.data.records import write_dataset  # noqa: E402
from mmjax.errors import UserError  # noqa: E402
from mmjax.data.synthetic import SyntheticConfig, SyntheticDataset  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", choices=("laion", "mix"), default=None,
                    help="default: mix for a model with an audio encoder, else laion")
    ap.add_argument("--num_samples", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True, help="ArrayRecord path; index at OUT.index.json")
    ap.add_argument("--model", default="tiny",
                    help="named model config to match (sets the sizes below from it); "
                         "default tiny (configs/tiny.gin's); 'none': the sizes below")
    ap.add_argument("--vocab_size", type=int, default=512)
    ap.add_argument("--patch_size", type=int, default=14)
    ap.add_argument("--max_grid", type=int, default=64)
    ap.add_argument("--n_mels", type=int, default=16)
    ap.add_argument("--gen_fraction", type=float, default=None,
                    help="share of generation tasks (samples with an image_out target); "
                         "default 0, or the model's (0.15 with a generator) with --model")
    ap.add_argument("--bad_fraction", type=float, default=0.0,
                    help="share of empty / bad-shape / too-long samples")
    ap.add_argument("--corrupt_fraction", type=float, default=0.0,
                    help="share of records written truncated (fail to decode)")
    ap.add_argument("--raw_text", action="store_true",
                    help="store text as bytes, tokenised byte-level by the loader's workers")
    a = ap.parse_args(argv)
    if a.num_samples < 1:
        ap.error("--num_samples must be >= 1")
    if a.model and a.model != "none":
        from mmjax.train.config import named_model_config

        model = named_model_config(a.model)
        vision = [e.encoder for e in model.encoders if e.modality == "image"]
        audio = any(e.modality == "audio" for e in model.encoders)
        if a.kind is None:
            a.kind = "mix" if audio else "laion"
        if a.kind == "mix" and not audio:
            raise UserError(f"--kind=mix writes audio samples, which model {a.model!r} cannot "
                            f"read (no audio encoder): use --kind=laion or a model with audio, "
                            f"e.g. --model=tiny_valm")
        if vision:
            a.patch_size, a.max_grid = vision[0].patch_size, vision[0].max_grid
        kw = {} if a.gen_fraction is None else {"gen_fraction": a.gen_fraction}
        cfg = SyntheticConfig.for_model(model, bad_fraction=a.bad_fraction, **kw)
    else:
        a.kind = a.kind or "mix"
        cfg = SyntheticConfig(vocab_size=a.vocab_size, patch_size=a.patch_size, n_mels=a.n_mels,
                              gen_fraction=a.gen_fraction or 0.0,
                              bad_fraction=a.bad_fraction)
    ds = SyntheticDataset(a.kind, cfg, seed=a.seed, size=a.num_samples)
    rng = np.random.default_rng([a.seed, 99])
    corrupt = frozenset(np.flatnonzero(rng.random(a.num_samples) < a.corrupt_fraction).tolist())
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    t = time.perf_counter()
    n = write_dataset(a.out, (ds[i] for i in range(a.num_samples)), a.patch_size, a.max_grid,
                      corrupt, a.raw_text)
    print(f"wrote {n} records ({len(corrupt)} corrupt) to {a.out} in "
          f"{time.perf_counter() - t:.1f}s; index {a.out}.index.json")


if __name__ == "__main__":
    from mmjax.cli import run_main

    sys.exit(run_main(main))
