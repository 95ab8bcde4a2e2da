"""Import (and export) Hugging Face safetensors checkpoints.

Cornstarch §3 builds an MLLM from pretrained unimodal models (a Hugging Face LLM, a Whisper
encoder, ...) plus new projectors; this file puts such checkpoints into mmjax's NNX modules.

Each module has a table of `Entry`s: HF tensor name -> path in our pure parameter dict, our
shape, and whether the HF array is the transpose of ours (HF Linear weights are [out, in],
ours [in, out]; HF Conv1d weights are [out, in, k], ours [k, in, out]; both are `.T`). The
same table drives strict checks (missing / unexpected tensors, shapes, all before any data
is read), lazy per-tensor reads, and export. Layer ranges [start, end) load a pipeline
stage, renumbered from 0 as `LLM(cfg, key, start, end)` holds them.

RoPE: HF's Llama/Qwen2 modelling code uses the rotate-half convention, like
`layers.rope` (first half x1*cos - x2*sin, second half x2*cos + x1*sin), so q/k weights
need no permutation.

Whisper: weights map exactly, but `AudioEncoder` is Whisper-like, not Whisper: its blocks
use tanh-approximate GELU (Whisper: exact) and its sinusoid divides by d/2 (Whisper: d/2 - 1),
so outputs differ slightly from HF's WhisperEncoder: a close, not bit-exact, start.

Vision: HF ViT checkpoints have a CLS token and a 1-D position table over a fixed grid;
mmjax's packed ViT has factorised 2-D positions and no CLS token, so there is no faithful
mapping and ViT import is deliberately not offered.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from mmjax.models.config import AudioConfig, LLMConfig, VisionConfig

INDEX_NAME = "model.safetensors.index.json"
# Non-parameter buffers some older HF checkpoints carry.
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


@dataclass(frozen=True)
class Entry:
    """One tensor: HF name (None: no HF tensor, load zeros), our pure-dict path, our shape."""

    hf: str | None
    path: tuple
    shape: tuple[int, ...]
    transpose: bool = False

    @property
    def hf_shape(self) -> tuple[int, ...]:
        return self.shape[::-1] if self.transpose else self.shape


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


def _set(tree: dict, path: tuple, value):
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def _get(tree: dict, path: tuple):
    for k in path:
        tree = tree[k]
    return tree


def _flatten(tree, prefix=()) -> dict[tuple, object]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out = {}
    for k, v in tree.items():
        out.update(_flatten(v, prefix + (k,)))
    return out


def _fmt(path: tuple) -> str:
    return ".".join(str(k) for k in path)


def load_entries(ckpt: Checkpoint, entries: list[Entry], known: set[str], what: str,
                 prefix: str = "", dtype=np.float32) -> dict:
    """Check then read `entries` from `ckpt` into a pure dict.

    known: every HF name (under `prefix`) the whole module has; a checkpoint name under
    `prefix` outside it (and not an ignored buffer) is unexpected. Missing names and shape
    mismatches are checked for every entry before any tensor data is read.
    """
    unexpected = sorted(n for n in ckpt.names
                        if n.startswith(prefix) and n not in known and not _IGNORED.search(n))
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise ValueError(f"{what}: unexpected tensor {unexpected[0]!r}{more} in the checkpoint; "
                         f"the config does not describe this model (check num_layers, "
                         f"qkv_bias, tie_embeddings and sizes against config.json)")
    for e in entries:
        if e.hf is None:
            continue
        if e.hf not in ckpt.file:
            raise ValueError(f"{what}: missing tensor {e.hf!r}: expected shape {e.hf_shape} "
                             f"(HF layout) for {_fmt(e.path)}")
        if ckpt.shape[e.hf] != e.hf_shape:
            raise ValueError(f"{what}: tensor {e.hf!r} has shape {ckpt.shape[e.hf]}, expected "
                             f"{e.hf_shape} (HF layout) for {_fmt(e.path)} {e.shape}; "
                             f"the config does not match the checkpoint")
    pure: dict = {}
    for e in entries:
        arr = np.zeros(e.shape, dtype) if e.hf is None else ckpt.read(e.hf)
        _set(pure, e.path, np.ascontiguousarray(arr.T if e.transpose else arr, dtype=dtype))
    return pure


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
    tensors: dict[str, np.ndarray] = {}
    for e in entries:
        arr = np.asarray(jax.device_get(_get(pure, e.path)))
        if arr.shape != e.shape:
            raise ValueError(f"{what}: {_fmt(e.path)} has shape {arr.shape}, expected {e.shape}")
        if e.hf is not None:
            arr = arr.T if e.transpose else arr
            tensors[e.hf] = np.ascontiguousarray(arr if dtype is None else arr.astype(dtype))
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


# ---------------------------------------------------------------------------------- LLM


def _range(num_layers: int, start: int, end: int | None, what: str) -> tuple[int, int]:
    end = num_layers if end is None else end
    if not 0 <= start < end <= num_layers:
        raise ValueError(f"{what} layer range [{start}, {end}) outside 0..{num_layers}")
    return start, end


def llm_entries(cfg: LLMConfig, start: int = 0, end: int | None = None) -> list[Entry]:
    """HF Llama/Qwen2 names for the parameters of `LLM(cfg, key, start, end)`."""
    start, end = _range(cfg.num_layers, start, end, "LLM")
    d, v, f = cfg.hidden_size, cfg.vocab_size, cfg.ffn_size
    hq, hkv = cfg.num_heads * cfg.dim_per_head, cfg.num_kv_heads * cfg.dim_per_head
    is_first, is_last = start == 0, end == cfg.num_layers
    out = []
    if is_first or (is_last and cfg.tie_embeddings):
        out.append(Entry("model.embed_tokens.weight", ("embed",), (v, d)))
    for i in range(start, end):
        p, j = f"model.layers.{i}.", i - start
        out += [
            Entry(p + "input_layernorm.weight", ("layers", j, "attn_norm", "scale"), (d,)),
            Entry(p + "self_attn.q_proj.weight", ("layers", j, "wq"), (d, hq), True),
            Entry(p + "self_attn.k_proj.weight", ("layers", j, "wk"), (d, hkv), True),
            Entry(p + "self_attn.v_proj.weight", ("layers", j, "wv"), (d, hkv), True),
            Entry(p + "self_attn.o_proj.weight", ("layers", j, "wo"), (hq, d), True),
            Entry(p + "post_attention_layernorm.weight", ("layers", j, "mlp_norm", "scale"), (d,)),
            Entry(p + "mlp.gate_proj.weight", ("layers", j, "w_gate"), (d, f), True),
            Entry(p + "mlp.up_proj.weight", ("layers", j, "w_up"), (d, f), True),
            Entry(p + "mlp.down_proj.weight", ("layers", j, "w_down"), (f, d), True),
        ]
        if cfg.qkv_bias:
            out += [Entry(p + "self_attn.q_proj.bias", ("layers", j, "bq"), (hq,)),
                    Entry(p + "self_attn.k_proj.bias", ("layers", j, "bk"), (hkv,)),
                    Entry(p + "self_attn.v_proj.bias", ("layers", j, "bv"), (hkv,))]
    if is_last:
        out.append(Entry("model.norm.weight", ("final_norm", "scale"), (d,)))
        if not cfg.tie_embeddings:
            out.append(Entry("lm_head.weight", ("lm_head",), (d, v), True))
    return out


def load_llm_safetensors(paths_or_dir, cfg: LLMConfig, start: int = 0, end: int | None = None,
                         dtype=np.float32) -> dict:
    """HF Llama/Qwen2 safetensors -> pure dict for `LLM(cfg, key, start, end)`.

    Reads only layers [start, end) (renumbered from 0) plus the embedding / final norm /
    head the stage holds. A tied checkpoint may still carry `lm_head.weight`; it is accepted
    only if it equals the embedding.
    """
    ckpt = Checkpoint(paths_or_dir)
    entries = llm_entries(cfg, start, end)
    known = {e.hf for e in llm_entries(cfg)}
    tied_head = cfg.tie_embeddings and "lm_head.weight" in ckpt.file
    if tied_head:
        known.add("lm_head.weight")
    pure = load_entries(ckpt, entries, known, "LLM", dtype=dtype)
    if tied_head and "embed" in pure:
        if not np.array_equal(np.asarray(ckpt.read("lm_head.weight"), dtype), pure["embed"]):
            raise ValueError("LLM: cfg.tie_embeddings is True but the checkpoint's "
                             "'lm_head.weight' differs from 'model.embed_tokens.weight'; "
                             "set tie_embeddings=False (config.json tie_word_embeddings)")
    return pure


def export_llm_safetensors(module_or_pure_dict, cfg: LLMConfig, path, start: int = 0,
                           max_shard_bytes: int | None = None, dtype=None) -> list[Path]:
    """Inverse of `load_llm_safetensors`: an `LLM` module (or its pure dict, holding layers
    [start, start + n)) -> HF-named safetensors. Writing to a directory also writes
    config.json, so the directory is a loadable HF checkpoint. Returns the files written."""
    if isinstance(module_or_pure_dict, nnx.Module):
        start = module_or_pure_dict.start
        pure = nnx.to_pure_dict(nnx.state(module_or_pure_dict, nnx.Param))
    else:
        pure = module_or_pure_dict
    n = len(pure.get("layers", {}))
    files = save_entries(pure, llm_entries(cfg, start, start + n), path, "LLM",
                         max_shard_bytes, dtype)
    if Path(path).suffix != ".safetensors":
        (Path(path) / "config.json").write_text(json.dumps(config_to_hf(cfg), indent=2))
    return files


def _read_config(config) -> dict:
    if isinstance(config, dict):
        return config
    p = Path(config)
    return json.loads((p / "config.json" if p.is_dir() else p).read_text())


def config_from_hf(config) -> LLMConfig:
    """HF Llama/Qwen2 config.json (path, checkpoint directory or dict) -> LLMConfig.

    Features mmjax's decoder lacks raise ValueError naming the field instead of loading a
    model that would silently compute something else.
    """
    c = _read_config(config)
    kind = c.get("model_type")
    if kind not in ("llama", "qwen2"):
        raise ValueError(f"config.json model_type={kind!r}: only 'llama' and 'qwen2' are supported")
    if c.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json hidden_act={c['hidden_act']!r}: mmjax's decoder uses 'silu'")
    for field in ("rope_scaling", "mlp_bias", "attention_bias", "use_sliding_window"):
        if c.get(field):
            raise ValueError(f"config.json {field}={c[field]!r}: not supported by mmjax's "
                             f"decoder (plain RoPE, bias only on q/k/v for qwen2, full attention); "
                             f"remove the field only if you accept a different model")
    d, heads = c["hidden_size"], c["num_attention_heads"]
    head_dim = c.get("head_dim")
    return LLMConfig(
        vocab_size=c["vocab_size"], hidden_size=d, num_layers=c["num_hidden_layers"],
        num_heads=heads, num_kv_heads=c.get("num_key_value_heads") or heads,
        ffn_size=c["intermediate_size"],
        head_dim=None if head_dim in (None, d // heads) else head_dim,
        rope_theta=float(c.get("rope_theta", 10000.0)),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        qkv_bias=kind == "qwen2", norm_eps=float(c.get("rms_norm_eps", 1e-6)))


def config_to_hf(cfg: LLMConfig) -> dict:
    """LLMConfig -> HF config.json dict (qwen2 when the model has q/k/v biases, else llama)."""
    return {
        "architectures": ["Qwen2ForCausalLM" if cfg.qkv_bias else "LlamaForCausalLM"],
        "model_type": "qwen2" if cfg.qkv_bias else "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "intermediate_size": cfg.ffn_size,
        "head_dim": cfg.dim_per_head, "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.tie_embeddings, "rms_norm_eps": cfg.norm_eps,
        "hidden_act": "silu",
    }


# ------------------------------------------------------------------------ Whisper encoder


def _dense(hf: str, path: tuple, din: int, dout: int, bias: bool = True) -> list[Entry]:
    return [Entry(hf + ".weight", path + ("kernel",), (din, dout), True),
            Entry(hf + ".bias" if bias else None, path + ("bias",), (dout,))]


def _layer_norm(hf: str, path: tuple, d: int) -> list[Entry]:
    return [Entry(hf + ".weight", path + ("scale",), (d,)),
            Entry(hf + ".bias", path + ("bias",), (d,))]


def whisper_entries(cfg: AudioConfig, start: int = 0, end: int | None = None,
                    prefix: str = "") -> list[Entry]:
    """HF WhisperEncoder names for `AudioEncoder(cfg, key, start, end)`. Whisper's k_proj
    has no bias: our k bias gets zeros (a key bias only shifts each query's scores by a
    constant, so it cannot change attention anyway)."""
    start, end = _range(cfg.num_layers, start, end, "audio")
    d, m, f = cfg.hidden_size, cfg.num_mel_bins, cfg.ffn_size
    out = []
    if start == 0:
        out += [Entry(prefix + "conv1.weight", ("conv1_kernel",), (3, m, d), True),
                Entry(prefix + "conv1.bias", ("conv1_bias",), (d,)),
                Entry(prefix + "conv2.weight", ("conv2_kernel",), (3, d, d), True),
                Entry(prefix + "conv2.bias", ("conv2_bias",), (d,))]
    for i in range(start, end):
        p, j = f"{prefix}layers.{i}.", ("layers", i - start)
        out += (_layer_norm(p + "self_attn_layer_norm", j + ("ln1",), d)
                + _dense(p + "self_attn.q_proj", j + ("q",), d, d)
                + _dense(p + "self_attn.k_proj", j + ("k",), d, d, bias=False)
                + _dense(p + "self_attn.v_proj", j + ("v",), d, d)
                + _dense(p + "self_attn.out_proj", j + ("o",), d, d)
                + _layer_norm(p + "final_layer_norm", j + ("ln2",), d)
                + _dense(p + "fc1", j + ("fc1",), d, f)
                + _dense(p + "fc2", j + ("fc2",), f, d))
    if end == cfg.num_layers:
        out += _layer_norm(prefix + "layer_norm", ("final_ln",), d)
    return out


def audio_config_from_hf(config) -> AudioConfig:
    """HF Whisper config.json (path, directory or dict) -> AudioConfig of its encoder."""
    c = _read_config(config)
    if c.get("model_type") != "whisper":
        raise ValueError(f"config.json model_type={c.get('model_type')!r}: expected 'whisper'")
    return AudioConfig(hidden_size=c["d_model"], num_layers=c["encoder_layers"],
                       num_heads=c["encoder_attention_heads"], ffn_size=c["encoder_ffn_dim"],
                       num_mel_bins=c["num_mel_bins"])


def _whisper_prefix(ckpt: Checkpoint) -> str:
    """'' for a WhisperEncoder checkpoint, 'encoder.' / 'model.encoder.' for WhisperModel /
    WhisperForConditionalGeneration (whose decoder tensors are then left alone)."""
    for prefix in ("", "encoder.", "model.encoder."):
        if prefix + "conv1.weight" in ckpt.file:
            return prefix
    raise ValueError("audio: no 'conv1.weight' (nor 'encoder.conv1.weight', "
                     "'model.encoder.conv1.weight'): not a Whisper encoder checkpoint")


def load_whisper_encoder_safetensors(paths_or_dir, cfg: AudioConfig, start: int = 0,
                                     end: int | None = None, dtype=np.float32) -> dict:
    """HF Whisper encoder safetensors -> pure dict for `AudioEncoder(cfg, key, start, end)`.

    Whisper's `embed_positions.weight` is a fixed sinusoid table; `AudioEncoder` computes
    its positions itself, so the table is not loaded.
    """
    ckpt = Checkpoint(paths_or_dir)
    prefix = _whisper_prefix(ckpt)
    known = {e.hf for e in whisper_entries(cfg, prefix=prefix) if e.hf is not None}
    known.add(prefix + "embed_positions.weight")
    return load_entries(ckpt, whisper_entries(cfg, start, end, prefix), known, "audio",
                        prefix=prefix, dtype=dtype)


# ------------------------------------------------------------------- into NNX modules


def apply_to_module(module: nnx.Module, pure_dict: dict) -> nnx.Module:
    """Put a pure dict of arrays into `module`'s parameters (`nnx.replace_by_pure_dict` on
    its state, then `nnx.update`), keeping each parameter's dtype and sharding. `module`
    may be abstract (`nnx.eval_shape`), which skips random init before loading. Keys and
    shapes must match exactly (ValueError naming the parameter)."""
    state = nnx.state(module, nnx.Param)
    current = _flatten(nnx.to_pure_dict(state))
    new = _flatten(pure_dict)
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
        arr = jnp.asarray(arr, dtype=old.dtype)
        sharding = getattr(old, "sharding", None)
        _set(values, path, jax.device_put(arr, sharding) if sharding is not None else arr)
    nnx.replace_by_pure_dict(state, values)
    nnx.update(module, state)
    return module


def load_into_model(model, llm_path=None, encoder_paths: dict | None = None):
    """Load pretrained parts into a `MultimodalModel` (Cornstarch §3): `llm_path` an HF
    Llama/Qwen2 checkpoint for `model.llm`; `encoder_paths` {encoder name: HF Whisper
    checkpoint} for audio encoders. Projectors (and anything not named) keep their init."""
    if llm_path is not None:
        llm = model.llm
        apply_to_module(llm, load_llm_safetensors(llm_path, model.cfg.llm, llm.start, llm.end))
    for name, path in (encoder_paths or {}).items():
        enc_cfg = model.cfg.encoder(name).encoder
        if isinstance(enc_cfg, VisionConfig):
            raise ValueError(f"encoder {name!r}: HF ViT checkpoints (CLS token, 1-D position "
                             f"table) have no faithful mapping onto mmjax's packed ViT "
                             f"(factorised 2-D positions); train it or load native weights")
        enc = model.encoders[name]
        apply_to_module(enc, load_whisper_encoder_safetensors(path, enc_cfg, enc.start, enc.end))
    return model
