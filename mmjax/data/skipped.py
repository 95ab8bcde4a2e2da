"""The one record of a skipped sample (no JAX): what `skipped.jsonl` holds per sample and
what every layout's data path, the hosts' failure exchange (train/host_failures.py) and the
loop pass around. A tuple, so it is written to JSON as [name, reason, where]."""
from __future__ import annotations

from typing import NamedTuple

from mmjax.data.records import sample_name, sample_where


class Skipped(NamedTuple):
    """A skipped sample: its name (the source's id, else its index), the reason (its kind
    before the first ':'), and where it is: (file, "line" | "record", number)."""

    name: str
    reason: str
    where: tuple

    @classmethod
    def of(cls, source, index: int, reason: str) -> "Skipped":
        """Sample `index` of `source`, skipped for `reason`."""
        return cls(sample_name(source, index), reason, sample_where(source, index))

    @classmethod
    def at_assembly(cls, sample_id: int, reason: str) -> "Skipped":
        """A sample left out when a batch was assembled (data/assemble.py `Batch.skipped`):
        known by its dataset index alone."""
        return cls(str(sample_id), reason, ("", "record", int(sample_id)))

    @classmethod
    def from_json(cls, row) -> "Skipped":
        name, reason, where = row
        return cls(str(name), str(reason), tuple(where))
