"""A source of chat records with images / audio: metadata from the sidecar index, samples
decoded on demand (no JAX). Shared by the LLaVA and WebDataset sources.

A record is JSON-able: {"id", "images": [ref], "audio": [ref], "conversations": [...]}; a
ref is a file path or ["tar", shard, offset, size] (a member of a tar shard). The index
entry of a record is {"pieces": [["text", L, num_masked] | ["image", h, w] |
["audio", num_samples] | ["image_out", h, w], ...]} in LLM order (an `output_image`, the
generator's target, last), or {"problem": "kind: why"} for a record that
cannot be used (missing or unreadable file, placeholder count mismatch, bad conversation):
the loader skips it, counts it and names it (`skipped.jsonl`).
"""
from __future__ import annotations

import io
import os
from typing import cast
from functools import cached_property

import numpy as np

from mmjax.errors import UserError
from mmjax.data.chat import ChatFormat
from mmjax.data.index import cached_index, index_key
from mmjax.data.records import DecodeError
from mmjax.data.preprocess import audio_num_samples, load_audio
from mmjax.data.sample import Sample, Segment
from mmjax.data.spec_columns import SpecTable


def open_ref(ref):
    """A binary file object for a path or a tar member ref."""
    if isinstance(ref, str):
        return open(ref, "rb")
    _, shard, offset, size = ref
    with open(shard, "rb") as f:
        f.seek(int(offset))
        data = f.read(int(size))
    if len(data) != int(size):
        raise OSError(f"{shard}: member at {offset} truncated")
    return io.BytesIO(data)


def ref_name(ref) -> str:
    return ref if isinstance(ref, str) else f"{ref[1]}@{ref[2]}"


def text_chars(conversation) -> int:
    """The characters of a conversation's turn texts (0 for a malformed one: the chat
    format reports it)."""
    if not isinstance(conversation, list):
        return 0
    return sum(len(cast(str, t.get("value", t.get("content")))) for t in conversation  # str by the filter
               if isinstance(t, dict) and isinstance(t.get("value", t.get("content")), str))


class EntryBuilder:
    """record -> index entry (picklable: index workers rebuild the chat format)."""

    def __init__(self, tokenizer, chat_template, loss_on: str, audio_rate: int,
                 max_tokens: int | None = None):
        """`max_tokens` (the run's seq_len): a record whose text cannot fit is a `too_long`
        problem, judged on its characters before it is tokenized (at most
        `max_token_chars` characters per token), then on its tokens, so a 100 MB string
        costs no more than a string at the limit."""
        self.tokenizer, self.chat_template, self.loss_on = tokenizer, chat_template, loss_on
        self.audio_rate, self.max_tokens = audio_rate, max_tokens
        self.max_chars = None
        if max_tokens is not None:
            from mmjax.data.tokenizer import PLACEHOLDERS

            per_token = max([tokenizer.max_token_chars()] + [len(p) for p in
                                                            PLACEHOLDERS.values()])
            self.max_chars = max_tokens * per_token
        self._chat: ChatFormat | None = None

    def __getstate__(self):
        return {**self.__dict__, "_chat": None}

    @property
    def chat(self) -> ChatFormat:
        if self._chat is None:
            self._chat = ChatFormat(self.tokenizer, self.chat_template, self.loss_on)
        return self._chat

    def __call__(self, rec: dict) -> dict:
        from PIL import Image

        if rec.get("problem"):  # a malformed line or record (read_llava)
            return {"problem": rec["problem"]}
        chars = text_chars(rec["conversations"])
        if self.max_chars is not None and chars > self.max_chars:
            return {"problem": f"too_long: {chars} characters of text > {self.max_chars}, "
                               f"the most seq_len {self.max_tokens} tokens can hold"}
        try:
            chat = self.chat(rec["conversations"])
        except Exception as e:  # noqa: BLE001 (a template can fail in many ways)
            return {"problem": f"chat: the template cannot render the conversation "
                               f"({type(e).__name__}: {e})"}
        tokens = sum(len(ids) if kind == "text" else 1 for kind, ids, _ in chat.pieces)
        if self.max_tokens is not None and tokens > self.max_tokens:
            return {"problem": f"too_long: {tokens} text tokens > seq_len {self.max_tokens}"}
        n_img, n_aud = chat.count("image"), chat.count("audio")
        if n_img != len(rec["images"]) or n_aud != len(rec["audio"]):
            return {"problem": f"placeholders: the conversation has {n_img} <image> and "
                               f"{n_aud} <audio> but the record lists {len(rec['images'])} "
                               f"image(s) and {len(rec['audio'])} audio file(s)"}
        sizes, lengths = [], []
        for ref in rec["images"]:
            try:
                with open_ref(ref) as f, Image.open(f) as im:  # header only
                    sizes.append((im.height, im.width))
            except FileNotFoundError:
                return {"problem": f"missing: image {ref_name(ref)} not found"}
            except Exception as e:  # PIL raises many types for unreadable headers
                return {"problem": f"unreadable: image {ref_name(ref)}: {e}"}
        for ref in rec["audio"]:
            if not isinstance(ref, str) or not os.path.isfile(ref):
                return {"problem": f"missing: audio {ref_name(ref)} not found"}
            try:
                lengths.append(audio_num_samples(ref, self.audio_rate))
            except Exception as e:  # soundfile raises RuntimeError / LibsndfileError
                return {"problem": f"unreadable: audio {ref}: {e}"}
        pieces, size_it, au = [], iter(sizes), iter(lengths)
        for kind, ids, mask in chat.pieces:
            if kind == "text":
                pieces.append(["text", len(ids), 0 if mask is None else int((~mask).sum())])
            elif kind == "image":
                pieces.append(["image", *next(size_it)])
            else:
                pieces.append(["audio", next(au)])
        out = rec.get("output_image")
        if out is not None:  # the generator's target, after the conversation
            try:
                with open_ref(out) as f, Image.open(f) as img:
                    pieces.append(["image_out", img.height, img.width])
            except FileNotFoundError:
                return {"problem": f"missing: output_image {ref_name(out)} not found"}
            except Exception as e:
                return {"problem": f"unreadable: output_image {ref_name(out)}: {e}"}
        return {"pieces": pieces}


class ChatRecordSource:
    """Loader source over chat records (`__len__`, `spec`, `load`, `problem`, `name`)."""

    def __init__(self, records: list[dict], tokenizer, chat_template, loss_on: str,
                 image_processor, audio_processor, index_path: str, data_key,
                 index_workers: int = 8, output_images=None, max_tokens: int | None = None):
        if tokenizer is None:
            raise UserError("a LLaVA / WebDataset source needs a tokenizer: set tokenizer.path "
                             "to a directory with tokenizer.json and tokenizer_config.json")
        self.records = records
        self.image_processor, self.audio_processor = image_processor, audio_processor
        self.builder = EntryBuilder(tokenizer, chat_template, loss_on,
                                    audio_processor.sampling_rate, max_tokens)
        _ = self.builder.chat  # fail fast on a bad template / loss_on, before indexing
        key = index_key(data_key, tokenizer.fingerprint(), chat_template, loss_on,
                        audio_processor.sampling_rate, 1,
                        *(() if max_tokens is None else (max_tokens,)))
        self.entries = cached_index(index_path, key, records, self.builder, index_workers,
                                    label=f"indexing {len(records)} records")
        # `output_images`: image -> generator latents [C, h, w] (train/vae_latents.py's
        # LatentEncoder: a frozen VAE on this process's CPU) or, for the model's VAE unit,
        # pixels [3, side, side], with `data_shape` and
        # `num_queries`; needed when a record names an `output_image`
        self.output_images = output_images
        n_out = sum(1 for r in records if r.get("output_image") is not None)
        if n_out and output_images is None:
            raise ValueError(f"{n_out} record(s) name an output_image (a generation target) "
                             f"but no VAE encodes them: set vae.path to a diffusers "
                             f"AutoencoderKL directory (and use a model with a generator)")

    def __len__(self) -> int:
        return len(self.records)

    def name(self, index: int) -> str:
        return str(self.records[index]["id"])

    def where(self, index: int) -> tuple:
        """(file, "line" | "record", number) of record `index` (skipped.jsonl)."""
        w = self.records[index].get("where")
        return tuple(w) if w else ("", "record", int(index))

    def problem(self, index: int) -> str | None:
        return self.entries[index].get("problem")

    def problem_free(self, indices: np.ndarray) -> np.ndarray:
        """Per index whether `problem` is None (data/selection.py)."""
        return self._problem_free[indices]

    def spec_table(self) -> SpecTable:
        """Every record's spec as columns (data/spec_columns.py), built on first use."""
        return self._table

    @cached_property
    def _problem_free(self) -> np.ndarray:
        return np.fromiter((e.get("problem") is None for e in self.entries), bool,
                           len(self.entries))

    @cached_property
    def _table(self) -> SpecTable:
        return SpecTable.from_specs([self.spec(i) for i in range(len(self))])

    def spec(self, index: int):
        out = []
        for piece in self.entries[index].get("pieces", []):
            if piece[0] == "text":
                out.append(("text", (piece[1],), 0) + ((piece[2],) if piece[2] else ()))
            elif piece[0] == "image":
                h, w = self.image_processor.output_size(piece[1], piece[2])
                out.append(("image", (h, w, 3), 0))
            elif piece[0] == "image_out":
                enc = self.output_images
                out.append(("image_out", enc.data_shape, enc.num_queries))
            else:
                frames = self.audio_processor.num_frames(piece[1], "longest")
                out.append(("audio", (frames, self.audio_processor.feature_size), 0))
        return out

    def load(self, index: int) -> Sample:
        """Decode record `index`; DecodeError (with the reason) on any bad input."""
        return self.load_parts(index, None)

    def load_parts(self, index: int, modalities) -> Sample:
        """Record `index` with only the files of `modalities` ("image", "audio", "image_out";
        None: all)
        decoded; the others are zeros of their indexed shapes, not read (a host whose
        devices hold only the LLM or another encoder of this sample, data/global_batch.py)."""
        from PIL import Image

        rec = self.records[index]
        shapes = ([] if modalities is None else
                  [sh for kind, sh, *_ in self.spec(index) if kind != "text"])
        if rec.get("problem"):
            raise DecodeError(rec["problem"])
        try:
            chat = self.builder.chat(rec["conversations"])
        except Exception as e:  # noqa: BLE001 (ChatError, jinja errors, bad turns)
            raise DecodeError(f"chat: {type(e).__name__}: {e}") from None
        images, audio = iter(rec["images"]), iter(rec["audio"])
        segs = []
        for kind, ids, mask in chat.pieces:
            if kind == "text":
                segs.append(Segment("text", ids, loss_mask=mask))
                continue
            ref = next(images if kind == "image" else audio, None)
            if ref is None:
                raise DecodeError(f"placeholders: more <{kind}> than files")
            if modalities is not None and kind not in modalities:
                k = sum(1 for sg in segs if sg.modality != "text")
                if k >= len(shapes):
                    raise DecodeError(f"placeholders: more <{kind}> than the index has")
                segs.append(Segment(kind, np.zeros(shapes[k], np.float32)))
                continue
            try:
                if kind == "image":
                    with open_ref(ref) as f, Image.open(f) as im:
                        im.load()
                        data = self.image_processor.channels_last(im)
                else:
                    wave = load_audio(ref, self.audio_processor.sampling_rate)
                    data = self.audio_processor(wave, padding="longest").T
            except Exception as e:  # PIL / soundfile raise many types on bad files
                raise DecodeError(f"decode: {kind} {ref_name(ref)}: {type(e).__name__}: {e}"
                                  ) from None
            segs.append(Segment(kind, np.ascontiguousarray(data, np.float32)))
        out = rec.get("output_image")
        if out is not None:
            enc = self.output_images
            if modalities is not None and "image_out" not in modalities:
                data = np.zeros(enc.data_shape, np.float32)
            else:
                try:
                    with open_ref(out) as f, Image.open(f) as im:
                        im.load()
                        data = enc(im)
                except Exception as e:  # PIL raises many types on bad files
                    raise DecodeError(f"decode: output_image {ref_name(out)}: "
                                      f"{type(e).__name__}: {e}") from None
            segs.append(Segment("image_out", data, num_queries=enc.num_queries))
        return Sample(int(index), tuple(segs))
