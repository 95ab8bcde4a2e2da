"""Writing a unit back into the checkpoint it was imported from.

A unit imported from a larger checkpoint (a CLIP tower from a `CLIPModel`, a tower the
projector reads at an inner layer, a Whisper encoder from a whole Whisper, LLaVA's parts)
holds only some of its tensors. `write_over_source` writes the source checkpoint again with
the unit's tensors in place and every other tensor copied untouched, so transformers loads
the result as the original class with no missing or unexpected keys. A tensor whose value
is unchanged (a frozen unit) is copied from the source byte for byte, in its own dtype.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from mmjax.models.hf.checkpoint import Checkpoint, write_safetensors

# files next to the weights that describe the model and are kept as they are
SIDE_FILES = ("config.json", "generation_config.json", "preprocessor_config.json")


def write_over_source(ours: dict, source, out, what: str,
                      max_shard_bytes: int | None = None) -> list[Path]:
    """`ours` {HF name: array in HF layout} over every tensor of checkpoint `source`
    (directory), written to directory `out` with `source`'s side files (config.json ...)."""
    ckpt = Checkpoint(source)
    for name, arr in ours.items():
        if name not in ckpt.file:
            raise ValueError(f"{what}: tensor {name!r} is not in the source checkpoint "
                             f"{source}; it is not the checkpoint this unit was imported from")
        if tuple(arr.shape) != ckpt.shape[name]:
            raise ValueError(f"{what}: tensor {name!r} has shape {tuple(arr.shape)}, the source "
                             f"checkpoint {source} has {ckpt.shape[name]}")
    tensors = {}
    for name in sorted(ckpt.names):
        src = ckpt.read(name)
        if name in ours:
            arr = np.asarray(ours[name])
            if not np.array_equal(arr, src.astype(arr.dtype)):
                src = np.ascontiguousarray(arr)
        tensors[name] = src
    files = write_safetensors(tensors, out, max_shard_bytes)
    for side in SIDE_FILES:
        if (Path(source) / side).exists():
            shutil.copyfile(Path(source) / side, Path(out) / side)
    return files
