"""Frozen pretrained units survive export and generation bit for bit: they are not in the
checkpoints, so export_hf.py / generate.py re-read them from the pretrained files run.json
recorded (sizes and SHA-256 checked), for single-program and plan runs alike, on a host with
any device count. Towers read at an inner layer are written back over their source
checkpoint (all layers kept)."""
import json
import os
import shutil
import subprocess
import sys

import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

import hf_reference as ref
from test_pretrained_training import CLIP, QWEN, base_cfg
from mmjax.errors import UserError
from mmjax.models import hf
from mmjax.models.config import with_overrides
from mmjax.models.mllm import MultimodalModel, trainable_filter
from mmjax.planner.plan import Plan
from mmjax.train import pretrained_sources
from mmjax.train.checkpoint import Checkpointer
from mmjax.train.export import export_workdir, restore_model
from mmjax.train.logical_state import single_logical
from mmjax.train.optimizer import learning_rate_schedule, optimizer_from_settings
from mmjax.train.run_files import write_run_info
from mmjax.train.state import whole_model_state
from mmjax.train.step import split_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def frozen_cfg():
    return with_overrides(base_cfg(), {"llm_frozen": True, "encoders.vision.frozen": True})


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pretrained")
    ref.write_checkpoint(root / "qwen", QWEN, ref.llm_tensors(QWEN, seed=1, std=0.1), shards=2)
    ref.write_checkpoint(root / "clip", CLIP, ref.tower_tensors("clip", CLIP, seed=2, std=0.1))
    return {"llm": str(root / "qwen"), "vision": str(root / "clip")}


def source_tensors(d):
    out = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(d, f)))
    return out


def assert_bit_identical(exported_dir, source_dir):
    got, want = source_tensors(exported_dir), source_tensors(source_dir)
    assert sorted(got) == sorted(want)  # every tensor, the layers above feature_layer too
    for name, arr in want.items():
        assert got[name].dtype == arr.dtype and got[name].tobytes() == arr.tobytes(), name


def fake_run(workdir, dirs, cfg):
    """A single-program checkpoint as the trainer writes it (frozen units loaded from
    `dirs`, trainable ones moved off their init) and its run.json."""
    cfg = hf.prepare_pretrained(cfg, dirs)
    model = MultimodalModel(cfg, jax.random.key(0))
    hf.load_into_model(model, dirs["llm"], {"vision": dirs["vision"]})
    _, tr, fr = split_model(model, trainable_filter(cfg))
    tr = jax.tree.map(lambda a: a + 0.5, tr)
    tx = optimizer_from_settings(learning_rate_schedule(1))
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), async_save=False)
    ckpt.save(2, single_logical(whole_model_state(tr, tx.init(tr), jnp.ones((), jnp.int32))), {})
    ckpt.close()
    write_run_info(workdir, cfg, None, 0, dirs, pretrained_sources.record(dirs))
    return cfg, tr


def test_frozen_units_exported_bit_identical_and_trained_ones_kept(dirs, tmp_path):
    run = str(tmp_path / "run")
    cfg, tr = fake_run(run, dirs, frozen_cfg())
    written = export_workdir(run, tmp_path / "out")
    assert set(written) == {"llm", "vision", "extra"}  # feature_layer=-2 tower: vision/
    assert_bit_identical(tmp_path / "out" / "llm", dirs["llm"])
    assert_bit_identical(tmp_path / "out" / "vision", dirs["vision"])
    extra = load_file(str(tmp_path / "out" / "mmjax_extra.safetensors"))
    want = nnx.to_pure_dict(tr)["projectors"]["vision"]
    for k, v in jax.tree_util.tree_flatten_with_path(want)[0]:
        name = "projectors.vision." + ".".join(str(p.key) for p in k)
        np.testing.assert_array_equal(extra[name], np.asarray(v))
    # the exported tower loads as the whole CLIP tower, and as the run's (feature_layer -2)
    tower, vcfg = hf.load(tmp_path / "out" / "vision")
    assert vcfg.num_layers == 3 and vcfg.feature_layer is None
    _, model, step, _ = restore_model(run)  # what generate.py decodes with
    assert step == 2
    llm = nnx.to_pure_dict(nnx.state(model.llm, nnx.Param))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), llm,
                 hf.load_pure(dirs["llm"], cfg.llm))


def test_changed_or_missing_pretrained_files_refused(dirs, tmp_path):
    moved = {u: str(tmp_path / u) for u in dirs}
    for u in dirs:
        shutil.copytree(dirs[u], moved[u])
    run = str(tmp_path / "run")
    fake_run(run, moved, frozen_cfg())
    shard = os.path.join(moved["llm"], "model-00002-of-00002.safetensors")
    t = load_file(shard)
    name = sorted(t)[0]
    t[name] = t[name] + 1  # same size, other weights
    from safetensors.numpy import save_file
    save_file(t, shard)
    with pytest.raises(UserError, match=r"^pretrained\.llm: .*model-00002-of-00002\."
                                         r"safetensors changed since the run trained with it "
                                         r"\(sha256 differs\): restore the files"):
        export_workdir(run, tmp_path / "out")
    shutil.rmtree(moved["vision"])
    with pytest.raises(UserError, match=r"^pretrained\.llm: |^pretrained\.vision: .* is gone"):
        export_workdir(run, tmp_path / "out")


@pytest.fixture
def gin_pretrained():
    def bind(**units):
        gin.clear_config()
        for unit, path in units.items():
            gin.parse_config(f"pretrained.{unit} = {str(path)!r}")
    yield bind
    gin.clear_config()


@pytest.mark.slow
@pytest.mark.parametrize("planned", [False, True])
def test_trained_frozen_run_exports_its_pretrained_weights(dirs, tmp_path, gin_pretrained,
                                                           planned):
    """The issue's case: a frozen CLIP tower and Qwen2 LLM, the projector trained a few
    steps, single program or a plan (pp=2 LLM, dp=2 tower), exported on a one-device host."""
    from mmjax.train.trainer import train
    gin_pretrained(**dirs)
    cfg = frozen_cfg()
    plan = None
    if planned:
        plan = str(tmp_path / "plan.json")
        Plan.uniform(hf.prepare_pretrained(cfg, dirs), 4, 2, dp={"vision": 2},
                     pp={"llm": 2}).save(plan)
    run = str(tmp_path / "run")
    train(run, model=cfg, steps=2, global_batch=4, progress=False, checkpoint_every=2,
          plan=plan)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1",
               JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "scripts/export_hf.py", f"--workdir={run}",
                          f"--out={tmp_path}/out"], cwd=ROOT, env=env, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr
    assert_bit_identical(tmp_path / "out" / "llm", dirs["llm"])
    assert_bit_identical(tmp_path / "out" / "vision", dirs["vision"])
    _, model, _, _ = restore_model(run)
    proj = nnx.to_pure_dict(nnx.state(model.projectors, nnx.Param))
    init = nnx.to_pure_dict(nnx.state(MultimodalModel(
        hf.prepare_pretrained(cfg, dirs), jax.random.key(0)).projectors, nnx.Param))
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(proj),
                                                        jax.tree.leaves(init)))  # trained
    # the CLI: one line, exit 2, when a pretrained directory is gone
    moved = tmp_path / "moved"
    shutil.move(dirs["vision"], moved)
    try:
        out = subprocess.run([sys.executable, "scripts/export_hf.py", f"--workdir={run}",
                              f"--out={tmp_path}/out2"], cwd=ROOT, env=env,
                             capture_output=True, text=True)
    finally:
        shutil.move(moved, dirs["vision"])
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert out.stderr.startswith("error: pretrained.vision: ") and "is gone" in out.stderr
    # a resume must read the same pretrained weights
    info = json.load(open(os.path.join(run, "run.json")))
    assert set(info["pretrained_sources"]) == {"llm", "vision"}
    t = load_file(os.path.join(dirs["vision"], "model.safetensors"))
    bad = tmp_path / "clip2"
    shutil.copytree(dirs["vision"], bad)
    name = sorted(t)[0]
    from safetensors.numpy import save_file
    save_file(dict(t, **{name: t[name] * 2}), str(bad / "model.safetensors"))
    gin_pretrained(llm=dirs["llm"], vision=bad)
    with pytest.raises(UserError, match=r"^pretrained\.vision: the checkpoints in .* were "
                                        r"trained from other pretrained weights"):
        train(run, model=cfg, steps=3, global_batch=4, progress=False, plan=plan)
