"""Dataset records and sources (no JAX): the ArrayRecord codec (byte-level text for the
synthetic set, images at the packed ViT's native-aspect size), `ArrayRecordSource` with its
shape index, `SyntheticSource`, and `loader_source` (gin: which file a run reads)."""
from __future__ import annotations

import json
import os
import struct
from functools import cached_property

import gin
import numpy as np

from mmjax.data.sample import FIRST_TEXT_ID, Sample, Segment
from mmjax.data.spec_columns import SpecTable
from mmjax.data.synthetic import Spec, SyntheticDataset
from mmjax.errors import UserError, one_line


class DecodeError(ValueError):
    """A record whose bytes cannot be turned into a Sample."""


# ---------------------------------------------------------------------------------------
# Sources: shapes cheaply (`spec`), arrays expensively (`load`)
# ---------------------------------------------------------------------------------------

class SyntheticSource:
    """A `SyntheticDataset` as a loader source."""

    def __init__(self, dataset: SyntheticDataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def spec(self, index: int) -> Spec:
        return self.dataset.spec(index)

    def specs(self, indices: np.ndarray) -> list[Spec]:
        return self.dataset.specs(indices)

    def load(self, index: int) -> Sample:
        return self.dataset[index]


def tokenize_bytes(raw: bytes) -> np.ndarray:
    """Byte-level tokeniser (ByT5-style): token id = FIRST_TEXT_ID + byte value, so every
    string tokenises without a vocabulary file (needs vocab_size >= FIRST_TEXT_ID + 256)."""
    return FIRST_TEXT_ID + np.frombuffer(raw, np.uint8).astype(np.int32)


def encode_record(sample: Sample, raw_text: bool = False) -> bytes:
    """Sample -> bytes: 4-byte header length, JSON header, raw arrays. Images are stored
    as uint8 pixels (what a real dataset holds). With `raw_text`, text is stored as bytes
    (one byte per token id, (id - FIRST_TEXT_ID) mod 256) and tokenised by the worker with
    `tokenize_bytes`; otherwise as int32 token ids."""
    segs, payload = [], []
    for s in sample.segments:
        data, dtype = s.data, None
        if s.modality == "image":
            data = np.clip(np.rint(data * 255.0), 0, 255).astype(np.uint8)
        if s.modality == "text" and raw_text:
            data, dtype = ((s.data - FIRST_TEXT_ID) % 256).astype(np.uint8), "bytes"
        raw = np.ascontiguousarray(data).tobytes()
        segs.append({"modality": s.modality, "shape": list(data.shape),
                     "dtype": dtype or str(data.dtype), "num_queries": s.num_queries,
                     "nbytes": len(raw)})
        payload.append(raw)
    head = json.dumps({"id": int(sample.id), "segments": segs}).encode()
    return struct.pack("<I", len(head)) + head + b"".join(payload)


def decoded_image_shape(h: int, w: int, patch_size: int, max_grid: int) -> tuple[int, int, int]:
    """Resize rule: each side to the nearest multiple of the patch size, 1..max_grid patches."""
    fit = lambda x: int(np.clip(round(x / patch_size), 1, max_grid)) * patch_size
    return (fit(h), fit(w), 3)


def _resize_nearest(img: np.ndarray, h: int, w: int) -> np.ndarray:
    rows = (np.arange(h) * img.shape[0] // h).clip(0, img.shape[0] - 1)
    cols = (np.arange(w) * img.shape[1] // w).clip(0, img.shape[1] - 1)
    return img[rows][:, cols]


def decode_record(raw: bytes, patch_size: int, max_grid: int) -> Sample:
    """bytes -> Sample: parse, tokenise raw text, uint8 pixels -> float32 in [0, 1], resize
    to whole patches. Raises DecodeError on truncated or malformed records."""
    try:
        (n,) = struct.unpack_from("<I", raw, 0)
        head = json.loads(raw[4:4 + n])
        off, segs = 4 + n, []
        for s in head["segments"]:
            nb = int(s["nbytes"])
            if off + nb > len(raw):
                raise DecodeError(f"record {head.get('id')}: payload truncated")
            if s["dtype"] == "bytes":
                data = tokenize_bytes(raw[off:off + nb])
            else:
                dt = np.dtype(s["dtype"])
                data = np.frombuffer(raw, dtype=dt, count=nb // dt.itemsize,
                                     offset=off).reshape(s["shape"])
            off += nb
            if s["modality"] == "image":
                data = data.astype(np.float32) / 255.0
                h, w, _ = decoded_image_shape(data.shape[0], data.shape[1], patch_size,
                                              max_grid)
                if data.shape[:2] != (h, w):
                    data = _resize_nearest(data, h, w)
            segs.append(Segment(s["modality"], np.array(data), int(s["num_queries"])))
        return Sample(int(head["id"]), tuple(segs))
    except DecodeError:
        raise
    except Exception as e:  # noqa: BLE001 (untrusted bytes: any failure means undecodable)
        raise DecodeError(f"cannot decode record: {one_line(e, 160)}") from None


class ArrayRecordSource:
    """Records written by `scripts/make_dataset.py`: `<path>` (ArrayRecord, one encoded
    sample per record) and `<path>.index.json` (per record the decoded shapes, so planning
    reads no pixels). A file that cannot be opened is a UserError naming it (before any
    training); a record that cannot be read (Riegeli chunk checksum, I/O error) or decoded
    is a DecodeError naming the file and record index, which the loader skips, counts and
    names in skipped.jsonl; its reason starts with its kind ("unreadable:" / "decode:"), so
    the run's summary counts damaged records together, whatever their number."""

    def __init__(self, path: str):
        import grain
        try:
            with open(path + ".index.json") as f:
                index = json.load(f)
            self.patch_size, self.max_grid = int(index["patch_size"]), int(index["max_grid"])
            self.specs = [[(m, tuple(s), int(k)) for m, s, k in spec]
                          for spec in index["specs"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UserError(f"{path}.index.json: unreadable index ({one_line(e, 120)}); "
                            f"rewrite the dataset with scripts/make_dataset.py") from None
        try:
            self.records = grain.sources.ArrayRecordDataSource([path])
            n = len(self.records)
        except Exception as e:  # noqa: BLE001 (array_record raises RuntimeError, OSError...)
            raise UserError(f"{path}: cannot open the ArrayRecord file ({one_line(e, 120)}); "
                            f"rewrite it with scripts/make_dataset.py") from None
        if n != len(self.specs):
            raise UserError(f"{path}: {n} records but the index lists "
                            f"{len(self.specs)}; rewrite it with scripts/make_dataset.py")
        self.path = path

    def __len__(self) -> int:
        return len(self.specs)

    def spec(self, index: int) -> Spec:
        return self.specs[index]

    def spec_table(self) -> SpecTable:
        """The index as columns (data/spec_columns.py), built on first use."""
        return self._table

    @cached_property
    def _table(self) -> SpecTable:
        return SpecTable.from_specs(self.specs)

    def name(self, index: int) -> str:
        """The record's name in skip reports: file and record index."""
        return f"{self.path}:{index}"

    def load(self, index: int) -> Sample:
        try:
            raw = self.records[index]
        except Exception as e:  # noqa: BLE001 (Riegeli checksum RuntimeError, OSError...)
            raise DecodeError(f"unreadable: {self.path} record {index} "
                              f"({one_line(e, 160)})") from None
        try:
            return decode_record(raw, self.patch_size, self.max_grid)
        except DecodeError as e:
            raise DecodeError(f"decode: {self.path} record {index}: {e}") from None


def write_dataset(path: str, samples, patch_size: int, max_grid: int,
                  corrupt: frozenset[int] = frozenset(), raw_text: bool = False) -> int:
    """Write `samples` as an ArrayRecord file plus its shape index; records whose id is in
    `corrupt` are truncated (to exercise the loader's decode-failure path); `raw_text`
    stores text as bytes for the worker to tokenise. Returns the number of records."""
    from array_record.python.array_record_module import ArrayRecordWriter
    writer = ArrayRecordWriter(path, "group_size:1")
    specs = []
    try:
        for s in samples:
            raw = encode_record(s, raw_text)
            writer.write(raw[: len(raw) // 2] if s.id in corrupt else raw)
            specs.append([[m, list(sh), k] for m, sh, k in index_spec(s, patch_size, max_grid)])
    finally:
        writer.close()
    with open(path + ".index.json", "w") as f:
        json.dump({"patch_size": patch_size, "max_grid": max_grid, "specs": specs}, f)
    return len(specs)


def index_spec(sample: Sample, patch_size: int, max_grid: int) -> Spec:
    """The shapes `decode_record(encode_record(sample))` will have (for the index file)."""
    out = []
    for s in sample.segments:
        shape = tuple(s.data.shape)
        if s.modality == "image" and len(shape) == 3:
            shape = decoded_image_shape(shape[0], shape[1], patch_size, max_grid)
        out.append((s.modality, shape, s.num_queries))
    return out


def source_problem(source, index: int) -> str | None:
    """Why sample `index` is unusable, known from the source's index (e.g. a missing or
    unreadable image), or None; sources without the notion have no such problems."""
    problem = getattr(source, "problem", None)
    return problem(index) if problem is not None else None


def sample_where(source, index: int) -> tuple:
    """Where the sample is, for `skipped.jsonl`: (file, "line" | "record", number): the
    source's own `where` (a LLaVA JSONL line), else its file (`path`) and the index."""
    where = getattr(source, "where", None)
    if where is not None:
        return tuple(where(index))
    return (str(getattr(source, "path", type(source).__name__)), "record", int(index))


def sample_name(source, index: int) -> str:
    """The sample's name for `skipped.jsonl`: the source's own id (e.g. a LLaVA `id`),
    else the dataset index."""
    name = getattr(source, "name", None)
    return str(name(index)) if name is not None else str(index)


def as_source(source):
    """A loader source: an object with `__len__`, `spec`, `load`, or the path of an
    ArrayRecord file written by scripts/make_dataset.py (its index next to it)."""
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if not os.path.exists(path):
            raise UserError(f"loader_source.path={path!r}: no such file; write the dataset "
                            f"with scripts/make_dataset.py --out={path}")
        if not os.path.exists(path + ".index.json"):
            raise UserError(f"loader_source.path={path!r}: no {path}.index.json; write the "
                            f"dataset with scripts/make_dataset.py --out={path}")
        return ArrayRecordSource(path)
    if not all(hasattr(source, a) for a in ("__len__", "spec", "load")):
        raise ValueError(f"Loader.source: {type(source).__name__} is not a source (needs "
                         f"__len__, spec, load) nor an ArrayRecord path")
    return source


@gin.configurable
def loader_source(default=None, path: str | None = None):
    """The trainer's data source (gin): `loader_source.path = "/data/mix.arrayrecord"` reads
    an ArrayRecord file written by scripts/make_dataset.py; unset, `default()` (the
    trainer passes its gin-configured synthetic set)."""
    if path:
        return as_source(path)
    if default is None:
        raise ValueError("loader_source.path is unset and no default source was given")
    return default()


# ---------------------------------------------------------------------------------------
# Planning from metadata only
# ---------------------------------------------------------------------------------------
