"""LoRA in a disaggregated plan (the pipeline runtime, Cornstarch §4.2's frozen-aware
backward: a LoRA'd LLM stage takes activation and adapter gradients, no base-weight ones):
the loss and every trained gradient (LLM adapters over pp = 2 with a LoRA'd projector, or
at tp = 2 with a LoRA'd tower; the rest trained whole) equal the single program's by the
suite's tolerance rule."""
import pytest

from helpers import check, make_cfg
from mmjax.errors import UserError
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
    with pytest.raises(UserError, match="lora.dropout"):  # the stages apply none yet
        run(tmp_path / "refused", 2, extra=[f"train.plan = '{plan}'"])
    piped = run(tmp_path / "piped", 2, extra=[f"train.plan = '{plan}'", "lora.dropout = 0.0"])
    assert len(piped) == len(single) == 2 and all(np.isfinite(r["loss"]) for r in piped)
    flat = lambda m: {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(
        nnx.state(m, nnx.Param))}
    a = flat(restore_model(str(tmp_path / "single"))[1])
    b = flat(restore_model(str(tmp_path / "piped"))[1])
    assert set(a) == set(b)
    base = [p for p in a if p[0] == "llm" and "lora" not in p]
    assert base and all(np.array_equal(a[p], b[p]) for p in base)  # frozen: the same init
