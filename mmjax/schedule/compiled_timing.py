"""The multimodal 1F1B schedule built and timed in compiled loops (numba, no JAX): the
same rows as schedule.py `multimodal_one_f_one_b` and the same times as simulate.py
`simulate` over them, bit for bit, without a Python step per action.

`ChainLayout.of` lays a unit DAG out as arrays: each unit a chain of pp * v virtual
stages (nodes, numbered unit by unit in the DAG's order, so every edge points forward),
the physical stage and chunk of each node, its predecessor and successor nodes, whether
it runs a backward (Cornstarch §4.2) and its depth to the sink. `schedule_rows` builds
every physical stage's row (1F1B warm-up = the virtual stages downstream; Megatron-LM's
interleaved warm-up for v > 1) and raises a warm-up where the rows deadlock, by the rule
of `multimodal_one_f_one_b`. `makespan` runs the rows: an action starts when its stage is
free and its dependencies have ended, plus `comm` when a dependency ran on another stage.
The planner times every candidate plan with these (planner/schedule_time.py); tests check
rows and times against the event-walking Python on random graphs.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from mmjax.models.units import UnitDag, is_encoder


@dataclass(frozen=True)
class ChainLayout:
    """A unit DAG as arrays over its virtual stages (nodes) and physical stages."""

    units: tuple[str, ...]
    unit_nodes: tuple[tuple[int, int], ...]  # [first, end) node of each unit
    node_stage: np.ndarray  # physical stage of each node
    node_chunk: np.ndarray
    runs_backward: np.ndarray  # bool per node
    depth: np.ndarray  # virtual stages downstream of each node (longest path)
    pred_ptr: np.ndarray  # CSR: preds of node k are pred_idx[pred_ptr[k]:pred_ptr[k + 1]]
    pred_idx: np.ndarray
    succ_ptr: np.ndarray
    succ_idx: np.ndarray
    stage_pp: np.ndarray  # per physical stage: its unit's pp, chunks, index in the unit
    stage_v: np.ndarray
    stage_index: np.ndarray
    stage_node: np.ndarray  # [stage, chunk] -> node (-1 past the unit's chunks)

    @classmethod
    def of(cls, dag: UnitDag, pp: dict, chunks: dict | None = None,
           trainable: dict | None = None) -> "ChainLayout":
        """`StageGraph.from_dag(dag, pp, trainable, chunks)` as arrays (same node order,
        edges and backward modes); `trainable[unit]` a bool or one per virtual stage."""
        chunks = chunks or {}
        spans, first_stage, n, ns = {}, {}, 0, 0
        for u in dag.names:
            k = pp[u] * chunks.get(u, 1)
            spans[u], first_stage[u] = (n, n + k), ns
            n, ns = n + k, ns + pp[u]
        node_stage = np.zeros(n, np.int64)
        node_chunk = np.zeros(n, np.int64)
        train = np.ones(n, bool)
        preds: list[list[int]] = [[] for _ in range(n)]
        succs: list[list[int]] = [[] for _ in range(n)]
        for u in dag.names:
            a, b = spans[u]
            p = pp[u]
            for k in range(a, b):
                node_stage[k] = first_stage[u] + (k - a) % p
                node_chunk[k] = (k - a) // p
                if k > a:
                    preds[k].append(k - 1)
                    succs[k - 1].append(k)
            flags = True if trainable is None else trainable[u]
            train[a:b] = flags if isinstance(flags, bool) else np.asarray(flags, bool)
        for x, y in _unit_edges(dag):  # the edge order of `StageGraph.from_dag`
            last, head = spans[x][1] - 1, spans[y][0]
            succs[last].append(head)
            preds[head].append(last)
        upstream = np.zeros(n, bool)
        for k in range(n):  # nodes are in topological order
            upstream[k] = any(upstream[j] or train[j] for j in preds[k])
        depth = np.zeros(n, np.int64)
        for k in range(n - 1, -1, -1):
            depth[k] = max((1 + depth[j] for j in succs[k]), default=0)
        stage_pp, stage_v, stage_index = (np.zeros(ns, np.int64) for _ in range(3))
        vmax = max((chunks.get(u, 1) for u in dag.names), default=1)
        stage_node = np.full((ns, vmax), -1, np.int64)
        for u in dag.names:
            p, v = pp[u], chunks.get(u, 1)
            for s in range(p):
                st = first_stage[u] + s
                stage_pp[st], stage_v[st], stage_index[st] = p, v, s
                for c in range(v):
                    stage_node[st, c] = spans[u][0] + c * p + s
        return cls(tuple(dag.names), tuple(spans[u] for u in dag.names), node_stage,
                   node_chunk, train | upstream, depth, *_csr(preds), *_csr(succs),
                   stage_pp, stage_v, stage_index, stage_node)

    @property
    def num_stages(self) -> int:
        return len(self.stage_pp)


def _unit_edges(dag: UnitDag) -> list[tuple[str, str]]:
    out = [(u, b) for u in dag.names if is_encoder(u) for b in dag.successors(u)]
    return out + [(a, b) for a, b in dag.edges if not is_encoder(a)]


def _csr(lists: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    ptr = np.zeros(len(lists) + 1, np.int64)
    ptr[1:] = np.cumsum([len(x) for x in lists])
    idx = np.array([j for x in lists for j in x], np.int64)
    return ptr, idx


def _interleaved_warmup(p, m, v, s):
    return m * v if m == p else min(2 * (p - s - 1) + (v - 1) * p, m * v)


def first_warmups(lay: ChainLayout, m: int) -> np.ndarray:
    """Per physical stage, `multimodal_one_f_one_b`'s warm-up before any deadlock raise."""
    warm = np.zeros(lay.num_stages, np.int64)
    for st in range(lay.num_stages):
        p, v, s = int(lay.stage_pp[st]), int(lay.stage_v[st]), int(lay.stage_index[st])
        if v == 1:
            warm[st] = lay.depth[lay.stage_node[st, 0]]
        else:
            if m % p:
                raise ValueError(f"num_microbatches={m} must be a multiple of the pp of an "
                                 f"interleaved unit ({p}) for the interleaved schedule")
            last = lay.stage_node[st, 0] - s + p * v - 1
            warm[st] = m * v if m == p else _interleaved_warmup(p, m, v, s) + lay.depth[last]
    return warm


@njit(cache=True)
def _row_lengths(stage_v, stage_node, runs_backward, m):
    ns = len(stage_v)
    ptr = np.zeros(ns + 1, np.int64)
    for st in range(ns):
        nb = 0
        for c in range(stage_v[st]):
            if runs_backward[stage_node[st, c]]:
                nb += 1
        ptr[st + 1] = ptr[st] + m * stage_v[st] + m * nb
    return ptr


@njit(cache=True)
def _fill_row(st, stage_pp, stage_v, stage_node, runs_backward, warm, m, ptr, kind, mb,
              chunk):
    """Stage st's row (kind 0 = F / 1 = B, microbatch, chunk) into ptr[st]:ptr[st + 1]:
    schedule.py `_interleaved_row` (v = 1: `_warmup_steady_cooldown`), dropping the B of
    chunks that run no backward."""
    p, v = stage_pp[st], stage_v[st]
    total = m * v
    w = min(warm[st], total)
    i = ptr[st]
    for step in range(total + total):  # w F steps, then F and B steps alternating, then B
        if step < w:
            k, fwd = step, True
        elif step < w + 2 * (total - w):
            j = step - w
            if j % 2 == 0:
                k, fwd = w + j // 2, True
            else:
                k, fwd = j // 2, False
        else:
            k, fwd = step - total, False
        c = (k % (p * v)) // p
        if not fwd:
            c = v - 1 - c
            if not runs_backward[stage_node[st, c]]:
                continue
        kind[i] = 0 if fwd else 1
        mb[i] = (k // (p * v)) * p + k % p
        chunk[i] = c
        i += 1


@njit(cache=True)
def _run(ptr, kind, mb, chunk, stage_node, node_stage, pred_ptr, pred_idx, succ_ptr,
         succ_idx, runs_backward, dur_f, dur_b, comm, m, limit=np.inf):
    """The rows run to completion or deadlock: (start, end per action, position reached
    per stage, F done, B done [node, microbatch]). Stages are swept until none moves; an
    action's times depend on its dependencies alone, so the sweep order changes nothing;
    sweeps alternate direction (forwards flow up the stages, backwards down). Stops at
    the first action ending after `limit` (the makespan exceeds it)."""
    ns = len(ptr) - 1
    n = len(node_stage)
    start = np.zeros(ptr[ns])
    end = np.zeros(ptr[ns])
    end_f = np.zeros((n, m))
    end_b = np.zeros((n, m))
    done_f = np.zeros((n, m), np.bool_)
    done_b = np.zeros((n, m), np.bool_)
    pos = ptr[:-1].copy()
    free = np.zeros(ns)
    moved, sweep = True, 0
    while moved:
        moved = False
        for k in range(ns):
            st = k if sweep % 2 == 0 else ns - 1 - k
            while pos[st] < ptr[st + 1]:
                i = pos[st]
                node = stage_node[st, chunk[i]]
                b = mb[i]
                t = free[st]
                blocked = False
                if kind[i] == 0:
                    for q in range(pred_ptr[node], pred_ptr[node + 1]):
                        d = pred_idx[q]
                        if not done_f[d, b]:
                            blocked = True
                            break
                        e = end_f[d, b] + (comm if node_stage[d] != st else 0.0)
                        if e > t:
                            t = e
                else:
                    if not done_f[node, b]:
                        blocked = True
                    elif end_f[node, b] > t:
                        t = end_f[node, b]
                    if not blocked:
                        for q in range(succ_ptr[node], succ_ptr[node + 1]):
                            d = succ_idx[q]
                            if not runs_backward[d]:
                                continue
                            if not done_b[d, b]:
                                blocked = True
                                break
                            e = end_b[d, b] + (comm if node_stage[d] != st else 0.0)
                            if e > t:
                                t = e
                if blocked:
                    break
                start[i] = t
                if kind[i] == 0:
                    end[i] = t + dur_f[node]
                    end_f[node, b] = end[i]
                    done_f[node, b] = True
                else:
                    end[i] = t + dur_b[node]
                    end_b[node, b] = end[i]
                    done_b[node, b] = True
                free[st] = end[i]
                pos[st] += 1
                moved = True
                if end[i] > limit:
                    return start, end, pos, done_f, done_b
        sweep += 1
    return start, end, pos, done_f, done_b


@dataclass(frozen=True)
class Rows:
    """Every physical stage's row as arrays: actions ptr[s]:ptr[s + 1] of stage s."""

    ptr: np.ndarray
    kind: np.ndarray  # 0: F, 1: B
    microbatch: np.ndarray
    chunk: np.ndarray
    warm: np.ndarray
    num_microbatches: int


def run(lay: ChainLayout, rows: Rows, dur_f, dur_b, comm: float = 0.0):
    """(start, end per action, position reached per stage, F done, B done)."""
    return _run(rows.ptr, rows.kind, rows.microbatch, rows.chunk, lay.stage_node,
                lay.node_stage, lay.pred_ptr, lay.pred_idx, lay.succ_ptr, lay.succ_idx,
                lay.runs_backward, np.ascontiguousarray(dur_f, np.float64),
                np.ascontiguousarray(dur_b, np.float64), float(comm), rows.num_microbatches)


@njit(cache=True)
def _reach(ptr, kind, mb, chunk, stage_node, pred_ptr, pred_idx, succ_ptr, succ_idx,
           runs_backward, pos, done_f, done_b):
    """`_run` without times: how far every row gets (into `pos`, `done_f`, `done_b`,
    overwritten). Sweeps alternate direction (forwards flow up the stages, backwards
    down); the fixpoint does not depend on the order."""
    ns = len(ptr) - 1
    done_f[:] = False
    done_b[:] = False
    for st in range(ns):
        pos[st] = ptr[st]
    moved, sweep = True, 0
    while moved:
        moved = False
        for k in range(ns):
            st = k if sweep % 2 == 0 else ns - 1 - k
            while pos[st] < ptr[st + 1]:
                i = pos[st]
                node = stage_node[st, chunk[i]]
                b = mb[i]
                ok = True
                if kind[i] == 0:
                    for q in range(pred_ptr[node], pred_ptr[node + 1]):
                        if not done_f[pred_idx[q], b]:
                            ok = False
                            break
                else:
                    ok = done_f[node, b]
                    if ok:
                        for q in range(succ_ptr[node], succ_ptr[node + 1]):
                            d = succ_idx[q]
                            if runs_backward[d] and not done_b[d, b]:
                                ok = False
                                break
                if not ok:
                    break
                if kind[i] == 0:
                    done_f[node, b] = True
                else:
                    done_b[node, b] = True
                pos[st] += 1
                moved = True
        sweep += 1


@njit(cache=True)
def _deadlock_free(stage_pp, stage_v, stage_node, node_stage, pred_ptr, pred_idx,
                   succ_ptr, succ_idx, runs_backward, warm, m):
    """`multimodal_one_f_one_b`'s raise loop: while the rows deadlock, raise by one the
    warm-up of each stage stuck at a backward that holds back a forward another stage
    waits for (else of every stage stuck at a backward). Returns (ptr, kind, mb, chunk,
    ok); ok False where no stage can be raised."""
    ns = len(stage_pp)
    ptr = _row_lengths(stage_v, stage_node, runs_backward, m)
    kind = np.zeros(ptr[ns], np.int64)
    mb = np.zeros(ptr[ns], np.int64)
    chunk = np.zeros(ptr[ns], np.int64)
    for st in range(ns):
        _fill_row(st, stage_pp, stage_v, stage_node, runs_backward, warm, m, ptr, kind, mb,
                  chunk)
    n = len(node_stage)
    pos = np.zeros(ns, np.int64)
    done_f = np.zeros((n, m), np.bool_)
    done_b = np.zeros((n, m), np.bool_)
    while True:
        _reach(ptr, kind, mb, chunk, stage_node, pred_ptr, pred_idx, succ_ptr, succ_idx,
               runs_backward, pos, done_f, done_b)
        holding = np.zeros(ns, np.bool_)
        at_b = np.zeros(ns, np.bool_)
        stuck = False
        for st in range(ns):
            i = pos[st]
            if i >= ptr[st + 1]:
                continue
            stuck = True
            if kind[i] == 1:
                at_b[st] = warm[st] < m * stage_v[st]
            else:
                node = stage_node[st, chunk[i]]
                for q in range(pred_ptr[node], pred_ptr[node + 1]):
                    d = pred_idx[q]
                    if not done_f[d, mb[i]]:
                        holding[node_stage[d]] = True
        if not stuck:
            return ptr, kind, mb, chunk, True
        pick = at_b & holding
        if not pick.any():
            pick = at_b
        if not pick.any():
            return ptr, kind, mb, chunk, False
        for st in range(ns):
            if pick[st]:
                warm[st] += 1
                _fill_row(st, stage_pp, stage_v, stage_node, runs_backward, warm, m, ptr,
                          kind, mb, chunk)


def schedule_rows(lay: ChainLayout, m: int) -> Rows:
    """`multimodal_one_f_one_b`'s rows: the first warm-ups, raised where the rows would
    deadlock (`_deadlock_free`)."""
    if m < 1:
        raise ValueError(f"num_microbatches={m!r}: must be an int >= 1")
    warm = first_warmups(lay, m)
    ptr, kind, mb, chunk, ok = _deadlock_free(
        lay.stage_pp, lay.stage_v, lay.stage_node, lay.node_stage, lay.pred_ptr,
        lay.pred_idx, lay.succ_ptr, lay.succ_idx, lay.runs_backward, warm, m)
    if not ok:
        raise RuntimeError("internal: schedule_rows could not make the schedule "
                           "deadlock-free")
    return Rows(ptr, kind, mb, chunk, warm, m)


@njit(cache=True)
def _span(ptr, kind, mb, chunk, stage_node, node_stage, pred_ptr, pred_idx, succ_ptr,
          succ_idx, runs_backward, dur_f, dur_b, comm, m, limit):
    """(latest end, whether every row ran to its end or past `limit`) of `_run`."""
    _, end, pos, _, _ = _run(ptr, kind, mb, chunk, stage_node, node_stage, pred_ptr,
                             pred_idx, succ_ptr, succ_idx, runs_backward, dur_f, dur_b,
                             comm, m, limit)
    latest = end.max() if len(end) else 0.0
    if latest > limit:
        return latest, True
    done = True
    for st in range(len(pos)):
        if pos[st] < ptr[st + 1]:
            done = False
    return latest, done


def makespan(lay: ChainLayout, rows: Rows, dur_f, dur_b, comm: float = 0.0,
             limit: float = np.inf) -> float:
    """The latest end of any action: `simulate(...).iteration_time` of the rows with
    per-node forward / backward seconds `dur_f`, `dur_b` and transfer time `comm`; a
    time above `limit` once an action ends after it (not the makespan then: a caller
    that only needs plans within `limit` stops timing the others early)."""
    span, done = _span(rows.ptr, rows.kind, rows.microbatch, rows.chunk, lay.stage_node,
                       lay.node_stage, lay.pred_ptr, lay.pred_idx, lay.succ_ptr,
                       lay.succ_idx, lay.runs_backward,
                       np.ascontiguousarray(dur_f, np.float64),
                       np.ascontiguousarray(dur_b, np.float64), float(comm),
                       rows.num_microbatches, float(limit))
    if not done:
        raise ValueError("schedule deadlocks")
    return float(span)


def load_kernels() -> None:
    """Run every compiled function once on a two-stage schedule: a process pays numba's
    start-up and the load of the cached machine code here (~0.5 s), not inside the first
    plan it times."""
    lay = ChainLayout.of(UnitDag.of(["llm"]), {"llm": 2}, {"llm": 2})
    makespan(lay, schedule_rows(lay, 2), np.ones(4), np.ones(4), 0.0)
