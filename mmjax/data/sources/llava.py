"""LLaVA-format annotations (JSON list or JSONL) as a loader source (no JAX).

Each record: `id`, optional `image` (a path or a list of paths, relative to `image_root`),
optional `audio` (likewise, relative to `audio_root`), and `conversations`: turns
{"from": "human" | "gpt" | "system", "value": ...} with one `<image>` / `<audio>`
placeholder per file, where that file's tokens go.
"""
from __future__ import annotations

import json
import os

from mmjax.errors import UserError
from mmjax.data.index import file_digest
from mmjax.data.sources.common import ChatRecordSource


def _paths(value, root: str, field: str, where: str) -> list[str]:
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(v, str) for v in items):
        raise UserError(f"{where}: `{field}` must be a path or a list of paths")
    return [v if os.path.isabs(v) else os.path.join(root, v) for v in items]


def read_llava(json_path: str, image_root: str = "", audio_root: str | None = None
               ) -> list[dict]:
    """The records of a LLaVA JSON / JSONL file, with resolved file paths."""
    if not os.path.isfile(json_path):
        raise UserError(f"llava_source.json_path={json_path!r}: no such file")
    try:
        with open(json_path) as f:
            if json_path.endswith(".jsonl"):
                raw = [json.loads(line) for line in f if line.strip()]
            else:
                raw = json.load(f)
    except ValueError as e:
        raise UserError(f"llava_source.json_path={json_path!r}: not valid JSON/JSONL ({e})"
                         ) from None
    if not isinstance(raw, list):
        raise UserError(f"llava_source.json_path={json_path!r}: expected a list of records")
    audio_root = image_root if audio_root is None else audio_root
    records = []
    for k, r in enumerate(raw):
        where = f"{json_path} record {k}"
        if not isinstance(r, dict):
            raise UserError(f"{where}: a record must be an object with id/conversations")
        records.append({"id": str(r.get("id", k)),
                        "images": _paths(r.get("image"), image_root, "image", where),
                        "audio": _paths(r.get("audio"), audio_root, "audio", where),
                        "conversations": r.get("conversations")})
    return records


class LlavaSource(ChatRecordSource):
    """`read_llava` records; index cached at `<json_path>.mmjax_index.json`."""

    def __init__(self, json_path: str, tokenizer, image_processor, audio_processor,
                 image_root: str = "", audio_root: str | None = None,
                 chat_template: str | None = None, loss_on: str = "assistant",
                 index_workers: int = 8):
        records = read_llava(json_path, image_root, audio_root)
        data_key = (file_digest(json_path), os.path.abspath(image_root or "."),
                    os.path.abspath(audio_root or image_root or "."),
                    type(image_processor).__name__)
        super().__init__(records, tokenizer, chat_template, loss_on, image_processor,
                         audio_processor, json_path + ".mmjax_index.json", data_key,
                         index_workers)
