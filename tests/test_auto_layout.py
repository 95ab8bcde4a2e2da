"""`--plan=auto` with `auto_plan.layout = "auto"` prices the co-located layout's best choice
beside the disaggregated planner's plan on the run's own workload and takes the faster
(planner/layout_choice.py), saying which and why (both predicted iteration times) in one
line; `"colocated"` takes the co-located layout; the default keeps the disaggregated
planner. OrchMLLM's MLLM-10B on 64 devices at 256 samples (H100 model): disaggregated (the
co-located layout exposes the encoders' and the LLM's gradient collectives); the tiny config
on 8 devices at 16 samples: co-located (the pipeline's warm-up and slowest stage cost more
than every GPU computing every phase)."""
import re

import gin
import pytest

import mmjax.data.loader  # noqa: F401  (registers Loader with gin)
import mmjax.train.auto_plan  # noqa: F401  (registers auto_plan with gin)
from mmjax.errors import UserError
from mmjax.models.config import with_overrides
from mmjax.models.tiny import tiny
from mmjax.planner.plan import Plan
from mmjax.train.colocated_plan import Colocation

TIMES = re.compile(r"(co-located|disaggregated) (\d+\.\d+ m?s)")


def small_tiny():
    return with_overrides(tiny(), {"llm.num_layers": 2, "encoders.vision.encoder.num_layers": 1,
                                   "generator.num_layers": 1})


@pytest.fixture(scope="module")
def source():
    from mmjax.train.data_config import train_source
    return train_source(small_tiny())


def test_auto_layout_picks_each_layout_and_says_why(source):
    from mmjax.train.auto_plan import auto_plan

    from mmjax.models.named import named_config
    from mmjax.train.data_config import train_source

    big = named_config("orchmllm/mllm_10b")
    dis, line_big = auto_plan(big, 256, train_source(big), layout="auto", num_devices=64)
    chosen, line16 = auto_plan(small_tiny(), 16, source, layout="auto", num_devices=8)
    assert isinstance(dis.chosen, Plan) and dis.colocation is None
    colo = chosen.colocation
    assert isinstance(colo, Colocation) and chosen.chosen is None
    for line, first in ((line_big, "disaggregated"), (line16, "co-located")):
        assert "\n" not in line and line.startswith(f"auto layout: {first}")
        times = dict(TIMES.findall(line))  # both layouts' predicted iteration times
        assert set(times) == {"co-located", "disaggregated"}, line
    a, b = (float(TIMES.findall(line16)[k][1].split()[0]) for k in (0, 1))
    assert a < b  # "co-located X < disaggregated Y"
    assert f"llm tp {colo.tp}" in line16 and "ZeRO" in line16


def test_auto_layout_default_and_forced(source):
    from mmjax.train.auto_plan import auto_plan

    cfg = small_tiny()
    dis, line = auto_plan(cfg, 16, source, num_devices=8)  # the default: disaggregated
    assert isinstance(dis.chosen, Plan) and dis.colocation is None
    assert line == "auto plan: " + "; ".join(f"{u.name} dp={u.dp} tp={u.tp} pp={u.pp}"
                                             for u in dis.chosen.units)
    colo, line = auto_plan(cfg, 8, source, layout="colocated", num_devices=8)
    assert isinstance(colo.colocation, Colocation) and "auto_plan.layout='colocated'" in line
    with pytest.raises(UserError, match=r"^auto_plan.layout='both': must be one of "
                                        r"\['auto', 'colocated', 'disaggregated'\]"):
        auto_plan(cfg, 8, source, layout="both", num_devices=8)


@pytest.mark.slow
def test_train_plan_auto_chooses_colocated(tmp_path, capfd):
    """train.py's --plan=auto: the co-located layout chosen, the line printed, the run
    trains on the co-located runner."""
    from mmjax.train.trainer import train

    gin.clear_config()
    with gin.unlock_config():
        gin.parse_config(["Loader.reserve = 4", "data_layout.seq_len = 128",
                          'auto_plan.layout = "auto"'])
    try:
        records = train(str(tmp_path / "run"), model=small_tiny(), steps=2, global_batch=16,
                        progress=False, plan="auto", checkpoint_every=100)
    finally:
        gin.clear_config()
    out = " ".join(capfd.readouterr().err.split())  # the console: stderr
    assert "auto layout: co-located (llm tp 1" in out, out
    assert "co-located (llm tp 1)" in out.split("auto layout:")[1]  # the run's own line
    assert len(TIMES.findall(out)) >= 2
    assert [r["step"] for r in records] == [1, 2]
