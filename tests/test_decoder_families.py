"""Decoder families through `hf.load` and the training model, against transformers' logits.

tests/data/families/*.npz were made once by tests/fixtures/make_family_fixtures.py with
transformers 5 (float32, eager attention): per case both config layouts (transformers 4 and
5), the tensor names and shapes the HF class itself has, a NumPy seed for the values, and the
logits. Here the checkpoint is rebuilt with NumPy + safetensors (no torch), loaded, and run.
"""
import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from mmjax.models import hf
from mmjax.models.attention import causal_meta
from mmjax.models.hf.checkpoint import Checkpoint, apply_to_module
from mmjax.models.llm import LLM

DATA = Path(__file__).parent / "data" / "families"
CASES = sorted(p.stem for p in DATA.glob("*.npz"))
RTOL = 1e-4


def family_weights(names, shapes, seed: int) -> dict:
    """The fixture script's NumPy draw (float64 normals * 0.3 -> float32), bit for bit."""
    rng = np.random.default_rng(seed)
    return {n: (rng.standard_normal(tuple(int(d) for d in s)) * 0.3).astype(np.float32)
            for n, s in zip(names, shapes)}


def assert_close(got, want):
    got = np.asarray(got, np.float64)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL * np.abs(want).max())


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    """{case: (fixture dict, {layout: checkpoint dir})}."""
    root = tmp_path_factory.mktemp("families")
    out = {}
    for name in CASES:
        z = np.load(DATA / f"{name}.npz")
        names, shapes = [str(n) for n in z["names"]], json.loads(str(z["shapes"]))
        tensors = family_weights(names, shapes, int(z["seed"]))
        dirs = {}
        for layout in ("v4", "v5"):
            d = root / f"{name}_{layout}"
            d.mkdir()
            (d / "config.json").write_text(str(z[f"config_{layout}"]))
            save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
            dirs[layout] = d
        fx = {"names": names, "shapes": shapes, "tokens": z["tokens"][None],
              "logits": z["logits"].astype(np.float64), "tensors": tensors}
        out[name] = (fx, dirs)
    return out


def test_every_family_has_a_fixture():
    assert set(CASES) >= {"qwen3", "qwen3_window", "qwen2_window", "mistral_window", "gemma2",
                          "gemma3", "phi3", "llama_linear", "llama_yarn"}


@pytest.mark.parametrize("layout", ["v4", "v5"])
@pytest.mark.parametrize("name", CASES)
def test_hf_load_matches_transformers(fixtures, name, layout):
    fx, dirs = fixtures[name]
    module, cfg = hf.load(dirs[layout])
    assert_close(hf.hf_forward(module, input_ids=fx["tokens"])["logits"][0], fx["logits"])


def test_both_layouts_give_the_same_config(fixtures):
    for name in CASES:
        _, dirs = fixtures[name]
        assert hf.config_for(dirs["v4"]) == hf.config_for(dirs["v5"]), name


@pytest.mark.parametrize("name,impl", [("gemma3", "chunked"), ("gemma3", "pallas"),
                                       ("gemma2", "pallas"), ("qwen2_window", "chunked"),
                                       ("phi3", "pallas")])
def test_training_model_with_layer_scan_matches_transformers(fixtures, name, impl):
    """The LLM the pipelines run: scanned layers (a traced local/global flag where layers
    differ), token-metadata attention through the chosen implementation."""
    fx, dirs = fixtures[name]
    cfg = dataclasses.replace(hf.config_for(dirs["v5"]), scan_layers=True)
    model = apply_to_module(LLM(cfg, jax.random.key(0)),
                            hf.load_llm_safetensors(dirs["v5"], cfg))
    tok = jnp.asarray(fx["tokens"])
    pos = jnp.arange(tok.shape[1])[None]
    logits = jax.jit(lambda m, t: m(t, pos, causal_meta(jnp.ones_like(t)),
                                    attention_impl=impl))(model, tok)
    assert_close(logits[0], fx["logits"])


def test_gemma3_scan_carries_a_per_layer_flag():
    cfg = hf.config_from_hf(json.loads(str(np.load(DATA / "gemma3.npz")["config_v5"])))
    assert cfg.sliding_layers == (True, True, False, True) and cfg.layers_differ
    assert cfg.rope_local_theta == 10.0 and cfg.rope_theta == 1e3
    assert cfg.rope_scaling == ("linear", 2.0)
    model = LLM(dataclasses.replace(cfg, scan_layers=True), jax.random.key(0))
    jaxpr = str(jax.make_jaxpr(lambda t: model(t, jnp.arange(6)[None],
                                               causal_meta(jnp.ones((1, 6), jnp.int32)),
                                               attention_impl="dense"))(
        jnp.zeros((1, 6), jnp.int32)))
    assert jaxpr.count("scan[") == 1  # one scan over four layers that differ


def test_sliding_window_is_exercised(fixtures):
    """Without its window the model differs from transformers: the window is tested."""
    for name in ("mistral_window", "qwen2_window", "gemma3", "phi3"):
        fx, dirs = fixtures[name]
        cfg = dataclasses.replace(hf.config_for(dirs["v5"]), sliding_window=None,
                                  sliding_layers=None, rope_local_theta=None)
        model = apply_to_module(LLM(cfg, jax.random.key(0)),
                                hf.load_llm_safetensors(dirs["v5"], cfg))
        got = np.asarray(hf.hf_forward(model, input_ids=fx["tokens"])["logits"][0])
        assert np.abs(got - fx["logits"]).max() > 1e-2, name


@pytest.mark.parametrize("name", CASES)
def test_export_writes_transformers_names_and_reloads(fixtures, tmp_path, name):
    fx, dirs = fixtures[name]
    module, cfg = hf.load(dirs["v5"])
    hf.export_llm_safetensors(module, cfg, tmp_path)
    ckpt = Checkpoint(tmp_path)
    assert sorted(ckpt.names) == fx["names"]
    assert [list(ckpt.shape[n]) for n in fx["names"]] == fx["shapes"]
    for n in fx["names"]:
        np.testing.assert_array_equal(ckpt.read(n), fx["tensors"][n])
    again, cfg2 = hf.load(tmp_path)
    assert dataclasses.replace(cfg2, hf_type=None) == dataclasses.replace(cfg, hf_type=None)
    assert_close(hf.hf_forward(again, input_ids=fx["tokens"])["logits"][0], fx["logits"])


def test_phi3_stage_loading_reads_fused_blocks(fixtures):
    """A pipeline stage's sliced reads split the fused qkv / gate_up tensors the same way."""
    from flax import nnx
    from mmjax.models.hf.llm import llm_load_plan
    from mmjax.models.hf.pretrained import load_stage_state
    fx, dirs = fixtures["phi3"]
    cfg = hf.config_for(dirs["v5"])
    stage = nnx.eval_shape(lambda: LLM(cfg, jax.random.key(0), 1, 3))
    state = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), nnx.state(stage, nnx.Param))
    state = load_stage_state(state, llm_load_plan(dirs["v5"], cfg, 1, 3))
    want = hf.load_llm_safetensors(dirs["v5"], cfg, 1, 3)
    got = nnx.to_pure_dict(state)
    for j in range(2):
        for key in ("wq", "wk", "wv", "w_gate", "w_up"):
            np.testing.assert_array_equal(got["layers"][j][key], want["layers"][j][key])


BASE = {"vocab_size": 29, "hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 40, "max_position_embeddings": 64}


def test_sliding_window_defaults_follow_transformers():
    mistral = dict(BASE, model_type="mistral")
    assert hf.config_from_hf(mistral).sliding_window == 4096  # MistralConfig's default
    assert hf.config_from_hf(dict(mistral, sliding_window=None)).sliding_window is None
    qwen = dict(BASE, model_type="qwen2", sliding_window=8)
    assert hf.config_from_hf(qwen).sliding_window is None  # use_sliding_window False
    on = hf.config_from_hf(dict(qwen, use_sliding_window=True, max_window_layers=3))
    assert on.sliding_window == 8 and on.sliding_layers == (False, False, False, True)
    g2 = hf.config_from_hf(dict(BASE, model_type="gemma2"))
    assert g2.sliding_layers == (True, False, True, False) and g2.sliding_window == 4096
    assert (g2.attn_softcap, g2.final_softcap, g2.attn_scale) == (50.0, 30.0, 256 ** -0.5)
    g3 = hf.config_from_hf(dict(BASE, model_type="gemma3_text", num_hidden_layers=7))
    assert g3.sliding_layers == (True,) * 5 + (False, True)
    assert (g3.rope_theta, g3.rope_local_theta) == (1e6, 1e4)


@pytest.mark.parametrize("change,match", [
    ({"model_type": "mixtral", "num_local_experts": 8}, "num_local_experts=8: "),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type='dynamic'"),
    ({"model_type": "phi3", "rope_scaling": {"type": "longrope", "short_factor": [1.0]}},
     "rope_scaling.rope_type='longrope'"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ({"model_type": "gemma3_text", "use_bidirectional_attention": True},
     "use_bidirectional_attention=True"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default"}}}, "rope_parameters="),
    ({"model_type": "gemma3_text", "rope_parameters": {
        "sliding_attention": {"rope_type": "linear", "factor": 2.0},
        "full_attention": {"rope_type": "default"}}},
     "rope_parameters.sliding_attention.rope_type='linear'"),
    ({"model_type": "gemma2", "layer_types": ["chunked_attention"] * 4}, "layer_types="),
    ({"model_type": "gemma2", "hidden_activation": "relu"}, "hidden_activation='relu'"),
])
def test_refusals_are_one_line_naming_the_field(change, match):
    with pytest.raises(ValueError, match=match) as err:
        hf.config_from_hf({**BASE, "model_type": "llama", **change})
    assert "\n" not in str(err.value) and str(err.value).startswith("config.json ")


def test_mixtral_checkpoint_refused_by_load(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(
        BASE, model_type="mixtral", architectures=["MixtralForCausalLM"], num_local_experts=8)))
    with pytest.raises(ValueError, match="num_local_experts=8.*supported dense LLMs: llama"):
        hf.load(tmp_path)
