"""Asynchronous multimodal data loader: plan the global batch from metadata, materialise
only this host's share, prefetch ahead of the trainer (no JAX).

DistTrain §4.2 / MMScale §6 (CPU preprocessing disaggregated from training, producer-
consumer: decoding and reordering run in worker processes while the GPUs train) and OrchMLLM
§6 (the global orchestrator runs balancing on the CPU during prefetch, "as soon as all
the mini-batches have been sampled", and composes rearrangements). Built on grain:
`MapDataset.range(steps).map(GlobalBatchBuilder)` -> `to_iter_dataset` -> `mp_prefetch`
(worker processes) or thread prefetch. A global batch is a pure function of (seed, step),
so the iterator state is the next step and its stream position: resume is exact, and a
run resumed with another global batch goes on from the same sample
(data/stream_position.py).

One global batch (step k):
 1. Candidates (data/sample_stream.py, the same for every layout): positions
    [k*W, (k+1)*W) of the seeded per-epoch shuffle, W = global_batch
    + reserve (after a resume with another W: from the stored sample on). Each
    candidate's *shapes* (`source.spec`) are checked (`check_shapes`); bad
    ones (empty, undecodable shape, too long) are skipped and counted; the first
    `global_batch` good ones form the batch (an error names `reserve` if too few are good),
    or with `row_budget` the good ones of the window that pack into that many LLM rows.
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
 3. Routes (rearrangement composition, OrchMLLM §6): follow from the splits; the feed
    (data/feed.py) turns them into one part per (encoder rank, LLM rank) pair and rewrites
    the LLM's `gather_<e>` to index the parts it receives (`compose_rearrangement` in
    data/balance/ is the same map at sample level).
 4. Materialise each microbatch as one feed (data/feed.py `MicrobatchFeed`: every unit's
    and rank's inputs, stacked rank-major, and the parts between units). This host decodes
    only the samples its own DP ranks read (others are shape-only blanks: every host builds
    the same shapes and routes). A sample that fails to decode here is replaced by a blank
    of the same shapes with its loss masked out (shapes and routes stay valid), and counted
    as skipped.
"""
from __future__ import annotations

from typing import Any

from mmjax.data.global_batch import GlobalBatch, GlobalBatchBuilder, host_devices
from mmjax.data.loader_settings import loader_settings
from mmjax.data.sample_stream import SampleStream
from mmjax.models.config import MLLMConfig
from mmjax.planner.plan import Plan


class Loader:
    """Iterator of a plan's `GlobalBatch`es (its `builder` over a `SampleStream`) with
    exact resume (`get_state` / `set_state`: the one resume schema, data/stream_position.py).

    The `Loader.*` gin settings (data/loader_settings.py) are, e.g.: `balance`: one policy
    for every phase or a dict unit -> policy ("none", "disttrain", "orchmllm"; the LLM also
    "rows": whole packed rows per rank, data/row_deal.py); `post_balance_policy`: the
    OrchMLLM algorithm, one for all phases or a dict unit -> algorithm; `ranks_per_node` /
    `node_wise_*`: `NodeWise`; `hardware`: the planner's hardware whose cost model times
    microbatches for Algorithm 3. `shape_scan_steps`: every feed is padded to the union of
    the shapes of the first that many global batches (planned from metadata when the stream
    first starts), so the stage and broker programs compile once; None (default):
    `default_scan_steps` (64 global batches, at most 4,096 samples), whatever the run's
    length. `num_workers` > 0 runs planning, decoding and assembly in grain worker
    processes; each holds `prefetch` (>= 2) global batches, and with 0 workers a thread
    prefetches `prefetch` global batches. `producers` > 0 starts that many preprocessing
    processes on this host (pinned to `producer_cpus` if given), and `producer_addresses`
    ("HOST:PORT", each started with `python -m mmjax.data.producer --listen=HOST:PORT`)
    attaches to producers elsewhere (DistTrain §4.2, data/producer_pool.py); the batches
    are the same as without them. `row_budget`: LLM rows a global batch fills
    (data/row_budget.py). `max_bad_fraction`: a run stops (one line naming the worst
    files) once more than this share of the samples it drew were bad.
    Gin, e.g.: `Loader.balance = {"vision": "orchmllm", "llm": "disttrain"}`.
    """

    def __init__(self, builder: GlobalBatchBuilder):
        self.builder, self.stream = builder, builder.stream
        self._it: Any = None  # stream.deliver's iterator (with producers: their positions())
        self.step = 0  # the pipeline starts at the first `next` (or `set_state`)

    @classmethod
    def build(cls, source, model: MLLMConfig, plan: Plan, layout, balance=None, *,
              local_devices: frozenset[int] | None = None, host_id: int = 0,
              num_hosts: int = 1, **settings) -> "Loader":
        """The loader of `plan` over `source`, its settings gin's `Loader.*` with
        `settings` (and `balance`, when given) over them. `local_devices` (the runtime's
        own device map) wins over the contiguous-block split of `host_id` / `num_hosts`."""
        if balance is not None:
            settings["balance"] = balance
        stream_settings, balance_settings = loader_settings(**settings)
        stream = SampleStream(source, layout, plan.global_batch, stream_settings,
                              plan.num_microbatches)
        local = (local_devices if local_devices is not None
                 else host_devices(plan, host_id, num_hosts))
        return cls(GlobalBatchBuilder(stream, model, plan, balance_settings, local))

    @property
    def exchange(self) -> str:
        """`Loader.exchange`: the form of the pipeline's broker exchanges."""
        return self.builder.balance.exchange

    @property
    def max_bad_fraction(self) -> float:
        """The trainer stops a run whose share of bad samples passes this."""
        return self.stream.settings.max_bad_fraction

    def feed_floor(self):
        """The shapes every feed is padded to: the union over global batches 0 ..
        `scan_steps` - 1 (from step 0, so a resumed run pads as the uninterrupted one),
        scanned from metadata on first use; None with no scan."""
        if self.builder.floor is None and self.stream.scan_steps:
            self.builder.floor = self.builder.scan_floor(self.stream.scan_steps)
        return self.builder.floor

    def close(self) -> None:
        """Stop prefetch threads / worker processes of the current pipeline."""
        if self._it is not None:
            self._it.close()
            self._it = None

    def _start(self, step: int) -> None:
        """(Re)start the stream from global batch `step` on. Global batches are a pure
        function of the step and the stream's origin, so those are the whole iterator
        state: exact, and portable across worker and producer counts."""
        self.close()
        self.feed_floor()
        self._it = self.stream.deliver(self.builder, step)
        self.step = step

    def __iter__(self):
        return self

    def __next__(self) -> GlobalBatch:
        if self._it is None:
            self._start(self.step)
        gb = next(self._it)
        self.step = gb.step + 1
        return gb

    def get_state(self) -> dict:
        """The resume schema (`SampleStream.state`: the next step, its first stream sample,
        the settings that drew the windows); with producers also their positions (the
        steps each has in flight; a resume restarts them all from `step`)."""
        state = self.stream.state(self.step)
        if hasattr(self._it, "positions"):
            state["producers"] = self._it.positions()
        return state

    def set_state(self, state: dict) -> None:
        """Go on from `state` (the resume schema; an older loader state's
        "skipped_samples" is the trainer's and ignored)."""
        self._start(self.stream.resume(state))
