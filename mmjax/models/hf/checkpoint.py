"""Safetensors checkpoints and the tables that map them onto mmjax modules.

Each module has a table of `Entry`s: HF tensor name -> path in our pure parameter dict, our
shape, and how the HF array is laid out: HF Linear weights are [out, in] and ours [in, out],
HF Conv1d weights [out, in, k] and ours [k, in, out] (both `.T`); an HF Conv2d patch
embedding [out, C, p, p] is our dense kernel over patches flattened (py, px, c); a fused HF
Linear (Phi-3's qkv_proj / gate_up_proj) is several entries, each a block of its output rows. The same
table drives strict checks (missing / unexpected tensors, shapes, all before any data is
read), lazy per-tensor reads, and export. Layer ranges [start, end) load a pipeline stage,
renumbered from 0 as the modules hold them.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

INDEX_NAME = "model.safetensors.index.json"
# Non-parameter buffers some older HF checkpoints carry.
_IGNORED = re.compile(r"(^|\.)(rotary_emb\.inv_freq|position_ids)$")


@dataclass(frozen=True)
class Entry:
    """One tensor: HF name, our pure-dict path, our shape;
    `transpose`: HF holds the transpose; `patch` > 0: HF holds a Conv2d patch kernel
    [out, C, patch, patch] for our [patch * patch * C, out]; `rows` = (start, stop, total):
    ours is rows [start, stop) of a fused HF tensor of `total` rows (transposed)."""

    hf: str
    path: tuple
    shape: tuple[int, ...]
    transpose: bool = False
    patch: int = 0
    rows: tuple[int, int, int] | None = None

    @property
    def hf_shape(self) -> tuple[int, ...]:
        """The whole HF tensor's shape (a fused one's, for `rows` entries)."""
        if self.patch:
            p = self.patch
            return (self.shape[1], self.shape[0] // (p * p), p, p)
        if self.rows:
            return (self.rows[2], self.shape[0])
        return self.shape[::-1] if self.transpose else self.shape

    def to_ours(self, arr: np.ndarray) -> np.ndarray:
        """Our array from the HF tensor (the whole fused tensor for `rows` entries)."""
        if self.patch:
            return arr.transpose(2, 3, 1, 0).reshape(self.shape)
        if self.rows:
            return arr[self.rows[0]:self.rows[1]].T
        return arr.T if self.transpose else arr

    def to_hf(self, arr: np.ndarray) -> np.ndarray:
        if self.patch:
            p, (_, c, _, _) = self.patch, self.hf_shape
            return arr.reshape(p, p, c, self.shape[1]).transpose(3, 2, 0, 1)
        return arr.T if self.transpose else arr


# ---------------------------------------------------------------------------- checkpoint


def _shard_files(paths_or_dir) -> tuple[list[Path], dict | None]:
    """-> (shard files, index weight_map or None) for a file, a list of files, an index
    json or a directory (index json if present, else every *.safetensors in it)."""
    if isinstance(paths_or_dir, (list, tuple)):
        files = [Path(p) for p in paths_or_dir]
        if not files:
            raise ValueError("no checkpoint files given: pass *.safetensors paths or a directory")
        return files, None
    p = Path(paths_or_dir)
    if p.is_dir():
        if (p / INDEX_NAME).exists():
            p = p / INDEX_NAME
        else:
            files = sorted(p.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors files or {INDEX_NAME} in {p}")
            return files, None
    if p.name.endswith(".index.json"):
        weight_map = json.loads(p.read_text())["weight_map"]
        return [p.parent / f for f in sorted(set(weight_map.values()))], weight_map
    if not p.exists():
        raise FileNotFoundError(f"checkpoint {p} does not exist")
    return [p], None


class Checkpoint:
    """Tensor names, shapes and shard of a safetensors checkpoint (headers only); `read`
    loads one tensor at a time, so a stage never holds more than its own weights."""

    def __init__(self, paths_or_dir):
        files, weight_map = _shard_files(paths_or_dir)
        self.file: dict[str, Path] = {}
        self.shape: dict[str, tuple[int, ...]] = {}
        for fp in files:
            if not fp.exists():
                raise FileNotFoundError(f"checkpoint shard {fp} does not exist")
            with safe_open(str(fp), framework="numpy") as f:
                for name in f.keys():
                    if name in self.file:
                        raise ValueError(f"tensor {name!r} is in two shards: "
                                         f"{self.file[name].name} and {fp.name}")
                    self.file[name] = fp
                    self.shape[name] = tuple(f.get_slice(name).get_shape())
        if weight_map is not None:
            for name, shard in weight_map.items():
                if name not in self.file or self.file[name].name != shard:
                    raise ValueError(f"{INDEX_NAME} puts tensor {name!r} in {shard}, "
                                     f"but that shard does not hold it")

    @property
    def names(self) -> set[str]:
        return set(self.file)

    def read(self, name: str) -> np.ndarray:
        with safe_open(str(self.file[name]), framework="numpy") as f:
            return f.get_tensor(name)

    def read_slice(self, name: str, index: tuple) -> np.ndarray:
        """Only block `index` (slices, HF layout) of tensor `name` is read from the file."""
        with safe_open(str(self.file[name]), framework="numpy") as f:
            return f.get_slice(name)[index]


def _set(tree: dict, path: tuple, value):
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def _get(tree: dict, path: tuple):
    for k in path:
        tree = tree[k]
    return tree


def _flatten(tree, prefix=()) -> dict[tuple, Any]:  # leaves: arrays (or any pytree leaf)
    if not isinstance(tree, dict):
        return {prefix: tree}
    out = {}
    for k, v in tree.items():
        out.update(_flatten(v, prefix + (k,)))
    return out


def _fmt(path: tuple) -> str:
    return ".".join(str(k) for k in path)


@dataclass
class LoadPlan:
    """What loading one module (or stage) reads: `entries` from `ckpt`; `known`: every HF
    name (under `prefix`) the whole module has, so a checkpoint name under `prefix` outside
    it (and not an ignored buffer) is unexpected."""

    ckpt: Checkpoint
    entries: list[Entry]
    known: set[str]
    what: str
    prefix: str = ""

    def check(self) -> None:
        """Unexpected / missing tensors and shape mismatches, from the headers alone."""
        unexpected = sorted(n for n in self.ckpt.names if n.startswith(self.prefix)
                            and n not in self.known and not _IGNORED.search(n))
        if unexpected:
            more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
            raise ValueError(f"{self.what}: unexpected tensor {unexpected[0]!r}{more} in the "
                             f"checkpoint; the config does not describe this model (check "
                             f"num_layers, qkv_bias, tie_embeddings and sizes against config.json)")
        for e in self.entries:
            if e.hf not in self.ckpt.file:
                raise ValueError(f"{self.what}: missing tensor {e.hf!r}: expected shape "
                                 f"{e.hf_shape} (HF layout) for {_fmt(e.path)}")
            if self.ckpt.shape[e.hf] != e.hf_shape:
                raise ValueError(f"{self.what}: tensor {e.hf!r} has shape "
                                 f"{self.ckpt.shape[e.hf]}, expected {e.hf_shape} (HF layout) "
                                 f"for {_fmt(e.path)} {e.shape}; the config does not match "
                                 f"the checkpoint")

    def read(self, dtype=np.float32) -> dict:
        """Check, then read every entry whole into a pure dict."""
        self.check()
        pure: dict = {}
        last: tuple = (None, None)  # a fused tensor's blocks are consecutive: read it once
        for e in self.entries:
            arr = last[1] if e.rows and last[0] == e.hf else self.ckpt.read(e.hf)
            last = (e.hf, arr) if e.rows else (None, None)
            _set(pure, e.path, np.ascontiguousarray(e.to_ours(arr), dtype=dtype))
        return pure

    def read_part(self, e: Entry, index: tuple) -> np.ndarray:
        """Our-layout block `index` (a tuple of slices over e.shape) of entry `e`, reading
        only that block of the file (safetensors get_slice) unless it is a patch kernel."""
        if e.patch:
            return e.to_ours(self.ckpt.read(e.hf))[index]
        if e.rows:  # our columns are HF rows offset by the block's start
            cols, rws = index[1], index[0]
            lo, hi, _ = cols.indices(e.shape[1])
            block = self.ckpt.read_slice(e.hf, (slice(e.rows[0] + lo, e.rows[0] + hi), rws))
            return block.T
        hf_index = tuple(index[::-1]) if e.transpose else tuple(index)
        return e.to_ours(self.ckpt.read_slice(e.hf, hf_index))


def load_entries(ckpt: Checkpoint, entries: list[Entry], known: set[str], what: str,
                 prefix: str = "", dtype=np.float32) -> dict:
    """Check then read `entries` from `ckpt` into a pure dict (see `LoadPlan`)."""
    return LoadPlan(ckpt, entries, known, what, prefix).read(dtype)


def save_entries(pure: dict, entries: list[Entry], path, what: str,
                 max_shard_bytes: int | None = None, dtype=None) -> list[Path]:
    """Write `pure` as HF-named safetensors: one file (`path` ends in .safetensors), or a
    directory holding model.safetensors, or shards + model.safetensors.index.json when
    the tensors exceed `max_shard_bytes`. Entries without an HF name are not written."""
    have = set(_flatten(pure))
    want = {e.path for e in entries}
    if have != want:
        bad = sorted(map(_fmt, have ^ want))
        raise ValueError(f"{what}: parameters do not match the config: {bad[:5]} "
                         f"(missing or extra); pass the config the module was built with")
    return write_safetensors(hf_tensors(pure, entries, what, dtype), path, max_shard_bytes)


def hf_tensors(pure: dict, entries: list[Entry], what: str, dtype=None) -> dict:
    """{HF name: array in HF layout} of `pure` (nested or `_flatten`ed by path) under
    `entries`. A fused HF tensor (Phi-3's qkv_proj / gate_up_proj: several `rows` entries)
    is assembled from its blocks; each block must be written, so a fused tensor with a
    block missing is an error, not zeros. `dtype`: cast to it (default: the arrays' own)."""
    flat = pure if pure and isinstance(next(iter(pure)), tuple) else _flatten(pure)
    tensors: dict[str, np.ndarray] = {}
    filled: dict[str, int] = {}
    for e in entries:
        if e.hf is None:
            continue
        arr = np.asarray(jax.device_get(flat[e.path]))
        if arr.shape != e.shape:
            raise ValueError(f"{what}: {_fmt(e.path)} has shape {arr.shape}, expected {e.shape}")
        if dtype is not None:
            arr = arr.astype(dtype)
        if e.rows:  # one block of a fused tensor
            fused = tensors.setdefault(e.hf, np.zeros(e.hf_shape, arr.dtype))
            fused[e.rows[0]:e.rows[1]] = arr.T
            filled[e.hf] = filled.get(e.hf, 0) + e.rows[1] - e.rows[0]
        else:
            tensors[e.hf] = np.ascontiguousarray(e.to_hf(arr))
    for name, n in filled.items():
        if n != tensors[name].shape[0]:
            raise ValueError(f"{what}: fused tensor {name!r} has {n} of "
                             f"{tensors[name].shape[0]} rows from the model; the entries do "
                             f"not cover it")
    return tensors


def save_extra(out: Path, flat: dict, written: dict) -> dict:
    """`flat` ({name tuple: array}: what no HF format holds) into
    out/mmjax_extra.safetensors (dotted names) when not empty, added to `written`."""
    arrays = {_fmt(k): np.ascontiguousarray(np.asarray(jax.device_get(v)))
              for k, v in flat.items()}
    if arrays:
        save_file(arrays, str(out / "mmjax_extra.safetensors"))
        written["extra"] = out / "mmjax_extra.safetensors"
    return written


def write_safetensors(tensors: dict, path, max_shard_bytes: int | None = None) -> list[Path]:
    """{HF name: array} -> one file (`path` ends in .safetensors), or a directory holding
    model.safetensors, or shards + model.safetensors.index.json above `max_shard_bytes`."""
    meta = {"format": "pt"}  # what transformers expects of a PyTorch-loadable file
    path = Path(path)
    if path.suffix == ".safetensors":
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path), metadata=meta)
        return [path]
    path.mkdir(parents=True, exist_ok=True)
    shards: list[dict] = [{}]
    size = 0
    for name, arr in tensors.items():
        if max_shard_bytes is not None and shards[-1] and size + arr.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = arr
        size += arr.nbytes
    if len(shards) == 1:
        save_file(shards[0], str(path / "model.safetensors"), metadata=meta)
        return [path / "model.safetensors"]
    n, files, weight_map = len(shards), [], {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        save_file(shard, str(path / fname), metadata=meta)
        files.append(path / fname)
        weight_map.update({name: fname for name in shard})
    total = sum(a.nbytes for a in tensors.values())
    (path / INDEX_NAME).write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return files


def read_config(config) -> dict:
    """config.json as a dict, from a dict, a config.json path or a checkpoint directory."""
    if isinstance(config, dict):
        return config
    p = Path(config)
    f = p / "config.json" if p.is_dir() else p
    if not f.exists():
        raise FileNotFoundError(f"{f} does not exist: a Hugging Face checkpoint directory holds "
                                f"config.json next to its *.safetensors")
    return json.loads(f.read_text())


def dense(hf: str, path: tuple, din: int, dout: int, bias: bool = True) -> list[Entry]:
    """An HF nn.Linear -> our `Dense` (kernel [in, out], bias when it has one)."""
    out = [Entry(hf + ".weight", path + ("kernel",), (din, dout), True)]
    return out + ([Entry(hf + ".bias", path + ("bias",), (dout,))] if bias else [])


def layer_norm(hf: str, path: tuple, d: int) -> list[Entry]:
    return [Entry(hf + ".weight", path + ("scale",), (d,)),
            Entry(hf + ".bias", path + ("bias",), (d,))]


def module_pure(module_or_pure_dict) -> dict:
    if isinstance(module_or_pure_dict, nnx.Module):
        return nnx.to_pure_dict(nnx.state(module_or_pure_dict, nnx.Param))
    return module_or_pure_dict


def apply_to_module(module: nnx.Module, pure_dict: dict) -> nnx.Module:
    """Put a pure dict of arrays into `module`'s parameters (`nnx.replace_by_pure_dict` on
    its state, then `nnx.update`), keeping each parameter's dtype and sharding. `module`
    may be abstract (`nnx.eval_shape`), which skips random init before loading. Keys and
    shapes must match exactly (ValueError naming the parameter). A pure dict without LoRA
    adapters (a base checkpoint) fills a LoRA'd module's base weights and leaves its
    adapters as they are (models/lora.py)."""
    from mmjax.models.lora import LoRAParam

    new = _flatten(pure_dict)
    adapters = set(_flatten(nnx.to_pure_dict(nnx.state(module, LoRAParam))))
    state = nnx.state(module, nnx.Param if adapters & set(new) else
                      nnx.All(nnx.Param, nnx.Not(LoRAParam)))
    current = _flatten(nnx.to_pure_dict(state))
    if set(current) != set(new):
        missing = sorted(map(_fmt, set(current) - set(new)))
        extra = sorted(map(_fmt, set(new) - set(current)))
        raise ValueError(f"parameters do not match the module: missing {missing[:5]}, "
                         f"unexpected {extra[:5]}; load with the module's config and layer range")
    values: dict = {}
    for path, old in current.items():
        arr = np.asarray(new[path])
        if arr.shape != tuple(old.shape):
            raise ValueError(f"parameter {_fmt(path)}: got shape {arr.shape}, the module has "
                             f"{tuple(old.shape)}")
        value = jnp.asarray(arr, dtype=old.dtype)
        sharding = getattr(old, "sharding", None)
        _set(values, path, jax.device_put(value, sharding) if sharding is not None else value)
    nnx.replace_by_pure_dict(state, values)
    nnx.update(module, state)
    return module
