"""Where a run stands in its sample stream, counted in samples (no JAX).

The stream is the seeded per-epoch shuffle of the data set (`GlobalBatchBuilder._index`):
a pure function of the position, whatever the global batch. Global batch k draws the window
of W = global_batch + reserve positions that starts at `StreamOrigin.start(k, W)`; each
window follows the last, so a fresh run's origin is (step 0, sample 0) and
start(k) = k * W.

A loader state stores the position of its next window (`sample`) with the settings that
drew the windows so far (`global_batch`, `seq_len`). A run resumed at step k0 takes the
origin (k0, sample): with another global batch (another W) the windows go on from that
sample, so no sample is read twice or skipped, and the trainer says once what changed
(`resume_notice`). With the same settings the origin gives start(k) = k * W: the windows of
the uninterrupted run. A state written before positions were stored in samples (the step
alone) resumes at k * W of the current W, exactly as it did then.
"""
from __future__ import annotations

from dataclasses import dataclass

POSITION_KEYS = ("sample", "global_batch", "seq_len")


@dataclass(frozen=True)
class StreamOrigin:
    """Global batch `step` starts at stream position `sample`; later ones follow it."""

    step: int = 0
    sample: int = 0

    def start(self, step: int, window: int) -> int:
        """Stream position of the first candidate of global batch `step` (>= self.step)."""
        return self.sample + (step - self.step) * window


def position_fields(state: dict) -> dict:
    """The position keys of a loader state (empty for one written before them)."""
    return {k: state[k] for k in POSITION_KEYS if k in state}


def resumed_origin(state: dict, step: int) -> StreamOrigin:
    """The origin of a run resumed at global batch `step` from loader `state`: its stored
    sample, or (a state without one) the fresh run's origin, windows at step * W."""
    if "sample" not in state:
        return StreamOrigin()
    return StreamOrigin(int(step), int(state["sample"]))


def resume_notice(state: dict, step: int, global_batch: int, seq_len: int) -> str | None:
    """One console line naming the data settings that differ from those the stored position
    was reached with (None when none does, or the state predates them)."""
    if "sample" not in state:
        return None
    changed = [f"{name} {old} -> {new}" for name, old, new in (
        ("train.global_batch", state.get("global_batch"), global_batch),
        ("data_layout.seq_len", state.get("seq_len"), seq_len)) if old is not None and old != new]
    if not changed:
        return None
    return (f"resumed with {', '.join(changed)}: the data stream goes on from sample "
            f"{int(state['sample'])} (global batch {step} on), no sample read twice or skipped")


def settings_changed(state: dict, global_batch: int, seq_len: int) -> bool:
    """Whether the state's position was reached with other batch settings (its high-water
    shapes then belong to other batches: the resumed run starts from its own floor)."""
    return resume_notice(state, 0, global_batch, seq_len) is not None


# the checkpoint's data-state key of the one resume schema: {"step": next global batch,
# "sample", "global_batch", "seq_len" (the position; absent in states older than it), then
# what a layout keeps of its own: "shapes" (the single program's high-water batch shapes),
# "phase_shapes" and "capacity" (the co-located layout's), "producers" (informational)}
STATE_KEY = "stream"
_OLD_KEYS = ("loader", "batches")  # a plan's loader state; the single / co-located one's


def stream_state(data_state: dict, step: int) -> dict:
    """A checkpoint's data state in the one resume schema, whichever runner and version
    wrote it: `STATE_KEY`; an older plan's "loader" ({"step", ...}); an older single or
    co-located program's "batches" ({"next_batch", ...}); none (a checkpoint without a
    stream): global batch `step` of a fresh run's windows."""
    for key in (STATE_KEY, *_OLD_KEYS):
        if key in data_state:
            state = dict(data_state[key])
            if "next_batch" in state:
                state["step"] = state.pop("next_batch")
            state.pop("skipped_samples", None)  # an older loader's: the trainer's total
            state.setdefault("step", step)
            return state
    return {"step": step}


def stored_position(data_state: dict) -> dict:
    """The position keys of a checkpoint's data state, whichever runner wrote it."""
    return position_fields(stream_state(data_state, 0))
