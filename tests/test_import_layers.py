"""Layers point one way: a module imports only from its own layer or the ones below.

  host     (no JAX: configs, data, planner, schedules, CP token distribution)
  models   (pure Flax NNX modules)
  parallel (meshes, shardings, collectives)
  pipeline (stages, runtime)
  train    (steps, optimizer, checkpoints, trainer)
  launch

Read statically from every file's imports (function-level imports included), so a lazy
import cannot hide an upward edge.
"""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
LAYERS = ("host", "models", "parallel", "pipeline", "train", "launch")
HOST_MODULES = ("mmjax.models.config", "mmjax.models.named", "mmjax.models.tiny",
                "mmjax.models.qwen2_vl_config",
                "mmjax.schedule.stage_graph", "mmjax.schedule.dependencies",
                "mmjax.schedule.schedule", "mmjax.schedule.simulate",
                "mmjax.parallel.token_distribution")
# The planner's profiler times real layers on devices (DistTrain §3's profiler): it sits
# above the models it measures, outside the JAX-free host layer.
# The scripts' shared command-line handling sits on top, beside the launcher.
OVERRIDES = {"mmjax.planner.profile": "pipeline", "mmjax.cli": "launch"}


def layer(module: str) -> int:
    if module in OVERRIDES:
        return LAYERS.index(OVERRIDES[module])
    if module in HOST_MODULES or module.split(".")[1] in ("data", "planner"):
        return 0
    top = module.split(".")[1]
    return LAYERS.index(top) if top in LAYERS else 0  # mmjax/__init__ etc.


def module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def mmjax_imports(path: pathlib.Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            # the longest prefix that is a module of the package
            parts = name.split(".")
            while parts and not (ROOT.joinpath(*parts).with_suffix(".py").exists()
                                 or ROOT.joinpath(*parts, "__init__.py").exists()):
                parts.pop()
            if parts and parts[0] == "mmjax" and len(parts) > 1:
                found.add(".".join(parts))
    return found


FILES = sorted((ROOT / "mmjax").rglob("*.py"))


def violations(me: str, deps) -> list[str]:
    return [f"{me} ({LAYERS[layer(me)]}) imports {dep} ({LAYERS[layer(dep)]})"
            for dep in sorted(deps) if layer(dep) > layer(me)]


def test_no_module_imports_a_higher_layer():
    bad = [v for path in FILES for v in violations(module_name(path), mmjax_imports(path))]
    assert bad == []


def test_the_check_sees_an_upward_import(tmp_path):
    """The check can fail: a models file that lazily imports the runtime is reported."""
    probe = tmp_path / "llm.py"
    probe.write_text("def f():\n    from mmjax.pipeline.runtime import PipelineRuntime\n")
    assert violations("mmjax.models.llm", mmjax_imports(probe)) == [
        "mmjax.models.llm (models) imports mmjax.pipeline.runtime (pipeline)"]


@pytest.mark.parametrize("module,expected", [("mmjax.data.loader", "host"),
                                             ("mmjax.models.llm", "models"),
                                             ("mmjax.schedule.schedule", "host"),
                                             ("mmjax.train.trainer", "train")])
def test_layer_assignment(module, expected):
    assert LAYERS[layer(module)] == expected
