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
 1. Candidates: positions [k*W, (k+1)*W) of the seeded per-epoch shuffle, W = global_batch
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

import gin

from mmjax.data.layout import AssemblyLayout
from mmjax.errors import UserError
from mmjax.models.config import MLLMConfig
from mmjax.planner.hardware import hardware as hardware_by_name
from mmjax.planner.plan import Plan
from mmjax.data.batch_plan import NodeWise, unit_policies
from mmjax.data.global_batch import GlobalBatch, GlobalBatchBuilder
from mmjax.data.records import as_source


# global batches whose shapes a run scans at start-up by default (metadata only: about a
# millisecond each unbalanced, ~7 ms balanced at the tiny config), however long the run:
# the programs' shapes do not depend on train.steps, so runs of any length share the
# compilation cache; a run that meets a larger batch later grows its shapes and compiles,
# with a console line. At most SHAPE_SCAN_SAMPLES samples (fewer batches for a large
# global batch), so the scan takes about a second whatever the batch.
SHAPE_SCAN_STEPS = 64
SHAPE_SCAN_SAMPLES = 4096


def default_scan_steps(global_batch: int) -> int:
    """Global batches scanned for the shape floor by default (not the run's length)."""
    return max(1, min(SHAPE_SCAN_STEPS, SHAPE_SCAN_SAMPLES // max(global_batch, 1)))


def _init_worker(worker_index: int, worker_count: int) -> None:
    from absl import flags
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


@gin.configurable
class Loader:
    """Iterator of `GlobalBatch`es with exact resume (`get_state` / `set_state`).

    `source`: a source object (`SyntheticSource`, `ArrayRecordSource`) or the path of an
    ArrayRecord file written by scripts/make_dataset.py. `balance`: one policy for every
    phase or a dict unit -> policy ("none", "disttrain", "orchmllm"; the LLM also "rows":
    whole packed rows per rank, data/row_deal.py);
    `post_balance_policy`: the OrchMLLM algorithm, one for all phases or a dict unit ->
    algorithm (`post_balance_policies`); `node_wise_*`: `NodeWise` (with `ranks_per_node`);
    `hardware`: the planner's hardware whose cost model times microbatches for Algorithm 3.
    `shape_scan_steps`: every feed is padded to the union of the shapes of the first that
    many global batches (planned from metadata when the stream first starts; the single
    program, which draws whole global batches as samples, never scans), so the stage and broker
    programs compile once, not once per new combination of balanced shapes; None (default):
    `default_scan_steps` (64 global batches, at most 4,096 samples), whatever the run's
    length (`num_steps`), so runs of other lengths compile the same programs.
    `num_workers` > 0 runs planning, decoding and assembly in grain worker processes; each
    holds `prefetch` (>= 2) global batches, and with 0 workers a thread prefetches
    `prefetch` global batches, so the trainer finds the next one ready.
    `producers` > 0 starts that many preprocessing processes on this host (pinned to
    `producer_cpus` if given), and `producer_addresses` ("HOST:PORT", each started with
    `python -m mmjax.data.producer --listen=HOST:PORT`) attaches to producers elsewhere
    (DistTrain §4.2, data/producer_pool.py): they build whole global batches, `prefetch`
    each ahead of the trainer; the batches are the same as without them.
    `row_budget`: LLM rows a global batch fills (data/row_budget.py): a step takes the
    usable samples of its window that pack into that many rows, a variable number (None:
    `global_batch` samples a step).
    `exchange`: the form of the data exchanges between layouts (the co-located encoder->LLM
    rearrangement, the pipeline's brokers): "staged" collective permutes, "ragged" one
    `lax.ragged_all_to_all` (GPU only), "auto" staged until a GPU run checks the ragged form (parallel/ragged_exchange.py).
    `max_bad_fraction`: a run stops (one line naming the worst files) once more than this
    share of the samples it drew were bad (skipped; at least 4 global batches drawn).
    Gin, e.g.:
    `Loader.balance = {"vision": "orchmllm", "audio": "orchmllm", "llm": "disttrain"}`.
    """

    def __init__(self, source, model: MLLMConfig, plan: Plan, layout: AssemblyLayout,
                 balance="none", post_balance_policy="sum", ranks_per_node: int = 0,
                 seed: int = 0, reserve: int | None = None, shuffle: bool = True,
                 num_workers: int = 0, prefetch: int = 2, host_id: int = 0,
                 num_hosts: int = 1, num_steps: int = 1 << 31,
                 cp_method: str = "lpt", cp_block: int = 128, node_wise_method: str = "auto",
                 node_wise_time_limit: float = 0.2, node_wise_max_milp_ranks: int = 32,
                 hardware: str = "h100", shape_scan_steps: int | None = None,
                 local_devices: frozenset[int] | None = None, max_bad_fraction: float = 0.5,
                 producers: int = 0, producer_addresses=None, producer_cpus=None,
                 producer_timeout: float = 300.0, row_budget: int | None = None,
                 exchange: str = "auto"):
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
        # as given (a dict names units): the co-located layout checks what it can honour
        self.balance, self.post_balance_policy = balance, post_balance_policy
        self.exchange = exchange  # the co-located exchange's form (train/colocated_data.py)
        node_wise = NodeWise(ranks_per_node, node_wise_method, node_wise_time_limit,
                             node_wise_max_milp_ranks)
        self.builder = GlobalBatchBuilder(
            source, model, plan, layout, unit_policies(balance, model, layout.packing),
            post_balance_policy,
            seed=seed, reserve=reserve, shuffle=shuffle, host_id=host_id, num_hosts=num_hosts,
            cp_method=cp_method, cp_block=cp_block, node_wise=node_wise,
            hardware=hardware_by_name(hardware), local_devices=local_devices,
            row_budget=row_budget)
        if producers < 0 or producer_timeout <= 0:
            raise UserError(f"Loader.producers={producers} / producer_timeout="
                            f"{producer_timeout}: use producers >= 0 and a timeout > 0 s")
        if (producers or producer_addresses) and num_workers:
            raise UserError("Loader.num_workers and Loader.producers / producer_addresses are "
                            "both set: producers replace grain workers; keep one")
        from mmjax.data.producer import endpoint
        producer_addresses, producer_cpus = producer_addresses or (), producer_cpus or ()
        for a in producer_addresses:
            try:
                endpoint(a)
            except ValueError as e:
                raise UserError(f"Loader.producer_addresses: {e}") from None
        self.producers, self.producer_addresses = producers, tuple(producer_addresses)
        self.producer_cpus, self.producer_timeout = tuple(producer_cpus), producer_timeout
        self.num_workers, self.prefetch, self.num_steps = num_workers, prefetch, num_steps
        if shape_scan_steps is None:
            # not the run's length: shapes stay put
            shape_scan_steps = default_scan_steps(plan.global_batch)
        self.shape_scan_steps = shape_scan_steps
        if shape_scan_steps < 0:
            raise UserError(f"Loader.shape_scan_steps={shape_scan_steps}: use >= 0 (0: every "
                            f"microbatch at its own shapes, a compile per new shape)")
        # the trainer stops a run whose share of bad samples passes this (train/trainer.py)
        self.max_bad_fraction = max_bad_fraction
        self._it = None
        self.step = 0  # the grain pipeline starts at the first `next` (or `set_state`)

    def feed_floor(self):
        """The shapes every feed is padded to: the union over global batches 0 ..
        `shape_scan_steps` - 1 (from step 0, so a resumed run pads as the uninterrupted
        one), scanned from metadata on first use; None with no scan."""
        if self.builder.floor is None and self.shape_scan_steps:
            self.builder.floor = self.builder.scan_floor(self.shape_scan_steps)
        return self.builder.floor

    def close(self) -> None:
        """Stop prefetch threads / worker processes of the current pipeline."""
        if self._it is not None:
            self._it.close()
            self._it = None

    def stream(self, fn, step: int):
        """Iterator of fn(s) for s = step, step + 1, ...: from producer processes when the
        loader has them, else grain (worker processes or a prefetch thread). `fn` is the
        builder or `builder.samples` (the single program's global batches)."""
        if self.producers or self.producer_addresses:
            from mmjax.data.producer_pool import ProducerPool
            return ProducerPool(fn, step, self.num_steps, self.producers,
                                self.producer_addresses, self.prefetch, self.producer_timeout,
                                self.producer_cpus)
        return self._grain(fn, step)

    def _start(self, step: int) -> None:
        """(Re)start the stream from global batch `step` on. Global batches are a pure
        function of the step, so the step is the whole iterator state: exact, and portable
        across worker and producer counts (grain's own multiprocess state is not)."""
        self.close()
        self.feed_floor()
        self._it = self.stream(self.builder, step)
        self.step = step

    def _grain(self, fn, step: int):
        import grain
        ds = grain.MapDataset.range(step, self.num_steps).map(fn)
        it_ds = ds.to_iter_dataset(grain.ReadOptions(
            num_threads=1 if self.num_workers == 0 else 0, prefetch_buffer_size=self.prefetch))
        if self.num_workers > 0:
            _init_worker(0, 1)
            it_ds = it_ds.mp_prefetch(grain.MultiprocessingOptions(
                num_workers=self.num_workers, per_worker_buffer_size=self.prefetch),
                worker_init_fn=_init_worker)
        return iter(it_ds)

    def __iter__(self):
        return self

    def __next__(self) -> GlobalBatch:
        if self._it is None:
            self._start(self.step)
        gb = next(self._it)
        self.step = gb.step + 1
        return gb

    def get_state(self) -> dict:
        """JSON-able state (stored with the checkpoint): the next step and its position in
        the sample stream (`GlobalBatchBuilder.position`: the sample, global batch and
        sequence length; data/stream_position.py); with producers also their positions
        (the steps each has in flight; a resume restarts them all from `step`, whatever
        their number). The run's skip total is the trainer's."""
        state = {"step": self.step, **self.builder.position(self.step)}
        if hasattr(self._it, "positions"):
            state["producers"] = self._it.positions()
        return state

    def set_state(self, state: dict) -> None:
        """Go on from `state`: at its stored sample (with this loader's global batch), or,
        for a state that predates samples, at its step's window of a fresh run."""
        step = int(state["step"])  # an older state's "skipped_samples": the trainer's
        self.builder.resume(state, step)
        self._start(step)
