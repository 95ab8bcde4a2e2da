"""Asynchronous multimodal data loader: plan the global batch from metadata, materialise
only this host's share, prefetch ahead of the trainer (no JAX).

Seed 000 §4.2 / seed 003 §6 (CPU preprocessing disaggregated from training, producer-
consumer: decoding and reordering run in worker processes while the GPUs train) and seed
001 §6 (the global orchestrator runs balancing on the CPU during prefetch, "as soon as all
the mini-batches have been sampled", and composes rearrangements). Built on grain:
`MapDataset.range(steps).map(GlobalBatchBuilder)` -> `to_iter_dataset` -> `mp_prefetch`
(worker processes) or thread prefetch. A global batch is a pure function of (seed, step),
so the iterator state is the next step: resume is exact.

One global batch (step k):
 1. Candidates: positions [k*W, (k+1)*W) of the seeded per-epoch shuffle, W = global_batch
    + reserve. Each candidate's *shapes* (`source.spec`) are checked (`check_shapes`); bad
    ones (empty, undecodable shape, too long) are skipped and counted; the first
    `global_batch` good ones form the batch (an error names `reserve` if too few are good).
 2. Plan (metadata only, identical on every host; `plan_global_batch`): microbatch m = a
    contiguous slice; per unit ("phase") a policy splits each microbatch over the unit's DP
    ranks: "none" (contiguous), "disttrain" (Algorithm 2 intra-microbatch reorder per
    microbatch, then Algorithm 3 inter-microbatch order over microbatches, seed 000 §6),
    "orchmllm" (batch post-balancing per phase, seed 001 §5.1, optionally node-wise
    rearranged §5.2.2). The generator follows the LLM's split (it reads LLM hidden states).
    All DP ranks of a unit share one `BatchShapes` per microbatch (one SPMD program).
 3. Routes (rearrangement composition, seed 001 §6): per encoder, `compose_rearrangement`
    gives each sample's (encoder rank, slot) -> (LLM rank, slot); expanded to token rows,
    `routes[e][d, j] = (encoder rank, row)` fills row j of LLM rank d's projected buffer
    (the one its `gather_<e>` indexes) from that row of the encoder rank's flattened output.
 4. Materialise the (unit, rank) pairs this host owns: encoder ranks get their encoder
    inputs (`Batch.encoders[e]`), LLM ranks get the LLM side + generator fields (no encoder
    pixels). A sample that fails to decode here is replaced by a blank of the same shapes
    with its loss masked out (shapes and routes stay valid), and counted as skipped.
"""
from __future__ import annotations

import json
import struct
import time
from dataclasses import dataclass, field

import gin
import numpy as np

from mmjax.data.assemble import (AssemblyLayout, Batch, BatchShapes, assemble, batch_shapes,
                                 check_sample, check_shapes, item_rows, projected_size)
from mmjax.data.balance import (batches_by_rank, compose_rearrangement, node_wise_rearrange,
                                post_balance, Rearrangement)
from mmjax.data.reorder import inter_reorder, intra_reorder
from mmjax.data.sample import FIRST_TEXT_ID, Sample, SampleMeta, Segment
from mmjax.data.synthetic import Spec, SyntheticDataset
from mmjax.models.config import MLLMConfig
from mmjax.planner.plan import Plan

POLICIES = ("none", "disttrain", "orchmllm")


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
                h, w, _ = decoded_image_shape(*data.shape[:2], patch_size, max_grid)
                if data.shape[:2] != (h, w):
                    data = _resize_nearest(data, h, w)
            segs.append(Segment(s["modality"], np.array(data), int(s["num_queries"])))
        return Sample(int(head["id"]), tuple(segs))
    except DecodeError:
        raise
    except (ValueError, KeyError, TypeError, struct.error, UnicodeDecodeError) as e:
        raise DecodeError(f"cannot decode record: {e}") from None


class ArrayRecordSource:
    """Records written by `scripts/make_dataset.py`: `<path>` (ArrayRecord, one encoded
    sample per record) and `<path>.index.json` (per record the decoded shapes, so planning
    reads no pixels)."""

    def __init__(self, path: str):
        import grain
        with open(path + ".index.json") as f:
            index = json.load(f)
        self.patch_size, self.max_grid = int(index["patch_size"]), int(index["max_grid"])
        self.specs = [[(m, tuple(s), int(k)) for m, s, k in spec] for spec in index["specs"]]
        self.records = grain.sources.ArrayRecordDataSource([path])
        if len(self.records) != len(self.specs):
            raise ValueError(f"{path}: {len(self.records)} records but the index lists "
                             f"{len(self.specs)}; rewrite it with scripts/make_dataset.py")

    def __len__(self) -> int:
        return len(self.specs)

    def spec(self, index: int) -> Spec:
        return self.specs[index]

    def load(self, index: int) -> Sample:
        return decode_record(self.records[index], self.patch_size, self.max_grid)


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


# ---------------------------------------------------------------------------------------
# Planning from metadata only
# ---------------------------------------------------------------------------------------

@dataclass
class MicrobatchPlan:
    """One microbatch: per unit, per DP rank, the ordered positions (into the global batch)
    it processes, the unit's common shapes, and per encoder the sample- and token-level
    moves from encoder ranks to LLM ranks."""

    positions: list[int]
    ranks: dict[str, list[list[int]]]
    shapes: dict[str, BatchShapes]
    rearrangements: dict[str, Rearrangement]
    routes: dict[str, np.ndarray]  # e -> int32 [dp_llm, rows, 2]: (encoder rank, row); -1 pad


def _unit_cost(unit: str, m: SampleMeta, model: MLLMConfig) -> float:
    if unit in ("llm", "generator"):
        return float(m.llm_length)
    return float(m.encoder_tokens(model.encoder(unit).modality))


def _split(unit: str, pos: list[int], metas, model, dp: int, policy: str, algo: str,
           ranks_per_node: int) -> list[list[int]]:
    if policy == "none":
        k, r = divmod(len(pos), dp)
        cuts = np.cumsum([0] + [k + (i < r) for i in range(dp)])
        return [pos[cuts[i]:cuts[i + 1]] for i in range(dp)]
    costs = [_unit_cost(unit, metas[p], model) for p in pos]
    if policy == "disttrain":
        groups = intra_reorder(costs, dp)
    else:
        groups = post_balance(costs, dp, algo)
        if ranks_per_node and dp > ranks_per_node and dp % ranks_per_node == 0:
            src = [min(i * dp // len(pos), dp - 1) for i in range(len(pos))]  # "none" split
            perm = node_wise_rearrange(src, groups, costs, ranks_per_node, method="greedy")
            groups = batches_by_rank(groups, perm)
    return [[pos[i] for i in g] for g in groups]


def plan_global_batch(metas: list[SampleMeta], model: MLLMConfig, plan: Plan,
                      layout: AssemblyLayout, policies: dict[str, str],
                      post_balance_policy: str = "sum", ranks_per_node: int = 0
                      ) -> list[MicrobatchPlan]:
    """Deterministic plan of one global batch from metadata (every host gets the same)."""
    l = plan.num_microbatches
    n = len(metas)
    if n % l:
        raise ValueError(f"global batch of {n} samples not divisible by num_microbatches={l}")
    size = n // l
    mbs = [list(range(i * size, (i + 1) * size)) for i in range(l)]
    # Algorithm 3 over microbatches, driven by the first encoder unit under "disttrain".
    driver = next((e.name for e in model.encoders if policies[e.name] == "disttrain"), None)
    if driver is not None and l > 1:
        u = plan.unit(driver)
        mb_cost = [sum(_unit_cost(driver, metas[p], model) for p in mb) / u.dp for mb in mbs]
        mbs = [mbs[j] for j in inter_reorder(mb_cost, u.pp, u.num_chunks)]
    out = []
    for pos in mbs:
        ranks = {}
        for unit in model.unit_names:
            if unit == "generator":
                continue
            ranks[unit] = _split(unit, pos, metas, model, plan.unit(unit).dp, policies[unit],
                                 post_balance_policy, ranks_per_node)
        if "generator" in model.unit_names:
            ranks["generator"] = ranks["llm"]
        shapes = {u: batch_shapes([[metas[p] for p in r] for r in rs], layout)
                  for u, rs in ranks.items()}
        rearr, routes = _routes(metas, model, layout, ranks, shapes)
        out.append(MicrobatchPlan(pos, ranks, shapes, rearr, routes))
    return out


def _routes(metas, model, layout, ranks, shapes):
    """Rearrangement composition per encoder, at sample and at token-row granularity."""
    enc_batches = {}
    for slot in layout.encoders:
        enc_batches[slot.name] = [[p for p in r if metas[p].count(slot.modality)]
                                  for r in ranks[slot.name]]
    rearr = compose_rearrangement(enc_batches, ranks["llm"])
    routes = {}
    for slot in layout.encoders:
        def rows_by_rank(unit):
            out = []
            for r in ranks[unit]:
                rows = item_rows([metas[p] for p in r], layout, shapes[unit])[slot.name]
                it = iter(rows)
                per_sample = {p: [next(it) for _ in range(metas[p].count(slot.modality))]
                              for p in r}
                out.append(per_sample)
            return out
        src, dst = rows_by_rank(slot.name), rows_by_rank("llm")
        n_rows = projected_size(slot, shapes["llm"])
        table = np.full((len(ranks["llm"]), n_rows, 2), -1, np.int32)
        for s, (er, _), (lr, _) in zip(rearr[slot.name].samples, rearr[slot.name].src,
                                       rearr[slot.name].dst):
            for a, b in zip(src[er][s], dst[lr][s]):
                table[lr, b, 0] = er
                table[lr, b, 1] = a
        routes[slot.name] = table
    return rearr, routes


# ---------------------------------------------------------------------------------------
# Global batches
# ---------------------------------------------------------------------------------------

@dataclass
class Microbatch:
    """`inputs[(unit, rank)]`: for an encoder unit, that encoder's input arrays
    (`Batch.encoders[e]`); for "llm", the Batch (LLM side, gather_<e>, generator fields;
    no encoder pixels). Only pairs this host owns are present."""

    plan: MicrobatchPlan
    inputs: dict[tuple[str, int], object]


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


def owned_ranks(plan: Plan, unit: str, host_id: int, num_hosts: int) -> list[int]:
    """DP ranks of `unit` with a device on this host (devices split over hosts in contiguous
    blocks, as jax.devices() orders them across processes)."""
    u = plan.unit(unit)
    per_host = -(-plan.num_devices // num_hosts)
    out = []
    for d in range(u.dp):
        devs = [r.start + d * u.cp * u.tp + j for r in plan.stage_device_ranges()[unit]
                for j in range(u.cp * u.tp)]
        if any(x // per_host == host_id for x in devs):
            out.append(d)
    return out


def _blank(spec: Spec, sample_id: int) -> Sample:
    segs = []
    for mod, shape, k in spec:
        if mod == "text":
            segs.append(Segment("text", np.full(shape, FIRST_TEXT_ID, np.int32)))
        else:
            segs.append(Segment(mod, np.zeros(shape, np.float32), k))
    return Sample(sample_id, tuple(segs))


def _mask_out(batch: Batch, samples: list[Sample], failed: set[int]) -> None:
    """Drop the loss of blanked samples (their shapes stay, so routes stay valid)."""
    g = 0
    for s, (row, doc) in zip(samples, batch.doc_index):
        n_out = sum(seg.modality == "image_out" for seg in s.segments)
        if s.id in failed:
            m = batch.doc[row] == doc
            batch.loss_mask[row, m] = 0.0
            batch.targets[row, m] = 0
            if batch.gen is not None:
                batch.gen["gen_valid"][g:g + n_out] = 0.0
        g += n_out
    batch.num_target_tokens = int(batch.loss_mask.sum())
    if batch.gen is not None:
        per = batch.gen["gen_latents"].shape[1] * batch.gen["gen_latents"].shape[2]
        batch.num_gen_elements = int(batch.gen["gen_valid"].sum()) * per


class GlobalBatchBuilder:
    """step -> GlobalBatch; pure function of (source, seed, step), picklable for workers."""

    def __init__(self, source, model: MLLMConfig, plan: Plan, layout: AssemblyLayout,
                 policies: dict[str, str], post_balance_policy: str = "sum",
                 ranks_per_node: int = 0, seed: int = 0, reserve: int | None = None,
                 shuffle: bool = True, host_id: int = 0, num_hosts: int = 1,
                 feeds: bool = False, cp_method: str = "lpt", cp_block: int = 128):
        self.source, self.model, self.plan, self.layout = source, model, plan, layout
        # feeds=True: materialise each microbatch as a pipeline/feed.py MicrobatchFeed (all
        # units and ranks, part maps included) for the pipeline runtime, instead of Batches.
        self.feeds, self.cp_method, self.cp_block = feeds, cp_method, cp_block
        self.policies, self.algo, self.rpn = policies, post_balance_policy, ranks_per_node
        self.seed, self.shuffle = seed, shuffle
        self.reserve = max(2, plan.global_batch // 4) if reserve is None else reserve
        self.host_id, self.num_hosts = host_id, num_hosts
        self.owned = {u: owned_ranks(plan, u, host_id, num_hosts) for u in model.unit_names
                      if u != "generator"}

    def candidates(self, step: int) -> list[int]:
        """Dataset indices at positions [step*W, (step+1)*W) of the stream: epoch e is a
        seeded permutation (grain's Feistel `index_shuffle`, O(1) per index, no table)."""
        from grain.experimental import index_shuffle
        w = self.plan.global_batch + self.reserve
        n = len(self.source)
        out = []
        for pos in range(step * w, (step + 1) * w):
            epoch, i = divmod(pos, n)
            if self.shuffle:
                i = index_shuffle(index=i, max_index=n - 1,
                                  seed=(self.seed * 1_000_003 + epoch) % (1 << 32), rounds=4)
            out.append(int(i))
        return out

    def select(self, step: int):
        """(indices, specs, skip reasons) of the first `global_batch` usable candidates."""
        gb = self.plan.global_batch
        idx, specs, reasons = [], [], {}
        for i in self.candidates(step):
            if len(idx) == gb:
                break
            spec = self.source.spec(i)
            why = check_shapes(spec, self.layout)
            if why:
                kind = why.split(":")[0]
                reasons[kind] = reasons.get(kind, 0) + 1
            else:
                idx.append(i)
                specs.append(spec)
        if len(idx) < gb:
            raise ValueError(f"global batch {step}: only {len(idx)} of {gb + self.reserve} "
                             f"candidates are usable ({reasons}); raise `reserve`")
        return idx, specs, reasons

    def _feed(self, mp: MicrobatchPlan, get):
        """The microbatch as the pipeline runtime's feed, with this plan's rank assignments."""
        from mmjax.pipeline.feed import microbatch_feed

        where = {p: i for i, p in enumerate(mp.positions)}
        assignments = {u: [[where[p] for p in r] for r in ranks] for u, ranks in mp.ranks.items()}
        dp = {u.name: u.dp for u in self.plan.units}
        return microbatch_feed([get(p) for p in mp.positions], self.layout, dp, assignments,
                               cp=self.plan.unit("llm").cp, cp_method=self.cp_method,
                               cp_block=self.cp_block)

    def __call__(self, step: int) -> GlobalBatch:
        t0 = time.perf_counter()
        idx, specs, reasons = self.select(int(step))
        metas = [self.layout.rules.meta_from_shapes(i, s) for i, s in zip(idx, specs)]
        mb_plans = plan_global_batch(metas, self.model, self.plan, self.layout, self.policies,
                                     self.algo, self.rpn)
        t_plan = time.perf_counter() - t0
        loaded: dict[int, Sample] = {}
        failed: set[int] = set()

        def get(p):
            if p not in loaded:
                try:
                    s = self.source.load(idx[p])
                    bad = check_sample(s, self.layout)
                    if bad or self.layout.rules.meta(s) != metas[p]:
                        raise DecodeError(bad or "decoded shapes differ from the index")
                except DecodeError:
                    s = _blank(specs[p], idx[p])
                    failed.add(idx[p])
                loaded[p] = s
            return loaded[p]

        mbs = []
        for mp in mb_plans:
            if self.feeds:
                mbs.append(Microbatch(mp, {"feed": self._feed(mp, get)}))
                continue
            inputs = {}
            for unit, ranks in mp.ranks.items():
                if unit == "generator":
                    continue
                for r in self.owned[unit]:
                    samples = [get(p) for p in ranks[r]]
                    if unit == "llm":
                        b = assemble(samples, self.layout, mp.shapes["llm"], encoder_inputs=False)
                        if failed:
                            _mask_out(b, samples, failed)
                        inputs[(unit, r)] = b
                    else:
                        b = assemble(samples, self.layout, mp.shapes[unit])
                        inputs[(unit, r)] = b.encoders[unit]
            mbs.append(Microbatch(mp, inputs))
        gen = self.layout.gen
        n_gen = sum(m.count("image_out") for m in metas) * (gen.num_patches * gen.patch_dim
                                                              if gen else 0)
        if failed:
            reasons["decode"] = reasons.get("decode", 0) + len(failed)
        return GlobalBatch(int(step), idx, mbs, sum(reasons.values()), reasons,
                           sum(m.num_targets for m in metas), n_gen, len(failed), t_plan)


# ---------------------------------------------------------------------------------------
# The grain pipeline
# ---------------------------------------------------------------------------------------

def _policies(balance, model: MLLMConfig) -> dict[str, str]:
    units = model.unit_names
    if isinstance(balance, str):
        pol = {u: balance for u in units}
    else:
        unknown = set(balance) - set(units)
        if unknown:
            raise ValueError(f"balance: unknown units {sorted(unknown)}; units are {units}")
        pol = {u: balance.get(u, "none") for u in units}
    for u, p in pol.items():
        if p not in POLICIES:
            raise ValueError(f"balance[{u!r}]={p!r}: use one of {POLICIES}")
    return pol


def _init_worker(worker_index: int, worker_count: int) -> None:
    from absl import flags
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


@gin.configurable
class Loader:
    """Iterator of `GlobalBatch`es with exact resume (`get_state` / `set_state`).

    `balance`: one policy for every phase or a dict unit -> policy ("none", "disttrain",
    "orchmllm"). `num_workers` > 0 runs planning, decoding and assembly in grain worker
    processes; each holds `prefetch` global batches, and with 0 workers a thread prefetches
    `prefetch` global batches, so the trainer finds the next one ready. Gin, e.g.:
    `Loader.balance = {"vision": "orchmllm", "audio": "orchmllm", "llm": "disttrain"}`.
    """

    def __init__(self, source, model: MLLMConfig, plan: Plan, layout: AssemblyLayout,
                 balance="none", post_balance_policy: str = "sum", ranks_per_node: int = 0,
                 seed: int = 0, reserve: int | None = None, shuffle: bool = True,
                 num_workers: int = 0, prefetch: int = 2, host_id: int = 0,
                 num_hosts: int = 1, num_steps: int = 1 << 31, feeds: bool = False,
                 cp_method: str = "lpt", cp_block: int = 128):
        if prefetch < 1:
            raise ValueError(f"Loader.prefetch={prefetch}: use >= 1 (2 keeps planning off the "
                             f"training path)")
        self.builder = GlobalBatchBuilder(source, model, plan, layout, _policies(balance, model),
                                          post_balance_policy, ranks_per_node, seed, reserve,
                                          shuffle, host_id, num_hosts, feeds, cp_method, cp_block)
        self.num_workers, self.prefetch, self.num_steps = num_workers, prefetch, num_steps
        self.skipped_samples = 0
        self._it = None
        self._start(0)

    def close(self) -> None:
        """Stop prefetch threads / worker processes of the current pipeline."""
        if self._it is not None:
            self._it.close()
            self._it = None

    def _start(self, step: int) -> None:
        """(Re)build the grain pipeline from global batch `step` on. Global batches are a pure
        function of the step, so the step is the whole iterator state: exact, and portable
        across worker counts (grain's own multiprocess state is not)."""
        import grain
        self.close()
        ds = grain.MapDataset.range(step, self.num_steps).map(self.builder)
        it_ds = ds.to_iter_dataset(grain.ReadOptions(
            num_threads=1 if self.num_workers == 0 else 0, prefetch_buffer_size=self.prefetch))
        if self.num_workers > 0:
            _init_worker(0, 1)
            it_ds = it_ds.mp_prefetch(grain.MultiprocessingOptions(
                num_workers=self.num_workers, per_worker_buffer_size=self.prefetch),
                worker_init_fn=_init_worker)
        self._it = iter(it_ds)
        self.step = step

    def __iter__(self):
        return self

    def __next__(self) -> GlobalBatch:
        gb = next(self._it)
        self.skipped_samples += gb.skipped_samples
        self.step = gb.step + 1
        return gb

    def get_state(self) -> dict:
        """JSON-able state (stored with the checkpoint): next step and the skip counter."""
        return {"step": self.step, "skipped_samples": self.skipped_samples}

    def set_state(self, state: dict) -> None:
        self._start(int(state["step"]))
        self.skipped_samples = int(state["skipped_samples"])
