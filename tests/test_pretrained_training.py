"""Training from pretrained parts: configs from config.json, each pipeline stage reading only
its own tensors (and, with tp, only its slices) straight onto its sub-mesh, the design's
invariant against the single-device model loaded the same way, and bad input refused
before any work."""

import gin
import jax
import numpy as np
import pytest
from helpers import assert_same_grads, assert_same_loss, exact_reference, global_batch
from test_vit_training import CLIP_TINY

import hf_reference as ref
from mmjax.data.assemble import assemble
from mmjax.models import hf
from mmjax.models.config import with_overrides
from mmjax.models.hf.checkpoint import Checkpoint
from mmjax.models.mllm import MultimodalModel, trainable_filter
from mmjax.models.tiny import tiny
from mmjax.data.feed import microbatch_feed
from reference_layout import pure_grads, to_reference_layout
from mmjax.pipeline.runtime import PipelineRuntime
from mmjax.planner.plan import Plan
from mmjax.train.inputs import model_inputs
from mmjax.train.step import make_loss_fn, split_model
from mmjax.train.trainer import train

pytestmark = pytest.mark.parity  # judged by the float64 rule; CI reruns it under a second XLA config

QWEN = {"model_type": "qwen2", "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
        "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e5}}
CLIP = {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 3, "num_attention_heads": 2, "num_channels": 3, "image_size": 16,
        "patch_size": 4, "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pretrained")
    # std 0.1: pretrained-like scales (std 0.3 towers amplify float reassociation)
    ref.write_checkpoint(root / "qwen", QWEN, ref.llm_tensors(QWEN, seed=1, std=0.1), shards=2)
    ref.write_checkpoint(root / "clip", CLIP, ref.tower_tensors("clip", CLIP, seed=2, std=0.1))
    return {"llm": str(root / "qwen"), "vision": str(root / "clip")}


def base_cfg():
    return with_overrides(tiny(), {"generator": None, "encoders.vision.encoder": CLIP_TINY})


def test_configs_come_from_config_json(dirs):
    cfg = hf.prepare_pretrained(base_cfg(), dirs)
    assert cfg.llm == hf.config_from_hf(QWEN) and cfg.llm.rope_theta == 1e5
    v = cfg.encoder("vision").encoder
    assert (v.hidden_size, v.num_layers, v.ffn_size, v.class_token, v.act) == (
        32, 3, 48, True, "quick_gelu")
    assert v.feature_layer == -2 and v.max_images == 2  # mmjax choices kept from the config


@pytest.mark.slow
def test_pp2_tp2_llm_and_dp2_clip_tower_match_single_device(dirs, monkeypatch):
    cfg = hf.prepare_pretrained(base_cfg(), dirs)
    lay, samples = global_batch(cfg, 4)
    mdl = MultimodalModel(cfg, jax.random.key(0))
    hf.load_into_model(mdl, dirs["llm"], {"vision": dirs["vision"]})
    gd, tr, fr = split_model(mdl, trainable_filter(cfg))
    ref_loss, ref_grads = exact_reference(make_loss_fn(gd), tr, fr,
        model_inputs(assemble(samples, lay)))

    reads = []
    real = Checkpoint.read_slice
    monkeypatch.setattr(Checkpoint, "read_slice", lambda self, name, index: reads.append(
        (name, real(self, name, index).shape)) or real(self, name, index))
    monkeypatch.setattr(Checkpoint, "read", lambda self, name: pytest.fail(f"whole read {name}")
                        if "patch_embedding" not in name else Checkpoint.read_slice(
                            self, name, (slice(None),)))
    plan = Plan.uniform(cfg, 4, 2, dp={"vision": 2}, tp={"llm": 2}, pp={"llm": 2})
    rt = PipelineRuntime(cfg, plan, pretrained=dirs)
    monkeypatch.undo()
    q = [shape for name, shape in reads if name == "model.layers.1.self_attn.q_proj.weight"]
    assert q == [(32, 64), (32, 64)]  # one half per TP rank, never the whole tensor
    assert not any(n.startswith("vision_model.encoder.layers.2.") for n, _ in reads)  # feature -2

    feeds = [microbatch_feed(samples[m * 2:(m + 1) * 2], lay, {"vision": 2, "llm": 1})
             for m in range(2)]
    res = rt.run(feeds, rt.initial_compute_params())
    grads = to_reference_layout(plan, pure_grads(res))
    assert_same_loss(res.losses()["loss"], ref_loss)
    assert_same_grads(grads, ref_grads)


@pytest.fixture
def gin_pretrained():
    def bind(**units):
        gin.clear_config()
        for unit, path in units.items():
            gin.parse_config(f"pretrained.{unit} = {str(path)!r}")
    yield bind
    gin.clear_config()


def test_bad_pretrained_input_fails_before_any_work(dirs, tmp_path, gin_pretrained):
    import shutil
    broken = tmp_path / "broken"
    shutil.copytree(dirs["llm"], broken)
    (broken / "model-00002-of-00002.safetensors").unlink()
    wrong = tmp_path / "wrong"
    ref.write_checkpoint(wrong, dict(QWEN, intermediate_size=97), ref.llm_tensors(QWEN))
    bert = tmp_path / "bert"
    ref.write_checkpoint(bert, {"model_type": "bert"}, {"x": np.zeros(1, np.float32)})
    cases = [({"llm": broken}, "model-00002-of-00002.safetensors does not exist"),
             ({"llm": wrong}, r"has shape \(96, 64\), expected \(97, 64\)"),
             ({"llm": bert}, "model_type='bert'"),
             ({"vision": dirs["llm"]}, "model_type='qwen2' is not a vision tower"),
             ({"generator": dirs["llm"]}, "pretrained.generator: no such unit")]
    for units, match in cases:
        gin_pretrained(**units)
        with pytest.raises(hf.PretrainedError, match=match):
            train(workdir=str(tmp_path / "run"), model=base_cfg(), steps=1)
        assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_two_processes_load_only_their_stages_and_match_one_process(dirs, gloo_jobs):
    """2 processes x 4 CPU devices (tests/multiprocess_driver.py, layout "span": vision and
    LLM stage 0 on process 0, LLM stage 1 across both, the generator on process 1) start
    from the HF checkpoints: each process reads only the tensors of stages it holds, and the
    losses equal one process with 8 devices."""
    import json
    import os
    import subprocess
    import sys

    from multiprocess_driver import run_steps

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    spec = ",".join(f"{u}={d}" for u, d in dirs.items())
    proc = subprocess.run(
        [sys.executable, os.path.join(root, "scripts", "launch_local.py"), "--num_processes=2",
         "--devices_per_process=4", "--timeout=400",
         "--script=" + os.path.join(root, "tests", "multiprocess_driver.py"), "--",
         "--layout=span", "--steps=2", f"--pretrained={spec}"],
        env=env, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=420)
    out = proc.stdout
    assert proc.returncode == 0, out[-8000:]
    reads = {p: set(json.loads(ln.split("READS ", 1)[1])) for p in (0, 1)
             for ln in out.splitlines() if ln.startswith(f"[p{p}] READS ")}
    layer = lambda names, i: {n for n in names if n.startswith(f"model.layers.{i}.")}
    # process 1 holds half of LLM stage 1 (layer 1 + head) and the generator: no tower,
    # no embedding, no layer 0
    assert layer(reads[1], 1) and not layer(reads[1], 0)
    assert not any(n.startswith("vision_model.") or "embed_tokens" in n for n in reads[1])
    assert any(n.startswith("vision_model.") for n in reads[0]) and layer(reads[0], 0)
    got = json.loads(next(ln for ln in out.splitlines()
                          if ln.startswith("[p0] LOSSES "))[len("[p0] LOSSES "):])
    ref = run_steps("span", 2, dirs)
    for g, r in zip(got, ref):
        for k in ("loss", "lm_loss", "diffusion_loss", "grad_norm"):
            np.testing.assert_allclose(g[k], r[k], rtol=1e-5, err_msg=k)
