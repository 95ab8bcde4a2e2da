"""Bytes a compiled program's collectives send, read from its HLO text (XLA's own program,
not a host recount).

`collective_bytes(hlo, ranks_per_node, scope)` sums, over the program's
`collective-permute` and `all-to-all` instructions whose op_name contains `scope`, the bytes
each device sends to another device, split by link class: device positions (partition ids,
the mesh's row-major order) p and q are on the same node when p // ranks_per_node ==
q // ranks_per_node. A collective-permute sends its operand once per source-target pair;
an all-to-all (split over its replica group of g devices, or all `num_devices`) sends
g - 1 of its g chunks from every device of the group. A `ragged-all-to-all` sends the
send sizes the step passes, within its send buffer: `ragged_operands` reads its buffers,
`ragged_bytes` counts its bytes from the step's tables.
"""
from __future__ import annotations

import re

import numpy as np

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
                "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1}
_OP = re.compile(r"=\s*(?P<shape>.*?)\s(?P<op>collective-permute|all-to-all)"
                 r"(?P<start>-start)?\(")
_ARRAY = re.compile(r"([a-z0-9]+)\[([0-9,]*)\]")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
_GROUPS = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[(\d+)\]")
_NAME = re.compile(r'op_name="([^"]*)"')


def _array_bytes(dtype: str, dims: str) -> int:
    n = 1
    for d in filter(None, dims.split(",")):
        n *= int(d)
    return n * _DTYPE_BYTES[dtype]


def _bytes(shape: str, whole_tuple: bool) -> int:
    """Bytes of an HLO result shape: every array of it (an all-to-all's tuple form, one
    array per peer), or its first (a -start op's (operand, result, ...) tuple)."""
    arrays = _ARRAY.findall(shape)
    if whole_tuple:
        return sum(_array_bytes(t, d) for t, d in arrays)
    return _array_bytes(*arrays[0])


def _groups(line: str, num_devices: int) -> list[list[int]]:
    m = _IOTA_GROUPS.search(line)
    if m:
        g, size = int(m.group(1)), int(m.group(2))
        return [list(range(k * size, (k + 1) * size)) for k in range(g)]
    m = _GROUPS.search(line)
    if m and m.group(1):
        return [[int(x) for x in grp.split(",") if x]
                for grp in re.findall(r"\{([\d,]*)\}", m.group(1))]
    return [list(range(num_devices))]


def collective_bytes(hlo: str, ranks_per_node: int, scope: str = "",
                     num_devices: int | None = None) -> dict[str, int]:
    """{"intra_node", "inter_node", "ops"}: bytes sent between distinct devices by the
    program's collective permutes and all-to-alls whose op_name holds `scope` (module
    docstring), and how many such instructions there are. `num_devices`: for all-to-alls
    without replica groups."""
    out = {"intra_node": 0, "inter_node": 0, "ops": 0}
    for line in hlo.splitlines():
        m = _OP.search(line)
        if not m:
            continue
        name = _NAME.search(line)
        if scope and (name is None or scope not in name.group(1)):
            continue
        out["ops"] += 1
        size = _bytes(m.group("shape"), m.group("op") == "all-to-all" and not m.group("start"))
        if m.group("op") == "collective-permute":
            pairs = _PAIRS.search(line)
            assert pairs is not None, line  # HLO always writes a permute's source_target_pairs
            for p, q in re.findall(r"\{(\d+),(\d+)\}", pairs.group(1)):
                p, q = int(p), int(q)
                if p != q:
                    out["inter_node" if p // ranks_per_node != q // ranks_per_node
                        else "intra_node"] += size
        else:
            if num_devices is None and not _GROUPS.search(line) and not _IOTA_GROUPS.search(line):
                raise ValueError("collective_bytes: an all-to-all over all devices needs "
                                 "num_devices")
            for grp in _groups(line, num_devices or 0):
                chunk = size // len(grp)
                for p in grp:
                    for q in grp:
                        if p != q:
                            out["inter_node" if p // ranks_per_node != q // ranks_per_node
                                else "intra_node"] += chunk
    return out


_INSTR = re.compile(r"^\s*(?:ROOT\s+)?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>[a-z0-9]+\[[0-9,]*\])")
_RAGGED = re.compile(r"ragged-all-to-all\((?P<args>[^)]*)\)")


def _dims(shape: str) -> tuple[str, tuple[int, ...]]:
    m = _ARRAY.match(shape)
    assert m is not None
    return m.group(1), tuple(int(d) for d in m.group(2).split(",") if d)


def ragged_operands(hlo: str, scope: str = "") -> list[dict]:
    """Per `ragged-all-to-all` instruction of an HLO module's text whose op_name holds
    `scope`: its per-device send buffer and receive buffer shapes and dtype
    ({"dtype", "send", "recv"}). A link carries the send sizes the step passes, at most the
    send buffer's rows (`ragged_bytes`)."""
    shapes: dict[str, str] = {}
    out = []
    for line in hlo.splitlines():
        m = _INSTR.match(line)
        if m:
            shapes[m.group("name")] = m.group("shape")
        r = _RAGGED.search(line)
        if not (m and r):
            continue
        name = _NAME.search(line)
        if scope and (name is None or scope not in name.group(1)):
            continue
        operand = r.group("args").split(",")[0].strip()
        dtype, send = _dims(shapes[operand])
        out.append({"dtype": dtype, "send": send, "recv": _dims(m.group("shape"))[1]})
    return out


def ragged_bytes(op: dict, send_sizes, ranks_per_node: int) -> dict[str, int]:
    """Bytes one ragged all-to-all (`ragged_operands` entry `op`) sends with the step's
    `send_sizes` [n, n] (rows device u sends v): {"intra_node", "inter_node"} by link
    class, and "bound", what its n send buffers could hold."""
    row = _DTYPE_BYTES[op["dtype"]] * int(np.prod(op["send"][1:], dtype=np.int64))
    sizes = np.asarray(send_sizes, np.int64)
    n = sizes.shape[0]
    node = np.arange(n) // ranks_per_node
    same = node[:, None] == node[None, :]
    return {"intra_node": int(sizes[same & ~np.eye(n, dtype=bool)].sum()) * row,
            "inter_node": int(sizes[~same].sum()) * row, "bound": n * op["send"][0] * row}
