"""An exported Hugging Face checkpoint directory cast to another dtype (scripts/export_hf.py
--dtype): every floating tensor of every shard rounded to `dtype` (round to nearest even, as
torch's `.to`), integer tensors left alone, and config.json's dtype field (`torch_dtype` in
transformers 4's layout, `dtype` in 5's, also inside `text_config` / `vision_config` where the
source names one there) set to it; mmjax_extra.safetensors (projectors, generator) cast the
same way, so a --dtype export is in one dtype throughout. Without --dtype an export keeps its
source's dtype."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from mmjax.errors import UserError
from mmjax.models.hf.checkpoint import INDEX_NAME

DTYPES = ("float32", "bfloat16", "float16")


def _np_dtype(name: str):
    if name not in DTYPES:
        raise UserError(f"--dtype={name!r}: use one of {', '.join(DTYPES)} (or leave it unset "
                        f"to keep the source's)")
    import ml_dtypes
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def set_config_dtype(c: dict, name: str) -> dict:
    """`c` (a config.json dict) naming dtype `name` where its layout does."""
    key = "dtype" if ("dtype" in c or "text_config" in c and "torch_dtype" not in c) \
        else "torch_dtype"
    c[key] = name
    for sub in ("text_config", "vision_config"):
        for k in ("dtype", "torch_dtype"):
            if k in (c.get(sub) or {}):
                c[sub][k] = name
    return c


def cast_file(path, name: str) -> int:
    """Cast every floating tensor of one safetensors file to dtype `name` (metadata kept);
    -> the file's tensor bytes."""
    dtype = _np_dtype(name)
    with safe_open(str(path), framework="numpy") as st:
        meta = st.metadata() or {"format": "pt"}
        tensors = {k: st.get_tensor(k) for k in st.keys()}
    for k, a in tensors.items():
        if np.issubdtype(a.dtype, np.floating) or a.dtype.name == "bfloat16":
            tensors[k] = np.ascontiguousarray(a.astype(dtype))
    save_file(tensors, str(path), metadata=meta)
    return sum(a.nbytes for a in tensors.values())


def cast_checkpoint(directory, name: str) -> None:
    """Cast the checkpoint in `directory` (model.safetensors or shards) to dtype `name`."""
    d = Path(directory)
    total = sum(cast_file(f, name) for f in sorted(d.glob("*.safetensors")))
    if (d / INDEX_NAME).exists():
        index = json.loads((d / INDEX_NAME).read_text())
        index.setdefault("metadata", {})["total_size"] = total
        (d / INDEX_NAME).write_text(json.dumps(index, indent=2))
    if (d / "config.json").exists():
        c = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps(set_config_dtype(c, name), indent=2))
