"""The sample stream (no JAX, no plan): which samples global batch k holds, decoded, and
where a run stands in the stream.

Step 1 of data/loader.py's docstring: positions [start(k), start(k) + W) of the seeded
per-epoch shuffle, W = global_batch + reserve (data/stream_position.py), bad samples skipped
and counted, replacements drawn when the window runs short, `row_budget` filling rows
instead of counting samples. Every layout draws the same samples at step k: the single
program assembles them as one batch, the co-located layout in its phases, a plan's
`GlobalBatchBuilder` (data/global_batch.py) splits them over its ranks. The stream also
delivers what a consumer makes of each step (`deliver`: grain threads, worker processes or
producer processes) and states its position in the one resume schema (`state` / `resume`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mmjax.data.layout import AssemblyLayout, check_sample
from mmjax.data.loader_settings import StreamSettings
from mmjax.data.records import DecodeError, as_source
from mmjax.data.row_budget import fill_rows
from mmjax.data.sample import FIRST_TEXT_ID, Sample, Segment
from mmjax.data.selection import Draws, pick, stream_indices
from mmjax.data.skipped import Skipped

from mmjax.data.stream_position import StreamOrigin, position_fields, resumed_origin
from mmjax.data.synthetic import Spec
from mmjax.data.spec_list import SpecList, meta_columns_of
from mmjax.errors import UserError

# global batches whose shapes a run scans at start-up by default (metadata only), however
# long the run: the programs' shapes do not depend on train.steps, so runs of any length
# share the compilation cache. At most SHAPE_SCAN_SAMPLES samples (fewer batches for a
# large global batch), so the scan takes about a second whatever the batch.
SHAPE_SCAN_STEPS = 64
SHAPE_SCAN_SAMPLES = 4096
REPLACEMENTS = 16  # a short batch draws up to this many windows of replacements


def default_scan_steps(global_batch: int) -> int:
    """Global batches scanned for the shape floor by default (not the run's length)."""
    return max(1, min(SHAPE_SCAN_STEPS, SHAPE_SCAN_SAMPLES // max(global_batch, 1)))


def blank_sample(spec: Spec, sample_id: int) -> Sample:
    """A sample of `spec`'s shapes that trains nothing (fully masked text)."""
    segs = []
    for mod, shape, k, *_ in spec:
        if mod == "text":
            segs.append(Segment("text", np.full(shape, FIRST_TEXT_ID, np.int32),
                                loss_mask=np.zeros(shape, bool)))
        else:
            segs.append(Segment(mod, np.zeros(shape, np.float32), k))
    return Sample(sample_id, tuple(segs))


@dataclass
class GlobalSamples:
    """One global batch as samples (`SampleStream.samples`), before any planning."""
    step: int
    sample_ids: list[int]
    samples: list[Sample]  # decode failures blanked (fully masked), ids in `failed`
    failed: set[int]
    skipped_samples: int
    skipped: list[Skipped]


def _init_worker(worker_index: int, worker_count: int) -> None:
    from absl import flags
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


class SampleStream:
    """step -> the step's samples; a pure function of (source, seed, step, origin),
    picklable for workers. `microbatches`: with a `row_budget`, a step's sample count is a
    multiple of it (the plan's microbatch count; 1 for one program)."""

    def __init__(self, source, layout: AssemblyLayout, global_batch: int,
                 settings: StreamSettings | None = None, microbatches: int = 1):
        source = as_source(source)
        rules = layout.rules
        if getattr(source, "patch_size", rules.patch_size) != rules.patch_size:
            raise UserError(f"Loader.source: the dataset was written with patch_size="
                            f"{source.patch_size} but the model's is {rules.patch_size}; "
                            f"rewrite it with scripts/make_dataset.py --patch_size="
                            f"{rules.patch_size}")
        self.source, self.layout = source, layout
        self.settings = settings = settings or StreamSettings()
        self.global_batch, self.microbatches = global_batch, microbatches
        self.reserve = (max(2, global_batch // 4) if settings.reserve is None
                        else settings.reserve)
        self.window = global_batch + self.reserve
        self.origin = StreamOrigin()  # (0, 0) fresh; the stored sample on resume
        self.scan_steps = (default_scan_steps(global_batch)
                           if settings.shape_scan_steps is None else settings.shape_scan_steps)

    @classmethod
    def from_gin(cls, source, layout: AssemblyLayout, global_batch: int,
                 microbatches: int = 1, **given) -> "SampleStream":
        """The stream of gin's `Loader.*` settings, `given` over them."""
        from mmjax.data.loader_settings import loader_settings

        return cls(source, layout, global_batch, loader_settings(**given)[0], microbatches)

    # ---- position and resume ----------------------------------------------------------
    def start(self, step: int) -> int:
        """Stream position of global batch `step`'s first candidate."""
        return self.origin.start(step, self.window)

    def state(self, step: int) -> dict:
        """The resume schema's stream part for next global batch `step`: the step, its
        first stream sample and the settings that drew the windows."""
        return {"step": step, "sample": self.start(step), "global_batch": self.global_batch,
                "seq_len": self.layout.seq_len}

    def resume(self, state: dict) -> int:
        """Go on from `state` (the resume schema, data/stream_position.py `stream_state`)
        at its stored sample (a state without one: the windows of a fresh run). -> the
        next global batch."""
        step = int(state["step"])
        self.origin = resumed_origin(position_fields(state), step)
        return step

    # ---- selection --------------------------------------------------------------------
    def _index(self, pos: int, salt: int = 0) -> int:
        """Dataset index at stream position `pos`: epoch e is a seeded permutation (grain's
        Feistel `index_shuffle`, O(1) per index, no table); `salt` picks another stream
        (data/selection.py `stream_indices`, which `select` runs on whole windows)."""
        return int(stream_indices(np.array([pos]), len(self.source), self.settings.seed,
                                  self.settings.shuffle, salt)[0])

    def candidates(self, step: int) -> list[int]:
        """Dataset indices at positions [start, start + W) of the stream."""
        return self.draws(step).indices(0, self.window).tolist()

    def draws(self, step: int, start: int | None = None) -> Draws:
        """The step's candidates (data/selection.py): its window, then replacements from a
        second seeded stream at the step's own positions, at most `REPLACEMENTS` windows'
        worth (or the data set): a pure function of (seed, window start), so a restart
        draws the same ones."""
        return Draws(len(self.source), self.settings.seed, self.settings.shuffle,
                     self.start(step) if start is None else start, self.window, REPLACEMENTS)

    def select(self, step: int, skipped: list | None = None, start: int | None = None):
        """(indices, specs, skip reasons) of the first `global_batch` usable candidates; a
        `Skipped` record of each skipped one is appended to `skipped`. Short of usable
        samples, replacements are drawn (`draws`); a sample is used at most once per
        batch. `start`: the window's first position (default `self.start(step)`). With a
        `row_budget`: the window's usable candidates that pack into it (data/row_budget.py),
        a multiple of `microbatches` of them."""
        mbs, budget = self.microbatches, self.settings.row_budget
        need = self.global_batch if budget is None else mbs
        idx, cols, reasons, drawn = pick(self.source, self.layout, self.draws(step, start),
                                         need, budget is not None, skipped)
        if budget is not None:  # the usable candidates that fill the rows; equal microbatches
            lens = cols.meta_columns(idx, self.layout.rules).llm_length.tolist()
            keep = fill_rows(lens, budget, self.layout.seq_len)
            keep = keep[:len(keep) - len(keep) % mbs]
            if len(keep) < need <= len(idx):
                raise UserError(f"Loader.row_budget={budget}: global batch {step} packs only "
                                f"{len(keep)} samples into {budget} rows of "
                                f"{self.layout.seq_len} tokens, fewer than the {mbs} "
                                f"microbatches (raise it, e.g. to {4 * budget})")
            idx, cols = [idx[k] for k in keep], cols.take(np.asarray(keep, np.int64))
        if len(idx) < need:
            raise self._short(step, idx, drawn, reasons)
        return idx, SpecList(cols), reasons

    def _short(self, step: int, idx: list, drawn: int, reasons: dict) -> UserError:
        hint = getattr(self.source, "missing_hint", None)
        if hint and reasons.get("missing", 0) * 2 >= sum(reasons.values()):
            return UserError(f"global batch {step}: only {len(idx)} of {drawn} samples "
                             f"drawn are usable ({reasons}): {hint}")
        return UserError(f"global batch {step}: only {len(idx)} of {drawn} samples "
                         f"drawn are usable ({reasons}; data set of {len(self.source)}); "
                         f"see skipped.jsonl and fix the data (or the settings that reject "
                         f"them, e.g. data_layout.seq_len)")

    def scan(self, steps: int):
        """(indices, specs, metadata columns) of each global batch 0 .. steps-1 from the
        samples' shapes alone (nothing decoded), skipping a step with too few usable
        samples. Always from step 0 (a fresh run's windows, whatever the origin), so a
        resumed run pads exactly as the uninterrupted one did. Every layout's shape floor
        folds over this one scan."""
        for step in range(steps):
            try:
                idx, specs, _ = self.select(step, start=step * self.window)
            except UserError:
                continue
            yield idx, specs, meta_columns_of(idx, specs, self.layout.rules)

    # ---- decoding ---------------------------------------------------------------------
    def sample_getter(self, idx, specs, metas, skipped: list, failed: set,
                      failed_at: dict | None = None):
        """position -> its sample, loaded once; a sample that fails to decode (or decodes to
        other shapes than its index says) is recorded in `skipped` (and `failed_at[p]`),
        its id added to `failed`, and replaced by a blank of its shapes."""
        loaded: dict[int, Sample] = {}
        load_parts = getattr(self.source, "load_parts", None)

        def get(p, modalities=None):
            if p not in loaded:
                try:
                    s = (self.source.load(idx[p]) if modalities is None or load_parts is None
                         else load_parts(idx[p], modalities))
                    bad = check_sample(s, self.layout)
                    if bad or self.layout.rules.meta(s) != metas[p]:
                        raise DecodeError(bad or "decoded shapes differ from the index")
                except DecodeError as e:
                    skipped.append(Skipped.of(self.source, idx[p], str(e)))
                    if failed_at is not None:
                        failed_at[p] = skipped[-1]
                    s = blank_sample(specs[p], idx[p])
                    failed.add(idx[p])
                loaded[p] = s
            return loaded[p]
        return get

    def samples(self, step: int) -> GlobalSamples:
        """Global batch `step` as its samples, in global batch order (the single program's
        and the co-located layout's data: the same samples, skips and blanks as every
        plan's)."""
        skipped: list[Skipped] = []
        idx, specs, reasons = self.select(int(step), skipped)
        metas = meta_columns_of(idx, specs, self.layout.rules)
        failed: set[int] = set()
        get = self.sample_getter(idx, specs, metas, skipped, failed)
        samples = [get(p) for p in range(len(idx))]
        if failed:
            reasons["decode"] = reasons.get("decode", 0) + len(failed)
        return GlobalSamples(int(step), idx, samples, failed, sum(reasons.values()), skipped)

    # ---- delivery ---------------------------------------------------------------------
    def deliver(self, fn, step: int):
        """Iterator of fn(s) for s = step, step + 1, ...: from producer processes when the
        settings name them (DistTrain §4.2, data/producer_pool.py), else grain (worker
        processes, or a prefetch thread). `fn`: `samples`, or a planner of them."""
        st = self.settings
        if st.delivered_by_producers:
            from mmjax.data.producer_pool import ProducerPool
            return ProducerPool(fn, step, st.num_steps, st.producers,
                                st.producer_addresses or (), st.prefetch, st.producer_timeout,
                                st.producer_cpus or ())
        import grain
        ds = grain.MapDataset.range(step, st.num_steps).map(fn)
        it_ds = ds.to_iter_dataset(grain.ReadOptions(
            num_threads=1 if st.num_workers == 0 else 0, prefetch_buffer_size=st.prefetch))
        if st.num_workers > 0:
            _init_worker(0, 1)
            it_ds = it_ds.mp_prefetch(grain.MultiprocessingOptions(
                num_workers=st.num_workers, per_worker_buffer_size=st.prefetch),
                worker_init_fn=_init_worker)
        return iter(it_ds)
