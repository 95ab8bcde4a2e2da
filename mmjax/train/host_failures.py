"""Hosts agree on a global batch's decode failures before its step.

With several processes each host decodes only the samples on its own DP ranks
(data/global_batch.py), so a sample that fails to decode is known only to the hosts that
hold it. Every LLM rank divides its loss by the microbatch's trained-token count, and
process 0 writes the run's skip log, so before the step all hosts share their failures
(one all-gather of their sizes; a second of the names only when some host has any), mask
the samples that failed elsewhere and recount: the same losses, normalisers, skip count and
skip list on every host as when one host decodes everything.
"""
from __future__ import annotations

import json

import numpy as np

from mmjax.data.feed import mask_samples
from mmjax.data.skipped import Skipped


def agree_on_failures(gb, allgather, gen_elements_per_image: int) -> int:
    """Merge every host's decode failures into `gb` (skip count, reasons, skip list; each
    feed's samples failed elsewhere masked, `num_target_tokens` recounted from metadata). `allgather(array) -> [processes, *array.shape]`, the same
    calls on every process (multihost_utils.process_allgather). -> the change in the skip
    count."""
    mine = json.dumps(sorted([p, n, r, list(w)] for p, (n, r, w) in gb.failed_at.items())
                      ).encode()
    sizes = np.asarray(allgather(np.array([len(mine)], np.int64))).reshape(-1)
    union: dict[int, Skipped] = {}
    if any(int(n) > 2 for n in sizes):  # "[]" is two bytes
        buf = np.zeros(int(sizes.max()), np.uint8)
        buf[:len(mine)] = np.frombuffer(mine, np.uint8)
        rows = np.asarray(allgather(buf)).reshape(len(sizes), -1)
        for k, n in enumerate(sizes):
            for p, name, reason, where in json.loads(rows[k, :int(n)].tobytes()):
                union.setdefault(int(p), Skipped.from_json((name, reason, where)))
    local = len(gb.failed_at)
    before = gb.skipped_samples
    gb.skipped = gb.skipped[:len(gb.skipped) - local] + [union[p] for p in sorted(union)]
    gb.skipped_samples = before - local + len(union)
    gb.skip_reasons = {k: v for k, v in gb.skip_reasons.items() if k != "decode"}
    if union:
        gb.skip_reasons["decode"] = len(union)
    gb.decode_failures = len(union)
    for mb in gb.microbatches:
        if mb.feed is not None:
            late = [i for i, p in enumerate(mb.plan.positions)
                    if p in union and p not in gb.failed_at]
            if late:
                mask_samples(mb.feed, late, gen_elements_per_image)
            mb.feed.num_target_tokens = sum(gb.position_targets[p] for p in mb.plan.positions
                                            if p not in union)
    gb.failed_at = union
    return gb.skipped_samples - before
