"""LoRA dropout (models/lora.py `dropout_key`) on a pipeline stage: a training step's stage
of a part with `lora.dropout` > 0 reads, beside its feed, the ids its masks are keyed by,
one row per dp rank: (unit, stage index, applied-step count, microbatch, rank). As in the
single program the count is the optimizer's (a resumed run draws the same masks), and
evaluation passes none (no dropout). The ids are a host input of the stage, so the
backward's re-linearization draws the forward's masks. A plan's masks are its own: they
follow its stages, microbatches and ranks, not the single program's rows (docs/lora.md)."""
from __future__ import annotations

import contextlib
import zlib

import jax
import numpy as np

from mmjax.models.lora import DROPOUT_SEED, dropout_key
from mmjax.models.units import is_llm

SIDE_KEY = "lora_dropout"


def dropout_units(cfg) -> frozenset[str]:
    """The units whose stages apply LoRA dropout: the LLM, or an encoder whose tower or
    projector is LoRA'd with dropout > 0."""
    out = set()
    for part in cfg.lora_units():
        if is_llm(part):
            lora, unit = cfg.llm.lora, part
        elif part.endswith(".projector"):
            unit = part.removesuffix(".projector")
            lora = cfg.encoder(unit).projector.lora
        else:
            lora, unit = cfg.encoder(part).encoder.lora, part
        if lora.dropout:
            out.add(unit)
    return frozenset(out)


def dropout_ids(unit: str, index: int, count: int, microbatch: int, dp: int) -> np.ndarray:
    """[dp, 5] int32: each dp rank's (unit, stage index, count, microbatch, rank)."""
    head = [zlib.crc32(unit.encode()) & 0x7FFFFFFF, index, count, microbatch]
    return np.asarray([head + [r] for r in range(dp)], np.int32)


@contextlib.contextmanager
def stage_dropout(side):
    """Trace-time scope of one rank's stage call: LoRA dropout on, keyed by the rank's ids,
    when `side` carries them; else nothing."""
    if not isinstance(side, dict) or SIDE_KEY not in side:
        yield
        return
    key = jax.random.key(DROPOUT_SEED)
    ids = side[SIDE_KEY].reshape(-1, 5)[0]  # this rank's row (vmapped: [1, 5])
    for i in range(5):
        key = jax.random.fold_in(key, ids[i])
    with dropout_key(key):
        yield
