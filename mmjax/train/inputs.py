"""Host `Batch` (mmjax/data/assemble.py) -> the nested dict of arrays the model reads."""
from __future__ import annotations

import numpy as np

from mmjax.data.assemble import Batch


def model_inputs(batch: Batch, num_target_tokens: int | None = None,
                 num_gen_elements: int | None = None) -> dict:
    """Normalisers default to this batch's own counts; pass the GLOBAL batch's counts when
    `batch` is a microbatch or a DP shard, so every split gives the same loss."""
    out = {k: getattr(batch, k) for k in ("tokens", "targets", "loss_mask", "positions",
                                          "doc", "sub")}
    out["bam"] = batch.bam.astype(np.int32)  # jax x64 is off: 31 bits = 30 modalities
    out.update({f"gather_{e}": g for e, g in batch.gather.items()})
    out["encoders"] = {e: dict(d) for e, d in batch.encoders.items()}
    out.update(batch.gen or {})
    n_tok = batch.num_target_tokens if num_target_tokens is None else num_target_tokens
    n_gen = batch.num_gen_elements if num_gen_elements is None else num_gen_elements
    out["num_target_tokens"] = np.float32(n_tok)
    out["num_gen_elements"] = np.float32(n_gen)
    return out
