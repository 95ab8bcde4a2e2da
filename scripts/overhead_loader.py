"""scripts/bench_overhead.py's loader part: mmjax's LLaVA source loading the example set's
records (`LlavaSource.load`: decode, resize, patchify, chat template, tokenise, loss mask,
the sample's segments) against a plain loop over the same records: PIL decode and the same
image processor, one chat-template render and one tokeniser call per sample."""
from __future__ import annotations

import os
import statistics
import time


def plain_loop(records, image_root: str, render, tokenizer, image_processor) -> int:
    """What a user's own loop does per record; -> tokens produced (so nothing is skipped)."""
    from PIL import Image

    n = 0
    for rec in records:
        images = rec.get("image") or []
        for name in [images] if isinstance(images, str) else images:
            with Image.open(os.path.join(image_root, name)) as im:
                im.load()
                image_processor(im).transpose(1, 2, 0)
        n += len(tokenizer.encode(render(rec["conversations"])).ids)
    return n


def compare_loaders(a) -> dict:
    import json

    from mmjax.data.chat import ChatFormat, normalize_messages
    from mmjax.data.example_data import write_llava_example
    from mmjax.data.sources import default_processors
    from mmjax.data.sources.llava import LlavaSource
    from mmjax.data.tokenizer import Tokenizer
    from mmjax.models.tiny import tiny

    info = write_llava_example(a.data, a.samples)
    tok = Tokenizer(info["tokenizer"])
    img, aud = default_processors(tiny(), None, None)
    src = LlavaSource(info["json"], tok, img, aud, info["image_root"])
    usable = [i for i in range(len(src)) if src.problem(i) is None]
    with open(info["json"]) as f:
        records = json.load(f)  # the same records: index i is the source's record i
    chat = ChatFormat(tok)  # the tokenizer's template, compiled once, as the source's
    render = lambda conv: chat.render(normalize_messages(conv))
    # alternate in chunks of 25 records (the order flipped each chunk), so both see the
    # same load; wall and CPU time (process_time: this process's cores, what the load
    # does not inflate) summed per pass
    wall = {"mmjax": [], "plain": []}
    cpu = {"mmjax": [], "plain": []}
    runs = {"mmjax": lambda idx: [src.load(i) for i in idx],
            "plain": lambda idx: plain_loop([records[i] for i in idx], info["image_root"],
                                            render, tok, img)}
    for p in range(a.passes + 1):  # pass 0 warms the file cache and both code paths
        w, c = {"mmjax": 0.0, "plain": 0.0}, {"mmjax": 0.0, "plain": 0.0}
        for k in range(0, len(usable), 25):
            idx = usable[k:k + 25]
            for name in ("mmjax", "plain") if (k // 25 + p) % 2 == 0 else ("plain", "mmjax"):
                t0, c0 = time.perf_counter(), time.process_time()
                runs[name](idx)
                w[name] += time.perf_counter() - t0
                c[name] += time.process_time() - c0
        if p:
            for name in w:
                wall[name].append(w[name])
                cpu[name].append(c[name])
    per_s = {k: len(usable) / statistics.median(v) for k, v in wall.items()}
    cpu_per_s = {k: len(usable) / statistics.median(v) for k, v in cpu.items()}
    return {"records": len(usable), "mmjax_per_s": per_s["mmjax"],
            "plain_per_s": per_s["plain"], "ratio": per_s["mmjax"] / per_s["plain"],
            "mmjax_cpu_per_s": cpu_per_s["mmjax"], "plain_cpu_per_s": cpu_per_s["plain"],
            "cpu_ratio": cpu_per_s["mmjax"] / cpu_per_s["plain"],
            "wall_s": wall, "cpu_s": cpu}
