"""Planning from the user's data (DistTrain §3): source specs, the workload of sampled
shapes, scripts/plan.py --data and train.plan = "auto"'s planner."""
import os
import sys

import numpy as np
import pytest

from mmjax.errors import UserError
from mmjax.planner.plan import PlanError
from mmjax.data.data_spec import open_source, sample_workload
from mmjax.data.sample import TokenRules
from mmjax.data.synthetic import SyntheticDataset
from mmjax.models.named import named_config
from mmjax.planner.build import plan_model
from mmjax.planner.hardware import A800

ROOT = os.path.join(os.path.dirname(__file__), os.pardir)


class ShapeSource:
    """A source of n identical samples: text, one side x side image, one generated image."""

    def __init__(self, n, side, text=64):
        self.n, self.side, self.text = n, side, text

    def __len__(self):
        return self.n

    def spec(self, index):
        return [("text", (self.text,), 0), ("image", (self.side, self.side, 3), 0)]


@pytest.fixture(scope="module")
def model():
    return named_config("disttrain/mllm_9b")


def test_specs_open_their_sources(model):
    src = open_source("synthetic:mix@3", model)
    assert isinstance(src, SyntheticDataset) and src.kind == "mix" and src.seed == 3
    assert open_source("synthetic:laion", model).seed == 0
    for bad, msg in [("foo:bar", "use one of"), ("synthetic:cats", "unknown set"),
                     ("synthetic:laion@x", "must be an integer"), ("synthetic:", "nothing after"),
                     ("/no/such/file", "make_dataset.py")]:
        with pytest.raises(UserError, match=msg):
            open_source(bad, model)


def test_workload_is_the_sampled_shapes(model):
    """Moments equal a numpy reference over the sampled samples' metadata."""
    src = open_source("synthetic:laion@1", model)
    wl = sample_workload(src, model, num_samples=64, seed=5)
    idx = np.sort(np.random.default_rng(5).choice(len(src), 64, replace=False))
    rules = TokenRules.from_config(model)
    metas = [rules.meta_from_shapes(int(i), src.spec(int(i))) for i in idx]
    llm = np.array([m.llm_length for m in metas], dtype=float)
    enc = [[s.num_encoder_tokens for s in m.segments if s.modality == "image"] for m in metas]
    assert wl.num_samples == 64
    assert wl.llm_moments() == pytest.approx((llm.mean(), (llm ** 2).mean()), rel=1e-12)
    name = model.encoders[0].name
    want = (np.mean([sum(e) for e in enc]), np.mean([sum(v * v for v in e) for e in enc]))
    assert wl.encoder_moments(name) == pytest.approx(want, rel=1e-12)
    assert sample_workload(ShapeSource(3, 28), model, 50).num_samples == 3  # all of them


def test_larger_images_in_the_data_move_gpus_to_the_encoder(model):
    """Same model, GPUs and batch: data with 4x the image side plans more vision GPUs."""
    small = plan_model(model, A800, 98, 128, workload=sample_workload(ShapeSource(64, 112),
                                                                       model))
    large = plan_model(model, A800, 98, 128, workload=sample_workload(ShapeSource(64, 448),
                                                                       model))
    assert large.unit("vision").num_devices > small.unit("vision").num_devices


def test_plan_cli_plans_for_the_data(tmp_path, capsys):
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import gin
    import plan as plan_cli
    from mmjax.planner.plan import Plan

    gin.clear_config()
    out = tmp_path / "p.json"
    gin_file = os.path.join(ROOT, "configs", "disttrain", "mllm_9b.gin")
    assert plan_cli.main([f"--gin_file={gin_file}", "--gpus=98", "--global_batch=128",
                          "--data=synthetic:laion", "--data_samples=64", f"--json={out}"]) == 0
    assert "workload: 64 samples of synthetic:laion" in capsys.readouterr().out
    wl = sample_workload(open_source("synthetic:laion", model := named_config(
        "disttrain/mllm_9b")), model, 64)
    want = plan_model(model, A800, 98, 128, workload=wl)
    got = Plan.load(str(out))
    assert [(u.dp, u.tp, u.pp) for u in got.units] == [(u.dp, u.tp, u.pp) for u in want.units]
    gin.clear_config()
    assert plan_cli.main([f"--gin_file={gin_file}", "--gpus=98", "--global_batch=128",
                          "--data=nope:x"]) == 2
    assert "error: data spec 'nope:x'" in capsys.readouterr().err  # errors go to stderr
    gin.clear_config()


def test_auto_plan_for_the_devices_present():
    from mmjax.models.tiny import tiny
    from mmjax.planner.hardware import H100
    from mmjax.train.auto_plan import auto_plan, device_hardware

    cfg = tiny()
    plan = auto_plan(cfg, 8, open_source("synthetic:laion", cfg), num_devices=8)[0].chosen
    assert plan.num_devices <= 8 and plan.global_batch == 8
    assert device_hardware() is H100  # CPU devices: the analytic H100 model
    with pytest.raises(PlanError, match="train.plan='auto' on 1 device:"):
        auto_plan(cfg, 8, open_source("synthetic:laion", cfg), num_devices=1)
