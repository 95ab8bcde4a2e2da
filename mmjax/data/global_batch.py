"""One global batch of a plan (no JAX): the builder that plans a step's samples (drawn by
data/sample_stream.py) over the plan's ranks (data/batch_plan.py) and materialises this
host's share; what it returns (`GlobalBatch`, `Microbatch`). Steps 2 and 4 of
data/loader.py's docstring."""
from __future__ import annotations

import time
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from mmjax.data.assemble import Batch
from mmjax.data.batch_plan import MicrobatchPlan, plan_global_batch
from mmjax.data.feed import (MicrobatchFeed, gen_elements_per_image, mask_documents,
                             mask_samples, microbatch_feed)
from mmjax.data.loader_settings import BalanceSettings
from mmjax.data.sample import Sample
from mmjax.data.sample_stream import SampleStream, blank_sample
from mmjax.data.skipped import Skipped
from mmjax.data.spec_list import meta_columns_of
from mmjax.models.config import MLLMConfig
from mmjax.models.units import UnitRole, is_vae, role
from mmjax.planner.hardware import hardware as hardware_by_name
from mmjax.planner.plan import Plan

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
    skipped: list[Skipped] = field(default_factory=list)
    # decode failures found on this host: position -> its record; with several
    # hosts each decodes only its ranks' samples, so hosts agree on these before the step
    # (train/host_failures.py)
    failed_at: dict[int, Skipped] = field(default_factory=dict)
    position_targets: list[int] = field(default_factory=list)  # loss targets, from metadata


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


def mask_out_failed(batch: Batch, samples: list[Sample], failed: AbstractSet[int]) -> None:
    """`mask_documents` on an assembled Batch: the samples whose ids are in `failed`;
    its token and generated-element counts recounted."""
    docs, g = [], 0
    images: list[int] = []
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


class GlobalBatchBuilder:
    """step -> GlobalBatch: one plan's batch planner over a `SampleStream` (which samples);
    picklable for workers. `local_devices`: this host's devices (global indices), whose DP
    ranks' samples it decodes (None: every device)."""

    def __init__(self, stream: SampleStream, model: MLLMConfig, plan: Plan,
                 balance: BalanceSettings | None = None,
                 local_devices: frozenset[int] | None = None):
        if (stream.global_batch, stream.microbatches) != (plan.global_batch,
                                                          plan.num_microbatches):
            raise ValueError(f"the stream draws {stream.global_batch} samples in "
                             f"{stream.microbatches} microbatches, the plan trains "
                             f"{plan.global_batch} in {plan.num_microbatches}")
        balance = balance or BalanceSettings()
        self.stream, self.model, self.plan, self.layout = stream, model, plan, stream.layout
        self.balance = balance
        self.policies = balance.policies(model, stream.layout.packing)
        self.algo = balance.algos(model)
        self.node_wise = balance.node_wise
        self.hardware = hardware_by_name(balance.hardware)
        self.local = None if local_devices is None else frozenset(local_devices)
        self.owned = {u: owned_ranks(plan, u, self.local) for u in model.unit_names}
        self.floor = None  # FeedShapes every feed is padded to (`scan_floor`)

    def scan_floor(self, steps: int):
        """The union of the feed shapes of global batches 0 .. steps-1 (`SampleStream.scan`),
        built on blank samples."""
        self.floor, floor = None, None
        for idx, specs, metas in self.stream.scan(steps):
            for mp in self.plan_microbatches(metas):
                feed = self._feed(mp, lambda p: blank_sample(specs[p], idx[p]))
                floor = feed.shapes.union(floor)
        return floor

    def plan_microbatches(self, metas) -> list[MicrobatchPlan]:
        """The global batch of `metas` planned over this plan's ranks (`plan_global_batch`)."""
        return plan_global_batch(metas, self.model, self.plan, self.layout, self.policies,
                                 self.algo, node_wise=self.node_wise, hardware=self.hardware)

    def _feed(self, mp: MicrobatchPlan, get):
        """The microbatch as the pipeline runtime's feed, with this plan's rank assignments."""

        dp = {u.name: u.dp for u in self.plan.units}
        return microbatch_feed([get(p) for p in mp.positions], self.layout, dp, mp.splits,
                               cp=self.plan.unit("llm").cp, cp_method=self.balance.cp_method,
                               cp_block=self.balance.cp_block, floor=self.floor)

    def __call__(self, step: int) -> GlobalBatch:
        t0 = time.perf_counter()
        skipped: list[Skipped] = []
        idx, specs, reasons = self.stream.select(int(step), skipped)
        metas = meta_columns_of(idx, specs, self.layout.rules)
        mb_plans = self.plan_microbatches(metas)
        t_plan = time.perf_counter() - t0
        failed: set[int] = set()
        failed_at: dict[int, Skipped] = {}
        get = self.stream.sample_getter(idx, specs, metas, skipped, failed, failed_at)

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
                          else blank_sample(specs[p], idx[p]))

