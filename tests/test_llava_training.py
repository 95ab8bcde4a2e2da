"""`pretrained.model = DIR`: a run started from a whole LlavaForConditionalGeneration
checkpoint (tower, projector, LLM; HF LLaVA semantics), the tower and LLM frozen and only the
projector trained, single program and a plan (pp=2 LLM, dp=2 tower), exported whole over
its source: every frozen tensor bit-identical to the input checkpoint's, the projector the
trained one; generation restores the same weights."""
import os
import sys

import gin
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "fixtures"))
import llava_tiny  # noqa: E402
from test_vit_training import CLIP_TINY  # noqa: E402
from mmjax.models import hf  # noqa: E402
from mmjax.models.config import with_overrides  # noqa: E402
from mmjax.models.tiny import tiny  # noqa: E402
from mmjax.planner.plan import Plan  # noqa: E402
from mmjax.train.export import export_workdir, restore_model  # noqa: E402


def gin_cfg():
    cfg = with_overrides(tiny(), {"generator": None, "encoders.vision.encoder": CLIP_TINY})
    cfg = cfg.replace(encoders=tuple(e for e in cfg.encoders if e.name == "vision"),
                      llm_frozen=True)
    return with_overrides(cfg, {"encoders.vision.frozen": True})


def test_config_comes_from_the_llava_checkpoint(tmp_path):
    src = llava_tiny.write(tmp_path / "src")
    cfg = hf.prepare_pretrained(gin_cfg(), {"model": str(src)})
    assert cfg.image_attention == "causal" and not cfg.modality_markers
    assert cfg.llm_frozen and cfg.encoder("vision").frozen  # the run's choices kept
    assert cfg.llm.vocab_size == 128 and cfg.encoder("vision").projector.act == "gelu"
    with pytest.raises(hf.PretrainedError, match=r"^pretrained: pretrained.model names the "
                                                 r"whole model: leave \['llm'\] unset"):
        hf.prepare_pretrained(gin_cfg(), {"model": str(src), "llm": str(src)})


@pytest.mark.slow
@pytest.mark.parametrize("planned", [False, True])
def test_run_from_whole_llava_exports_frozen_parts_bit_identical(tmp_path, planned):
    from mmjax.train.trainer import train
    src = llava_tiny.write(tmp_path / "src")
    gin.clear_config()
    gin.parse_config([f"pretrained.model = '{src}'"])
    plan = None
    try:
        if planned:
            plan = str(tmp_path / "plan.json")
            Plan.uniform(hf.prepare_pretrained(gin_cfg(), {"model": str(src)}), 4, 2,
                         dp={"vision": 2}, pp={"llm": 2}).save(plan)
        run = str(tmp_path / "run")
        train(run, model=gin_cfg(), steps=2, global_batch=4, progress=False,
              checkpoint_every=2, plan=plan)
    finally:
        gin.clear_config()
    assert export_workdir(run, tmp_path / "out") == {"model": tmp_path / "out" / "model"}
    want = load_file(str(src / "model.safetensors"))
    got = load_file(str(tmp_path / "out" / "model" / "model.safetensors"))
    assert sorted(got) == sorted(want)
    changed = sorted(k for k in want if got[k].tobytes() != want[k].tobytes())
    assert changed == sorted(k for k in want if k.startswith("multi_modal_projector."))
    _, model, _, _ = restore_model(run)  # what generate.py decodes with
    llm = nnx.to_pure_dict(nnx.state(model.llm, nnx.Param))
    ref, _ = hf.load(src)
    ref_llm = nnx.to_pure_dict(nnx.state(ref.llm, nnx.Param))
    for a, b in zip(__import__("jax").tree.leaves(llm), __import__("jax").tree.leaves(ref_llm)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_pretrained_vocabulary_that_covers_the_tokenizer_is_kept():
    """LLaVA-1.5's 32064 is no multiple of 128: kept for a pretrained LLM (tp dividing it),
    padded otherwise."""
    from types import SimpleNamespace
    from mmjax.train.data_config import fit_vocab
    cfg = with_overrides(tiny(), {"llm.vocab_size": 32064})
    tok = SimpleNamespace(vocab_size=32010)  # 32002 + mmjax's markers
    assert fit_vocab(cfg, tok, (1, 4), pretrained=True).llm.vocab_size == 32064
    assert fit_vocab(cfg, tok, (5,), pretrained=True).llm.vocab_size == 32640
    assert fit_vocab(cfg, tok).llm.vocab_size == 32128
