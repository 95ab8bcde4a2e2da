"""The README's own-data path end to end: scripts/make_example_data.py writes a LLaVA set
(with a corrupt and a missing image) and a BPE tokenizer; configs/examples/llava_tiny.gin
trains on it; bad samples are skipped, counted and named in skipped.jsonl."""
import importlib.util
import json
import os

import gin
import numpy as np
import pytest

from mmjax.train.trainer import train

REPO = os.path.join(os.path.dirname(__file__), os.pardir)


def _script(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "scripts", name + ".py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_llava_tiny_trains_and_skips_bad_images(tmp_path, capsys):
    data = str(tmp_path / "data")
    _script("make_example_data").main([f"--out={data}", "--num_samples=16"])
    run = str(tmp_path / "run")
    gin.parse_config_files_and_bindings(
        [os.path.join(REPO, "configs", "examples", "llava_tiny.gin")],
        [f"tokenizer.path = '{data}/tokenizer'", f"llava_source.json_path = '{data}/train.json'",
         f"llava_source.image_root = '{data}/images'", "train.steps = 3",
         "train.checkpoint_every = 3", "train.progress = False", "train.eval_every = 2",
         f"eval_source.json_path = '{data}/val.json'",
         f"eval_source.image_root = '{data}/images'", "eval_source.max_batches = 1"],
        finalize_config=False)
    try:
        recs = train(run)
    finally:
        gin.clear_config()
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert all(np.isfinite(r["loss"]) and r["loss"] > 0 for r in recs)
    # prompts are masked: fewer tokens trained than seen
    assert all(0 < r["tokens_trained"] < r["tokens_seen"] for r in recs)
    # validation loss on the held-out source at steps 2 and 3 (the end)
    assert ["eval_loss" in r for r in recs] == [False, True, True]
    assert all(np.isfinite(r["eval_loss"]) and r["eval_loss"] > 0 for r in recs[1:])
    with open(os.path.join(run, "skipped.jsonl")) as f:
        skipped = [json.loads(line) for line in f]
    # 3 steps x 8 samples cover the 19 records: both bad images come up and are named
    names = {s["id"]: s["reason"] for s in skipped}
    assert names["missing-image"].startswith("missing: image")
    assert names["corrupt-image"].split(":")[0] in ("unreadable", "decode")
    assert recs[-1]["skipped_samples"] == len(skipped)
    assert os.path.isdir(os.path.join(run, "checkpoints"))
    # scripts/generate.py decodes text from the checkpoint through the same chat template
    try:
        assert _script("generate").main([f"--workdir={run}", f"--image={data}/images/0002.png",
                                         "--prompt=What colour is the shape?",
                                         "--max_new_tokens=8"]) == 0
    finally:
        gin.clear_config()
    out = capsys.readouterr().out.splitlines()
    assert out and "<|" not in out[-1]  # plain text, special tokens stripped
    # a vision model without --image: one line, exit 2, nothing decoded
    from mmjax.cli import run_main

    try:
        assert run_main(_script("generate").main, [f"--workdir={run}", "--prompt=Hi"]) == 2
    finally:
        gin.clear_config()
    cap = capsys.readouterr()
    assert cap.out == "" and cap.err.startswith("error: --image: model llava_tiny reads images")
    assert len(cap.err.strip().splitlines()) == 1
