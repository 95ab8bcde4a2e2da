"""Host side of one microbatch: per unit and dp rank inputs, and the routes the broker
applies between units (no JAX).

Each unit splits the microbatch's samples over its own dp ranks (`assignments`: contiguous
by default, or any per-phase balancing from data/balance/, as the batch plan's `RankSplit`
arrays or one list of sample indices per rank). Encoder outputs travel to the
LLM as *parts*: part (i, j) holds, in the LLM rank's sample order, the projected tokens of
the samples encoder rank i computed and LLM rank j consumes, so one transfer per encoder
realises the whole rearrangement (OrchMLLM §6, rearrangement composition Pi_M o Pi_E^-1).
The LLM's `gather_<e>` indices are rewritten to point into the parts it receives. The same
holds for LLM -> generator, with images as the unit of a part.
Arrays of all dp ranks are stacked rank-major along axis 0, ready to shard over 'dp'.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import cast
from dataclasses import dataclass, field

import numpy as np

from mmjax.data.layout import AssemblyLayout, check_sample
from mmjax.data.batch_shapes import BatchShapes, batch_shapes
from mmjax.data.assemble import Batch, assemble
from mmjax.data.rank_split import RankSplit
from mmjax.data.routes import Routes
from mmjax.data.sample import Sample
from mmjax.data.token_distribution import batch_layout
from mmjax.models.units import has_generator


def _pow2(n: int) -> int:
    return 1 << max(0, int(np.ceil(np.log2(max(n, 1)))))


def _stack(dicts: list[dict]) -> dict:
    return {k: np.concatenate([d[k] for d in dicts], axis=0) for k in dicts[0]}


def _doc_positions(batch: Batch, sample_pos: int, mask: np.ndarray):
    """Flat (row*S + col) positions of sample `sample_pos` of `batch` where `mask`, in order."""
    row, doc_id = batch.doc_index[sample_pos]
    cols = np.nonzero((batch.doc[row] == doc_id) & mask[row])[0]
    return row, cols


def _parts(src_groups, dst_groups, items_of):
    """Pairs (i, j) with the items (in dst order) that go from src rank i to dst rank j."""
    owner = {s: i for i, g in enumerate(src_groups) for s in g}
    per_pair: dict[tuple[int, int], list] = {}
    for j, g in enumerate(dst_groups):
        for s in g:
            per_pair.setdefault((owner[s], j), []).extend(items_of(s))
    return per_pair


def _part_map(per_pair, a, b, min_slots: tuple[int, ...] = (1, 1)) -> tuple[Routes, dict]:
    src_slot, dst_slot, pairs = {}, {}, []
    # in (i, j) order a pair's src slot is the count of earlier pairs from i (smaller j),
    # its dst slot the count of earlier pairs into j (smaller i): one pass, not pairs^2
    from_src: dict[int, int] = {}
    into_dst: dict[int, int] = {}
    for i, j in sorted(per_pair):
        src_slot[(i, j)] = from_src.get(i, 0)
        dst_slot[(i, j)] = into_dst.get(j, 0)
        from_src[i] = src_slot[(i, j)] + 1
        into_dst[j] = dst_slot[(i, j)] + 1
        pairs.append((i, src_slot[(i, j)], j, dst_slot[(i, j)]))
    ps = max([v + 1 for v in src_slot.values()] + [min_slots[0]])
    pr = max([v + 1 for v in dst_slot.values()] + [min_slots[1]])
    return Routes.from_pairs(a, ps, b, pr, pairs), {"src": src_slot, "dst": dst_slot}


FeedUnits = tuple[tuple[str, BatchShapes], ...]
FeedParts = tuple[tuple[str, int, int, int], ...]


@dataclass(frozen=True)
class FeedShapes:
    """Every static size of a microbatch feed: per unit its BatchShapes, per transfer
    (an encoder's name, or "generator") its part capacity and (src, dst) slot counts. The
    stage and broker programs are compiled per FeedShapes; a floor (`microbatch_feed`'s
    `floor`) makes feeds share one, so a run compiles once (data/loader.py scans the first
    steps for it)."""

    units: FeedUnits = ()
    parts: FeedParts = ()  # (name, cap, src slots, dst slots)

    def unit(self, name: str) -> BatchShapes | None:
        return dict(self.units).get(name)

    def part(self, name: str) -> tuple[int, int, int]:
        for n, cap, ps, pr in self.parts:
            if n == name:
                return cap, ps, pr
        return 1, 1, 1

    def union(self, other: "FeedShapes | None") -> "FeedShapes":
        """The smallest FeedShapes at least as large as both."""
        if other is None:
            return self
        names = sorted({n for n, _ in self.units} | {n for n, _ in other.units})
        # each name is in self or other, so no unit is None (hence the casts)
        units = cast(FeedUnits, tuple((n, cast(BatchShapes, self.unit(n)).union(other.unit(n))
                                        if self.unit(n) is not None else other.unit(n))
                                       for n in names))
        pnames = sorted({n for n, *_ in self.parts} | {n for n, *_ in other.parts})
        parts = cast(FeedParts, tuple((n, *(max(x, y) for x, y in zip(self.part(n), other.part(n))))
                                      for n in pnames))  # part() gives three ints
        return FeedShapes(units, parts)


@dataclass
class MicrobatchFeed:
    """Everything the stages of every unit need for one microbatch."""

    enc_inputs: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    enc_pack: dict[str, np.ndarray] = field(default_factory=dict)  # [a, ps, cap] local idx
    enc_routes: dict[str, Routes] = field(default_factory=dict)
    llm: dict[str, np.ndarray] = field(default_factory=dict)
    gen_pack: np.ndarray | None = None  # [b, ps, cap] image index in the LLM rank
    gen_routes: Routes | None = None
    gen: dict[str, np.ndarray] = field(default_factory=dict)
    num_target_tokens: int = 0
    num_gen_elements: int = 0
    shapes: FeedShapes = field(default_factory=FeedShapes)
    # host-side map of each sample (in the order given): its (row of `llm`, doc id) and
    # its images' indices in `gen`, so a sample found bad later can be masked (`mask_samples`)
    sample_rows: list = field(default_factory=list)
    sample_gen: list = field(default_factory=list)


def microbatch_feed(samples: list[Sample], layout: AssemblyLayout, dp: dict[str, int],
                    assignments: Mapping[str, RankSplit | list[list[int]]] | None = None,
                    cp: int = 1,
                    cp_method: str = "lpt", cp_block: int = 128,
                    floor: FeedShapes | None = None) -> MicrobatchFeed:
    """Build the feed of one microbatch. `dp[unit]` is each unit's dp size; samples must
    already be valid (the loader skips bad ones before forming microbatches). With `cp` > 1
    the LLM arrays are laid out for context parallelism (Cornstarch §4.3: each row's tokens
    distributed over cp ranks by `cp_method` in blocks of `cp_block`). `floor`: sizes at
    least these (padding: masked rows, empty buffers, empty part slots), `feed.shapes` the
    sizes used."""
    n = len(samples)
    assignments = dict(assignments or {})
    groups = {}
    for u, d in dp.items():
        a = assignments.get(u)
        if a is None or (not isinstance(a, RankSplit) and not a):
            if n % d:
                raise ValueError(f"microbatch of {n} samples does not split over dp={d}")
            a = RankSplit.contiguous(n, d)
        elif not isinstance(a, RankSplit):
            a = RankSplit.from_lists(a)
        a.check(n, d, f"assignments[{u!r}]")
        groups[u] = a.lists()
    for s in samples:
        reason = check_sample(s, layout)
        if reason:
            raise ValueError(f"sample {s.id} cannot be assembled ({reason}); skip bad samples "
                             "before forming microbatches (the loader does)")
    build = _FeedBuilder(samples, layout, dp, groups, floor or FeedShapes())
    feed = MicrobatchFeed()
    llm_b = build.batches("llm", False)
    for slot in layout.encoders:
        build.encoder(feed, slot.name, llm_b)
    llm_fields = ("tokens", "targets", "loss_mask", "positions", "doc", "sub")
    feed.llm = _stack([{**{k: getattr(bt, k) for k in llm_fields},
                        "bam": bt.bam.astype(np.int32),
                        **{f"gather_{e}": g for e, g in bt.gather.items()}} for bt in llm_b])
    feed.num_target_tokens = sum(bt.num_target_tokens for bt in llm_b)
    rows = llm_b[0].tokens.shape[0]
    for i in range(n):
        j, k = build.llm_pos[i]
        row, doc = llm_b[j].doc_index[k]
        feed.sample_rows.append((j * rows + row, doc))
    feed.sample_gen = [[] for _ in range(n)]
    if layout.gen is not None and has_generator(dp):
        build.generator(feed, llm_b)
    if cp > 1:
        feed.llm = cp_layout(feed.llm, cp, cp_method, cp_block, ranks=dp["llm"])
    feed.shapes = FeedShapes(tuple(sorted(build.unit_shapes.items())),
                             tuple(sorted((n, *v) for n, v in build.part_shapes.items())))
    return feed


class _FeedBuilder:
    """One microbatch's per-rank batches and the parts that move between units (encoder
    outputs to the LLM ranks that read them, LLM states to the generator ranks)."""

    def __init__(self, samples, layout: AssemblyLayout, dp: dict, groups: dict,
                 floor: FeedShapes):
        self.samples, self.layout, self.dp, self.groups, self.floor = (
            samples, layout, dp, groups, floor)
        self.metas = [layout.rules.meta(s) for s in samples]
        self.unit_shapes: dict[str, BatchShapes] = {}
        self.part_shapes: dict[str, tuple[int, int, int]] = {}
        self.llm_pos = {s: (j, k) for j, g in enumerate(groups["llm"]) for k, s in enumerate(g)}

    def batches(self, unit: str, enc_inputs: bool) -> list:
        """One assembled batch per dp rank of `unit`, all at the unit's common shapes."""
        gs = self.groups[unit]
        shapes = batch_shapes([[self.metas[s] for s in g] for g in gs],
                              self.layout).union(self.floor.unit(unit))
        self.unit_shapes[unit] = shapes
        return [assemble([self.samples[s] for s in g], self.layout, shapes=shapes,
                         encoder_inputs=enc_inputs) for g in gs]

    def _route(self, name: str, per_pair: dict, src: int, dst: int):
        """(routes, slots, cap, pack) of the parts `per_pair[(src rank, dst rank)]`."""
        low_cap, *low_slots = self.floor.part(name)
        routes, slots = _part_map(per_pair, src, dst, tuple(low_slots))
        cap = max(_pow2(max([len(v) for v in per_pair.values()] or [1])), low_cap)
        self.part_shapes[name] = (cap, routes.src_slots, routes.dst_slots)
        pack = np.full((src, routes.src_slots, cap), -1, np.int32)
        for pair, items in per_pair.items():
            pack[pair[0], slots["src"][pair], :len(items)] = items
        return routes, slots, cap, pack

    def encoder(self, feed: MicrobatchFeed, e: str, llm_b: list) -> None:
        """Encoder `e`'s inputs per rank, its outputs' routes to the LLM ranks, and the LLM
        batches' `gather_<e>` rewritten to index the received parts."""
        groups = self.groups
        enc_b = self.batches(e, True)
        enc_pos = {s: (i, k) for i, g in enumerate(groups[e]) for k, s in enumerate(g)}
        enc_mask = [bt.gather[e] >= 0 for bt in enc_b]  # once per batch, not per sample
        llm_mask = [bt.gather[e] >= 0 for bt in llm_b]

        def tokens_of(s):
            i, k = enc_pos[s]
            bt = enc_b[i]
            row, cols = _doc_positions(bt, k, enc_mask[i])
            return bt.gather[e][row, cols].tolist()

        per_pair = _parts(groups[e], groups["llm"], tokens_of)
        routes, slots, cap, pack = self._route(e, per_pair, self.dp[e], self.dp["llm"])
        gathers = [np.full_like(bt.gather[e], -1) for bt in llm_b]
        for (i, j) in per_pair:
            off = slots["dst"][(i, j)] * cap
            for s in groups["llm"][j]:
                if enc_pos[s][0] != i:
                    continue
                row, cols = _doc_positions(llm_b[j], self.llm_pos[s][1], llm_mask[j])
                gathers[j][row, cols] = off + np.arange(len(cols))
                off += len(cols)
        feed.enc_inputs[e] = _stack([bt.encoders[e] for bt in enc_b])
        feed.enc_pack[e], feed.enc_routes[e] = pack, routes
        for j, bt in enumerate(llm_b):
            bt.gather[e] = gathers[j]

    def generator(self, feed: MicrobatchFeed, llm_b: list) -> None:
        """The generator's inputs, gathered per receiving rank in the order its parts
        arrive from the LLM ranks, and the LLM's `gen_query` positions."""
        groups = self.groups
        gen_b = self.batches("generator", False)
        image_count = [m.count("image_out") for m in self.metas]
        first_image = {}
        for g in groups["llm"]:
            k = 0
            for s in g:
                first_image[s] = k
                k += image_count[s]
        per_pair = _parts(groups["generator"], groups["llm"],
                          lambda s: [first_image[s] + t for t in range(image_count[s])])
        # parts flow llm -> generator: swap roles (src = llm rank j, dst = gen rank i)
        per_pair = {(j, i): v for (i, j), v in per_pair.items()}
        c = self.dp["generator"]
        routes, slots, cap, pack = self._route("generator", per_pair, self.dp["llm"], c)
        per_rank = routes.dst_slots * cap
        # gen_latents, or gen_pixels when the VAE is a unit (GenSlot.pixel_side); gen_noise,
        # gen_t, gen_valid: the shapes and dtypes of the assembled buffers
        gen = {key: np.zeros((c * per_rank,) + a.shape[1:], a.dtype)
               for key, a in gen_b[0].gen.items() if key != "gen_query"}
        gen_pos = {s: (i, k) for i, g in enumerate(groups["generator"]) for k, s in enumerate(g)}
        gen_first = {}  # a sample's first image among its generator rank's images
        for g in groups["generator"]:
            k = 0
            for s in g:
                gen_first[s] = k
                k += image_count[s]
        for (j, i) in per_pair:
            base = i * per_rank + slots["dst"][(j, i)] * cap
            t = 0
            for s in groups["llm"][j]:
                if gen_pos[s][0] != i:
                    continue
                gi = gen_pos[s][0]
                g_first = gen_first[s]
                for m in range(image_count[s]):
                    for key in gen:
                        gen[key][base + t] = gen_b[gi].gen[key][g_first + m]
                    feed.sample_gen[s].append(base + t)
                    t += 1
        feed.llm["gen_query"] = np.concatenate([bt.gen["gen_query"] for bt in llm_b], 0)
        feed.gen_pack, feed.gen_routes, feed.gen = pack, routes, gen
        feed.num_gen_elements = sum(bt.num_gen_elements for bt in llm_b)


_PAD_VALUE = {"gather": -1}


def gen_elements_per_image(layout: AssemblyLayout) -> int:
    """Diffusion-loss elements of one generated image (0 without a generator)."""
    g = layout.gen
    return g.num_patches * g.patch_dim if g is not None else 0


def mask_documents(loss_mask: np.ndarray, targets: np.ndarray, doc: np.ndarray, docs,
                   gen_valid: np.ndarray | None = None, images=()) -> None:
    """The one failed-sample mask: drop documents `docs` ((row, doc id) pairs) from the
    LLM loss (no target) and generated images `images` (indices into `gen_valid`) from
    the diffusion loss, in place. Shapes stay, so every route and buffer is unchanged, and
    a masked sample adds exactly nothing to the loss or the gradients, whatever its inputs
    hold. Callers recount their normalisers."""
    for row, d in docs:
        m = doc[row] == d
        loss_mask[row][m] = 0
        targets[row][m] = 0
    if gen_valid is not None:
        for g in images:
            gen_valid[g] = 0


def mask_samples(feed: MicrobatchFeed, samples, gen_elements_per_image: int) -> None:
    """`mask_documents` on a feed: samples by index in the feed's sample order;
    `num_gen_elements` recounted (`num_target_tokens` is the caller's)."""
    llm = feed.llm
    mask_documents(llm["loss_mask"], llm["targets"], llm["doc"],
                   [feed.sample_rows[i] for i in samples], feed.gen.get("gen_valid"),
                   [g for i in samples for g in feed.sample_gen[i]])
    if feed.gen:
        feed.num_gen_elements = int(feed.gen["gen_valid"].sum()) * gen_elements_per_image


def cp_layout(llm: dict, cp: int, method: str, block: int, ranks: int = 1) -> dict:
    """Permute the LLM's [B, S] arrays into the CP layout [B, cp * L] (rank-major; padding
    slots: doc 0, no target, no modality token), add `idx` (global token index, S for
    padding) and remap `gen_query` to the new flat positions. `ranks`: the LLM's dp ranks
    (rows and `gen_query` rank-major, each rank's positions relative to its own rows)."""
    gi = batch_layout(llm["bam"], llm["doc"], llm["sub"], cp, method, block)  # [B, N]
    b, s = llm["tokens"].shape
    rows = np.arange(b)[:, None]
    out = {}
    for k, v in llm.items():
        if k == "gen_query":
            continue
        fill = -1 if k.startswith("gather_") else 0
        # trailing dims ride along (Qwen2-VL's M-RoPE positions [B, S, 3])
        padded = np.concatenate([v, np.full((b, 1) + v.shape[2:], fill, v.dtype)], axis=1)
        out[k] = padded[rows, gi]
    out["idx"] = gi.astype(np.int32)
    if "gen_query" in llm:
        inverse = np.zeros((b, s), np.int64)
        for r in range(b):
            valid = np.nonzero(gi[r] < s)[0]
            inverse[r, gi[r, valid]] = valid
        q = llm["gen_query"]
        row = q // s + (np.arange(q.shape[0]) // (q.shape[0] // ranks) * (b // ranks))[:, None]
        out["gen_query"] = ((q // s) * gi.shape[1] + inverse[row, q % s]).astype(np.int32)
    return out
