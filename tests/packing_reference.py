"""The first-fit packers as they were before issue 41 (O(n x bins)), frozen: the reference
that `mmjax.data.batch_shapes.pack_rows` / `pack_images` (O(n log n)) must reproduce
exactly, and the "before" column of scripts/bench_host_plan.py."""
from __future__ import annotations


def pack_rows(lengths: list[int], seq_len: int, packing: str) -> list[int]:
    """Row of each document: one per row ("pad"), or first fit in order ("pack")."""
    if packing == "pad":
        return list(range(len(lengths)))
    free: list[int] = []
    rows = []
    for n in lengths:
        for r, f in enumerate(free):
            if f >= n:
                free[r] -= n
                rows.append(r)
                break
        else:
            free.append(seq_len - n)
            rows.append(len(free) - 1)
    return rows


def pack_images(runs: list[int], cap: int, max_items: int | None) -> list[tuple[int, int, int]]:
    """(buffer, patch offset, 1-based seg id) per image: first fit decreasing by run length
    (ties by order), at most `max_items` images per buffer when given."""
    order = sorted(range(len(runs)), key=lambda i: (-runs[i], i))
    free, items = [], []
    out: list[tuple[int, int, int]] = [(0, 0, 0)] * len(runs)
    for i in order:
        for b in range(len(free)):
            if free[b] >= runs[i] and (max_items is None or items[b] < max_items):
                break
        else:
            free.append(cap)
            items.append(0)
            b = len(free) - 1
        out[i] = (b, cap - free[b], items[b] + 1)
        free[b] -= runs[i]
        items[b] += 1
    return out
