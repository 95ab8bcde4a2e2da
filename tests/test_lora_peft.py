"""peft LoRA adapters in and out (models/hf/peft.py) against peft's own files and logits
(tests/data/peft, made by tests/fixtures/make_peft_reference.py with peft 0.21 and
transformers 5): `hf.load(base, adapter=)` gives PeftModel's logits, `hf.save_adapter`
writes peft's keys, tensors and config, and a saved adapter loads back to the same logits;
merged weights give the unmerged logits."""
from __future__ import annotations

import json
import os
import re
import shutil
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "fixtures"))
import llava_tiny  # noqa: E402
import peft_tiny  # noqa: E402
from mmjax.errors import UserError  # noqa: E402
from mmjax.models import hf  # noqa: E402
from mmjax.models.hf.checkpoint import apply_to_module  # noqa: E402
from mmjax.models.hf.dispatch import build_module  # noqa: E402
from mmjax.models.hf.peft import _unflatten  # noqa: E402
from mmjax.models.hf.peft_names import adapter_table  # noqa: E402
from mmjax.models.lora_merge import merged_flat, without_lora  # noqa: E402

DATA = os.path.join(os.path.dirname(__file__), "data", "peft")
REF = np.load(os.path.join(DATA, "reference.npz"))


def rel_err(got, want):
    return float(np.max(np.abs(np.asarray(got) - want)) / np.max(np.abs(want)))


def inputs(case):
    if case == "llama":
        return {"input_ids": REF["llama/input_ids"]}
    return {"input_ids": REF["llava/input_ids"], "pixel_values": REF["llava/pixel_values"]}


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("peft_bases")
    return {"llama": peft_tiny.write_llama(tmp / "llama"),
            "llava": llava_tiny.write(tmp / "llava", "tf5")}


@pytest.fixture(scope="module")
def loaded(bases):
    out = {}
    for case, base in bases.items():
        module, cfg = hf.load(base, adapter=os.path.join(DATA, f"{case}_adapter"))
        out[case] = (module, cfg, np.asarray(hf.hf_forward(module, **inputs(case))["logits"]))
    return out


@pytest.mark.parametrize("case", ["llama", "llava"])
def test_adapter_logits_equal_peft(loaded, case):
    _, _, logits = loaded[case]
    assert logits.shape == REF[f"{case}/logits"].shape
    assert rel_err(logits, REF[f"{case}/logits"]) < 1e-4


def test_adapter_settings_become_lora_configs(loaded):
    llama, llava = loaded["llama"][1], loaded["llava"][1]
    assert (llama.lora.rank, llama.lora.alpha, llama.lora.dropout, llama.lora.rslora) == (
        4, 8.0, 0.05, False)
    assert set(llama.lora.targets) == {"q", "k", "v", "o", "gate", "up", "down"}
    assert llava.llm.lora.rslora and llava.llm.lora.rank == 8
    assert llava.encoder("vision").encoder.lora is None  # the regex names the LLM only
    assert loaded["llava"][0].peft_trained == ("vision.projector",)


@pytest.mark.parametrize("case", ["llama", "llava"])
def test_save_adapter_writes_what_peft_writes(loaded, bases, case, tmp_path):
    module, cfg, logits = loaded[case]
    hf.save_adapter(module, cfg, tmp_path)
    theirs = load_file(os.path.join(DATA, f"{case}_adapter", "adapter_model.safetensors"))
    ours = load_file(str(tmp_path / "adapter_model.safetensors"))
    assert sorted(ours) == sorted(theirs)
    for k in theirs:
        np.testing.assert_array_equal(ours[k], theirs[k], err_msg=k)
    c_theirs = json.loads(open(os.path.join(DATA, f"{case}_adapter",
                                            "adapter_config.json")).read())
    c_ours = json.loads((tmp_path / "adapter_config.json").read_text())
    assert set(c_ours) == set(c_theirs)
    same = set(c_theirs) - {"base_model_name_or_path", "target_modules"}
    assert {k: c_ours[k] for k in same} == {k: c_theirs[k] for k in same}
    assert c_ours["base_model_name_or_path"] == str(bases[case].resolve())
    # target_modules select the same modules as peft's (a list: suffixes; a str: fullmatch)
    names = list(adapter_table(cfg))
    pick = lambda t: {n for n in names if (re.fullmatch(t, n) if isinstance(t, str) else
                                           any(n == s or n.endswith("." + s) for s in t))}
    assert pick(c_ours["target_modules"]) == pick(c_theirs["target_modules"])
    # ... and load back to the same logits
    again, _ = hf.load(bases[case], adapter=tmp_path)
    np.testing.assert_array_equal(
        np.asarray(hf.hf_forward(again, **inputs(case))["logits"]), logits)


def test_merged_weights_give_the_adapters_logits(loaded, tmp_path):
    module, cfg, logits = loaded["llama"]
    with pytest.raises(ValueError, match="save_adapter"):  # a base alone drops adapters
        hf.save(module, cfg, tmp_path / "base")
    merged = apply_to_module(build_module(without_lora(cfg)), _unflatten(merged_flat(module)))
    got = np.asarray(hf.hf_forward(merged, **inputs("llama"))["logits"])
    assert rel_err(got, REF["llama/logits"]) < 1e-4


@pytest.mark.parametrize("field, value", [("use_dora", True), ("bias", "all"),
                                          ("fan_in_fan_out", True),
                                          ("rank_pattern", {"q_proj": 2})])
def test_adapters_mmjax_cannot_apply_are_refused(bases, tmp_path, field, value):
    d = tmp_path / "adapter"
    shutil.copytree(os.path.join(DATA, "llama_adapter"), d)
    c = json.loads((d / "adapter_config.json").read_text())
    (d / "adapter_config.json").write_text(json.dumps({**c, field: value}))
    with pytest.raises(UserError, match=field) as e:
        hf.load(bases["llama"], adapter=d)
    assert "\n" not in str(e.value)
