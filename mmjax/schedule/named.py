"""Pipeline schedules chosen by name (`train.schedule`), over the unit DAG (no JAX).

Each name maps to a pure function `(graph, num_microbatches) -> {physical StageId: row}`
(schedule.py's dict form: a stage's row is the order its devices run its actions; the
plan's `num_chunks` places the virtual stages, the schedule orders them):

- "1f1b" (default): `multimodal_one_f_one_b`, Cornstarch §4.1's 1F1B over the unit DAG
  (Megatron-LM §2.2 warm-ups); a unit the plan gives num_chunks > 1 runs Megatron-LM's
  interleaved order (§2.2 "Schedule with Interleaved Stages") on its stages, as Megatron
  does once virtual stages are configured.
- "interleaved": the same rows, for a plan that must interleave: refused unless some unit
  with pp > 1 has num_chunks > 1 (its stages then hold several virtual stages each).
- "gpipe": `multimodal_gpipe`, GPipe (Huang et al., 2019, §2.2): every stage runs all its
  forwards, then all its backwards; at most every microbatch in flight, the most memory.
"""
from __future__ import annotations

from mmjax.errors import UserError
from mmjax.schedule.schedule import _check_sizes, multimodal_one_f_one_b
from mmjax.schedule.stage_graph import Action, StageGraph, StageId

SCHEDULES = ("1f1b", "interleaved", "gpipe")


def multimodal_gpipe(graph: StageGraph, num_microbatches: int) -> dict[StageId, list[Action]]:
    """GPipe over the unit DAG, keyed by physical stage: the forwards of every microbatch
    chunk by chunk (chunk 0 first), then the backwards chunk by chunk in reverse (the last
    chunk first), each in microbatch order. Chunks that run no backward (Cornstarch §4.2)
    drop their B actions. On a chain of one-chunk stages every row is `gpipe(p, m)`'s."""
    _check_sizes(1, num_microbatches)
    m, out = num_microbatches, {}
    for s in graph.physical_stages:
        v = graph.num_chunks(s.unit)
        back = [c for c in reversed(range(v)) if graph.runs_backward(graph.virtual(s, c))]
        out[s] = ([Action("F", i, c) for c in range(v) for i in range(m)]
                  + [Action("B", i, c) for c in back for i in range(m)])
    return out


def interleaved(graph: StageGraph, num_microbatches: int) -> dict[StageId, list[Action]]:
    """Megatron-LM's interleaved 1F1B on every unit the plan gives virtual stages (the
    "1f1b" rows); refused (UserError) when no pipelined unit has num_chunks > 1."""
    chunked = [u for u in _units(graph) if graph.num_chunks(u) > 1 and graph.num_stages(u) > 1]
    if not chunked:
        raise UserError("train.schedule='interleaved' needs virtual stages: no unit with "
                        "pp > 1 has num_chunks > 1 in the plan (set e.g. "
                        "manual_plan.num_chunks={'llm': 2}, or use train.schedule='1f1b')")
    return multimodal_one_f_one_b(graph, num_microbatches)


_BY_NAME = {"1f1b": multimodal_one_f_one_b, "interleaved": interleaved,
            "gpipe": multimodal_gpipe}


def named_schedule(name: str, graph: StageGraph,
                   num_microbatches: int) -> dict[StageId, list[Action]]:
    """The rows of schedule `name` (one of SCHEDULES) over `graph`."""
    if name not in _BY_NAME:
        raise UserError(f"train.schedule={name!r}: not a pipeline schedule (use one of "
                        f"{', '.join(SCHEDULES)})")
    return _BY_NAME[name](graph, num_microbatches)


def _units(graph: StageGraph) -> list[str]:
    return list(dict.fromkeys(s.unit for s in graph.physical_stages))
