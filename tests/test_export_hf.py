"""scripts/export_hf.py: training checkpoints (single program and a plan's per-stage state)
-> HF checkpoints that `hf.load` reads back bit-identically."""
import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from mmjax.errors import UserError
from mmjax.models import hf
from mmjax.models.config import EncoderSpec, VisionConfig, with_overrides
from mmjax.models.mllm import MultimodalModel, trainable_filter
from mmjax.models.tiny import tiny_valm
from mmjax.planner.plan import Plan
from mmjax.train.checkpoint import Checkpointer
from mmjax.train.logical_state import single_logical
from mmjax.train.export import export_workdir, restore_model
from mmjax.train.optimizer import learning_rate_schedule, optimizer_from_settings
from mmjax.train.state import whole_model_state
from mmjax.train.step import split_model
from mmjax.train.run_files import write_run_info

SIGLIP = VisionConfig(hidden_size=32, num_layers=2, num_heads=2, ffn_size=64, patch_size=4,
                      max_grid=16, kind="vit", image_size=16)


def model_cfg():
    base = with_overrides(tiny_valm(), {"llm.num_layers": 2})
    audio = dataclasses.replace(base.encoder("audio").encoder, max_source_positions=64)
    return base.replace(encoders=(EncoderSpec("vision", SIGLIP), EncoderSpec("audio", audio)))


def perturbed(tree, seed):
    """Parameters that are not the init (as after training)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda a: a + jnp.asarray(rng.normal(size=a.shape), a.dtype), tree)


def pure(module):
    return nnx.to_pure_dict(nnx.state(module, nnx.Param))


def check_exported(out, cfg, want: dict):
    for unit, got_cfg_want in (("llm", cfg.llm), ("vision", cfg.encoder("vision").encoder),
                               ("audio", cfg.encoder("audio").encoder)):
        module, got_cfg = hf.load(out / unit)
        if unit == "vision":  # max_grid: mmjax's data limit, not part of an HF tower
            got_cfg = dataclasses.replace(got_cfg, max_grid=got_cfg_want.max_grid)
        assert got_cfg == got_cfg_want
        ref = want["llm"] if unit == "llm" else want["encoders"][unit]
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                     pure(module), ref)


def test_single_program_checkpoint_round_trip(tmp_path):
    cfg = model_cfg()
    graphdef, tr, fr = split_model(MultimodalModel(cfg, jax.random.key(0)), trainable_filter(cfg))
    tr = perturbed(tr, 1)
    tx = optimizer_from_settings(learning_rate_schedule(1))
    ckpt = Checkpointer(str(tmp_path / "run" / "checkpoints"), async_save=False)
    ckpt.save(3, single_logical(whole_model_state(tr, tx.init(tr), jnp.ones((), jnp.int32))), {})
    ckpt.close()
    write_run_info(str(tmp_path / "run"), cfg, None, 0)
    written = export_workdir(str(tmp_path / "run"), tmp_path / "out", max_shard_bytes=20000)
    assert set(written) == {"llm", "vision", "audio", "extra"}
    assert (tmp_path / "out" / "llm" / hf.INDEX_NAME).exists()  # sharded above the limit
    check_exported(tmp_path / "out", cfg, pure(nnx.merge(graphdef, tr, fr)))
    # --dtype casts every file, mmjax_extra.safetensors (the projectors) included
    cast = export_workdir(str(tmp_path / "run"), tmp_path / "bf16", dtype="bfloat16")
    extra, want = load_file(str(cast["extra"])), load_file(str(written["extra"]))
    assert sorted(extra) == sorted(want) and all(a.dtype == ml_dtypes.bfloat16
                                                 for a in extra.values())
    assert all(np.array_equal(extra[k], want[k].astype(ml_dtypes.bfloat16)) for k in want)
    with pytest.raises(UserError, match=r"--step=7: .* holds steps \[3\]"):
        export_workdir(str(tmp_path / "run"), tmp_path / "out2", step=7)


@pytest.mark.slow
def test_plan_checkpoint_round_trip(tmp_path):
    from reference_layout import to_reference_layout
    from mmjax.train.pipelined import PipelinedRunner
    cfg = model_cfg()
    plan = Plan.uniform(cfg, 4, 2, pp={"llm": 2, "vision": 2}, tp={"llm": 2})
    step_fn = PipelinedRunner(cfg, plan, learning_rate_schedule(1))
    stages = dict(step_fn.state.stages)
    for k, sid in enumerate(step_fn.runtime.stages):
        if sid in stages:
            stages[sid] = stages[sid]._replace(master=perturbed(stages[sid].master, k))
    step_fn.state = step_fn.state._replace(stages=stages)
    ckpt = Checkpointer(str(tmp_path / "run" / "checkpoints"), async_save=False)
    ckpt.save(2, step_fn.checkpoint()[0], {})
    ckpt.close()
    write_run_info(str(tmp_path / "run"), cfg, plan, 0)
    trainable = {**step_fn.fixed, **{sid: st.master for sid, st in stages.items()}}
    want = to_reference_layout(plan, {sid: pure(nnx.merge(st.graphdef, trainable[sid], st.frozen))
                                      for sid, st in step_fn.runtime.stages.items()})
    cfg2, model, step, _ = restore_model(str(tmp_path / "run"))
    assert cfg2 == cfg and step == 2
    assert jax.tree.all(jax.tree.map(np.array_equal, pure(model), want))  # restored as trained
    export_workdir(str(tmp_path / "run"), tmp_path / "out")
    check_exported(tmp_path / "out", cfg, want)


def test_missing_run_info(tmp_path):
    with pytest.raises(UserError, match="run.json does not exist"):
        export_workdir(str(tmp_path), tmp_path / "out")
