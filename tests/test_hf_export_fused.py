"""Phi-3's fused tensors (`self_attn.qkv_proj`, `mlp.gate_up_proj`: several mmjax parameters
each) written back over the source checkpoint: every block lands in its rows, whether the
LLM is exported alone (`hf.save`, scripts/export_hf.py's `pretrained.llm`) or as LLaVA's
text model. GQA (2 kv heads of 4) makes the q / k / v blocks of different heights."""
import json
import os
import sys

import jax
import numpy as np
from flax import nnx
from safetensors.numpy import load_file

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "fixtures"))
import hf_reference as ref  # noqa: E402
import llava_tiny  # noqa: E402
from mmjax.models import hf  # noqa: E402

PHI3 = {"model_type": "phi3", "architectures": ["Phi3ForCausalLM"], "vocab_size": 29,
        "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 40, "rms_norm_eps": 1e-5,
        "hidden_act": "silu", "tie_word_embeddings": False, "max_position_embeddings": 64,
        "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}


def fuse(t: dict, prefix: str = "model.") -> dict:
    """Llama-named tensors -> Phi-3's (q, k, v rows in qkv_proj; gate, up in gate_up_proj)."""
    out = dict(t)
    for k in [k for k in t if k.startswith(prefix) and k.endswith("self_attn.q_proj.weight")]:
        p = k[: -len("q_proj.weight")]
        out[p + "qkv_proj.weight"] = np.concatenate(
            [out.pop(p + n + "_proj.weight") for n in "qkv"])
    for k in [k for k in t if k.startswith(prefix) and k.endswith("mlp.gate_proj.weight")]:
        p = k[: -len("gate_proj.weight")]
        out[p + "gate_up_proj.weight"] = np.concatenate(
            [out.pop(p + "gate_proj.weight"), out.pop(p + "up_proj.weight")])
    return out


def perturb(model, seed: int):
    """As after training: every parameter moved (nothing equal to the source)."""
    state = nnx.state(model, nnx.Param)
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    nnx.update(model, jax.tree.unflatten(tree, [
        a + 0.01 * jax.random.normal(k, a.shape, a.dtype) for a, k in zip(leaves, keys)]))


def test_phi3_written_over_its_source(tmp_path):
    t = fuse(ref.llm_tensors(PHI3, seed=3))
    src = ref.write_checkpoint(tmp_path / "phi3", PHI3, t)
    module, cfg = hf.load(src)
    hf.save(module, cfg, tmp_path / "same")  # untouched: the source, byte for byte
    same = load_file(str(tmp_path / "same" / "model.safetensors"))
    assert sorted(same) == sorted(t) and all(same[k].tobytes() == t[k].tobytes() for k in t)
    perturb(module, 0)
    want = np.asarray(hf.hf_forward(module, input_ids=np.arange(12)[None] % 29)["logits"])
    hf.save(module, cfg, tmp_path / "back")
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert {k: v.shape for k, v in back.items()} == {k: v.shape for k, v in t.items()}
    layer = module.layers[0]
    qkv = np.concatenate([np.asarray(layer.wq[...]).T, np.asarray(layer.wk[...]).T,
                          np.asarray(layer.wv[...]).T])
    np.testing.assert_array_equal(back["model.layers.0.self_attn.qkv_proj.weight"], qkv)
    again, _ = hf.load(tmp_path / "back")
    np.testing.assert_array_equal(
        np.asarray(hf.hf_forward(again, input_ids=np.arange(12)[None] % 29)["logits"]), want)


def test_llava_with_phi3_text_written_over_its_source(tmp_path):
    text = dict(PHI3, vocab_size=128, hidden_size=64, intermediate_size=96)
    conf = dict(llava_tiny.CONFIG, text_config=text)
    t = llava_tiny.tensors("tf5")
    t = {k: v for k, v in t.items()  # Phi-3 has no qkv bias
         if not (k.startswith("language_model.") and k.endswith("_proj.bias"))}
    t = fuse(t, "language_model.model.")
    src = ref.write_checkpoint(tmp_path / "llava", conf, t)
    model, cfg = hf.load(src)
    ids, pixels = llava_tiny.inputs()
    perturb(model, 1)
    want = np.asarray(hf.hf_forward(model, input_ids=ids, pixel_values=pixels)["logits"])
    hf.save(model, cfg, tmp_path / "back")
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert {k: v.shape for k, v in back.items()} == {k: v.shape for k, v in t.items()}
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == conf
    again, _ = hf.load(tmp_path / "back")
    got = np.asarray(hf.hf_forward(again, input_ids=ids, pixel_values=pixels)["logits"])
    np.testing.assert_array_equal(got, want)
