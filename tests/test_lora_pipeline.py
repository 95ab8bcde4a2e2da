"""LoRA in a disaggregated plan (the pipeline runtime, Cornstarch §4.2's frozen-aware
backward: a LoRA'd LLM stage takes activation and adapter gradients, no base-weight ones):
the loss and every trained gradient (LLM adapters over pp = 2 with a LoRA'd projector, or
at tp = 2 with a LoRA'd tower; the rest trained whole) equal the single program's by the
suite's tolerance rule."""
import pytest

from helpers import check, make_cfg
from mmjax.models.lora_config import LoRAConfig
from mmjax.planner.plan import Plan


@pytest.mark.slow  # a pipeline plan's stages compile: ~50-80 s on 2 busy cores
@pytest.mark.parametrize("other, plan", [
    ("encoders.vision.projector.lora", {"pp": {"llm": 2}}),  # LLM over pp = 2
    ("encoders.vision.encoder.lora", {"tp": {"llm": 2, "vision": 2}})])  # Megatron TP
def test_pipelined_lora_equals_single_program(reference_cache, other, plan):
    cfg = make_cfg(**{"llm.lora": LoRAConfig(rank=4, targets=("all",)),
                      other: LoRAConfig(rank=2, targets=("fc1", "fc2") if "projector" in other
                                        else ("attention",))})
    rt = check(cfg, Plan.uniform(cfg, 4, 2, **plan), n=4, cache=reference_cache)
    assert rt is not None


@pytest.mark.slow
def test_a_lora_run_on_a_plan_checkpoints_the_single_program_s_names(tmp_path):
    """train.plan with lora.units: the pipelined run trains and checkpoints the adapters
    under the names the single program uses, so export / generate restore it alike."""
    import numpy as np
    from flax import nnx
    from test_lora_train import CFG, run
    from mmjax.train.export import restore_model
    from mmjax.train.lora_setup import with_lora
    from mmjax.models.lora_config import LoRAConfig as L

    plan = str(tmp_path / "plan.json")
    lora = with_lora(CFG, ("llm",), L(rank=4, targets=("q", "v", "mlp")))
    Plan.uniform(lora, 4, 2, pp={"llm": 2}).save(plan)
    single = run(tmp_path / "single", 2, extra=["lora.dropout = 0.0"])
    piped = run(tmp_path / "piped", 2, extra=[f"train.plan = '{plan}'", "lora.dropout = 0.0"])
    assert len(piped) == len(single) == 2 and all(np.isfinite(r["loss"]) for r in piped)
    np.testing.assert_allclose([r["loss"] for r in piped], [r["loss"] for r in single],
                               rtol=1e-5)  # the runner-level rule of the layout tests
    flat = lambda m: {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(
        nnx.state(m, nnx.Param))}
    a = flat(restore_model(str(tmp_path / "single"))[1])
    b = flat(restore_model(str(tmp_path / "piped"))[1])
    assert set(a) == set(b)
    base = [p for p in a if p[0] == "llm" and "lora" not in p]
    assert base and all(np.array_equal(a[p], b[p]) for p in base)  # frozen: the same init


@pytest.mark.slow
def test_lora_dropout_on_a_plan_resumes_to_the_same_losses(tmp_path):
    """lora.dropout = 0.1 on a plan (the LLM over pp = 2): the stages draw masks keyed by the
    applied-step count (pipeline/lora_dropout.py), so a run stopped after 2 steps resumes
    to the uninterrupted run's losses exactly, and the masks change the loss (B trains from
    step 2 on: the third step's loss differs from the same plan's without dropout)."""
    from test_lora_train import CFG, run
    from mmjax.train.lora_setup import with_lora
    from mmjax.models.lora_config import LoRAConfig as L

    plan = str(tmp_path / "plan.json")
    lora = with_lora(CFG, ("llm",), L(rank=4, targets=("q", "v", "mlp")))
    Plan.uniform(lora, 4, 2, pp={"llm": 2}).save(plan)
    on = [f"train.plan = '{plan}'", "learning_rate_schedule.peak_lr = 1e-2"]
    whole = [r["loss"] for r in run(tmp_path / "a", 3, extra=on)]
    first = [r["loss"] for r in run(tmp_path / "b", 3, stop_after=2, extra=on)]
    rest = [r["loss"] for r in run(tmp_path / "b", 3, extra=on)]
    plain = [r["loss"] for r in run(tmp_path / "c", 3, extra=on + ["lora.dropout = 0.0"])]
    assert len(whole) == 3 and first + rest == whole
    assert abs(whole[2] - plain[2]) > 1e-6 * abs(plain[2])
