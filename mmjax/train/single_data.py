"""The single-program trainer's global batches, drawn from the run's sample stream.

Global batch k holds exactly the samples every plan trains at step k (the seeded selection,
skips and decode blanks of `SampleStream.samples`, data/sample_stream.py; no plan),
assembled as one batch,
so `train.py` and `train.py --plan=...` give the same loss curve up to float reassociation.
All `Loader.*` gin settings that choose samples (seed, shuffle, reserve, row_budget) apply
to both paths; those that place them (balance, workers, node-wise) only change where a plan
computes them. Shapes start at the high-water shapes of the first `Loader.shape_scan_steps`
global batches (planned from metadata at start-up) and only grow (`grow`: the trainer's
high-water rule), so jit compiles once in a usual run; a grain thread decodes the next
batches during the step.
"""
from __future__ import annotations

from mmjax.data.assemble import assemble
from mmjax.data.batch_shapes import BatchShapes
from mmjax.data.global_batch import mask_out_failed
from mmjax.data.sample_stream import SampleStream
from mmjax.data.stream_position import settings_changed
from mmjax.train.loader_stream import LoaderStream


class LoaderBatches(LoaderStream):
    """Iterator of (Batch, skipped [`Skipped`]) over the run's `SampleStream`; `state` /
    `restore` resume exactly (the one resume schema). `grow(shapes, metas)`: the trainer's
    high-water rule; `scan_steps`: global batches scanned for the shape floor (default the
    stream's `Loader.shape_scan_steps`)."""

    def __init__(self, stream: SampleStream, grow, scan_steps: int | None = None):
        self.stream, self.layout, self.grow = stream, stream.layout, grow
        self.next_batch = 0
        self.max_bad_fraction = stream.settings.max_bad_fraction
        # the high-water shapes of the first `scan_steps` global batches, from their
        # metadata: one compile up front instead of one per new shape met later
        scan = stream.scan_steps if scan_steps is None else scan_steps
        self.floor = self._scan(scan)  # not the run's length: shapes independent of it
        self.shapes: BatchShapes | None = self.floor
        self._it = None

    @classmethod
    def from_gin(cls, source, layout, global_batch: int, grow, scan_steps: int | None = None,
                 **given) -> "LoaderBatches":
        """Over a stream of gin's `Loader.*` settings, `given` over them (evaluation:
        `shuffle=False`)."""
        return cls(SampleStream.from_gin(source, layout, global_batch, **given), grow,
                   scan_steps)

    def _scan(self, steps: int) -> BatchShapes | None:
        """Shapes grown over global batches 0 .. steps-1 (`SampleStream.scan`)."""
        shapes = None
        for _, _, metas in self.stream.scan(steps):
            shapes = self.grow(shapes, metas)
        return shapes

    def state(self) -> dict:
        """The resume schema (data/stream_position.py) with the high-water shapes: a
        resumed run pads exactly as the uninterrupted one (other shapes compile other
        programs, whose float sums associate differently), so resume is bit-exact."""
        return {**self.stream.state(self.next_batch),
                "shapes": None if self.shapes is None else self.shapes.to_json()}

    def restore(self, state: dict) -> None:
        """Go on from `state` (the resume schema) at its stored sample; its high-water
        shapes only when they were reached with this global batch and sequence length
        (else this run's scanned floor)."""
        self.close()
        self.next_batch = self.stream.resume(state)
        hw = None if settings_changed(state, self.stream.global_batch,
                                      self.layout.seq_len) else state.get("shapes")
        self.shapes = self.floor if hw is None else BatchShapes.from_json(hw)

    def __next__(self):
        if self._it is None:  # grain's prefetch thread, or producer processes
            self._it = self.stream.deliver(self.stream.samples, self.next_batch)
        gs = next(self._it)
        metas = [self.layout.rules.meta(s) for s in gs.samples]
        self.shapes = self.grow(self.shapes, metas)
        batch = assemble(gs.samples, self.layout, shapes=self.shapes)
        if gs.failed:
            mask_out_failed(batch, gs.samples, gs.failed)
        self.next_batch = gs.step + 1
        return batch, list(gs.skipped)
