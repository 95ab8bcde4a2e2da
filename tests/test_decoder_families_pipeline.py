"""A Gemma 3 LLM (local/global layers, sliding window, soft-caps, q/k and sandwich norms) and a
Phi-3 LLM (fused qkv / gate_up, sliding window) as pretrained units of a pipelined run: pp=2
x tp=2 stages, each reading its own slices, with a layer scan whose per-layer local flag is
traced where a stage's layers differ, equal the single-device model (loss and gradients)."""
import json

import jax
import numpy as np
import pytest
from helpers import assert_same_grads, assert_same_loss, exact_reference, global_batch
from safetensors.numpy import save_file
from test_vit_training import CLIP_TINY

from mmjax.data.assemble import assemble
from mmjax.data.feed import microbatch_feed
from mmjax.models import hf
from mmjax.models.config import with_overrides
from mmjax.models.hf.llm import llm_entries
from mmjax.models.mllm import MultimodalModel, trainable_filter
from mmjax.models.tiny import tiny
from reference_layout import pure_grads, to_reference_layout
from mmjax.pipeline.runtime import PipelineRuntime
from mmjax.planner.plan import Plan
from mmjax.train.inputs import model_inputs
from mmjax.train.step import make_loss_fn, split_model

pytestmark = pytest.mark.parity  # judged by the float64 rule; CI reruns it under a second XLA config

BASE = {"vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 256}
GEMMA3 = dict(BASE, model_type="gemma3_text", query_pre_attn_scalar=16, sliding_window=8,
              layer_types=["sliding_attention", "sliding_attention", "full_attention",
                           "sliding_attention"],
              rope_theta=1e4, rope_local_base_freq=10.0,
              rope_scaling={"rope_type": "linear", "factor": 2.0},
              attn_logit_softcapping=20.0, final_logit_softcapping=30.0)
PHI3 = dict(BASE, model_type="phi3", sliding_window=12, pad_token_id=0,
            tie_word_embeddings=False)


def write(root, config):
    """A checkpoint with the family's HF names (checked against transformers by
    test_decoder_families) and small random values."""
    root.mkdir()
    (root / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(0)
    tensors = {}
    for e in llm_entries(hf.config_from_hf(config)):
        if e.hf not in tensors:
            tensors[e.hf] = (rng.standard_normal(e.hf_shape) * 0.1).astype(np.float32)
    save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
    return str(root)


@pytest.mark.slow
@pytest.mark.parametrize("family", [GEMMA3, PHI3], ids=["gemma3", "phi3"])
def test_pipelined_family_matches_single_device(tmp_path, family):
    dirs = {"llm": write(tmp_path / "llm", family)}
    base = with_overrides(tiny(), {"generator": None, "encoders.vision.encoder": CLIP_TINY,
                                   "llm.scan_layers": True})
    cfg = hf.prepare_pretrained(base, dirs)
    assert cfg.llm.scan_layers and cfg.llm.sliding_window is not None
    lay, samples = global_batch(cfg, 4)
    mdl = MultimodalModel(cfg, jax.random.key(0))
    hf.load_into_model(mdl, dirs["llm"])
    gd, tr, fr = split_model(mdl, trainable_filter(cfg))
    ref_loss, ref_grads = exact_reference(make_loss_fn(gd), tr, fr,
        model_inputs(assemble(samples, lay)))
    plan = Plan.uniform(cfg, 4, 2, dp={"vision": 2}, tp={"llm": 2}, pp={"llm": 2})
    rt = PipelineRuntime(cfg, plan, pretrained=dirs)
    feeds = [microbatch_feed(samples[m * 2:(m + 1) * 2], lay, {"vision": 2, "llm": 1})
             for m in range(2)]
    res = rt.run(feeds, rt.initial_compute_params())
    assert_same_loss(res.losses()["loss"], ref_loss)
    assert_same_grads(to_reference_layout(plan, pure_grads(res)), ref_grads)
