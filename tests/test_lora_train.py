"""Training with `lora.*` in the single program: only adapters (and the parts not LoRA'd)
carry master weights, gradients and optimizer state; the LoRA'd parts' base weights never
change; a stopped run resumes to the uninterrupted run's losses; bad settings refuse."""
from __future__ import annotations

import dataclasses

import gin
import jax
import numpy as np
import pytest
from flax import nnx

import mmjax.data.loader  # noqa: F401  (registers Loader with gin)
from mmjax.data.assemble import assemble
from mmjax.errors import UserError
from mmjax.models.config import EncoderSpec, MLLMConfig, ProjectorConfig
from mmjax.models.mllm import MultimodalModel, trainable_filter
from mmjax.models.tiny import TINY_LLM, TINY_VISION
from mmjax.train.inputs import model_inputs
from mmjax.train.lora_setup import with_lora
from mmjax.models.lora_config import LoRAConfig
from mmjax.train.logical_state import single_logical
from mmjax.train.optimizer import learning_rate_schedule, make_optimizer
from mmjax.train.state import WHOLE_MODEL, whole_model_state
from mmjax.train.step import make_loss_fn, make_train_step, split_model
from helpers import global_batch

CFG = MLLMConfig("tiny_lora", dataclasses.replace(TINY_LLM, num_layers=2, hidden_size=32,
                                                  ffn_size=64),
                 encoders=(EncoderSpec("vision", dataclasses.replace(
                     TINY_VISION, num_layers=1, hidden_size=16, ffn_size=32),
                     ProjectorConfig(downsample=1)),))
SETTINGS = ["data_layout.seq_len = 64", "data_layout.vision_caps = (64,)", "Loader.reserve = 16",
            "Loader.max_bad_fraction = 0.9", "lora.units = ['llm']", "lora.rank = 4",
            "lora.targets = ['q', 'v', 'mlp']", "lora.dropout = 0.1"]


def test_steps_move_adapters_only():
    cfg = with_lora(CFG, ("llm", "vision"), LoRAConfig(rank=4, targets=("attention", "mlp"),
                                                      dropout=0.2))
    model = MultimodalModel(cfg, jax.random.key(0))
    gd, tr, fr = split_model(model, trainable_filter(cfg))
    names = single_logical(whole_model_state(tr, make_optimizer(
        learning_rate_schedule(3)).init(tr)))
    params = [n for n in names if n.startswith("params.")]
    assert params and all(".lora." in n for n in params if ".llm." in n or ".encoders." in n)
    assert any(".projectors." in n and ".lora." not in n for n in params)  # trained whole
    opt = [n for n in names if n.startswith("opt.") and (".llm." in n or ".encoders." in n)]
    assert opt and all(".lora." in n for n in opt)  # optimizer state: adapters only
    lay, samples = global_batch(cfg, 2)
    step = make_train_step(gd, make_optimizer(learning_rate_schedule(4, peak_lr=1e-2)))
    state = whole_model_state(tr, make_optimizer(learning_rate_schedule(4, peak_lr=1e-2)).init(tr))
    base = {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(fr)}
    assert not np.any(np.asarray(model.llm.layers[0].lora["q"].b[...]))
    inputs = model_inputs(assemble(samples, lay))
    for i in range(3):  # lr 0 at step 0 (warmup): B moves from step 2 on
        if i == 2:  # the step's loss has dropout on the adapters' input; evaluation none
            plain = float(jax.jit(make_loss_fn(gd))(state.stages[WHOLE_MODEL].master, fr,
                                                    inputs)[0])
        state, m = step(state, fr, inputs)
        assert bool(m["applied"])
    assert abs(float(m["loss"]) - plain) > 1e-6 * abs(plain)
    after = nnx.merge(gd, state.stages[WHOLE_MODEL].master, fr)
    flat = {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(after, nnx.Param))}
    assert all(np.array_equal(flat[p], v) for p, v in base.items())  # frozen bases
    assert np.any(flat[("llm", "layers", 0, "lora", "q", "b")])  # B left zero: it trained


def run(work, steps, stop_after=None, extra=()):
    from mmjax.train.trainer import train

    gin.clear_config()
    gin.parse_config(SETTINGS + list(extra))
    try:
        return train(str(work), model=CFG, steps=steps, global_batch=4, progress=False,
                     checkpoint_every=1, stop_after=stop_after,
                     compilation_cache_dir=str(work.parent / "cache"))
    finally:
        gin.clear_config()


@pytest.mark.slow
def test_lora_run_resumes_to_the_same_losses(tmp_path):
    whole = [r["loss"] for r in run(tmp_path / "a", 3)]
    first = [r["loss"] for r in run(tmp_path / "b", 3, stop_after=2)]
    rest = [r["loss"] for r in run(tmp_path / "b", 3)]
    assert first + rest == whole and len(whole) == 3
    assert len(set(whole)) == 3


@pytest.mark.parametrize("extra, words", [
    (["lora.units = ['audio']"], "lora.units"), (["lora.targets = ['fc1']"], "lora.targets"),
    (["lora.dropout = 1.0"], "lora.dropout"), (["lora.rank = 0"], "lora.rank")])
def test_bad_lora_runs_fail_in_one_line(tmp_path, extra, words):
    with pytest.raises(UserError, match=words) as e:
        run(tmp_path / "bad", 1, extra=extra)
    assert "\n" not in str(e.value).split("  In call to")[0].strip()


@pytest.mark.slow  # two models' prefill + decode compiles
def test_generate_unmerged_and_merged_give_the_same_tokens():
    from mmjax.data.layout import AssemblyLayout
    from mmjax.data.sample import Sample, Segment
    from mmjax.models.decode import generate
    from mmjax.models.lora_merge import merged_module
    from test_lora import perturbed

    cfg = with_lora(CFG, ("llm", "vision"), LoRAConfig(rank=4, targets=("all",)))
    model = perturbed(MultimodalModel(cfg, jax.random.key(1)))
    lay = AssemblyLayout.from_config(cfg, 64, vision_caps=(64,))
    rng = np.random.default_rng(0)
    s = Sample(0, (Segment("text", rng.integers(16, 500, 5).astype(np.int32)),
                   Segment("image", rng.random((8, 12, 3), dtype=np.float32)),
                   Segment("text", rng.integers(16, 500, 4).astype(np.int32))))
    batch = model_inputs(assemble([s], lay))
    p = int((batch["doc"][0] == 1).sum()) - 1
    merged, _ = merged_module(model, cfg)
    unmerged_ids = generate(model, batch, p, 8)
    assert len(unmerged_ids) == 8
    assert generate(merged, batch, p, 8) == unmerged_ids
    plain = generate(MultimodalModel(CFG, jax.random.key(1)), batch, p, 8)
    assert plain != unmerged_ids  # the adapters change what is generated
