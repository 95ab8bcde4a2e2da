"""Global batches from any loader source for the single-program trainer (no JAX).

Batch k holds the next `global_batch` usable samples of a seeded per-epoch shuffle (grain's
`index_shuffle`); a sample is skipped, and named with its reason, when its source reports a
problem (missing image, placeholder mismatch), its shapes do not fit the layout (too long),
or it fails to decode. A background thread prepares `prefetch` batches ahead, so decoding
overlaps the training step; inside it, `workers` threads decode the candidates of a batch
side by side (Pillow's decoding and resizing release the GIL), in a fixed order, so the
batch is the same for any worker count. The state (next position, high-water shapes) is that of the
last batch handed out, so a resumed run sees exactly the same batches.
"""
from __future__ import annotations

from typing import Any

import queue
import threading

from mmjax.data.layout import AssemblyLayout, check_sample, check_shapes
from mmjax.data.batch_shapes import BatchShapes, batch_shapes
from mmjax.data.assemble import assemble
from mmjax.data.records import DecodeError, sample_name, sample_where, source_problem


class SourceBatches:
    def __init__(self, source, layout: AssemblyLayout, global_batch: int, seed: int = 0,
                 shuffle: bool = True, prefetch: int = 2, grow_shapes=None, workers: int = 4):
        self.source, self.layout, self.global_batch = source, layout, global_batch
        self.seed, self.shuffle, self.prefetch = seed, shuffle, prefetch
        # grow_shapes(previous shapes, metas) -> shapes (the trainer's high-water rule);
        # default: each batch's own shapes
        self.grow_shapes = grow_shapes or (lambda _, metas: batch_shapes([metas], layout))
        self.position = 0
        self.shapes: BatchShapes | None = None
        self.workers = max(1, int(workers))
        self._thread = None

    def state(self) -> dict:
        hw = None if self.shapes is None else self.shapes.to_json()
        return {"position": self.position, "shapes": hw}

    def restore(self, state: dict) -> None:
        self.close()
        self.position = int(state["position"])
        hw = state.get("shapes")
        self.shapes = None if hw is None else BatchShapes.from_json(hw)

    def index_at(self, position: int) -> int:
        from grain.experimental import index_shuffle

        n = len(self.source)
        epoch, i = divmod(position, n)
        if self.shuffle:
            i = index_shuffle(index=i, max_index=n - 1,
                              seed=(self.seed * 1_000_003 + epoch) % (1 << 32), rounds=4)
        return int(i)

    def _usable(self, i: int):
        """(sample, None) or (None, reason)."""
        spec = self.source.spec(i)
        why = source_problem(self.source, i) or check_shapes(spec, self.layout)
        if why:
            return None, why
        try:
            s = self.source.load(i)
        except DecodeError as e:
            return None, str(e)
        why = check_sample(s, self.layout)
        if why is None and self.layout.rules.meta(s) != self.layout.rules.meta_from_shapes(i, spec):
            why = "decode: decoded shapes differ from the index"
        return (None, why) if why else (s, None)

    def _make(self, position: int, shapes):
        """(batch, skipped, next position, new shapes) of the batch starting at position."""
        samples: list[Any] = []
        skipped: list[Any] = []
        tried = 0
        limit = max(4 * self.global_batch, len(self.source))
        while len(samples) < self.global_batch:
            if tried >= limit:
                raise ValueError(f"{tried} samples in a row are unusable (e.g. "
                                 f"{skipped[-1][1]}); see skipped.jsonl and fix the data")
            need = self.global_batch - len(samples)
            idx = [self.index_at(p) for p in range(position, position + need)]
            position, tried = position + need, tried + need
            for i, (s, why) in zip(idx, self._pool.map(self._usable, idx)):
                if s is None:
                    skipped.append((sample_name(self.source, i), why,
                                    sample_where(self.source, i)))
                else:
                    samples.append(s)
        metas = [self.layout.rules.meta(s) for s in samples]
        shapes = self.grow_shapes(shapes, metas)
        batch = assemble(samples, self.layout, shapes=shapes)
        return batch, skipped, position, shapes

    def _produce(self, q: queue.Queue, stop: threading.Event, position: int, shapes) -> None:
        try:
            while not stop.is_set():
                item = self._make(position, shapes)
                position, shapes = item[2], item[3]
                while not stop.is_set():
                    try:
                        q.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except Exception as e:  # surfaced to the consumer
            q.put(e)

    def __next__(self):
        """(batch, skipped [(name, reason, where)])."""
        if self._thread is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(self.workers)
            self._queue, self._stop = queue.Queue(self.prefetch), threading.Event()
            self._thread = threading.Thread(target=self._produce, daemon=True, args=(
                self._queue, self._stop, self.position, self.shapes))
            self._thread.start()
        item = self._queue.get()
        if isinstance(item, Exception):
            self.close()
            raise item
        batch, skipped, self.position, self.shapes = item
        return batch, skipped

    def close(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._pool.shutdown()
            self._thread = None
