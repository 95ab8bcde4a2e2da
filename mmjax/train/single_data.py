"""The single-program trainer's global batches, drawn by the pipeline path's loader.

Global batch k holds exactly the samples every plan trains at step k (`Loader`'s seeded
selection, skips and decode blanks: `GlobalBatchBuilder.samples`), assembled as one batch,
so `train.py` and `train.py --plan=...` give the same loss curve up to float reassociation.
All `Loader.*` gin settings that choose samples (seed, shuffle, reserve, row_budget) apply
to both paths; those that place them (balance, workers, node-wise) only change where a plan
computes them. Shapes start at the high-water shapes of the first `Loader.shape_scan_steps`
global batches (planned from metadata at start-up) and only grow (`grow`: the trainer's
high-water rule), so jit compiles once in a usual run; a grain thread decodes the next
batches during the step.
"""
from __future__ import annotations

from mmjax.data.batch_shapes import BatchShapes
from mmjax.data.assemble import assemble
from mmjax.data.loader import Loader
from mmjax.data.global_batch import mask_out_failed
from mmjax.data.stream_position import settings_changed
from mmjax.planner.plan import Plan
from mmjax.train.loader_stream import LoaderStream


class LoaderBatches(LoaderStream):
    """Iterator of (Batch, skipped [(name, reason, where)]); `state` / `restore` resume
    exactly."""

    def __init__(self, source, cfg, layout, global_batch: int, grow, prefetch: int = 2,
                 shuffle: bool | None = None, scan_steps: int | None = None):
        # a one-device plan: the loader's selection depends on global_batch only;
        # `shuffle` None keeps the gin setting (evaluation passes False)
        plan = Plan.uniform(cfg, global_batch, 1)
        kw = {} if shuffle is None else {"shuffle": shuffle}
        self.loader = Loader(source, cfg, plan, layout, **kw)  # gin: Loader.seed, .shuffle
        self.builder, self.layout, self.grow, self.prefetch = (
            self.loader.builder, layout, grow, prefetch)
        self.next_batch = 0
        # the high-water shapes of the first `scan_steps` (default `Loader.shape_scan_steps`)
        # global batches, from their metadata: one compile up front instead of one per new
        # shape met later
        scan = self.loader.shape_scan_steps if scan_steps is None else scan_steps
        self.floor = self._scan(scan)  # not the run's length: shapes independent of it
        self.shapes: BatchShapes | None = self.floor
        self._it = None

    def _scan(self, steps: int) -> BatchShapes | None:
        """Shapes grown over global batches 0 .. steps-1 (`GlobalBatchBuilder.scan`)."""
        shapes = None
        for _, _, metas in self.builder.scan(steps):
            shapes = self.grow(shapes, metas)
        return shapes

    def state(self) -> dict:
        """Next global batch and the high-water shapes: a resumed run pads exactly as the
        uninterrupted one (other shapes compile other programs, whose float sums associate
        differently), so resume is bit-exact."""
        hw = None if self.shapes is None else {
            "rows": self.shapes.rows, "gen": self.shapes.gen,
            "encoders": [list(e) for e in self.shapes.encoders]}
        return {"next_batch": self.next_batch, "shapes": hw,
                **self.builder.position(self.next_batch)}

    def restore(self, state: dict) -> None:
        """Go on from `state` at its stored sample (data/stream_position.py); its
        high-water shapes only when they were reached with this global batch and sequence
        length (else this run's scanned floor)."""
        self.close()
        self.next_batch = int(state["next_batch"])
        self.builder.resume(state, self.next_batch)
        hw = None if settings_changed(state, self.builder.plan.global_batch,
                                      self.layout.seq_len) else state.get("shapes")
        self.shapes = self.floor if hw is None else BatchShapes(
            int(hw["rows"]), tuple((str(n), int(c), int(k)) for n, c, k in hw["encoders"]),
            int(hw["gen"]))

    def __next__(self):
        if self._it is None and (self.loader.producers or self.loader.producer_addresses):
            # producer processes build the samples (DistTrain §4.2), as for a plan
            self._it = self.loader.stream(self.builder.samples, self.next_batch)
        if self._it is None:
            import grain

            ds = grain.MapDataset.range(self.next_batch, 1 << 31).map(self.builder.samples)
            self._it = iter(ds.to_iter_dataset(grain.ReadOptions(
                num_threads=1, prefetch_buffer_size=self.prefetch)))
        gs = next(self._it)
        metas = [self.layout.rules.meta(s) for s in gs.samples]
        self.shapes = self.grow(self.shapes, metas)
        batch = assemble(gs.samples, self.layout, shapes=self.shapes)
        if gs.failed:
            mask_out_failed(batch, gs.samples, gs.failed)
        self.next_batch = gs.step + 1
        return batch, list(gs.skipped)
