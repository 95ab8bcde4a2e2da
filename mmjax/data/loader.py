"""Asynchronous multimodal data loader: plan the global batch from metadata, materialise
only this host's share, prefetch ahead of the trainer (no JAX).

DistTrain §4.2 / MMScale §6 (CPU preprocessing disaggregated from training, producer-
consumer: decoding and reordering run in worker processes while the GPUs train) and OrchMLLM
§6 (the global orchestrator runs balancing on the CPU during prefetch, "as soon as all
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
    microbatch, then Algorithm 3 inter-microbatch order over microbatches, DistTrain §6, on
    microbatch times from the planner's cost model: `microbatch_costs`), "orchmllm" (batch
    post-balancing per phase with a per-phase algorithm, OrchMLLM §5.1 / Appendix A,
    optionally node-wise rearranged §5.2.2, `NodeWise`). The generator follows the LLM's
    split when their dp agree (it reads LLM hidden states, which then stay on their rank),
    else it is split on its own (cost: generated images per sample). All DP ranks of a unit
    share one `BatchShapes` per microbatch (one SPMD program).
 3. Routes (rearrangement composition, OrchMLLM §6): per encoder, `compose_rearrangement`
    gives each sample's (encoder rank, slot) -> (LLM rank, slot); expanded to token rows,
    `routes[e][d, j] = (encoder rank, row)` fills row j of LLM rank d's projected buffer
    (the one its `gather_<e>` indexes) from that row of the encoder rank's flattened output.
 4. Materialise the (unit, rank) pairs this host owns: encoder ranks get their encoder
    inputs (`Batch.encoders[e]`), LLM ranks get the LLM side + generator fields (no encoder
    pixels). A sample that fails to decode here is replaced by a blank of the same shapes
    with its loss masked out (shapes and routes stay valid), and counted as skipped.
    With `feeds=True` (the pipeline runtime) every host builds the whole microbatch feed
    (all units and ranks): the runtime forms its global inputs from full feeds.
"""
from __future__ import annotations

import json
import os
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import gin
import numpy as np

from mmjax.data.layout import AssemblyLayout, check_sample, check_shapes
from mmjax.data.batch_shapes import BatchShapes, batch_shapes
from mmjax.data.assemble import Batch, assemble, item_rows, projected_size
from mmjax.data.balance import POLICIES as POST_BALANCE_POLICIES
from mmjax.data.balance import (batches_by_rank, compose_rearrangement, node_wise_rearrange,
                                post_balance, Rearrangement)
from mmjax.data.feed import microbatch_feed
from mmjax.data.reorder import inter_reorder, intra_reorder
from mmjax.data.sample import FIRST_TEXT_ID, Sample, SampleMeta, Segment
from mmjax.data.synthetic import Spec, SyntheticDataset
from mmjax.errors import UserError, one_line
from mmjax.models.config import MLLMConfig
from mmjax.planner.costs import layer_times, unit_work
from mmjax.planner.hardware import H100, Hardware, hardware as hardware_by_name
from mmjax.planner.plan import Plan
from mmjax.planner.workload import workload_from_metas

POLICIES = ("none", "disttrain", "orchmllm")
NODE_WISE_METHODS = ("auto", "milp", "local", "greedy")


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
    except Exception as e:  # noqa: BLE001 (untrusted bytes: any failure means undecodable)
        raise DecodeError(f"cannot decode record: {one_line(e, 160)}") from None


class ArrayRecordSource:
    """Records written by `scripts/make_dataset.py`: `<path>` (ArrayRecord, one encoded
    sample per record) and `<path>.index.json` (per record the decoded shapes, so planning
    reads no pixels). A file that cannot be opened is a UserError naming it (before any
    training); a record that cannot be read (Riegeli chunk checksum, I/O error) or decoded
    is a DecodeError naming the file and record index, which the loader skips and counts."""

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

    def name(self, index: int) -> str:
        """The record's name in skip reports: file and record index."""
        return f"{self.path}:{index}"

    def load(self, index: int) -> Sample:
        try:
            raw = self.records[index]
        except Exception as e:  # noqa: BLE001 (Riegeli checksum RuntimeError, OSError...)
            raise DecodeError(f"{self.path} record {index}: unreadable "
                              f"({one_line(e, 160)})") from None
        try:
            return decode_record(raw, self.patch_size, self.max_grid)
        except DecodeError as e:
            raise DecodeError(f"{self.path} record {index}: {e}") from None


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
    """Per-sample size the within-microbatch split balances (tokens; generated images)."""
    if unit == "llm":
        return float(m.llm_length)
    if unit == "generator":
        return float(m.count("image_out"))
    return float(m.encoder_tokens(model.encoder(unit).modality))


@dataclass(frozen=True)
class NodeWise:
    """Node-wise rearrangement settings (OrchMLLM §5.2.2, Algorithm 3) for "orchmllm".

    `ranks_per_node` 0 disables it; a unit runs it only when its dp spans several nodes
    (dp > ranks_per_node and a multiple of it). `method`: "auto" (the MILP up to
    `max_milp_ranks` ranks, else, or when the MILP does not prove optimality within
    `time_limit` s, the better of greedy and its pairwise-swap local search), "milp",
    "local" (greedy + swaps, deterministic), "greedy".
    Every host must compute the same plan, so the loader only takes a MILP answer proven
    optimal (a time-limited incumbent depends on machine speed); otherwise greedy."""

    ranks_per_node: int = 0
    method: str = "auto"
    time_limit: float = 0.2
    max_milp_ranks: int = 32

    def __post_init__(self):
        if self.method not in NODE_WISE_METHODS:
            raise UserError(f"Loader.node_wise_method={self.method!r}: use one of "
                            f"{NODE_WISE_METHODS}")
        if not self.time_limit > 0:
            raise UserError(f"Loader.node_wise_time_limit={self.time_limit!r}: use > 0 seconds")


def _split(unit: str, pos: list[int], metas, model, dp: int, policy: str, algo: str,
           node_wise: NodeWise) -> list[list[int]]:
    if policy == "none":
        k, r = divmod(len(pos), dp)
        cuts = np.cumsum([0] + [k + (i < r) for i in range(dp)])
        return [pos[cuts[i]:cuts[i + 1]] for i in range(dp)]
    costs = [_unit_cost(unit, metas[p], model) for p in pos]
    if policy == "disttrain":
        groups = intra_reorder(costs, dp)
    else:
        groups = post_balance(costs, dp, algo)
        rpn = node_wise.ranks_per_node
        if rpn and dp > rpn and dp % rpn == 0:
            src = [min(i * dp // len(pos), dp - 1) for i in range(len(pos))]  # "none" split
            perm = node_wise_rearrange(src, groups, costs, rpn, method=node_wise.method,
                                       time_limit=node_wise.time_limit,
                                       max_milp_ranks=node_wise.max_milp_ranks,
                                       require_optimal=True)
            groups = batches_by_rank(groups, perm)
    return [[pos[i] for i in g] for g in groups]


def rank_times(model: MLLMConfig, unit: str, metas: list[SampleMeta], tp: int = 1,
               hw: Hardware = H100, cond_tokens: int = 64) -> tuple[float, float]:
    """(forward, backward) seconds of `unit` on one DP rank processing `metas`, from the
    planner's analytic cost model (planner/costs.py: per-layer FLOPs incl. the attention
    quadratic term, frozen-aware backward, Cornstarch §4.2). The model is linear in the
    per-sample moments, so the average sample of a `Workload` of these samples times their
    count is exactly the sum over samples."""
    if not metas:
        return 0.0, 0.0
    wl = workload_from_metas("microbatch", metas, model, cond_tokens)
    lt = layer_times(unit_work(model, wl, unit), tp, hw)
    return len(metas) * sum(f for f, _ in lt), len(metas) * sum(b for _, b in lt)


def microbatch_costs(metas: list[SampleMeta], model: MLLMConfig, plan: Plan,
                     ranks: list[dict[str, list[list[int]]]], hw: Hardware = H100,
                     cond_tokens: int = 64):
    """Inputs of DistTrain's Algorithm 3 (DistTrain §6.2) for the microbatches whose per-unit
    rank splits are `ranks[j]`: (costs, stage_costs) for `reorder.inter_reorder`.

    costs[j] = (forward, backward) seconds of microbatch j "in the modality encoder and
    generator" (§6.2): the slowest DP rank of each unit (its straggler sets the stage time),
    the max over encoders (parallel encoders run side by side, Cornstarch §4.1) plus the
    generator. stage_costs models the pipeline: the encoder's pp stages take equal shares
    of costs[j] (scale 1 / pp), then the LLM's pp stages at a fixed time (scale 0, offset =
    the mean over microbatches of the LLM's slowest-rank time / pp: with fixed-length
    sequences every LLM microbatch takes the same time, §2.3). The generator's time is in
    costs[j] (as in the paper); a model without encoders puts the generator's stages last.
    """
    def unit_time(unit, r):
        u = plan.unit(unit)  # a cp group shares its rank's sequences (cp = 1 but the LLM)
        per_rank = [rank_times(model, unit, [metas[p] for p in g], u.tp, hw, cond_tokens)
                    for g in r[unit]]
        return (max(f for f, _ in per_rank) / u.cp, max(b for _, b in per_rank) / u.cp)

    costs, llm = [], []
    has_gen = "generator" in model.unit_names
    for r in ranks:
        enc = [unit_time(e.name, r) for e in model.encoders]
        gen = unit_time("generator", r) if has_gen else (0.0, 0.0)
        f = max([x[0] for x in enc], default=0.0) + gen[0]
        b = max([x[1] for x in enc], default=0.0) + gen[1]
        costs.append((f, b))
        llm.append(unit_time("llm", r))
    u_llm = plan.unit("llm")
    n = max(len(llm), 1)
    fl = sum(x[0] for x in llm) / n / u_llm.pp
    bl = sum(x[1] for x in llm) / n / u_llm.pp
    llm_stages = [(0.0, fl, bl)] * u_llm.pp
    if model.encoders:
        pe = max(plan.unit(e.name).pp for e in model.encoders)
        return costs, [(1.0 / pe, 0.0, 0.0)] * pe + llm_stages
    pg = plan.unit("generator").pp if has_gen else 1
    return costs, llm_stages + ([(1.0 / pg, 0.0, 0.0)] * pg if has_gen else [])


def plan_global_batch(metas: list[SampleMeta], model: MLLMConfig, plan: Plan,
                      layout: AssemblyLayout, policies: dict[str, str],
                      post_balance_policy="sum", ranks_per_node: int = 0, *,
                      node_wise: NodeWise | None = None, hardware: Hardware = H100
                      ) -> list[MicrobatchPlan]:
    """Deterministic plan of one global batch from metadata (every host gets the same).

    `post_balance_policy`: one OrchMLLM algorithm for every phase or a dict unit -> one of
    ("sum", "padded", "sum_square", "conv"). Under "disttrain" (any unit) the microbatches
    run in Algorithm 3's order over `microbatch_costs` (the planner's cost model)."""
    l = plan.num_microbatches
    n = len(metas)
    if n % l:
        raise ValueError(f"global batch of {n} samples not divisible by num_microbatches={l}")
    algos = post_balance_policies(post_balance_policy, model)
    if node_wise is None:
        node_wise = NodeWise(ranks_per_node)
    size = n // l
    mbs = [list(range(i * size, (i + 1) * size)) for i in range(l)]
    llm_dp = plan.unit("llm").dp
    splits = []
    for pos in mbs:
        ranks = {}
        for unit in model.unit_names:
            if unit == "generator" and plan.unit(unit).dp == llm_dp:
                continue  # follows the LLM's split: hidden states stay on their rank
            ranks[unit] = _split(unit, pos, metas, model, plan.unit(unit).dp, policies[unit],
                                 algos[unit], node_wise)
        if "generator" in model.unit_names and "generator" not in ranks:
            ranks["generator"] = ranks["llm"]
        splits.append(ranks)
    if l > 1 and any(p == "disttrain" for p in policies.values()):
        gen = layout.gen.num_queries if layout.gen is not None else 64
        costs, stages = microbatch_costs(metas, model, plan, splits, hardware, gen)
        order = inter_reorder(costs, len(stages), stage_costs=stages)
        mbs, splits = [mbs[j] for j in order], [splits[j] for j in order]
    out = []
    for pos, ranks in zip(mbs, splits):
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
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (sample name, reason)


@dataclass
class GlobalSamples:
    """One global batch as samples (`GlobalBatchBuilder.samples`), before any planning."""
    step: int
    sample_ids: list[int]
    samples: list[Sample]  # decode failures blanked (fully masked), ids in `failed`
    failed: set[int]
    skipped_samples: int
    skipped: list[tuple[str, str]]


def owned_ranks(plan: Plan, unit: str, host_id: int, num_hosts: int) -> list[int]:
    """DP ranks of `unit` with a device on this host (devices split over hosts in contiguous
    blocks, as jax.devices() orders them across processes)."""
    u = plan.unit(unit)
    per_host = -(-plan.num_devices // num_hosts)
    out = []
    for d in range(u.dp):
        g = u.cp * u.tp
        devs = [x for idx in plan.stage_devices()[unit] for x in idx[d * g:(d + 1) * g]]
        if any(x // per_host == host_id for x in devs):
            out.append(d)
    return out


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
                 policies: dict[str, str], post_balance_policy="sum",
                 ranks_per_node: int = 0, seed: int = 0, reserve: int | None = None,
                 shuffle: bool = True, host_id: int = 0, num_hosts: int = 1,
                 feeds: bool = False, cp_method: str = "lpt", cp_block: int = 128,
                 node_wise: NodeWise | None = None, hardware: Hardware = H100):
        self.source, self.model, self.plan, self.layout = source, model, plan, layout
        # feeds=True: materialise each microbatch as a data/feed.py MicrobatchFeed (all
        # units and ranks, part maps included) for the pipeline runtime, instead of Batches.
        self.feeds, self.cp_method, self.cp_block = feeds, cp_method, cp_block
        self.policies = policies
        self.algo = post_balance_policies(post_balance_policy, model)
        self.node_wise = node_wise or NodeWise(ranks_per_node)
        self.hardware = hardware
        self.seed, self.shuffle = seed, shuffle
        self.reserve = max(2, plan.global_batch // 4) if reserve is None else reserve
        self.host_id, self.num_hosts = host_id, num_hosts
        self.owned = {u: owned_ranks(plan, u, host_id, num_hosts) for u in model.unit_names
                      if u != "generator"}
        self.floor = None  # FeedShapes every feed is padded to (`scan_floor`)

    def scan_floor(self, steps: int):
        """The union of the feed shapes of global batches 0 .. steps-1, from the samples'
        shapes alone (blank samples, nothing decoded). Always from step 0, so a resumed run
        pads exactly as the uninterrupted one did."""
        self.floor, floor = None, None
        for step in range(steps):
            try:
                idx, specs, _ = self.select(step)
            except UserError:  # too few usable samples: that step raises if it is reached
                continue
            metas = [self.layout.rules.meta_from_shapes(i, s) for i, s in zip(idx, specs)]
            for mp in plan_global_batch(metas, self.model, self.plan, self.layout,
                                        self.policies, self.algo, node_wise=self.node_wise,
                                        hardware=self.hardware):
                feed = self._feed(mp, lambda p: _blank(specs[p], idx[p]))
                floor = feed.shapes.union(floor)
        return floor

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

    def select(self, step: int, skipped: list | None = None):
        """(indices, specs, skip reasons) of the first `global_batch` usable candidates;
        (sample name, reason) of each skipped one is appended to `skipped`. A source may
        name a sample's problem up front (`problem(i)`: a missing image, say)."""
        gb = self.plan.global_batch
        idx, specs, reasons = [], [], {}
        for i in self.candidates(step):
            if len(idx) == gb:
                break
            spec = self.source.spec(i)
            why = source_problem(self.source, i) or check_shapes(spec, self.layout)
            if why:
                kind = why.split(":")[0]
                reasons[kind] = reasons.get(kind, 0) + 1
                if skipped is not None:
                    skipped.append((sample_name(self.source, i), why))
            else:
                idx.append(i)
                specs.append(spec)
        if len(idx) < gb:
            raise UserError(f"global batch {step}: only {len(idx)} of {gb + self.reserve} "
                            f"candidates are usable ({reasons}); raise `reserve`")
        return idx, specs, reasons

    def _feed(self, mp: MicrobatchPlan, get):
        """The microbatch as the pipeline runtime's feed, with this plan's rank assignments."""

        where = {p: i for i, p in enumerate(mp.positions)}
        assignments = {u: [[where[p] for p in r] for r in ranks] for u, ranks in mp.ranks.items()}
        dp = {u.name: u.dp for u in self.plan.units}
        return microbatch_feed([get(p) for p in mp.positions], self.layout, dp, assignments,
                               cp=self.plan.unit("llm").cp, cp_method=self.cp_method,
                               cp_block=self.cp_block, floor=self.floor)

    def _getter(self, idx, specs, metas, skipped: list, failed: set):
        """position -> its sample, loaded once; a sample that fails to decode (or decodes to
        other shapes than its index says) is named in `skipped`, added to `failed` and
        replaced by a blank of its shapes that trains nothing."""
        loaded: dict[int, Sample] = {}

        def get(p):
            if p not in loaded:
                try:
                    s = self.source.load(idx[p])
                    bad = check_sample(s, self.layout)
                    if bad or self.layout.rules.meta(s) != metas[p]:
                        raise DecodeError(bad or "decoded shapes differ from the index")
                except DecodeError as e:
                    skipped.append((sample_name(self.source, idx[p]), str(e)))
                    s = _blank(specs[p], idx[p])
                    failed.add(idx[p])
                loaded[p] = s
            return loaded[p]
        return get

    def samples(self, step: int) -> GlobalSamples:
        """Global batch `step` as its samples, in global batch order, selected and decoded
        exactly as `__call__` does (the single-program trainer's data: the same samples,
        skips and blanks as every plan's)."""
        skipped: list[tuple[str, str]] = []
        idx, specs, reasons = self.select(int(step), skipped)
        metas = [self.layout.rules.meta_from_shapes(i, s) for i, s in zip(idx, specs)]
        failed: set[int] = set()
        get = self._getter(idx, specs, metas, skipped, failed)
        samples = [get(p) for p in range(len(idx))]
        if failed:
            reasons["decode"] = reasons.get("decode", 0) + len(failed)
        return GlobalSamples(int(step), idx, samples, failed, sum(reasons.values()), skipped)

    def __call__(self, step: int) -> GlobalBatch:
        t0 = time.perf_counter()
        skipped: list[tuple[str, str]] = []
        idx, specs, reasons = self.select(int(step), skipped)
        metas = [self.layout.rules.meta_from_shapes(i, s) for i, s in zip(idx, specs)]
        mb_plans = plan_global_batch(metas, self.model, self.plan, self.layout, self.policies,
                                     self.algo, node_wise=self.node_wise,
                                     hardware=self.hardware)
        t_plan = time.perf_counter() - t0
        failed: set[int] = set()
        get = self._getter(idx, specs, metas, skipped, failed)

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
                            mask_out_failed(b, samples, failed)
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
                           sum(m.num_targets for m in metas), n_gen, len(failed), t_plan,
                           skipped)


# ---------------------------------------------------------------------------------------
# The grain pipeline
# ---------------------------------------------------------------------------------------

def _per_unit(value, model: MLLMConfig, setting: str, allowed, default: str) -> dict[str, str]:
    """A per-unit choice from one name (every unit) or a dict unit -> name (units left out
    get `default`), validated against `allowed`, errors naming `setting`."""
    units = model.unit_names
    if isinstance(value, str):
        pol = {u: value for u in units}
    elif isinstance(value, Mapping):
        unknown = set(value) - set(units)
        if unknown:
            raise UserError(f"{setting}: unknown units {sorted(unknown)}; units are {units}")
        pol = {u: value.get(u, default) for u in units}
    else:
        raise UserError(f"{setting}={value!r}: use one of {allowed} or a dict unit -> one "
                        f"of them")
    for u, p in pol.items():
        if p not in allowed:
            raise UserError(f"{setting}[{u!r}]={p!r}: use one of {allowed}")
    return pol


def _policies(balance, model: MLLMConfig) -> dict[str, str]:
    return _per_unit(balance, model, "Loader.balance", POLICIES, "none")


def post_balance_policies(value, model: MLLMConfig) -> dict[str, str]:
    """`Loader.post_balance_policy`: one OrchMLLM algorithm for every phase, or a dict unit
    -> algorithm (units left out use "sum"): "sum" (Algorithm 1, unpadded linear cost),
    "padded" (Algorithm 2), "sum_square" (Algorithm 4, attention-heavy), "conv" (Algorithm
    5); OrchMLLM picks per phase by its cost model (OrchMLLM §5.1, Appendix A)."""
    return _per_unit(value, model, "Loader.post_balance_policy", POST_BALANCE_POLICIES, "sum")


def _init_worker(worker_index: int, worker_count: int) -> None:
    from absl import flags
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


@gin.configurable
class Loader:
    """Iterator of `GlobalBatch`es with exact resume (`get_state` / `set_state`).

    `source`: a source object (`SyntheticSource`, `ArrayRecordSource`) or the path of an
    ArrayRecord file written by scripts/make_dataset.py. `balance`: one policy for every
    phase or a dict unit -> policy ("none", "disttrain", "orchmllm");
    `post_balance_policy`: the OrchMLLM algorithm, one for all phases or a dict unit ->
    algorithm (`post_balance_policies`); `node_wise_*`: `NodeWise` (with `ranks_per_node`);
    `hardware`: the planner's hardware whose cost model times microbatches for Algorithm 3.
    `shape_scan_steps` (feeds): every feed is padded to the union of the shapes of the first
    that many global batches (planned from metadata at start-up), so the stage and broker
    programs compile once, not once per new combination of balanced shapes.
    `num_workers` > 0 runs planning, decoding and assembly in grain worker processes; each
    holds `prefetch` (>= 2) global batches, and with 0 workers a thread prefetches
    `prefetch` global batches, so the trainer finds the next one ready. Gin, e.g.:
    `Loader.balance = {"vision": "orchmllm", "audio": "orchmllm", "llm": "disttrain"}`.
    """

    def __init__(self, source, model: MLLMConfig, plan: Plan, layout: AssemblyLayout,
                 balance="none", post_balance_policy="sum", ranks_per_node: int = 0,
                 seed: int = 0, reserve: int | None = None, shuffle: bool = True,
                 num_workers: int = 0, prefetch: int = 2, host_id: int = 0,
                 num_hosts: int = 1, num_steps: int = 1 << 31, feeds: bool = False,
                 cp_method: str = "lpt", cp_block: int = 128, node_wise_method: str = "auto",
                 node_wise_time_limit: float = 0.2, node_wise_max_milp_ranks: int = 32,
                 hardware: str = "h100", shape_scan_steps: int = 16):
        if prefetch < 2:
            raise UserError(f"Loader.prefetch={prefetch}: use >= 2 (global batches prepared "
                            f"ahead, so planning and preprocessing stay off the training "
                            f"path; MMScale §6)")
        source = as_source(source)
        rules = layout.rules
        if getattr(source, "patch_size", rules.patch_size) != rules.patch_size:
            raise UserError(f"Loader.source: the dataset was written with patch_size="
                            f"{source.patch_size} but the model's is {rules.patch_size}; "
                            f"rewrite it with scripts/make_dataset.py --patch_size="
                            f"{rules.patch_size}")
        node_wise = NodeWise(ranks_per_node, node_wise_method, node_wise_time_limit,
                             node_wise_max_milp_ranks)
        self.builder = GlobalBatchBuilder(
            source, model, plan, layout, _policies(balance, model), post_balance_policy,
            seed=seed, reserve=reserve, shuffle=shuffle, host_id=host_id, num_hosts=num_hosts,
            feeds=feeds, cp_method=cp_method, cp_block=cp_block, node_wise=node_wise,
            hardware=hardware_by_name(hardware))
        self.num_workers, self.prefetch, self.num_steps = num_workers, prefetch, num_steps
        if shape_scan_steps < 0:
            raise UserError(f"Loader.shape_scan_steps={shape_scan_steps}: use >= 0 (0: every "
                            f"microbatch at its own shapes, a compile per new shape)")
        if feeds and shape_scan_steps:
            self.builder.floor = self.builder.scan_floor(min(shape_scan_steps, num_steps))
        self.skipped_samples = 0
        self._it = None
        self.step = 0  # the grain pipeline starts at the first `next` (or `set_state`)

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
        if self._it is None:
            self._start(self.step)
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
