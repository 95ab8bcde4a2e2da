"""LLaVA-format annotations (JSON list or JSONL) as a loader source (no JAX).

Each record: `id`, optional `image` (a path or a list of paths, relative to `image_root`),
optional `audio` (likewise, relative to `audio_root`), and `conversations`: turns
{"from": "human" | "gpt" | "system", "value": ...} with one `<image>` / `<audio>`
placeholder per file, where that file's tokens go; optional `output_image` (one path,
relative to `image_root`): the image the generator learns to produce after the conversation
(its VAE latents, K query tokens after the last turn; needs `vae.path`).
"""
from __future__ import annotations

import json
import os
from typing import Any

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


def _output(value, root: str, where: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{where}: `output_image` must be one path (the image to generate)")
    return None if value is None else _paths(value, root, "output_image", where)[0]


def read_llava(json_path: str, image_root: str = "", audio_root: str | None = None
               ) -> list[dict]:
    """The records of a LLaVA JSON / JSONL file, with resolved file paths and where each
    is (`where`: file, "line" / "record", number). A JSONL line that is not valid JSON, or
    a record of the wrong form, becomes a record with a `problem` (skipped and named in
    skipped.jsonl by the loader; the rest of the set trains). A JSON list that does not
    parse at all is a UserError (nothing of it can be read)."""
    if not os.path.isfile(json_path):
        raise UserError(f"llava_source.json_path={json_path!r}: no such file")
    raw: list[tuple[tuple[str, str, int], Any, str | None]] = []  # (where, record or None, problem)
    try:
        with open(json_path) as f:
            if json_path.endswith(".jsonl"):
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        raw.append(((json_path, "line", n), json.loads(line), None))
                    except ValueError as e:
                        raw.append(((json_path, "line", n), None, f"json: line {n}: {e}"))
            else:
                items = json.load(f)
                if not isinstance(items, list):
                    raise UserError(f"llava_source.json_path={json_path!r}: expected a list "
                                    f"of records")
                raw = [((json_path, "record", k), r, None) for k, r in enumerate(items)]
    except (ValueError, UnicodeDecodeError) as e:
        if isinstance(e, UserError):
            raise
        raise UserError(f"llava_source.json_path={json_path!r}: not valid JSON ({e}); fix "
                        f"the file, or write it as JSONL (one record a line: a bad line is "
                        f"skipped)") from None
    audio_root = image_root if audio_root is None else audio_root
    records = []
    for k, (where, r, problem) in enumerate(raw):
        label = f"{where[0]} {where[1]} {where[2]}"
        rec: dict[str, Any] = {"id": str(r.get("id", k)) if isinstance(r, dict) else f"{where[1]}-{where[2]}",
               "images": [], "audio": [], "conversations": None, "output_image": None,
               "where": list(where)}
        try:
            if problem is None and not isinstance(r, dict):
                raise UserError(f"{label}: a record must be an object with id/conversations")
            if problem is None:
                rec.update(images=_paths(r.get("image"), image_root, "image", label),
                           audio=_paths(r.get("audio"), audio_root, "audio", label),
                           conversations=r.get("conversations"),
                           output_image=_output(r.get("output_image"), image_root, label))
        except (UserError, ValueError) as e:
            problem = f"record: {e}"
        if problem is not None:
            rec["problem"] = problem
        records.append(rec)
    return records


class LlavaSource(ChatRecordSource):
    """`read_llava` records; index cached at `<json_path>.mmjax_index.json`."""

    missing_hint: str  # set by the builders in sources/__init__.py; read with getattr

    def __init__(self, json_path: str, tokenizer, image_processor, audio_processor,
                 image_root: str = "", audio_root: str | None = None,
                 chat_template: str | None = None, loss_on: str = "assistant",
                 index_workers: int = 8, output_images=None, max_tokens: int | None = None):
        records = read_llava(json_path, image_root, audio_root)
        data_key = (file_digest(json_path), os.path.abspath(image_root or "."),
                    os.path.abspath(audio_root or image_root or "."),
                    type(image_processor).__name__)
        super().__init__(records, tokenizer, chat_template, loss_on, image_processor,
                         audio_processor, json_path + ".mmjax_index.json", data_key,
                         index_workers, output_images, max_tokens)
