"""One global batch (no JAX): the builder that selects a step's samples from the seeded
shuffle (skipping bad ones), plans it (data/batch_plan.py) and materialises this host's
share; what it returns (`GlobalBatch`, `Microbatch`, `GlobalSamples`). Steps 1 and 4 of
data/loader.py's docstring."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from mmjax.data.layout import AssemblyLayout, check_sample
from mmjax.data.assemble import Batch
from mmjax.data.feed import (MicrobatchFeed, gen_elements_per_image, mask_documents,
                             mask_samples, microbatch_feed)
from mmjax.data.sample import FIRST_TEXT_ID, Sample, Segment
from mmjax.data.synthetic import Spec
from mmjax.errors import UserError
from mmjax.models.config import MLLMConfig
from mmjax.planner.hardware import H100, Hardware
from mmjax.planner.plan import Plan
from mmjax.data.batch_plan import (MicrobatchPlan, NodeWise, plan_global_batch,
                                   post_balance_policies)
from mmjax.data.meta_columns import MetaColumns
from mmjax.data.records import DecodeError, sample_name, sample_where
from mmjax.data.row_budget import fill_rows
from mmjax.data.selection import Draws, pick, stream_indices
from mmjax.data.spec_columns import SpecList
from mmjax.data.stream_position import StreamOrigin, resumed_origin
from mmjax.models.units import UnitRole, is_vae, role

_READS = {UnitRole.LLM: "text", UnitRole.GENERATOR: "image_out"}  # the modality each reads


@dataclass
class Microbatch:
    """One microbatch: its plan (samples, rank splits, shapes) and its feed (data/feed.py:
    every unit's and rank's inputs and the routes between units; with several hosts the
    samples of other hosts' ranks are shape-only blanks)."""

    plan: MicrobatchPlan
    feed: MicrobatchFeed


@dataclass
class GlobalBatch:
    step: int
    sample_ids: list[int]  # dataset indices, global batch order
    microbatches: list[Microbatch]  # in execution order
    skipped_samples: int
    skip_reasons: dict[str, int]
    num_target_tokens: int  # global normaliser, from metadata
    num_gen_elements: int
    decode_failures: int = 0  # samples blanked at materialisation on this host
    plan_seconds: float = 0.0
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (sample name, reason)
    # decode failures found on this host: position -> (sample name, reason); with several
    # hosts each decodes only its ranks' samples, so hosts agree on these before the step
    # (train/host_failures.py)
    failed_at: dict[int, tuple[str, str]] = field(default_factory=dict)
    position_targets: list[int] = field(default_factory=list)  # loss targets, from metadata


@dataclass
class GlobalSamples:
    """One global batch as samples (`GlobalBatchBuilder.samples`), before any planning."""
    step: int
    sample_ids: list[int]
    samples: list[Sample]  # decode failures blanked (fully masked), ids in `failed`
    failed: set[int]
    skipped_samples: int
    skipped: list[tuple[str, str]]


def host_devices(plan: Plan, host_id: int, num_hosts: int) -> frozenset[int] | None:
    """Indices into the global device list of host `host_id`'s devices (devices split over
    hosts in contiguous blocks, as jax.devices() orders them across processes); None for
    one host (every device)."""
    if num_hosts <= 1:
        return None
    per_host = -(-plan.num_devices // num_hosts)
    return frozenset(range(host_id * per_host, (host_id + 1) * per_host))


def owned_ranks(plan: Plan, unit: str, local: frozenset[int] | None) -> list[int]:
    """DP ranks of `unit` with a device among `local` (global device indices; None: all)."""
    u = plan.unit(unit)
    if local is None:
        return list(range(u.dp))
    g = u.cp * u.tp
    stages = plan.stage_devices()[unit]
    return [d for d in range(u.dp)
            if any(x in local for idx in stages for x in idx[d * g:(d + 1) * g])]


def _blank(spec: Spec, sample_id: int) -> Sample:
    segs = []
    for mod, shape, k, *_ in spec:
        if mod == "text":  # fully masked: a blank trains nothing, on either path
            segs.append(Segment("text", np.full(shape, FIRST_TEXT_ID, np.int32),
                                loss_mask=np.zeros(shape, bool)))
        else:
            segs.append(Segment(mod, np.zeros(shape, np.float32), k))
    return Sample(sample_id, tuple(segs))


def mask_out_failed(batch: Batch, samples: list[Sample], failed: set[int]) -> None:
    """`mask_documents` on an assembled Batch: the samples whose ids are in `failed`;
    its token and generated-element counts recounted."""
    docs, images, g = [], [], 0
    for s, row_doc in zip(samples, batch.doc_index):
        n_out = sum(seg.modality == "image_out" for seg in s.segments)
        if s.id in failed:
            docs.append(row_doc)
            images.extend(range(g, g + n_out))
        g += n_out
    mask_documents(batch.loss_mask, batch.targets, batch.doc, docs,
                   None if batch.gen is None else batch.gen["gen_valid"], images)
    batch.num_target_tokens = int(batch.loss_mask.sum())
    if batch.gen is not None:
        per = batch.gen["gen_noise"].shape[1] * batch.gen["gen_noise"].shape[2]
        batch.num_gen_elements = int(batch.gen["gen_valid"].sum()) * per


REPLACEMENTS = 16  # a short batch draws up to this many windows of replacements


class GlobalBatchBuilder:
    """step -> GlobalBatch; pure function of (source, seed, step), picklable for workers."""

    def __init__(self, source, model: MLLMConfig, plan: Plan, layout: AssemblyLayout,
                 policies: dict[str, str], post_balance_policy="sum",
                 ranks_per_node: int = 0, seed: int = 0, reserve: int | None = None,
                 shuffle: bool = True, host_id: int = 0, num_hosts: int = 1,
                 cp_method: str = "lpt", cp_block: int = 128,
                 node_wise: NodeWise | None = None, hardware: Hardware = H100,
                 local_devices: frozenset[int] | None = None, row_budget: int | None = None):
        self.source, self.model, self.plan, self.layout = source, model, plan, layout
        self.cp_method, self.cp_block = cp_method, cp_block
        self.policies = policies
        self.algo = post_balance_policies(post_balance_policy, model)
        self.node_wise = node_wise or NodeWise(ranks_per_node)
        self.hardware = hardware
        self.seed, self.shuffle = seed, shuffle
        self.row_budget = row_budget  # None: `global_batch` samples a step (`select`)
        self.reserve = max(2, plan.global_batch // 4) if reserve is None else reserve
        # this host's devices (global indices): it materialises only the samples its DP
        # ranks hold; `local_devices` (the runtime's own device map) wins over the
        # contiguous-block split of `host_id` / `num_hosts`
        self.local = (frozenset(local_devices) if local_devices is not None
                      else host_devices(plan, host_id, num_hosts))
        self.owned = {u: owned_ranks(plan, u, self.local) for u in model.unit_names}
        self.floor = None  # FeedShapes every feed is padded to (`scan_floor`)
        # global batch k draws `window` stream positions from `origin.start(k, window)`
        # (data/stream_position.py): (0, 0) for a fresh run, the stored sample on resume
        self.window = plan.global_batch + self.reserve
        self.origin = StreamOrigin()

    def resume(self, state: dict, step: int) -> None:
        """Go on at global batch `step` from a loader `state`'s stored sample (a state
        without one: the windows of a fresh run, step * window)."""
        self.origin = resumed_origin(state, step)

    def position(self, step: int) -> dict:
        """The loader state's position of global batch `step` (next to be drawn): its
        first stream sample and the settings that drew the windows."""
        return {"sample": self.start(step), "global_batch": self.plan.global_batch,
                "seq_len": self.layout.seq_len}

    def start(self, step: int) -> int:
        """Stream position of global batch `step`'s first candidate."""
        return self.origin.start(step, self.window)

    def scan(self, steps: int):
        """(indices, specs, metadata columns) of each global batch 0 .. steps-1 from the
        samples' shapes alone (nothing decoded), skipping a step with too few usable samples (it
        raises if it is reached). Always from step 0, so a resumed run pads exactly as the
        uninterrupted one did (the windows of a fresh run, whatever the origin). The one
        shape scan: `scan_floor` and the single-program trainer's start-up shapes
        (train/single_data.py) fold over it."""
        for step in range(steps):
            try:
                idx, specs, _ = self.select(step, start=step * self.window)
            except UserError:
                continue
            yield idx, specs, MetaColumns.from_specs(idx, specs, self.layout.rules)

    def scan_floor(self, steps: int):
        """The union of the feed shapes of global batches 0 .. steps-1 (`scan`), built on
        blank samples."""
        self.floor, floor = None, None
        for idx, specs, metas in self.scan(steps):
            for mp in plan_global_batch(metas, self.model, self.plan, self.layout,
                                        self.policies, self.algo, node_wise=self.node_wise,
                                        hardware=self.hardware):
                feed = self._feed(mp, lambda p: _blank(specs[p], idx[p]))
                floor = feed.shapes.union(floor)
        return floor

    def _index(self, pos: int, salt: int = 0) -> int:
        """Dataset index at stream position `pos`: epoch e is a seeded permutation (grain's
        Feistel `index_shuffle`, O(1) per index, no table); `salt` picks another stream
        (data/selection.py `stream_indices`, which `select` runs on whole windows)."""
        return int(stream_indices(np.array([pos]), len(self.source), self.seed,
                                  self.shuffle, salt)[0])

    def candidates(self, step: int) -> list[int]:
        """Dataset indices at positions [start, start + W) of the stream, W = global
        batch + reserve, start = `self.start(step)` (k * W in a fresh run)."""
        return self.draws(step).indices(0, self.window).tolist()

    def draws(self, step: int, start: int | None = None) -> Draws:
        """The step's candidates (data/selection.py): its window, then replacements (when
        more than `reserve` of the window are unusable) from a second seeded stream at
        the step's own positions, at most `REPLACEMENTS` windows' worth (or the data
        set): a pure function of (seed, window start), so a restart draws the same ones.
        A batch that still runs short is a data set that is mostly bad: an error, not an
        endless search."""
        return Draws(len(self.source), self.seed, self.shuffle,
                     self.start(step) if start is None else start, self.window,
                     REPLACEMENTS)

    def select(self, step: int, skipped: list | None = None, start: int | None = None):
        """(indices, specs, skip reasons) of the first `global_batch` usable candidates;
        (sample name, reason, where) of each skipped one is appended to `skipped`. A source
        may name a sample's problem up front (`problem(i)`: a missing image, say). Short of
        usable samples in the window, replacements are drawn (`draws`); a sample is used
        at most once per batch. `start`: the window's first stream position (default
        `self.start(step)`). With a `row_budget`: the window's usable candidates that pack
        into it (data/row_budget.py), a multiple of num_microbatches of them."""
        gb, mbs = self.plan.global_batch, self.plan.num_microbatches
        budget = self.row_budget
        need = gb if budget is None else mbs
        idx, cols, reasons, drawn = pick(self.source, self.layout, self.draws(step, start), need,
                                         budget is not None, skipped)
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
            hint = getattr(self.source, "missing_hint", None)
            if hint and reasons.get("missing", 0) * 2 >= sum(reasons.values()):
                raise UserError(f"global batch {step}: only {len(idx)} of {drawn} "
                                f"samples drawn are usable ({reasons}): {hint}")
            raise UserError(f"global batch {step}: only {len(idx)} of {drawn} samples "
                            f"drawn are usable ({reasons}; data set of "
                            f"{len(self.source)}); see skipped.jsonl and fix the data (or "
                            f"the settings that reject them, e.g. data_layout.seq_len)")
        return idx, SpecList(cols), reasons

    def _feed(self, mp: MicrobatchPlan, get):
        """The microbatch as the pipeline runtime's feed, with this plan's rank assignments."""

        dp = {u.name: u.dp for u in self.plan.units}
        return microbatch_feed([get(p) for p in mp.positions], self.layout, dp, mp.splits,
                               cp=self.plan.unit("llm").cp, cp_method=self.cp_method,
                               cp_block=self.cp_block, floor=self.floor)

    def sample_getter(self, idx, specs, metas, skipped: list, failed: set,
                failed_at: dict | None = None):
        """position -> its sample, loaded once; a sample that fails to decode (or decodes to
        other shapes than its index says) is named in `skipped`, added to `failed` (and
        `failed_at[position]` = (name, reason, where)) and replaced by a blank of its shapes that
        trains nothing."""
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
                    skipped.append((sample_name(self.source, idx[p]), str(e),
                                    sample_where(self.source, idx[p])))
                    if failed_at is not None:
                        failed_at[p] = skipped[-1]
                    s = _blank(specs[p], idx[p])
                    failed.add(idx[p])
                loaded[p] = s
            return loaded[p]
        return get

    def samples(self, step: int) -> GlobalSamples:
        """Global batch `step` as its samples, in global batch order, selected and decoded
        exactly as `__call__` does (the single-program trainer's data: the same samples,
        skips and blanks as every plan's)."""
        skipped: list[tuple] = []
        idx, specs, reasons = self.select(int(step), skipped)
        metas = MetaColumns.from_specs(idx, specs, self.layout.rules)
        failed: set[int] = set()
        get = self.sample_getter(idx, specs, metas, skipped, failed)
        samples = [get(p) for p in range(len(idx))]
        if failed:
            reasons["decode"] = reasons.get("decode", 0) + len(failed)
        return GlobalSamples(int(step), idx, samples, failed, sum(reasons.values()), skipped)

    def __call__(self, step: int) -> GlobalBatch:
        t0 = time.perf_counter()
        skipped: list[tuple] = []
        idx, specs, reasons = self.select(int(step), skipped)
        metas = MetaColumns.from_specs(idx, specs, self.layout.rules)
        mb_plans = plan_global_batch(metas, self.model, self.plan, self.layout, self.policies,
                                     self.algo, node_wise=self.node_wise,
                                     hardware=self.hardware)
        t_plan = time.perf_counter() - t0
        failed: set[int] = set()
        failed_at: dict[int, tuple] = {}
        get = self.sample_getter(idx, specs, metas, skipped, failed, failed_at)

        mbs = []
        for mp in mb_plans:
            feed = self._feed(mp, self._here(mp, get, specs, idx))
            bad = [i for i, p in enumerate(mp.positions) if p in failed_at]
            if bad:
                mask_samples(feed, bad, gen_elements_per_image(self.layout))
            mbs.append(Microbatch(mp, feed))
        n_gen = int(metas.count("image_out").sum()) * gen_elements_per_image(self.layout)
        if failed:
            reasons["decode"] = reasons.get("decode", 0) + len(failed)
        targets = metas.num_targets
        return GlobalBatch(int(step), idx, mbs, sum(reasons.values()), reasons,
                           int(targets.sum()), n_gen, len(failed), t_plan,
                           skipped, failed_at, targets.tolist())

    def _here(self, mp: MicrobatchPlan, get, specs, idx):
        """`get` for the samples on this host's DP ranks, each decoded only in the
        modalities those ranks read (an encoder's its own, the LLM text, the generator its
        target images) where the source can (`load_parts`); a shape-only blank for the
        others, whose feed rows never reach a device here (`put_global` fills only this
        host's shards). A part this host skips may fail on another host: the hosts agree
        on failures before the step (train/host_failures.py) and mask them then."""
        if self.local is None:
            return get
        reads = {u: _READS.get(role(u)) for u in self.owned}
        for slot in self.layout.encoders:
            reads[slot.name] = slot.modality
        need: dict[int, set] = {}
        for u, split in mp.splits.items():
            for r in self.owned.get(u, ()):
                for i in split.rank(r).tolist():
                    need.setdefault(mp.positions[i], set()).add(reads[u])
        if any(self.owned[u] for u in self.owned if is_vae(u)):
            # the VAE unit's ranks hold blocks of the generator's rows in order: a host
            # with one of them decodes every target image of the microbatch
            for i in range(len(mp.positions)):
                need.setdefault(mp.positions[i], set()).add("image_out")
        return lambda p: (get(p, frozenset(need[p])) if p in need
                          else _blank(specs[p], idx[p]))


# ---------------------------------------------------------------------------------------
# The grain pipeline
# ---------------------------------------------------------------------------------------
