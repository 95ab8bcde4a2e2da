"""Two processes each decode only what their own devices read (data/global_batch.py): on
a LLaVA set with images that fail to decode and a plan whose process 1 holds only the LLM,
process 1 never opens an image, learns of the failures from process 0 before each step
(train/host_failures.py), and the run trains exactly what one process decoding everything
trains: the same skip counts and skip log, trained-token counts and losses."""
import json
import os
import subprocess

import numpy as np
import pytest

from mmjax.data.example_data import write_llava_example
from test_checkpoint_multiprocess import LAUNCH, ROOT, _env, _metrics

STEPS = 3
FLOAT = ("loss", "lm_loss", "grad_norm")
COUNTS = ("tokens_seen", "tokens_trained", "skipped_samples", "nonfinite_steps")
# vision on process 0's two devices, the LLM's two stages on process 1's
PLAN = ["--plan=manual", '--gin_param=manual_plan.dp={"vision": 2}',
        '--gin_param=manual_plan.pp={"llm": 2}']


def _train(work, processes, devices, root):
    cmd = LAUNCH + [f"--num_processes={processes}", f"--devices_per_process={devices}",
                    "--timeout=500", "--", f"--workdir={work}", *PLAN,
                    "--gin_file=configs/examples/llava_tiny.gin",
                    f"--gin_param=tokenizer.path='{root}/tokenizer'",
                    f"--gin_param=llava_source.json_path='{root}/train.json'",
                    f"--gin_param=llava_source.image_root='{root}/images'",
                    "--gin_param=train.progress=False", f"--gin_param=train.steps={STEPS}",
                    "--gin_param=train.checkpoint_every=100"]
    p = subprocess.run(cmd, env=_env(), cwd=ROOT, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=560, check=False)
    assert p.returncode == 0, p.stdout[-6000:]


def _skips(work):
    with open(os.path.join(work, "skipped.jsonl")) as f:
        return sorted((r["step"], r["id"], r["reason"]) for r in map(json.loads, f))


@pytest.mark.slow
def test_two_processes_decoding_their_own_parts_train_what_one_process_trains(
        tmp_path, gloo_jobs):
    root = str(tmp_path / "llava")
    write_llava_example(root, num_samples=24)
    images = os.path.join(root, "images")
    for name in ("0002.png", "0004.png", "0006.png"):  # header intact, pixels cut
        path = os.path.join(images, name)
        raw = open(path, "rb").read()
        open(path, "wb").write(raw[:len(raw) // 2])
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    _train(two, 2, 2, root)
    _train(one, 1, 4, root)
    a, b = _metrics(one), _metrics(two)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, STEPS + 1))
    for ra, rb in zip(a, b):
        for k in COUNTS:
            assert ra[k] == rb[k], (k, ra, rb)
        for k in FLOAT:
            np.testing.assert_allclose(rb[k], ra[k], rtol=1e-5, err_msg=k)
    decode = [s for s in _skips(one) if s[2].startswith("decode: image")]
    assert decode, "the run read no cut image: the test proves nothing"
    assert _skips(two) == _skips(one)
