"""`layer_range`: the layers [start, end) of a unit that one pipeline stage builds (no JAX)."""
from __future__ import annotations


def layer_range(what: str, num_layers: int, start: int,
                end: int | None) -> tuple[int, bool, bool]:
    """(end, is_first, is_last) of layers [start, end) of `num_layers` (`end` None: up to
    the last); a ValueError naming `what` (e.g. "vision layer") when outside 0..num_layers."""
    end = num_layers if end is None else end
    if not 0 <= start < end <= num_layers:
        raise ValueError(f"{what} range [{start}, {end}) outside 0..{num_layers}")
    return end, start == 0, end == num_layers
