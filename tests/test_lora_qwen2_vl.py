"""LoRA on Qwen2-VL / Qwen2.5-VL: adapters on the LLM and on the tower's fused qkv, proj and
MLP. peft's own adapters (tests/data/peft/<family>_adapter, made by
tests/fixtures/make_peft_reference.py with peft 0.21 and transformers 5 on the committed
tiny checkpoints of tests/data/qwen2_vl) load to PeftModel's logits (1e-4 relative, as
tests/test_qwen2_vl.py judges the base's), `hf.save_adapter` writes peft's keys, tensors and
config; the LoRA'd tower's loss and adapter gradients equal the merged weights' (float64
rule), merging folds W + A B s, and the planner counts the adapters the model holds."""
from __future__ import annotations

import json
import os
import re

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from helpers import assert_same_grads, assert_same_loss, exact_reference, global_batch, make_cfg
from mmjax.data.assemble import assemble
from mmjax.models import hf
from mmjax.models.hf.peft_names import adapter_table
from mmjax.models.lora import LoRAParam
from mmjax.models.lora_config import LoRAConfig
from mmjax.models.lora_merge import adapter_sites, flat_params, merged_flat
from mmjax.models.mllm import MultimodalModel, trainable_filter
from mmjax.models.tiny import tiny_qwen2_5_vl, tiny_qwen2_vl
from mmjax.planner.lora_params import lora_params
from mmjax.planner.module_params import num_params
from mmjax.train.inputs import model_inputs
from mmjax.train.lora_setup import with_lora
from mmjax.train.step import make_loss_fn, split_model
from test_lora import EPS32, merged_formulation, perturbed

HERE = os.path.dirname(__file__)
PEFT = os.path.join(HERE, "data", "peft")
QWEN = os.path.join(HERE, "data", "qwen2_vl")
REF = np.load(os.path.join(PEFT, "qwen2_vl.npz"))
FAMILIES = ("qwen2_vl", "qwen2_5_vl")


def _forward(module, family):
    ref = np.load(os.path.join(QWEN, f"{family}_logits.npz"))
    logits = np.asarray(hf.hf_forward(
        module, input_ids=ref["input_ids"], attention_mask=ref["attention_mask"],
        pixel_values=ref["pixel_values"].astype(np.float32),
        image_grid_thw=ref["image_grid_thw"], mm_token_type_ids=ref["mm_token_type_ids"])[
            "logits"])
    return logits, ref["attention_mask"].astype(bool), ref["logits"]


def rel_err(got, want):
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.fixture(scope="module")
def loaded():
    out = {}
    for family in FAMILIES:
        module, cfg = hf.load(os.path.join(QWEN, f"{family}_tf5"),
                              adapter=os.path.join(PEFT, f"{family}_adapter"))
        out[family] = (module, cfg, _forward(module, family))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_peft_adapter_logits_equal_peft(loaded, family):
    _, _, (logits, keep, base) = loaded[family]
    want = REF[f"{family}/logits"]
    assert rel_err(logits[keep], want[keep]) < 1e-4
    assert rel_err(base[keep], want[keep]) > 0.1  # the adapters matter


def test_adapter_settings_become_lora_configs(loaded):
    q2, q25 = loaded["qwen2_vl"][1], loaded["qwen2_5_vl"][1]
    assert (q2.llm.lora.rank, q2.llm.lora.alpha, q2.llm.lora.dropout) == (4, 8.0, 0.05)
    assert set(q2.llm.lora.targets) == {"q", "k", "v", "o", "gate", "up", "down"}
    assert set(q2.encoder("vision").encoder.lora.targets) == {"qkv", "proj", "fc1", "fc2"}
    assert q25.llm.lora.rslora and set(q25.llm.lora.targets) == {"q", "v"}
    assert set(q25.encoder("vision").encoder.lora.targets) == {"qkv", "proj", "gate", "up",
                                                               "down"}
    qkv = loaded["qwen2_vl"][0].encoders["vision"].layers[0].qkv.lora["qkv"]
    assert qkv.a[...].shape == (32, 4) and qkv.b[...].shape == (4, 96)  # one fused adapter


@pytest.mark.parametrize("family", FAMILIES)
def test_save_adapter_writes_what_peft_writes(loaded, family, tmp_path):
    module, cfg, (logits, _, _) = loaded[family]
    hf.save_adapter(module, cfg, tmp_path)
    theirs = load_file(os.path.join(PEFT, f"{family}_adapter", "adapter_model.safetensors"))
    ours = load_file(str(tmp_path / "adapter_model.safetensors"))
    assert sorted(ours) == sorted(theirs)
    for k in theirs:
        np.testing.assert_array_equal(ours[k], theirs[k], err_msg=k)
    c_theirs = json.loads(open(os.path.join(PEFT, f"{family}_adapter",
                                            "adapter_config.json")).read())
    c_ours = json.loads((tmp_path / "adapter_config.json").read_text())
    assert set(c_ours) == set(c_theirs)
    same = set(c_theirs) - {"base_model_name_or_path", "target_modules"}
    assert {k: c_ours[k] for k in same} == {k: c_theirs[k] for k in same}
    assert c_ours["base_model_name_or_path"] == os.path.realpath(
        os.path.join(QWEN, f"{family}_tf5"))
    # the same modules selected by peft's fullmatch of either regex (patch_embed.proj not)
    names = list(adapter_table(cfg)) + ["model.visual.patch_embed.proj"]
    pick = lambda t: {n for n in names if re.fullmatch(t, n)}
    assert pick(c_ours["target_modules"]) == pick(c_theirs["target_modules"])
    again, _ = hf.load(os.path.join(QWEN, f"{family}_tf5"), adapter=tmp_path)
    np.testing.assert_array_equal(_forward(again, family)[0], logits)


TOWER_LORA = LoRAConfig(rank=2, alpha=4.0, targets=("attention", "mlp"), rslora=True)


@pytest.fixture(scope="module", params=[tiny_qwen2_vl, tiny_qwen2_5_vl])
def tower_setup(request):
    cfg = with_lora(make_cfg(request.param, **{"llm.num_layers": 1, "llm_frozen": True,
                                               "encoders.vision.projector_frozen": True}),
                    ("vision",), TOWER_LORA)  # the tower's adapters train, nothing else
    model = perturbed(MultimodalModel(cfg, jax.random.key(0)))
    lay, samples = global_batch(cfg, 3)
    return cfg, model, model_inputs(assemble(samples, lay))


def test_tower_lora_forward_and_grads_equal_merged_weights(tower_setup):
    cfg, model, inputs = tower_setup
    gd, tr, fr = split_model(model, trainable_filter(cfg))
    tower = {tuple(p) for p, _ in nnx.to_flat_state(nnx.state(model.encoders, LoRAParam))}
    names = {p[-2] for p in tower}
    assert names == ({"qkv", "proj", "gate", "up", "down"} if cfg.encoder("vision").encoder
                     .gated_mlp else {"qkv", "proj", "fc1", "fc2"})
    assert {tuple(p) for p, _ in nnx.to_flat_state(tr)} == {("encoders",) + p for p in tower}
    (loss, _), grads = jax.jit(jax.value_and_grad(make_loss_fn(gd), has_aux=True))(
        tr, fr, inputs)
    fn, adapters, frozen = merged_formulation(cfg, model)
    ref_loss, ref_grads = exact_reference(fn, adapters, frozen, inputs)
    assert_same_loss(float(loss), ref_loss)
    assert_same_grads(nnx.to_pure_dict(grads), ref_grads)


def test_tower_merge_folds_the_fused_qkv(tower_setup):
    cfg, model, _ = tower_setup
    flat, merged = flat_params(model), merged_flat(model)
    sites = adapter_sites(model)
    assert any(base[-2] == "qkv" for base, _ in sites.values())
    for site, (bpath, scale) in sites.items():
        a = np.asarray(flat[site + ("a",)], np.float64)
        b = np.asarray(flat[site + ("b",)], np.float64)
        w = np.asarray(flat[bpath], np.float64)
        bound = EPS32 * (a.shape[1] + 2) * (np.abs(w) + np.abs(a) @ np.abs(b) * abs(scale))
        assert np.all(np.abs(np.asarray(merged[bpath], np.float64) - (w + a @ b * scale))
                      <= bound)
    model_count = sum(x.size for x in jax.tree.leaves(nnx.state(model, LoRAParam)))
    assert lora_params(cfg, "vision") == model_count
    assert num_params(cfg) == sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


LORA_RUN = ["lora.units = ['llm', 'vision']", "lora.rank = 4", "lora.alpha = 8.0",
            "lora.targets = ['attention', 'mlp']"]


def _train(run, extra, steps=2):
    import gin

    from mmjax.train.trainer import train
    cfg = make_cfg(tiny_qwen2_vl, **{"encoders.vision.projector_frozen": True})
    gin.clear_config()
    gin.parse_config(extra)
    try:
        return train(str(run), model=cfg, steps=steps, global_batch=4, progress=False,
                     checkpoint_every=steps)
    finally:
        gin.clear_config()


@pytest.mark.slow  # two short runs (compile + 2 steps, then 1)
def test_run_exports_peft_adapter_and_merge_and_resumes_from_peft(tmp_path):
    """A Qwen2-VL run from `pretrained.model` with LoRA on the LLM and the tower: `--adapter`
    writes peft's keys (those of peft's own adapter with the same targets) and loads back
    to the run's logits; `--merge` gives them too, every untargeted tensor byte-identical;
    `pretrained.adapter` (peft's file) starts a run with its parts and settings."""
    import shutil

    from mmjax.train.export import export_workdir, restore_model

    src = tmp_path / "src"
    shutil.copytree(os.path.join(QWEN, "qwen2_vl_tf5"), src)
    _train(tmp_path / "run", [f"pretrained.model = '{src}'"] + LORA_RUN)
    _, model, _, _ = restore_model(str(tmp_path / "run"))
    assert export_workdir(str(tmp_path / "run"), tmp_path / "a", adapter=True) == {
        "adapter": tmp_path / "a" / "adapter"}
    ours = load_file(str(tmp_path / "a" / "adapter" / "adapter_model.safetensors"))
    theirs = load_file(os.path.join(PEFT, "qwen2_vl_adapter", "adapter_model.safetensors"))
    assert sorted(ours) == sorted(theirs)
    assert all(ours[k].shape == theirs[k].shape for k in ours)
    again, _ = hf.load(src, adapter=tmp_path / "a" / "adapter")
    model.hf_source = again.hf_source  # its image token id
    want = _forward(model, "qwen2_vl")[0]
    np.testing.assert_array_equal(_forward(again, "qwen2_vl")[0], want)
    export_workdir(str(tmp_path / "run"), tmp_path / "m", merge=True)
    base = load_file(str(src / "model.safetensors"))
    got = load_file(str(tmp_path / "m" / "model" / "model.safetensors"))
    changed = {k for k in base if got[k].tobytes() != base[k].tobytes()}
    assert changed == {k for k in base if k.endswith("_proj.weight") and ".layers." in k or
                       re.search(r"blocks\.\d+\.(attn\.qkv|attn\.proj|mlp\.fc\d)\.weight", k)}
    merged, _ = hf.load(tmp_path / "m" / "model")
    assert rel_err(_forward(merged, "qwen2_vl")[0], want) < 1e-4
    recs = _train(tmp_path / "run2", [f"pretrained.model = '{src}'", "pretrained.adapter = "
                                      f"'{os.path.join(PEFT, 'qwen2_vl_adapter')}'"], steps=1)
    assert len(recs) == 1 and np.isfinite(recs[0]["loss"])
    cfg2, _, _, _ = restore_model(str(tmp_path / "run2"))
    assert cfg2.lora_units() == ("llm", "vision") and cfg2.llm.lora.rank == 4


@pytest.mark.slow  # a pipeline plan's stages compile
def test_pipelined_tower_lora_equals_single_program(reference_cache):
    """Qwen2.5-VL with adapters on the LLM and on the tower (fused qkv, proj, gated MLP),
    the tower and the LLM over pp = 2: the loss and every adapter's (and the trained
    merger's) gradient equal the single program's by the suite's tolerance rule."""
    from helpers import check
    from mmjax.planner.plan import Plan

    cfg = with_lora(make_cfg(tiny_qwen2_5_vl), ("llm", "vision"),
                    LoRAConfig(rank=2, targets=("attention", "mlp")))
    assert check(cfg, Plan.uniform(cfg, 8, 2, pp={"vision": 2, "llm": 2}), packing="pack",
                 cache=reference_cache) is not None
