"""WebDataset tar shards as a loader source (stdlib tarfile, no JAX).

`urls`: local shard paths with brace expansion ("data/shard-{000..099}.tar", "{a,b}.tar"),
one string (several patterns separated by whitespace) or a list. Members sharing a key
(the member path up to the first dot of its file name) form one sample: an image
(`jpg` / `jpeg` / `png` / `webp`) and a `txt` caption or a `json` object with
`conversations` (LLaVA turns) or `caption` / `text`. A caption becomes the conversation
[human: <image>, gpt: caption]. Images are read by seeking to their member's offset.
A skipped sample is named in skipped.jsonl by its shard and member (the image's, else the
caption's): {"file": "<shard path>", "member": "a/k1.jpg"}.
"""
from __future__ import annotations

import json
import os
import re
import tarfile

from mmjax.errors import UserError
from mmjax.data.index import cached_index, index_key
from mmjax.data.sources.common import ChatRecordSource

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
SCAN_VERSION = 2  # the shard scan's record layout (2: each record's `where`)


def expand_braces(pattern: str) -> list[str]:
    """Brace expansion: {000..012} (zero-padded to the first bound's width) and {a,b,c}."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if m is None:
        return [pattern]
    head, tail, body = pattern[:m.start()], pattern[m.end():], m.group(1)
    rng = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if rng:
        lo, hi = rng.group(1), rng.group(2)
        options = [str(i).zfill(len(lo)) for i in range(int(lo), int(hi) + 1)]
    else:
        options = body.split(",")
    return [p for o in options for p in expand_braces(head + o + tail)]


def shard_paths(urls) -> list[str]:
    patterns = urls.split() if isinstance(urls, str) else list(urls)
    paths = [p for pat in patterns for p in expand_braces(pat)]
    missing = [p for p in paths if not os.path.isfile(p)]
    if not paths or missing:
        raise UserError(f"webdataset_source.urls={urls!r}: "
                         + (f"missing shards {missing[:3]}" if missing else "no shards")
                         + " (local tar paths, brace patterns allowed)")
    return paths


def _conversation(doc) -> list[dict] | None:
    if isinstance(doc, dict) and isinstance(doc.get("conversations"), list):
        return doc["conversations"]
    caption = doc.get("caption", doc.get("text")) if isinstance(doc, dict) else doc
    if not isinstance(caption, str):
        return None
    return [{"from": "human", "value": "<image>"}, {"from": "gpt", "value": caption}]


def scan_shard(path: str) -> list[dict]:
    """Records of one shard (text members are read here; images stay refs)."""
    groups: dict[str, dict] = {}
    with tarfile.open(path) as tar:
        for m in tar:
            if not m.isfile():
                continue
            d, base = os.path.split(m.name)
            if "." not in base:
                continue
            stem, ext = base.split(".", 1)
            g = groups.setdefault(os.path.join(d, stem), {})
            ext = ext.lower()
            if ext in IMAGE_EXTS:
                g["image"] = ["tar", path, m.offset_data, m.size]
                g["member"] = m.name
            elif ext in ("txt", "json"):
                g.setdefault("member", m.name)
                member = tar.extractfile(m)
                assert member is not None  # a regular file (isfile above)
                raw = member.read().decode("utf-8", errors="replace")
                try:
                    g["doc"] = json.loads(raw) if ext == "json" else raw.strip()
                except ValueError:
                    g["doc"] = None
    records = []
    for key, g in groups.items():
        conv = _conversation(g.get("doc"))
        images = [g["image"]] if "image" in g else []
        if conv is not None and not images:  # text-only: drop the image placeholder
            conv = [t for t in conv if t.get("value") != "<image>"]
        records.append({"id": f"{os.path.basename(path)}/{key}", "images": images, "audio": [],
                        "conversations": conv if conv is not None else [],
                        "where": [path, "member", g.get("member", key)]})
    return records


class WebDatasetSource(ChatRecordSource):
    """Samples of tar shards; the shard scan and the metadata are cached next to the first
    shard (`.<name>.mmjax_index.json`), keyed by the shards' sizes and mtimes."""

    def __init__(self, urls, tokenizer, image_processor, audio_processor,
                 chat_template: str | None = "plain", loss_on: str = "assistant",
                 index_workers: int = 8, max_tokens: int | None = None):
        paths = shard_paths(urls)
        stats = [(os.path.abspath(p), os.path.getsize(p), os.stat(p).st_mtime_ns) for p in paths]
        key = index_key(stats, SCAN_VERSION)
        base = os.path.join(os.path.dirname(os.path.abspath(paths[0])),
                            f".{os.path.basename(paths[0])}.{key[:8]}")
        per_shard = cached_index(base + ".shards.json", key, paths, scan_shard, index_workers,
                                 label=f"scanning {len(paths)} shards")
        records = [r for shard in per_shard for r in shard]
        super().__init__(records, tokenizer, chat_template, loss_on, image_processor,
                         audio_processor, base + ".mmjax_index.json",
                         (key, type(image_processor).__name__), index_workers,
                         max_tokens=max_tokens)
