"""Node-aware device placement: which global device indices each pipeline stage owns (no JAX).

A stage of a unit is `dp` groups of `cp * tp` devices; a group's TP (and CP) collectives run
every layer, so a group must sit inside one node (NVLink), as Megatron-LM and DistTrain §4.1
place them; only DP and pipeline traffic crosses the network. Packing units on contiguous
devices (`devices_per_node = 0`) ignores nodes: the planner's 72B plan on 112 GPUs put 12 of
its 24 TP-4 groups across node boundaries that way.

`stage_devices` packs groups first-fit-decreasing by group size onto nodes (node k holds
devices `k * n .. k * n + n - 1`, the order `jax.devices()` lists a cluster's devices, one
process per node), groups of one size in unit and stage order, so a stage's groups and its
pipeline neighbours land on the same or adjacent nodes. Group sizes that divide the node
size (powers of two) pack with no hole. A group larger than a node takes whole nodes.
"""
from __future__ import annotations

from mmjax.errors import UserError


def contiguous(units) -> dict[str, list[list[int]]]:
    """Units packed in order on consecutive devices, stage after stage (node-blind)."""
    out, start = {}, 0
    for u in units:
        stages = []
        for _ in range(u.pp):
            stages.append(list(range(start, start + u.devices_per_stage)))
            start += u.devices_per_stage
        out[u.name] = stages
    return out


def stage_devices(units, devices_per_node: int) -> dict[str, list[list[int]]]:
    """Per unit, per pipeline stage, its device indices in mesh order (dp-major, then cp,
    then tp); every cp*tp group inside one node when `devices_per_node > 0`."""
    if devices_per_node <= 0:
        return contiguous(units)
    n = devices_per_node
    total = sum(u.num_devices for u in units)
    groups = [(u.name, s, d, u.cp * u.tp) for u in units for s in range(u.pp)
              for d in range(u.dp)]
    for name, _, _, g in groups:
        if g > n and g % n:
            raise UserError(f"placement: unit {name!r} has cp*tp = {g} devices per group, more "
                            f"than a node ({n}) and not a multiple of it (make cp*tp divide or "
                            f"be a multiple of devices_per_node)")
    num_nodes = -(-total // n)
    free = [list(range(k * n, min((k + 1) * n, total))) for k in range(num_nodes)]
    where: dict[tuple[str, int, int], list[int]] = {}
    order = sorted(range(len(groups)), key=lambda i: -groups[i][3])  # stable: unit order kept
    first: dict[int, int] = {}  # per group size, the first node that may have room for it
    for i in order:
        name, s, d, g = groups[i]
        where[(name, s, d)] = _take(free, g, n, name, first)
    out = {}
    for u in units:
        out[u.name] = [[x for d in range(u.dp) for x in where[(u.name, s, d)]]
                       for s in range(u.pp)]
    return out


def _take(free: list[list[int]], g: int, n: int, name: str,
          first: dict[int, int] | None = None) -> list[int]:
    """Take `g` devices in one node (first node with room), or g/n whole free nodes.
    `first[g]`: where the search for room for `g` may start (the nodes before it had less
    than `g` free when passed over, and free slots only shrink); updated here."""
    if g <= n:
        first = {} if first is None else first
        for k in range(first.get(g, 0), len(free)):
            slots = free[k]
            if len(slots) >= g:
                first[g] = k
                got, slots[:] = slots[:g], slots[g:]
                return got
        first[g] = len(free)
    else:
        k = g // n
        for start in range(len(free) - k + 1):
            if all(len(free[j]) == n for j in range(start, start + k)):
                got = [x for j in range(start, start + k) for x in free[j]]
                for j in range(start, start + k):
                    free[j] = []
                return got
    raise UserError(f"placement: cannot place a {g}-device group of unit {name!r} inside a "
                    f"node of {n} devices (the groups fragment the nodes; use group sizes "
                    f"(cp*tp) that divide devices_per_node, or devices_per_node=0 to pack "
                    f"contiguously)")


def node_of(device: int, devices_per_node: int) -> int:
    return device // devices_per_node if devices_per_node > 0 else 0


def straddling_groups(units, placement: dict[str, list[list[int]]],
                      devices_per_node: int) -> int:
    """How many cp*tp groups span more than one node (for reports and tests)."""
    count = 0
    for u in units:
        g = u.cp * u.tp
        for devs in placement[u.name]:
            for d in range(u.dp):
                grp = devs[d * g:(d + 1) * g]
                nodes = {node_of(x, devices_per_node) for x in grp}
                if len(nodes) > max(1, -(-g // devices_per_node)):
                    count += 1
    return count


def node_map(units, placement: dict[str, list[list[int]]], devices_per_node: int) -> list[str]:
    """One line per node: the (unit:stage dp-rank) groups on it, e.g.
    `node 0 (8 devices): llm:0 dp0 (tp 4), llm:0 dp1 (tp 4)`."""
    n = devices_per_node or sum(u.num_devices for u in units)
    rows: dict[int, list[str]] = {}
    for u in units:
        g = u.cp * u.tp
        for s, devs in enumerate(placement[u.name]):
            for d in range(u.dp):
                grp = devs[d * g:(d + 1) * g]
                shape = f" (tp {u.tp}" + (f" cp {u.cp}" if u.cp > 1 else "") + ")" if g > 1 else ""
                for node in sorted({x // n for x in grp}):
                    rows.setdefault(node, []).append(f"{u.name}:{s} dp{d}{shape}")
    total = sum(u.num_devices for u in units)
    return [f"node {k} ({min(n, total - k * n)} devices): " + ", ".join(rows[k])
            for k in sorted(rows)]
