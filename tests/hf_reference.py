"""Float64 NumPy re-implementations of Hugging Face's reference models (written from
transformers' modelling code: LlamaModel / Qwen2 / Mistral, CLIPVisionTransformer,
SiglipVisionTransformer, WhisperEncoder, `_compute_llama3_parameters`, PyTorch's bicubic
`interpolate`), and tiny random checkpoints with HF tensor names, for tests."""
from __future__ import annotations

import json
import math

import numpy as np
from safetensors.numpy import save_file

erf = np.vectorize(math.erf)

# ------------------------------------------------------------------------ checkpoints


def rand(rng, *shape, std=0.3):
    return rng.normal(0, std, shape).astype(np.float32)


def write_checkpoint(d, config: dict, tensors: dict, shards: int = 1):
    """config.json + model.safetensors, or `shards` files with model.safetensors.index.json."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config))
    if shards == 1:
        save_file(tensors, str(d / "model.safetensors"))
        return d
    names = sorted(tensors)
    wm = {}
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i::shards]
        save_file({n: tensors[n] for n in part}, str(d / fname))
        wm.update({n: fname for n in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return d


def llm_tensors(c: dict, seed=0, std=0.3) -> dict:
    """HF Llama / Mistral / Qwen2 tensors for config dict `c`."""
    rng = np.random.default_rng(seed)
    rand = lambda rng, *shape: globals()["rand"](rng, *shape, std=std)
    d, v, f = c["hidden_size"], c["vocab_size"], c["intermediate_size"]
    hd = c.get("head_dim") or d // c["num_attention_heads"]
    hq, hkv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    t = {"model.embed_tokens.weight": rand(rng, v, d), "model.norm.weight": 1 + rand(rng, d)}
    if not c.get("tie_word_embeddings"):
        t["lm_head.weight"] = rand(rng, v, d)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t.update({p + "input_layernorm.weight": 1 + rand(rng, d),
                  p + "post_attention_layernorm.weight": 1 + rand(rng, d),
                  p + "self_attn.q_proj.weight": rand(rng, hq, d),
                  p + "self_attn.k_proj.weight": rand(rng, hkv, d),
                  p + "self_attn.v_proj.weight": rand(rng, hkv, d),
                  p + "self_attn.o_proj.weight": rand(rng, d, hq),
                  p + "mlp.gate_proj.weight": rand(rng, f, d),
                  p + "mlp.up_proj.weight": rand(rng, f, d),
                  p + "mlp.down_proj.weight": rand(rng, d, f)})
        if c["model_type"] == "qwen2":
            t.update({p + "self_attn.q_proj.bias": rand(rng, hq),
                      p + "self_attn.k_proj.bias": rand(rng, hkv),
                      p + "self_attn.v_proj.bias": rand(rng, hkv)})
    return t


def tower_tensors(family: str, v: dict, seed=0, prefix="vision_model.", std=0.3) -> dict:
    """HF CLIP / SigLIP vision-tower tensors for vision config dict `v`."""
    rng = np.random.default_rng(seed)
    rand = lambda rng, *shape: globals()["rand"](rng, *shape, std=std)
    d, f, p, ch = v["hidden_size"], v["intermediate_size"], v["patch_size"], v["num_channels"]
    n = (v["image_size"] // p) ** 2 + (family == "clip")
    e = prefix + "embeddings."
    t = {e + "patch_embedding.weight": rand(rng, d, ch, p, p),
         e + "position_embedding.weight": rand(rng, n, d),
         prefix + "post_layernorm.weight": 1 + rand(rng, d),
         prefix + "post_layernorm.bias": rand(rng, d)}
    if family == "clip":
        t.update({e + "class_embedding": rand(rng, d), prefix + "pre_layrnorm.weight": 1 + rand(rng, d),
                  prefix + "pre_layrnorm.bias": rand(rng, d)})
    else:
        t[e + "patch_embedding.bias"] = rand(rng, d)
    for i in range(v["num_hidden_layers"]):
        q = f"{prefix}encoder.layers.{i}."
        for n_ in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj"):
            t[q + n_ + ".weight"], t[q + n_ + ".bias"] = rand(rng, d, d), rand(rng, d)
        for n_ in ("layer_norm1", "layer_norm2"):
            t[q + n_ + ".weight"], t[q + n_ + ".bias"] = 1 + rand(rng, d), rand(rng, d)
        t[q + "mlp.fc1.weight"], t[q + "mlp.fc1.bias"] = rand(rng, f, d), rand(rng, f)
        t[q + "mlp.fc2.weight"], t[q + "mlp.fc2.bias"] = rand(rng, d, f), rand(rng, d)
    return t


def whisper_tensors(c: dict, seed=0, prefix="model.encoder.") -> dict:
    rng = np.random.default_rng(seed)
    d, m, f = c["d_model"], c["num_mel_bins"], c["encoder_ffn_dim"]
    t = {"conv1.weight": rand(rng, d, m, 3), "conv1.bias": rand(rng, d),
         "conv2.weight": rand(rng, d, d, 3), "conv2.bias": rand(rng, d),
         "embed_positions.weight": np_whisper_sinusoids(c["max_source_positions"], d).astype(np.float32)
         + rand(rng, c["max_source_positions"], d, std=0.05),  # a table, not the formula
         "layer_norm.weight": 1 + rand(rng, d), "layer_norm.bias": rand(rng, d)}
    for i in range(c["encoder_layers"]):
        p = f"layers.{i}."
        for n in ("q_proj", "v_proj", "out_proj"):
            t[p + f"self_attn.{n}.weight"], t[p + f"self_attn.{n}.bias"] = rand(rng, d, d), rand(rng, d)
        t[p + "self_attn.k_proj.weight"] = rand(rng, d, d)
        for n in ("self_attn_layer_norm", "final_layer_norm"):
            t[p + n + ".weight"], t[p + n + ".bias"] = 1 + rand(rng, d), rand(rng, d)
        t[p + "fc1.weight"], t[p + "fc1.bias"] = rand(rng, f, d), rand(rng, f)
        t[p + "fc2.weight"], t[p + "fc2.bias"] = rand(rng, d, f), rand(rng, d)
    return {prefix + k: v for k, v in t.items()}


# ------------------------------------------------------------------------ primitives


def f64(t: dict) -> dict:
    return {k: np.asarray(v, np.float64) for k, v in t.items()}


def rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def layer_norm(x, w, b, eps):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps) * w + b


ACT = {"gelu": lambda x: 0.5 * x * (1 + erf(x / math.sqrt(2))),
       "gelu_pytorch_tanh": lambda x: 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi)
                                                             * (x + 0.044715 * x ** 3))),
       "quick_gelu": lambda x: x / (1 + np.exp(-1.702 * x))}


def softmax(s):
    e = np.exp(s - s.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def linear(t, name, x):
    return x @ t[name + ".weight"].T + t.get(name + ".bias", 0.0)


def inv_freq(dim, theta, scaling=None):
    """transformers' default / llama3 RoPE inverse frequencies, in float64."""
    inv = 1.0 / theta ** (np.arange(0, dim, 2) / dim)
    if scaling is None:
        return inv
    factor, lo, hi, old = (scaling[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                                  "original_max_position_embeddings"))
    wavelen = 2 * math.pi / inv
    out = np.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * out / factor + smooth * out
    medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
    return np.where(medium, smoothed, out)


def apply_rope(x, pos, inv):  # x [S, H, D], HF rotate_half
    d = x.shape[-1]
    emb = np.concatenate([pos[:, None] * inv] * 2, -1)[:, None, :]
    rot = np.concatenate([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * np.cos(emb) + rot * np.sin(emb)


def mha(q, k, v, mask=None):  # [S, H, D]
    s = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    if mask is not None:
        s = np.where(mask[None], s, -np.inf)
    return np.einsum("hqk,khd->qhd", softmax(s), v).reshape(q.shape[0], -1)


# ------------------------------------------------------------------------ models


def llm_logits(t: dict, c: dict, tokens, theta: float, scaling=None):
    """HF LlamaForCausalLM / Qwen2 / Mistral (no sliding window) logits [S, V]."""
    t = f64(t)
    heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
    hd = c.get("head_dim") or c["hidden_size"] // heads
    s, eps = len(tokens), c["rms_norm_eps"]
    pos, inv = np.arange(s, dtype=np.float64), inv_freq(hd, theta, scaling)
    x = t["model.embed_tokens.weight"][tokens]
    causal = np.tril(np.ones((s, s), bool))
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms_norm(x, t[p + "input_layernorm.weight"], eps)
        q = linear(t, p + "self_attn.q_proj", h).reshape(s, heads, hd)
        k = linear(t, p + "self_attn.k_proj", h).reshape(s, kv, hd)
        v = linear(t, p + "self_attn.v_proj", h).reshape(s, kv, hd)
        q, k = apply_rope(q, pos, inv), apply_rope(k, pos, inv)
        k, v = np.repeat(k, heads // kv, 1), np.repeat(v, heads // kv, 1)
        x = x + linear(t, p + "self_attn.o_proj", mha(q, k, v, causal))
        h = rms_norm(x, t[p + "post_attention_layernorm.weight"], eps)
        g = linear(t, p + "mlp.gate_proj", h)
        x = x + linear(t, p + "mlp.down_proj", g / (1 + np.exp(-g)) * linear(t, p + "mlp.up_proj", h))
    h = rms_norm(x, t["model.norm.weight"], eps)
    return h @ t.get("lm_head.weight", t["model.embed_tokens.weight"]).T


def _cubic(t, a=-0.75):
    near = lambda x: ((a + 2) * x - (a + 3)) * x * x + 1
    far = lambda x: ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.array([far(t + 1), near(t), near(1 - t), far(2 - t)])


def bicubic_resize(img, out_h, out_w):
    """PyTorch F.interpolate(mode="bicubic", align_corners=False, size=...): img [h, w, d]."""
    def axis_matrix(n_in, n_out):
        m = np.zeros((n_out, n_in))
        for i in range(n_out):
            src = (i + 0.5) * n_in / n_out - 0.5
            x0 = math.floor(src)
            for k, w in enumerate(_cubic(src - x0)):
                m[i, min(max(x0 - 1 + k, 0), n_in - 1)] += w
        return m
    mh, mw = axis_matrix(img.shape[0], out_h), axis_matrix(img.shape[1], out_w)
    return np.einsum("ih,jw,hwd->ijd", mh, mw, img)


def vision_tower(t: dict, family: str, v: dict, pixels, prefix="vision_model.",
                 hidden_state: int | None = None):
    """HF CLIPVisionTransformer / SiglipVisionTransformer on one image [C, H, W] with
    interpolate_pos_encoding: last_hidden_state, or hidden_states[hidden_state]."""
    t = f64(t)
    e = prefix + "embeddings."
    p, d, heads = v["patch_size"], v["hidden_size"], v["num_attention_heads"]
    ch, hh, ww = pixels.shape
    gh, gw = hh // p, ww // p
    w = t[e + "patch_embedding.weight"]
    patches = pixels[:, : gh * p, : gw * p].reshape(ch, gh, p, gw, p).transpose(1, 3, 0, 2, 4)
    x = np.einsum("ijcyx,dcyx->ijd", patches, w) + t.get(e + "patch_embedding.bias", 0.0)
    table = t[e + "position_embedding.weight"]
    clip = family == "clip"
    g0 = v["image_size"] // p
    grid = table[int(clip):].reshape(g0, g0, d)
    x = (x + bicubic_resize(grid, gh, gw)).reshape(gh * gw, d)
    if clip:
        x = np.concatenate([(t[e + "class_embedding"] + table[0])[None], x])
        x = layer_norm(x, t[prefix + "pre_layrnorm.weight"], t[prefix + "pre_layrnorm.bias"],
                       v["layer_norm_eps"])
    states, eps, act = [x], v["layer_norm_eps"], ACT[v["hidden_act"]]
    for i in range(v["num_hidden_layers"]):
        q = f"{prefix}encoder.layers.{i}."
        h = layer_norm(x, t[q + "layer_norm1.weight"], t[q + "layer_norm1.bias"], eps)
        sp = lambda n: linear(t, q + "self_attn." + n, h).reshape(len(x), heads, -1)
        x = x + linear(t, q + "self_attn.out_proj", mha(sp("q_proj"), sp("k_proj"), sp("v_proj")))
        h = layer_norm(x, t[q + "layer_norm2.weight"], t[q + "layer_norm2.bias"], eps)
        x = x + linear(t, q + "mlp.fc2", act(linear(t, q + "mlp.fc1", h)))
        states.append(x)
    if hidden_state is not None:
        return states[hidden_state]
    if not clip:
        x = layer_norm(x, t[prefix + "post_layernorm.weight"], t[prefix + "post_layernorm.bias"], eps)
    return x


def np_whisper_sinusoids(length, channels):
    inc = math.log(10000) / (channels // 2 - 1)
    ang = np.arange(length)[:, None] * np.exp(-inc * np.arange(channels // 2))[None]
    return np.concatenate([np.sin(ang), np.cos(ang)], 1)


def conv1d(x, w, b, stride):
    """PyTorch Conv1d(kernel 3, padding 1): x [T, C_in], w [C_out, C_in, 3] -> [T', C_out]."""
    xp = np.pad(x, ((1, 1), (0, 0)))
    n = (xp.shape[0] - 3) // stride + 1
    return np.stack([np.einsum("kc,ock->o", xp[i * stride: i * stride + 3], w)
                     for i in range(n)]) + b


def whisper_encoder(t: dict, c: dict, feats, prefix="model.encoder."):
    """HF WhisperEncoder on input_features [n_mels, T] -> last_hidden_state [T/2, d]."""
    t = {k[len(prefix):]: v for k, v in f64(t).items() if k.startswith(prefix)}
    gelu, eps, heads = ACT["gelu"], 1e-5, c["encoder_attention_heads"]
    x = gelu(conv1d(feats.T, t["conv1.weight"], t["conv1.bias"], 1))
    x = gelu(conv1d(x, t["conv2.weight"], t["conv2.bias"], 2))
    x = x + t["embed_positions.weight"]
    for i in range(c["encoder_layers"]):
        p = f"layers.{i}."
        h = layer_norm(x, t[p + "self_attn_layer_norm.weight"], t[p + "self_attn_layer_norm.bias"], eps)
        sp = lambda n: linear(t, p + "self_attn." + n, h).reshape(len(x), heads, -1)
        x = x + linear(t, p + "self_attn.out_proj", mha(sp("q_proj"), sp("k_proj"), sp("v_proj")))
        h = layer_norm(x, t[p + "final_layer_norm.weight"], t[p + "final_layer_norm.bias"], eps)
        x = x + linear(t, p + "fc2", gelu(linear(t, p + "fc1", h)))
    return layer_norm(x, t["layer_norm.weight"], t["layer_norm.bias"], eps)
