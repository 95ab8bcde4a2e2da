"""A tiny image-output run end to end (configs/examples/llava_gen_tiny.gin): the DiT trains on
real VAE latents of the records' `output_image`s and its loss decreases; scripts/generate.py
then writes a PNG of the VAE's output size."""
import os

import gin
import numpy as np
import pytest

from mmjax.train.trainer import train
from test_llava_example import REPO, _script


@pytest.mark.slow
def test_image_output_run_learns_and_generate_writes_a_png(tmp_path):
    from PIL import Image

    data = str(tmp_path / "data")
    _script("make_example_data").main([f"--out={data}", "--num_samples=8"])
    run = str(tmp_path / "run")
    gin.parse_config_files_and_bindings(
        [os.path.join(REPO, "configs", "examples", "llava_gen_tiny.gin")],
        [f"tokenizer.path = '{data}/tokenizer'",
         f"llava_source.json_path = '{data}/train_gen.json'",
         f"llava_source.image_root = '{data}/images'", f"vae.path = '{data}/vae'",
         "train.steps = 32", "train.checkpoint_every = 32", "train.progress = False"],
        finalize_config=False)
    try:
        recs = train(run)
    finally:
        gin.clear_config()
    # 32 steps: the example's 256 records each bring their own (noise, t), so the loss falls
    # by learning, not by meeting the same few pairs again (docs/guide.md, "Image output")
    diff = [r["diffusion_loss"] for r in recs]
    assert len(diff) == 32 and all(np.isfinite(diff)) and min(diff) > 0
    assert np.mean(diff[-4:]) < 0.8 * np.mean(diff[:4])  # learns the real latents
    png = str(tmp_path / "out.png")
    try:
        assert _script("generate").main([f"--workdir={run}", "--prompt=Draw a red square.",
                                         "--text_only", "--max_new_tokens=8", f"--output_image={png}",
                                         "--diffusion_steps=10", "--sampler=ddpm"]) == 0
    finally:
        gin.clear_config()
    with Image.open(png) as im:
        assert im.format == "PNG" and im.size == (16, 16) and im.mode == "RGB"
