"""Both runners implement train/runner.py's `Runner` protocol with its signatures, both
placements of the whole-model runner train/placement.py's `Placement`, and the pipeline
runtime takes its parameters from the caller (no training state kept)."""
import inspect

from mmjax.pipeline.runtime import PipelineRuntime
from mmjax.pipeline.stage_setup import Stage
from mmjax.train.pipelined import PipelinedRunner
from mmjax.train.colocated import ColocatedMesh
from mmjax.train.placement import Placement
from mmjax.train.runner import Runner, StepMetrics
from mmjax.train.single_program import OneDevice
from mmjax.train.whole_model import WholeModelRunner


def _methods(cls) -> dict:
    return {n: inspect.signature(v) for n, v in vars(cls).items()
            if callable(v) and not n.startswith("_")}


def test_both_runners_have_the_protocol_methods_and_parameters():
    want = _methods(Runner)
    assert set(want) == {"step", "evaluate", "checkpoint", "restore_target", "load", "close"}
    for cls in (WholeModelRunner, PipelinedRunner):
        for name, sig in want.items():
            got = inspect.signature(getattr(cls, name))
            assert list(got.parameters) == list(sig.parameters), (cls.__name__, name)


def test_both_placements_have_the_placement_methods_and_parameters():
    want = _methods(Placement)
    assert {"batches", "init", "step_fn", "inputs", "put", "fetch"} <= set(want)
    for cls in (OneDevice, ColocatedMesh):
        for name, sig in want.items():
            got = inspect.signature(getattr(cls, name))
            assert list(got.parameters) == list(sig.parameters), (cls.__name__, name)
    # the runner asks the placement; it overrides nothing of a base class
    assert WholeModelRunner.__bases__ == (object,)


def test_step_metrics_applied():
    m = StepMetrics(1.0, 1.0, 0.0, 2.0)
    assert m.applied and not StepMetrics(1.0, 1.0, 0.0, 2.0, spike=True).applied
    assert not StepMetrics(float("nan"), 0.0, 0.0, 0.0, nonfinite=True).applied


def test_runtime_stage_holds_no_parameter_values():
    fields = set(Stage.__dataclass_fields__)
    assert not fields & {"trainable", "compute", "compute_of"}
    assert Stage.__dataclass_params__.frozen  # built in one go, never filled in later
    for name in ("run", "evaluate"):
        assert "params" in inspect.signature(getattr(PipelineRuntime, name)).parameters
        # one call dispatches the whole step: nothing a caller could stop half-way
        assert not inspect.isgeneratorfunction(getattr(PipelineRuntime, name))
