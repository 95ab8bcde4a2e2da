"""`Loader.max_bad_fraction`: a run whose share of bad samples passes it stops, naming the
files that hold the most (from skipped.jsonl). Bad samples never stop a run on their own
(they are skipped and replaced, data/global_batch.py); a data set that is mostly bad is
worth a stop and a look."""
from __future__ import annotations

import json
import os


def too_much_bad_data(step: int, global_batch: int, skipped: int, limit: float,
                      skipped_path: str) -> str | None:
    """The one-line reason to stop after `step` (None: go on). `skipped`: bad samples so
    far; judged once 4 global batches were drawn."""
    drawn = step * global_batch + skipped
    if limit >= 1.0 or drawn < 4 * global_batch or skipped <= limit * drawn:
        return None
    counts: dict[str, int] = {}
    if os.path.exists(skipped_path):
        with open(skipped_path) as f:
            for row in map(json.loads, f):
                counts[row.get("file", "?")] = counts.get(row.get("file", "?"), 0) + 1
    worst = ", ".join(f"{os.path.basename(k) or '?'} ({v})" for k, v in sorted(
        counts.items(), key=lambda kv: -kv[1])[:3])
    return (f"{skipped} of {drawn} samples drawn by step {step} were bad "
            f"({skipped / drawn:.0%} > Loader.max_bad_fraction={limit}); most in: "
            f"{worst or 'see skipped.jsonl'} (fix the data, see skipped.jsonl for each sample "
            f"and reason, or raise Loader.max_bad_fraction)")
