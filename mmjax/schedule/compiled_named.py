"""The rows of each named schedule (schedule/named.py) as compiled_timing `Rows`, so the
planner's timer (planner/schedule_time.py) prices the schedule a run will execute: "1f1b"
and "interleaved" are `schedule_rows` (the same rows: `multimodal_one_f_one_b`), "gpipe"
is `multimodal_gpipe` laid out as arrays (no JAX)."""
from __future__ import annotations

import numpy as np

from mmjax.schedule.compiled_timing import ChainLayout, Rows, schedule_rows


def gpipe_rows(lay: ChainLayout, m: int) -> Rows:
    """`multimodal_gpipe`'s rows: per physical stage every chunk's forwards in microbatch
    order, chunk 0 first, then the backwards of the chunks that run one, the last first."""
    if m < 1:
        raise ValueError(f"num_microbatches={m!r}: must be an int >= 1")
    kind: list[int] = []
    mb: list[int] = []
    chunk: list[int] = []
    ptr = [0]
    for st in range(lay.num_stages):
        v = int(lay.stage_v[st])
        back = [c for c in reversed(range(v)) if lay.runs_backward[lay.stage_node[st, c]]]
        for k, chunks in ((0, range(v)), (1, back)):
            for c in chunks:
                kind += [k] * m
                mb += range(m)
                chunk += [c] * m
        ptr.append(len(kind))
    as_ints = lambda x: np.asarray(x, np.int64)  # noqa: E731
    return Rows(as_ints(ptr), as_ints(kind), as_ints(mb), as_ints(chunk),
                np.full(lay.num_stages, m, np.int64) * lay.stage_v, m)


def named_rows(name: str, lay: ChainLayout, m: int) -> Rows:
    """The rows of schedule `name` ("1f1b", "interleaved", "gpipe") over `lay`."""
    return gpipe_rows(lay, m) if name == "gpipe" else schedule_rows(lay, m)
