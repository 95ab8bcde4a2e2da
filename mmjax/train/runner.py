"""What the training loop asks of a way to run a step: the typed `Runner` protocol that the
whole-model runner (train/whole_model.py, on one device or a co-located mesh) and the
pipelined runner (train/pipelined.py) implement (mypy checks both where
train/make_runner.py returns them), and the `StepMetrics` each step returns.

A runner owns its run's training state (parameters, optimizer state, the data position):
the loop steps it, saves what `checkpoint()` hands out and gives back what it restored to
`load`. Nothing else reads or writes that state.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from math import inf
from typing import Protocol


@dataclass
class StepMetrics:
    """One training step as a runner reports it (host floats, after the step's one sync).
    `nonfinite` / `spike`: the step was not applied (its loss or gradient norm was not
    finite / passed the loss-spike guard's limits). `skipped`: samples this step's global
    batch skipped, `skipped_list` their (name, reason, (file, kind, place)); the run's total
    is the training loop's. `compile_s`: compile time inside the step (0: none);
    `compiled_programs`: how many programs compiled inside it (the loop's count);
    `compile_reason`: why a program compiled, when the runner knows; `trace`: the traced
    step's action records (pipeline/trace.py), else None. `extra`: more numbers for the
    step's metrics row (the co-located runner's all-to-all bytes per link class)."""

    loss: float
    lm_loss: float
    diffusion_loss: float
    grad_norm: float
    nonfinite: bool = False
    spike: bool = False
    step_time_s: float = 0.0
    compile_s: float = 0.0
    data_wait_s: float = 0.0
    tokens: int = 0
    tokens_trained: int = 0
    llm_slots: int = 0  # LLM token slots of the step's static shapes (rows x seq_len)
    skipped: int = 0
    skipped_list: list = field(default_factory=list)
    compile_reason: str = ""
    compiled_programs: int = 0  # XLA compilations inside the step (train/compile_watch.py)
    trace: list | None = None
    extra: dict = field(default_factory=dict)  # runner-specific numbers for the metrics row

    @property
    def applied(self) -> bool:
        return not (self.nonfinite or self.spike)


class Runner(Protocol):
    """One way to run the model's training steps, fed by its own loader.

    `checkpoint()` -> (named arrays, JSON-able data state): the plan-independent names of
    train/logical_state.py, so a checkpoint of one runner or plan restores into any other;
    `restore_target()`: the arrays' names, shapes and shardings to restore into (no init
    run); `load(arrays, data_state, step)`: continue from a checkpoint of step `step`, at
    the sample its loader stopped at (data/stream_position.py), returning one line that
    names the data settings changed since (global batch, sequence length) or None."""

    global_batch: int
    num_trainable: int
    memory_line: str | None  # the start-up memory estimate, when there is one
    max_bad_fraction: float  # the loader's limit on the share of bad samples
    progress: object  # train/progress.py Progress (set by the trainer), or None

    def step(self, trace: bool = False, limits=(inf, inf)) -> StepMetrics: ...

    def evaluate(self, source, max_batches: int, layout) -> float: ...

    def checkpoint(self) -> tuple[dict, dict]: ...

    def restore_target(self) -> dict: ...

    def load(self, arrays: dict, data_state: dict, step: int) -> str | None: ...

    def close(self) -> None: ...
