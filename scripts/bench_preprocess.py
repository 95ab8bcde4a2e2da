#!/usr/bin/env python
"""DistTrain's Figure 21: the trainer-side preprocessing time per iteration, in process and
with producers (DistTrain §4.2; mmjax.data.producer), for (images per sample, resolution) =
(1, 512), (4, 1024), (10, 1024) by default.

  python scripts/bench_preprocess.py [--global_batch 4] [--iters 5] [--producers 1]
                                     [--json bench_results/bench_preprocess.json]

Data: a LLaVA-format set of JPEG photos-like images (smooth gradients plus noise) at the given
resolution, each sample naming k of them; the image processor resizes them to the packed
ViT's 384 x 384 (patch 16, 24 x 24 grid). Both columns build the same global batches
(planning, decoding, resizing, assembly of the pipeline feeds):
- "in process": the trainer builds each global batch itself (`GlobalBatchBuilder(step)`),
  the time it spends per iteration;
- "producers": `Loader.build(..., producers=P)`, producers pinned to other cores than the trainer (the
  trainer on CPU 0, producers on the rest), trainer's wait in `next(loader)` per iteration
  while it runs a simulated training step (`--step_s`, a sleep: the accelerator's work,
  which holds no CPU). Default step: 1.25 x the in-process time / P, so P producers can keep
  up, as a deployment sizes them.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def write_set(out: str, k: int, res: int, num_samples: int, distinct: int = 12) -> str:
    """`out`/train.json naming k of `distinct` res x res JPEGs per sample; -> json path."""
    import numpy as np
    from PIL import Image

    from mmjax.data.example_data import write_tokenizer

    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:res, 0:res] / res
    for i in range(distinct):
        base = np.stack([np.sin(6 * xx + i), np.cos(5 * yy - i), np.sin(4 * (xx + yy))], -1)
        img = np.clip(127 + 100 * base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
        Image.fromarray(img).save(os.path.join(out, f"img{i}.jpg"), quality=90)
    recs = [{"id": str(s), "image": [f"img{(s * k + j) % distinct}.jpg" for j in range(k)],
             "conversations": [{"from": "human", "value": "<image>\n" * k + "Describe."},
                               {"from": "gpt", "value": "Colourful waves."}]}
            for s in range(num_samples)]
    path = os.path.join(out, "train.json")
    with open(path, "w") as f:
        json.dump(recs, f)
    write_tokenizer(os.path.join(out, "tokenizer"), ["Describe. Colourful waves."] * 8)
    return path


def setup(data: str, k: int, global_batch: int):
    from mmjax.data.layout import AssemblyLayout
    from mmjax.data.preprocess import NativeResizeProcessor, WhisperFeatureExtractor
    from mmjax.data.sources.llava import LlavaSource
    from mmjax.data.tokenizer import Tokenizer
    from mmjax.models.tiny import TINY_VISION, tiny
    from mmjax.planner.plan import Plan

    vision = dataclasses.replace(TINY_VISION, patch_size=16, max_grid=24)
    base = tiny()
    spec = dataclasses.replace(base.encoders[0], encoder=vision)
    tok = Tokenizer(os.path.join(data, "tokenizer"))
    cfg = dataclasses.replace(base, encoders=(spec,), generator=None,
                              llm=dataclasses.replace(base.llm, vocab_size=512))
    src = LlavaSource(os.path.join(data, "train.json"), tok, NativeResizeProcessor(16, 24),
                      WhisperFeatureExtractor(feature_size=16), image_root=data,
                      chat_template="llama3", index_workers=1)
    n = 576 * k
    layout = AssemblyLayout.from_config(cfg, seq_len=max(1024, n + 256), vision_caps=(n,),
                                        special=tok.special_tokens())
    return src, cfg, Plan.uniform(cfg, global_batch, 1), layout


def measure(k: int, res: int, a, root: str) -> dict:
    from mmjax.data.loader import Loader

    data = os.path.join(root, f"k{k}_r{res}")
    write_set(data, k, res, a.global_batch * (a.iters + 2) + 8)
    src, cfg, plan, layout = setup(data, k, a.global_batch)
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[0]})  # the trainer's core
    others = cpus[1:] or cpus
    kw = dict(shuffle=False, reserve=0, shape_scan_steps=a.iters + 1)
    ld = Loader.build(src, cfg, plan, layout, **kw)
    ld.builder(0)  # warm caches (file system, imports)
    t_in = []
    for step in range(1, a.iters + 1):
        t = time.perf_counter()
        ld.builder(step)
        t_in.append(time.perf_counter() - t)
    in_s = statistics.mean(t_in)
    step_s = a.step_s if a.step_s > 0 else 1.25 * in_s / a.producers
    pl = Loader.build(src, cfg, plan, layout, producers=a.producers, producer_cpus=others,
                prefetch=2, **kw)
    t0 = time.perf_counter()
    next(pl)  # start-up: producers start and build their first batches
    startup = time.perf_counter() - t0
    waits = []
    for _ in range(a.iters):
        time.sleep(step_s)  # the accelerator's step: no CPU
        t = time.perf_counter()
        next(pl)
        waits.append(time.perf_counter() - t)
    pl.close()
    os.sched_setaffinity(0, set(cpus))
    return {"images_per_sample": k, "resolution": res, "global_batch": a.global_batch,
            "in_process_s": in_s, "in_process_all_s": t_in, "producers": a.producers,
            "producer_cpus": others, "trainer_cpu": cpus[0], "step_s": step_s,
            "producer_wait_s": statistics.mean(waits), "producer_wait_all_s": waits,
            "producer_startup_s": startup}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="1x512,4x1024,10x1024",
                    help="images-per-sample x resolution, comma separated")
    ap.add_argument("--global_batch", type=int, default=4)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--producers", type=int, default=1)
    ap.add_argument("--step_s", type=float, default=0.0,
                    help="simulated training step (default 1.25 x in-process / producers)")
    ap.add_argument("--json", default="bench_results/bench_preprocess.json")
    a = ap.parse_args(argv)
    try:
        configs = [tuple(int(v) for v in c.split("x")) for c in a.configs.split(",")]
        assert all(len(c) == 2 and min(c) > 0 for c in configs)
    except (ValueError, AssertionError):
        print(f"error: --configs={a.configs!r} (use e.g. 1x512,4x1024)", file=sys.stderr)
        return 2
    if a.global_batch < 1 or a.iters < 1 or a.producers < 1:
        print("error: --global_batch, --iters and --producers must be >= 1", file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for k, res in configs:
            rows.append(measure(k, res, a, root))
            r = rows[-1]
            print(f"  ({k}, {res}): in process {r['in_process_s'] * 1e3:.0f} ms, with "
                  f"producers {r['producer_wait_s'] * 1e3:.1f} ms", flush=True)
    print(f"\nTrainer-side preprocessing time per iteration (global batch {a.global_batch}, "
          f"{a.producers} producer(s) on CPUs {rows[0]['producer_cpus']}, trainer on CPU "
          f"{rows[0]['trainer_cpu']})")
    print(f"{'(images, resolution)':>22} | {'in process (ms)':>15} | {'producers (ms)':>14} | "
          f"{'producers, median':>17} | {'simulated step (ms)':>19}")
    for r in rows:
        med = statistics.median(r["producer_wait_all_s"])
        print(f"{str((r['images_per_sample'], r['resolution'])):>22} | "
              f"{r['in_process_s'] * 1e3:15.0f} | {r['producer_wait_s'] * 1e3:14.1f} | "
              f"{med * 1e3:17.1f} | {r['step_s'] * 1e3:19.0f}")
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "cpus": os.cpu_count()}, f, indent=1)
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
