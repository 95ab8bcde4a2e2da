"""Write a synthetic multimodal dataset as ArrayRecord + shape index for the loader.

  python scripts/make_dataset.py --kind=mix --num_samples=1000 --out=/tmp/mix.arrayrecord

Images are stored as uint8 pixels and decoded/resized by the loader's worker processes
(seed 000 §4.2: preprocessing off the training path). `--corrupt_fraction` truncates some
records so the loader's skip path can be exercised.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mmjax.data.loader import write_dataset  # noqa: E402
from mmjax.data.synthetic import SyntheticConfig, SyntheticDataset  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", choices=("laion", "mix"), default="mix")
    ap.add_argument("--num_samples", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True, help="ArrayRecord path; index at OUT.index.json")
    ap.add_argument("--vocab_size", type=int, default=512)
    ap.add_argument("--patch_size", type=int, default=14)
    ap.add_argument("--max_grid", type=int, default=64)
    ap.add_argument("--n_mels", type=int, default=16)
    ap.add_argument("--gen_fraction", type=float, default=0.0)
    ap.add_argument("--bad_fraction", type=float, default=0.0,
                    help="share of empty / bad-shape / too-long samples")
    ap.add_argument("--corrupt_fraction", type=float, default=0.0,
                    help="share of records written truncated (fail to decode)")
    ap.add_argument("--raw_text", action="store_true",
                    help="store text as bytes, tokenised byte-level by the loader's workers")
    a = ap.parse_args(argv)
    if a.num_samples < 1:
        ap.error("--num_samples must be >= 1")
    cfg = SyntheticConfig(vocab_size=a.vocab_size, patch_size=a.patch_size, n_mels=a.n_mels,
                          gen_fraction=a.gen_fraction, bad_fraction=a.bad_fraction)
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
    main()
