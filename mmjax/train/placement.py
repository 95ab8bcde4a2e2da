"""`Placement`: where the whole-model runner (train/whole_model.py) runs its one jitted step:
one device (`single_program.OneDevice`, the parity reference) or a co-located mesh of every
device (`colocated.ColocatedMesh`: each unit's tp, its ZeRO stage, the per-phase balancing
exchange). The runner's loop, state, checkpoints and evaluation are the same for both; what
differs is asked of the placement, and nothing else is.

A placement serves one runner: `batches` is called once, first, and may set what its later
answers depend on (the co-located mesh: whether the phases are balanced).
"""
from __future__ import annotations

from typing import Any, Protocol

from mmjax.train.state import TrainState


class Placement(Protocol):
    """`devices`: where the step runs; `program_cache`: its compiled step may be stored and
    loaded untraced (train/program_cache.py: a program on one device)."""

    devices: list
    program_cache: bool

    def batches(self, source, cfg, layout, global_batch: int) -> Any:
        """The run's global batches as this placement trains them: an iterator of
        (batch, skipped) with `state()` / `restore(state)` / `close()`, `floor` (the scanned
        shapes) and `loader` (train/single_data.py `LoaderBatches` or, balanced co-located,
        train/colocated_data.py `PhaseBatches`)."""
        ...

    def memory_line(self, cfg, data, layout, abstract: TrainState, abstract_frozen, dtype,
                    attention_impl: str, global_batch: int, check_memory: bool) -> str | None:
        """The step's memory estimate at `data`'s scanned shapes, before anything compiles
        (None: no shapes to estimate at); with `check_memory`, a UserError when it does not
        fit (train/memory_check.py)."""
        ...

    def shardings(self, abstract: TrainState, abstract_frozen) -> tuple[Any, Any]:
        """(the TrainState's per-leaf shardings, the frozen parameters')."""
        ...

    def prefetch_init(self, cfg, key, filters: tuple) -> None:
        """`init`'s program for these arguments may start loading now (in a thread, from
        the program cache), before the data's shape scan; `init` may never be called (a
        resume)."""
        ...

    def init(self, cfg, key, filters: tuple, tx, shardings: tuple) -> tuple[TrainState, Any]:
        """(a fresh TrainState (step 0, no data position), the frozen parameters), made from
        `key` on `shardings` (`shardings()`'s pair)."""
        ...

    def fetch(self, tree) -> Any:
        """Placed arrays as values a host-side model can be merged from and loaded into."""
        ...

    def put(self, tree, shardings) -> Any:
        """`tree` (any placement, or host values) on `shardings`."""
        ...

    def step_fn(self, graphdef, tx, dtype, attention_impl: str, mask_family: str, tx_at,
                abstract: TrainState) -> Any:
        """The jitted (state, frozen, inputs, limits, learning rate) -> (state, metrics)
        step (train/step.py `train_step_fn`), the state donated, kept on `abstract`'s
        shardings."""
        ...

    def inputs(self, batch) -> dict:
        """The step's inputs for one of `batches()`' batches (or a plain held-out one)."""
        ...

    def step_extra(self, key, compiled) -> dict:
        """More numbers for the metrics row of the step just run by `compiled` (the program
        for input key `key`): the co-located exchange's bytes per link class, else {}."""
        ...
