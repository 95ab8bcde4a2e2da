"""A LoRA run from a whole LLaVA (`pretrained.model`; LoRA rank 8 on the LLM, the tower
frozen, the projector trained whole), exported: `--adapter` writes what peft writes for that
base (keys and settings of tests/data/peft/llava_adapter, made by peft itself), loading back
with `hf.load(base, adapter=)`; `--merge` writes the base with W + B A * scale, every tensor
of an untargeted module byte-identical to the source, and gives the adapter's logits;
`pretrained.adapter` continues training from the adapter."""
import json
import os
import sys

import gin
import numpy as np
import pytest
from safetensors.numpy import load_file

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "fixtures"))
import llava_tiny  # noqa: E402
from test_llava_training import gin_cfg  # noqa: E402
from mmjax.errors import UserError  # noqa: E402
from mmjax.models import hf  # noqa: E402
from mmjax.models.hf.peft_names import adapter_table  # noqa: E402
from mmjax.train.export import export_workdir, restore_model  # noqa: E402

PEFT = os.path.join(os.path.dirname(__file__), "data", "peft", "llava_adapter")
LORA = ["lora.units = ['llm']", "lora.rank = 8", "lora.alpha = 16.0",
        "lora.targets = ['attention', 'mlp']", "lora.rslora = True"]


def lora_cfg():
    return gin_cfg().replace(llm_frozen=False)  # the LLM's base frozen by LoRA itself


def run_train(run, src, extra, steps=2):
    from mmjax.train.trainer import train
    gin.clear_config()
    gin.parse_config([f"pretrained.model = '{src}'"] + extra)
    try:
        return train(str(run), model=lora_cfg(), steps=steps, global_batch=4, progress=False,
                     checkpoint_every=steps)
    finally:
        gin.clear_config()


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora_run")
    src = llava_tiny.write(tmp / "src", "tf5")
    run_train(tmp / "run", src, LORA)
    return tmp, src


@pytest.mark.slow
def test_adapter_export_is_peft_s_and_merge_keeps_untargeted_bytes(lora_run):
    tmp, src = lora_run
    run = str(tmp / "run")
    with pytest.raises(ValueError, match="--adapter .* or --merge"):
        export_workdir(run, tmp / "plain")
    assert export_workdir(run, tmp / "a", adapter=True) == {"adapter": tmp / "a" / "adapter"}
    ours = load_file(str(tmp / "a" / "adapter" / "adapter_model.safetensors"))
    theirs = load_file(os.path.join(PEFT, "adapter_model.safetensors"))
    assert sorted(ours) == sorted(theirs)
    assert all(ours[k].shape == theirs[k].shape for k in ours)
    c = json.loads((tmp / "a" / "adapter" / "adapter_config.json").read_text())
    c_peft = json.loads(open(os.path.join(PEFT, "adapter_config.json")).read())
    for k in ("r", "lora_alpha", "use_rslora", "modules_to_save", "peft_type", "bias"):
        assert c[k] == c_peft[k], k
    assert c["base_model_name_or_path"] == str(src.resolve())
    module, cfg = hf.load(src, adapter=tmp / "a" / "adapter")
    import re
    names = list(adapter_table(cfg))
    assert {n for n in names if re.fullmatch(c["target_modules"], n)} == \
        {n for n in names if re.fullmatch(c_peft["target_modules"], n)}

    assert export_workdir(run, tmp / "m", merge=True) == {"model": tmp / "m" / "model"}
    want = load_file(str(src / "model.safetensors"))
    got = load_file(str(tmp / "m" / "model" / "model.safetensors"))
    assert sorted(got) == sorted(want)
    changed = {k for k in want if got[k].tobytes() != want[k].tobytes()}
    targeted = {k for k in want if k.startswith("language_model.model.layers.") and any(
        p in k for p in ("_proj.weight",))}
    assert changed == targeted | {k for k in want if k.startswith("multi_modal_projector.")}
    ids, pixels = llava_tiny.inputs()
    unmerged = np.asarray(hf.hf_forward(module, input_ids=ids, pixel_values=pixels)["logits"])
    merged_model, _ = hf.load(tmp / "m" / "model")
    merged = np.asarray(hf.hf_forward(merged_model, input_ids=ids, pixel_values=pixels)["logits"])
    assert np.max(np.abs(merged - unmerged)) < 1e-4 * np.max(np.abs(unmerged))


@pytest.mark.slow
def test_pretrained_adapter_continues_training(lora_run):
    tmp, src = lora_run
    export_workdir(str(tmp / "run"), tmp / "a2", adapter=True)
    adapter = tmp / "a2" / "adapter"
    with pytest.raises(UserError, match="drop lora"):
        run_train(tmp / "bad", src, LORA + [f"pretrained.adapter = '{adapter}'"])
    recs = run_train(tmp / "run2", src, [f"pretrained.adapter = '{adapter}'"], steps=1)
    assert len(recs) == 1 and np.isfinite(recs[0]["loss"])
    cfg, model, _, _ = restore_model(str(tmp / "run2"))
    assert cfg.lora_units() == ("llm",) and cfg.llm.lora.rank == 8 and cfg.llm.lora.rslora
    # the run started from the adapter: one step from it, not from B = 0
    b = np.asarray(model.llm.layers[0].lora["q"].b[...])
    start = load_file(str(adapter / "adapter_model.safetensors"))
    b0 = start["base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_B.weight"].T
    assert np.any(b0) and np.max(np.abs(b - b0)) < 0.1 * np.max(np.abs(b0)) + 1e-2


@pytest.mark.slow  # a pipelined plan's stages compile, and two single-program runs
def test_pretrained_adapter_on_a_plan_starts_where_the_single_program_does(lora_run):
    """peft's own adapter (tests/data/peft/llava_adapter: LLM adapters + the projector saved
    whole) read into a plan's stages (the LLM over pp = 2): its losses are the single
    program's from the same adapter, and differ from the base's (B = 0) first loss."""
    from mmjax.planner.plan import Plan

    tmp, src = lora_run
    adapter = [f"pretrained.adapter = '{PEFT}'"]
    single = [r["loss"] for r in run_train(tmp / "ad_single", src, adapter)]
    cfg = hf.prepare_pretrained(lora_cfg(), {"model": str(src)})
    plan = str(tmp / "ad_plan.json")
    Plan.uniform(cfg, 4, 2, pp={"llm": 2}).save(plan)
    piped = [r["loss"] for r in run_train(tmp / "ad_plan", src, adapter
                                          + [f"train.plan = '{plan}'"])]
    base = [r["loss"] for r in run_train(tmp / "ad_base", src, LORA, steps=1)]
    assert len(single) == 2 and all(np.isfinite(single))
    np.testing.assert_allclose(piped, single, rtol=1e-5)
    assert abs(single[0] - base[0]) > 1e-3 * abs(base[0])  # the adapter is in effect
