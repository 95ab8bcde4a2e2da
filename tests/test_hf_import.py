"""HF safetensors import/export (mmjax/models/hf.py) against hand-written HF checkpoints and
an independent numpy Llama/Qwen2 forward pass."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from mmjax.models import hf
from mmjax.models.audio import AudioEncoder
from mmjax.models.config import AudioConfig, EncoderSpec, LLMConfig, MLLMConfig
from mmjax.models.llm import LLM
from mmjax.models.mllm import MultimodalModel

LLAMA = LLMConfig(vocab_size=23, hidden_size=16, num_layers=3, num_heads=4, num_kv_heads=2,
                  ffn_size=24, head_dim=6, rope_theta=500.0, norm_eps=1e-5)
QWEN_TIED = dataclasses.replace(LLAMA, qkv_bias=True, tie_embeddings=True, head_dim=None)


def hf_llm_tensors(cfg: LLMConfig, seed=0) -> dict:
    """Random HF-named tensors in HF layouts ([out, in] Linear weights)."""
    rng = np.random.default_rng(seed)
    d, v, f = cfg.hidden_size, cfg.vocab_size, cfg.ffn_size
    hq, hkv = cfg.num_heads * cfg.dim_per_head, cfg.num_kv_heads * cfg.dim_per_head
    r = lambda *s: rng.normal(0, 0.3, s).astype(np.float32)
    t = {"model.embed_tokens.weight": r(v, d), "model.norm.weight": 1 + r(d)}
    if not cfg.tie_embeddings:
        t["lm_head.weight"] = r(v, d)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        t.update({p + "input_layernorm.weight": 1 + r(d),
                  p + "post_attention_layernorm.weight": 1 + r(d),
                  p + "self_attn.q_proj.weight": r(hq, d), p + "self_attn.k_proj.weight": r(hkv, d),
                  p + "self_attn.v_proj.weight": r(hkv, d), p + "self_attn.o_proj.weight": r(d, hq),
                  p + "mlp.gate_proj.weight": r(f, d), p + "mlp.up_proj.weight": r(f, d),
                  p + "mlp.down_proj.weight": r(d, f)})
        if cfg.qkv_bias:
            t.update({p + "self_attn.q_proj.bias": r(hq), p + "self_attn.k_proj.bias": r(hkv),
                      p + "self_attn.v_proj.bias": r(hkv)})
    return t


def write_two_shards(tensors: dict, d):
    names = sorted(tensors)
    half = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
            "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for fname, ns in half.items():
        save_file({n: tensors[n] for n in ns}, str(d / fname))
    wm = {n: f for f, ns in half.items() for n in ns}
    (d / hf.INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return d


# ------------------------------------------------------------ numpy reference (HF Llama)


def np_rmsnorm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def np_rope(x, pos, theta):  # x [S, H, D]; HF apply_rotary_pos_emb with rotate_half
    d = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    emb = np.concatenate([pos[:, None] * inv] * 2, -1)[:, None, :]
    rot = np.concatenate([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * np.cos(emb) + rot * np.sin(emb)


def np_llm_logits(t: dict, cfg: LLMConfig, tokens):
    """Independent float64 Llama/Qwen2 forward from HF-named tensors: x @ W.T everywhere."""
    t = {k: v.astype(np.float64) for k, v in t.items()}
    s, hd, eps = len(tokens), cfg.dim_per_head, cfg.norm_eps
    pos = np.arange(s, dtype=np.float64)
    x = t["model.embed_tokens.weight"][tokens]
    causal = np.tril(np.ones((s, s), bool))
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        lin = lambda h, n: h @ t[p + n + ".weight"].T + t.get(p + n + ".bias", 0.0)
        h = np_rmsnorm(x, t[p + "input_layernorm.weight"], eps)
        q = lin(h, "self_attn.q_proj").reshape(s, cfg.num_heads, hd)
        k = lin(h, "self_attn.k_proj").reshape(s, cfg.num_kv_heads, hd)
        v = lin(h, "self_attn.v_proj").reshape(s, cfg.num_kv_heads, hd)
        q, k = np_rope(q, pos, cfg.rope_theta), np_rope(k, pos, cfg.rope_theta)
        rep = cfg.num_heads // cfg.num_kv_heads  # GQA: query head j uses kv head j // rep
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
        sc = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd)
        sc = np.where(causal[None], sc, -np.inf)
        a = np.exp(sc - sc.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        o = np.einsum("hqk,khd->qhd", a, v).reshape(s, -1)
        x = x + lin(o, "self_attn.o_proj")
        h = np_rmsnorm(x, t[p + "post_attention_layernorm.weight"], eps)
        g, u = lin(h, "mlp.gate_proj"), lin(h, "mlp.up_proj")
        x = x + lin(g / (1 + np.exp(-g)) * u, "mlp.down_proj")
    h = np_rmsnorm(x, t["model.norm.weight"], eps)
    head = t.get("lm_head.weight", t["model.embed_tokens.weight"])
    return h @ head.T


def load_llm(cfg, path, start=0, end=None):
    """Into an abstract module (nnx.eval_shape): no random init before loading."""
    m = nnx.eval_shape(lambda: LLM(cfg, jax.random.key(7), start, end))
    return hf.apply_to_module(m, hf.load_llm_safetensors(path, cfg, start, end))


def random_module(make, seed=0):
    """A concrete module with numpy-random parameters (fast: no eager JAX init)."""
    rng = np.random.default_rng(seed)
    m = nnx.eval_shape(make)
    shapes = nnx.to_pure_dict(nnx.state(m, nnx.Param))
    return hf.apply_to_module(m, jax.tree.map(lambda a: rng.normal(size=a.shape), shapes))


@nnx.jit
def llm_logits(model, tokens, positions, allowed):
    return model(tokens, positions, allowed)


# ------------------------------------------------------------------------------ tests


def test_tensors_land_transposed(tmp_path):
    t = hf_llm_tensors(LLAMA)
    save_file(t, str(tmp_path / "model.safetensors"))
    pure = hf.load_llm_safetensors(tmp_path / "model.safetensors", LLAMA)
    l1 = pure["layers"][1]
    assert l1["wq"].shape == (16, 24) and l1["wk"].shape == (16, 12)
    # HF q_proj[out, in] -> our wq[in, out]: element-wise checks, not just shapes.
    assert l1["wq"][3, 20] == t["model.layers.1.self_attn.q_proj.weight"][20, 3]
    assert l1["wk"][15, 0] == t["model.layers.1.self_attn.k_proj.weight"][0, 15]
    assert l1["wo"][23, 2] == t["model.layers.1.self_attn.o_proj.weight"][2, 23]
    assert l1["w_down"][5, 9] == t["model.layers.1.mlp.down_proj.weight"][9, 5]
    np.testing.assert_array_equal(pure["layers"][2]["w_gate"],
                                  t["model.layers.2.mlp.gate_proj.weight"].T)
    np.testing.assert_array_equal(pure["layers"][0]["mlp_norm"]["scale"],
                                  t["model.layers.0.post_attention_layernorm.weight"])
    np.testing.assert_array_equal(pure["embed"], t["model.embed_tokens.weight"])
    assert pure["lm_head"][4, 17] == t["lm_head.weight"][17, 4]
    np.testing.assert_array_equal(pure["final_norm"]["scale"], t["model.norm.weight"])


@pytest.mark.parametrize("cfg", [LLAMA, QWEN_TIED], ids=["llama_gqa_untied", "qwen2_bias_tied"])
def test_logits_match_numpy_reference(tmp_path, cfg):
    t = hf_llm_tensors(cfg, seed=1)
    save_file(t, str(tmp_path / "model.safetensors"))
    model = load_llm(cfg, tmp_path)
    if cfg.qkv_bias:
        np.testing.assert_array_equal(np.asarray(model.layers[2].bk[...]),
                                      t["model.layers.2.self_attn.k_proj.bias"])
    assert (model.lm_head is None) == cfg.tie_embeddings
    tokens = np.array([3, 9, 1, 22, 0, 7, 7, 15])
    s = len(tokens)
    causal = jnp.tril(jnp.ones((s, s), bool))[None]
    got = llm_logits(model, jnp.asarray(tokens)[None], jnp.arange(s)[None], causal)[0]
    want = np_llm_logits(t, cfg, tokens)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-4)


def test_two_shards_with_index_equal_single_file(tmp_path):
    t = hf_llm_tensors(QWEN_TIED, seed=2)
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    save_file(t, str(tmp_path / "one" / "model.safetensors"))
    write_two_shards(t, tmp_path / "two")
    a = hf.load_llm_safetensors(tmp_path / "one", QWEN_TIED)
    for src in (tmp_path / "two", tmp_path / "two" / hf.INDEX_NAME,
                sorted((tmp_path / "two").glob("*.safetensors"))):
        b = hf.load_llm_safetensors(src, QWEN_TIED)
        jax.tree.map(np.testing.assert_array_equal, a, b)
    assert "lm_head" not in a


def test_bf16_checkpoint_loads_exactly(tmp_path):
    t = {k: v.astype(ml_dtypes.bfloat16) for k, v in hf_llm_tensors(LLAMA, seed=3).items()}
    save_file(t, str(tmp_path / "model.safetensors"))
    pure = hf.load_llm_safetensors(tmp_path, LLAMA)
    assert pure["embed"].dtype == np.float32
    np.testing.assert_array_equal(pure["layers"][0]["wv"],
                                  t["model.layers.0.self_attn.v_proj.weight"].astype(np.float32).T)


@pytest.mark.parametrize("cfg", [LLAMA, QWEN_TIED], ids=["untied", "tied"])
def test_layer_range_equals_slice_of_full_load(tmp_path, cfg):
    save_file(hf_llm_tensors(cfg, seed=4), str(tmp_path / "model.safetensors"))
    full = hf.load_llm_safetensors(tmp_path, cfg)
    first = hf.load_llm_safetensors(tmp_path, cfg, 0, 1)
    last = hf.load_llm_safetensors(tmp_path, cfg, 1, 3)
    assert set(first) == {"embed", "layers"}
    assert set(last) == ({"embed", "layers", "final_norm"} if cfg.tie_embeddings
                         else {"layers", "final_norm", "lm_head"})
    jax.tree.map(np.testing.assert_array_equal, first["layers"][0], full["layers"][0])
    for j in (0, 1):
        jax.tree.map(np.testing.assert_array_equal, last["layers"][j], full["layers"][j + 1])
    for k in set(last) - {"layers"}:
        jax.tree.map(np.testing.assert_array_equal, last[k], full[k])
    stage = load_llm(cfg, tmp_path, 1, 3)  # the pure dict fits LLM(cfg, key, 1, 3) exactly
    np.testing.assert_array_equal(np.asarray(stage.layers[0].wo[...]), full["layers"][1]["wo"])


@pytest.mark.parametrize("cfg", [LLAMA, QWEN_TIED], ids=["untied", "tied"])
def test_export_import_round_trip_is_exact(tmp_path, cfg):
    model = random_module(lambda: LLM(cfg, jax.random.key(3)))
    ref = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    hf.export_llm_safetensors(model, cfg, tmp_path / "single")
    files = hf.export_llm_safetensors(model, cfg, tmp_path / "sharded", max_shard_bytes=4000)
    assert len(files) > 2 and (tmp_path / "sharded" / hf.INDEX_NAME).exists()
    assert hf.config_from_hf(tmp_path / "single") == cfg
    for src in ("single", "sharded"):
        back = hf.load_llm_safetensors(tmp_path / src, hf.config_from_hf(tmp_path / src))
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), ref, back)
    # A stage exports with its global layer names.
    stage = random_module(lambda: LLM(cfg, jax.random.key(3), 1, 3))
    hf.export_llm_safetensors(stage, cfg, tmp_path / "stage.safetensors")
    assert hf.Checkpoint(tmp_path / "stage.safetensors").names >= {
        "model.layers.1.mlp.up_proj.weight", "model.layers.2.mlp.up_proj.weight"}


def test_config_from_hf():
    llama = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
             "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
             "intermediate_size": 14336, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
             "tie_word_embeddings": False, "hidden_act": "silu", "rope_scaling": None}
    assert hf.config_from_hf(llama) == LLMConfig(128256, 4096, 32, 32, 8, 14336,
                                                 rope_theta=500000.0, norm_eps=1e-5)
    qwen = {"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896,
            "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
            "intermediate_size": 4864, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True, "use_sliding_window": False}
    assert hf.config_from_hf(qwen) == LLMConfig(151936, 896, 24, 14, 2, 4864, rope_theta=1e6,
                                                tie_embeddings=True, qkv_bias=True)
    with pytest.raises(ValueError, match=r"rope_type='llama3': llama3 scaling needs "
                                         r"\['low_freq_factor'"):
        hf.config_from_hf(llama | {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    with pytest.raises(ValueError, match="model_type='gemma'"):
        hf.config_from_hf(llama | {"model_type": "gemma"})


def test_errors_name_tensor_and_expected_shape(tmp_path):
    t = hf_llm_tensors(LLAMA, seed=5)
    missing = dict(t)
    del missing["model.layers.2.mlp.up_proj.weight"]
    save_file(missing, str(tmp_path / "missing.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.2\.mlp\.up_proj\.weight'"
                                         r": expected shape \(24, 16\)"):
        hf.load_llm_safetensors(tmp_path / "missing.safetensors", LLAMA)
    # A stage that does not need the missing layer still loads.
    hf.load_llm_safetensors(tmp_path / "missing.safetensors", LLAMA, 0, 2)
    wrong = dict(t)
    wrong["model.layers.0.self_attn.k_proj.weight"] = np.zeros((16, 16), np.float32)
    save_file(wrong, str(tmp_path / "wrong.safetensors"))
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.k_proj\.weight' has shape "
                                         r"\(16, 16\), expected \(12, 16\)"):
        hf.load_llm_safetensors(tmp_path / "wrong.safetensors", LLAMA)
    save_file(t, str(tmp_path / "ok.safetensors"))
    fewer_layers = dataclasses.replace(LLAMA, num_layers=2)
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.2\."):
        hf.load_llm_safetensors(tmp_path / "ok.safetensors", fewer_layers)
    save_file(hf_llm_tensors(dataclasses.replace(LLAMA, qkv_bias=True)),
              str(tmp_path / "bias.safetensors"))  # a Qwen2 checkpoint, a bias-free config
    with pytest.raises(ValueError,
                       match=r"unexpected tensor 'model\.layers\.0\.self_attn\.k_proj\.bias'"):
        hf.load_llm_safetensors(tmp_path / "bias.safetensors", LLAMA)
    tied_mismatch = dict(hf_llm_tensors(QWEN_TIED), **{"lm_head.weight": t["lm_head.weight"]})
    save_file(tied_mismatch, str(tmp_path / "tied.safetensors"))
    with pytest.raises(ValueError, match="tie_embeddings"):
        hf.load_llm_safetensors(tmp_path / "tied.safetensors", QWEN_TIED)
    with pytest.raises(ValueError, match=r"parameters do not match the module"):
        hf.apply_to_module(nnx.eval_shape(lambda: LLM(LLAMA, jax.random.key(0), 0, 2)),
                           hf.load_llm_safetensors(tmp_path / "ok.safetensors", LLAMA))


# ------------------------------------------------------------------------- Whisper encoder

AUDIO = AudioConfig(hidden_size=8, num_layers=2, num_heads=2, ffn_size=12, num_mel_bins=5,
                    max_source_positions=30)


def hf_whisper_tensors(cfg: AudioConfig, prefix="", seed=0) -> dict:
    rng = np.random.default_rng(seed)
    d, m, f = cfg.hidden_size, cfg.num_mel_bins, cfg.ffn_size
    r = lambda *s: rng.normal(0, 0.3, s).astype(np.float32)
    t = {"conv1.weight": r(d, m, 3), "conv1.bias": r(d), "conv2.weight": r(d, d, 3),
         "conv2.bias": r(d), "embed_positions.weight": r(cfg.max_source_positions, d),
         "layer_norm.weight": 1 + r(d), "layer_norm.bias": r(d)}
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        for n in ("q_proj", "v_proj", "out_proj"):
            t[p + f"self_attn.{n}.weight"], t[p + f"self_attn.{n}.bias"] = r(d, d), r(d)
        t[p + "self_attn.k_proj.weight"] = r(d, d)
        for n in ("self_attn_layer_norm", "final_layer_norm"):
            t[p + n + ".weight"], t[p + n + ".bias"] = 1 + r(d), r(d)
        t[p + "fc1.weight"], t[p + "fc1.bias"] = r(f, d), r(f)
        t[p + "fc2.weight"], t[p + "fc2.bias"] = r(d, f), r(d)
    return {prefix + k: v for k, v in t.items()}


def np_conv1d_torch(x, w, b, stride):
    """PyTorch Conv1d(padding=1): x [T, C_in], w [C_out, C_in, 3] -> [T', C_out]."""
    xp = np.pad(x, ((1, 1), (0, 0)))
    n = (xp.shape[0] - 3) // stride + 1
    out = [np.einsum("kc,ock->o", xp[i * stride: i * stride + 3], w) for i in range(n)]
    return np.stack(out) + b


def test_whisper_encoder_mapping_and_conv_layout(tmp_path):
    # A WhisperForConditionalGeneration-style file: encoder under a prefix, plus a decoder.
    t = hf_whisper_tensors(AUDIO, prefix="model.encoder.")
    t["model.decoder.layers.0.fc1.weight"] = np.zeros((3, 3), np.float32)
    save_file(t, str(tmp_path / "model.safetensors"))
    enc = nnx.eval_shape(lambda: AudioEncoder(AUDIO, jax.random.key(0)))
    hf.apply_to_module(enc, hf.load_whisper_encoder_safetensors(tmp_path, AUDIO))
    p = "model.encoder.layers.1."
    assert enc.layers[1].q.kernel[...][2, 6] == t[p + "self_attn.q_proj.weight"][6, 2]
    assert enc.layers[1].o.kernel[...][7, 0] == t[p + "self_attn.out_proj.weight"][0, 7]
    assert enc.layers[1].fc2.kernel[...][11, 3] == t[p + "fc2.weight"][3, 11]
    assert enc.layers[1].k.bias is None  # Whisper's k_proj has no bias
    np.testing.assert_array_equal(np.asarray(enc.layers[1].ln2.scale[...]),
                                  t[p + "final_layer_norm.weight"])
    np.testing.assert_array_equal(np.asarray(enc.final_ln.bias[...]),
                                  t["model.encoder.layer_norm.bias"])
    # Conv [out, in, k] -> [k, in, out]: our conv front end equals PyTorch's Conv1d.
    mels = np.random.default_rng(1).normal(size=(1, 7, 5)).astype(np.float32)
    x = nnx.jit(lambda e, m, n: e.embed(m, n))(enc, jnp.asarray(mels), jnp.array([7]))
    gelu = lambda z: np.asarray(jax.nn.gelu(jnp.asarray(z), approximate=False))
    e = "model.encoder."
    h = gelu(np_conv1d_torch(mels[0], t[e + "conv1.weight"], t[e + "conv1.bias"], 1))
    h = gelu(np_conv1d_torch(h, t[e + "conv2.weight"], t[e + "conv2.bias"], 2))
    want = h + t[e + "embed_positions.weight"][:4]  # the stored table, not a formula
    np.testing.assert_allclose(np.asarray(x[0]), want, rtol=1e-5, atol=1e-5)
    # Stage [1, 2) holds layer 1 renumbered to 0, plus the final norm.
    stage = hf.load_whisper_encoder_safetensors(tmp_path, AUDIO, 1, 2)
    assert set(stage) == {"layers", "final_ln"}
    np.testing.assert_array_equal(stage["layers"][0]["fc1"]["kernel"], t[p + "fc1.weight"].T)
    del t["model.encoder.layers.0.fc1.bias"]
    save_file(t, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensor 'model\.encoder\.layers\.0\.fc1\.bias'"
                                         r": expected shape \(12,\)"):
        hf.load_whisper_encoder_safetensors(tmp_path, AUDIO)


def test_load_into_multimodal_model(tmp_path):
    llm_cfg = dataclasses.replace(QWEN_TIED, hidden_size=16)
    cfg = MLLMConfig(name="t", llm=llm_cfg, encoders=(EncoderSpec("audio", AUDIO),))
    save_file(hf_llm_tensors(llm_cfg, seed=6), str(tmp_path / "llm.safetensors"))
    save_file(hf_whisper_tensors(AUDIO, seed=7), str(tmp_path / "whisper.safetensors"))
    model = random_module(lambda: MultimodalModel(cfg, jax.random.key(0)))
    proj_before = nnx.to_pure_dict(nnx.state(model.projectors, nnx.Param))
    hf.load_into_model(model, llm_path=tmp_path / "llm.safetensors",
                       encoder_paths={"audio": tmp_path / "whisper.safetensors"})
    want_llm = hf.load_llm_safetensors(tmp_path / "llm.safetensors", llm_cfg)
    got_llm = nnx.to_pure_dict(nnx.state(model.llm, nnx.Param))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), got_llm, want_llm)
    np.testing.assert_array_equal(np.asarray(model.encoders["audio"].conv2_bias[...]),
                                  hf_whisper_tensors(AUDIO, seed=7)["conv2.bias"])
    proj_after = nnx.to_pure_dict(nnx.state(model.projectors, nnx.Param))
    jax.tree.map(np.testing.assert_array_equal, proj_before, proj_after)


def test_apply_keeps_dtype_and_sharding(tmp_path):
    save_file(hf_llm_tensors(LLAMA, seed=8), str(tmp_path / "model.safetensors"))
    model = random_module(lambda: LLM(LLAMA, jax.random.key(0), 0, 1))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("x",))
    sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x", None))
    model.layers[0].wq.set_value(jax.device_put(model.layers[0].wq.get_value(), sharded))
    model.layers[0].wv.set_value(model.layers[0].wv.get_value().astype(jnp.bfloat16))
    pure = hf.load_llm_safetensors(tmp_path, LLAMA, 0, 1)
    hf.apply_to_module(model, pure)
    wq, wv = model.layers[0].wq.get_value(), model.layers[0].wv.get_value()
    assert wq.sharding == sharded and wv.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(wq), pure["layers"][0]["wq"])
    np.testing.assert_array_equal(np.asarray(wv),
                                  pure["layers"][0]["wv"].astype(ml_dtypes.bfloat16))


def test_audio_config_from_hf():
    whisper_tiny = {"model_type": "whisper", "d_model": 384, "encoder_layers": 4,
                    "encoder_attention_heads": 6, "encoder_ffn_dim": 1536, "num_mel_bins": 80}
    assert hf.audio_config_from_hf(whisper_tiny) == AudioConfig(384, 4, 6, 1536, 80)
    assert hf.audio_config_from_hf(whisper_tiny | {"max_source_positions": 7}) == AudioConfig(
        384, 4, 6, 1536, 80, max_source_positions=7)
    with pytest.raises(ValueError, match="activation_function='relu'"):
        hf.audio_config_from_hf(whisper_tiny | {"activation_function": "relu"})
    with pytest.raises(ValueError, match="expected 'whisper'"):
        hf.audio_config_from_hf({"model_type": "llama"})
