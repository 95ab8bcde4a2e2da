"""The prompts of tests/test_generate_transformers.py: each whole-model fixture (LLaVA,
Qwen2-VL, Qwen2.5-VL, and each decoder family of tests/data/families as a CLIP LLaVA's text
model) with a prompt assembled as training assembles it (the checkpoint's own
semantics), and the same prompt as transformers' inputs. `python tests/generate_prompts.py`
writes the latter to tests/data/generate/prompts.npz, which
tests/fixtures/make_generate_reference.py feeds to transformers' `generate`."""
from __future__ import annotations

import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "fixtures"))
DATA = os.path.join(HERE, "data")
FAMILIES = ("gemma2", "gemma3", "llama_linear", "llama_yarn", "mistral_window", "phi3",
            "qwen2_window", "qwen3", "qwen3_window")  # tests/data/families
# the whole models, and each decoder family as the text model of a CLIP LLaVA
CASES = ("llava", "qwen2_vl", "qwen2_5_vl") + tuple(f"llava_{f}" for f in FAMILIES)
NEW = 16  # tokens generated
FAMILY_IMAGE = 27  # the image token of a family LLaVA (vocabulary 29)


def checkpoint(case: str, root) -> str:
    if case == "llava":
        import llava_tiny
        return str(llava_tiny.write(root / "llava", "tf5"))
    if case.startswith("llava_"):
        from llava_families import llava_source
        return str(llava_source(root / case, case[len("llava_"):], "clip")[0])
    return os.path.join(DATA, "qwen2_vl", f"{case}_tf5")


def prompt(case: str, cfg):
    """-> (model inputs of the assembled prompt, prompt length, transformers' inputs)."""
    from mmjax.data.assemble import assemble
    from mmjax.data.qwen2_vl_processor import patchify
    from mmjax.data.sample import Sample, Segment, SpecialTokens
    from mmjax.train.data_config import data_layout
    from mmjax.train.inputs import model_inputs

    rng = np.random.default_rng(31 + CASES.index(case))
    family = case.startswith("llava_")
    text = lambda n: rng.integers(3, 27 if family else 100, n).astype(np.int32)
    if case.startswith("llava"):
        import llava_tiny
        image = rng.normal(size=(16, 16, 3)).astype(np.float32)
        marks = (25, 26) if family else (120, 121)  # unused: LLaVA has no markers
        special = SpecialTokens(bos=1, eos=2, first_text=0, image_start=marks[0],
                                image_end=marks[1])
        layout = data_layout(cfg, seq_len=48, vision_caps=(16,), special=special)
        token = FAMILY_IMAGE if family else llava_tiny.IMAGE_TOKEN
        images = [image]
    else:
        images = [rng.standard_normal((56, 84, 3)).astype(np.float32)]  # 4 x 6 patches
        special = SpecialTokens(bos=1, eos=2, first_text=0, image_start=120, image_end=121)
        layout = data_layout(cfg, seq_len=48, vision_caps=(64,), special=special)
        token = 250
    sample = Sample(0, (Segment("text", text(5)), Segment("image", images[0]),
                        Segment("text", text(6))))
    batch = assemble([sample], layout)
    p = int((batch.doc[0] != 0).sum()) - 1  # without the document's eos
    ids = batch.tokens[0, :p].astype(np.int64)
    ids[batch.gather["vision"][0, :p] >= 0] = token
    hf = {"input_ids": ids[None]}
    if case.startswith("llava"):
        hf["pixel_values"] = images[0].transpose(2, 0, 1)[None]
    else:
        hf["pixel_values"] = patchify(images[0].transpose(2, 0, 1), 14, 2, 2)[0]
        hf["image_grid_thw"] = np.array([[1, 4, 6]])
        hf["mm_token_type_ids"] = (ids == token).astype(np.int64)[None]
    return model_inputs(batch), p, hf


def main():
    import tempfile
    from pathlib import Path

    from mmjax.models import hf

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for case in CASES:
            _, cfg = hf.load(checkpoint(case, Path(tmp)))
            _, _, inputs = prompt(case, cfg)
            out.update({f"{case}/{k}": v for k, v in inputs.items()})
    np.savez(os.path.join(DATA, "generate", "prompts.npz"), **out)


if __name__ == "__main__":
    main()
