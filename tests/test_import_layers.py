"""Layers point one way, and no module imports itself back.

A module's layer is that of its package (the first name under mmjax/): it may import only
from its own layer or the ones below. Read statically from every file's imports, function
-level ones included, so a lazy import can hide neither an upward edge nor a circle.
"""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Lowest first. The schedules sit below the planner and the data reorderer, which price and
# fill them; the runtime (pipeline/) walks them. settings/ checks a run's settings for
# the trainer; the command line and the launcher sit on top.
LAYERS = (
    ("",),                    # mmjax/__init__.py: the version, no imports
    ("errors", "host_info", "cpu_threads", "values"),  # leaves: the user-error type, the
    #                   machine's description, XLA:CPU's pool size, plain-value predicates
    ("models",),              # pure Flax NNX modules, configs, unit roles
    ("schedule",),            # pipeline schedules as data (no JAX)
    ("planner",),             # cost model, orchestration, Plan
    ("data",),                # samples, balancing, reordering, feeds
    ("parallel",),            # meshes, shardings, collectives, broker
    ("pipeline",),            # stages and the runtime
    ("train", "settings"),    # steps, optimizer, checkpoints, the trainer
    ("launch", "cli"),        # process start-up, the scripts' shared command line
)


def layer(module: str) -> int:
    """The index in LAYERS of the group naming the module's first name under mmjax."""
    top = module.split(".")[1] if "." in module else ""
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise KeyError(f"{module}: mmjax.{top} is in no layer; add it to LAYERS")


def layer_name(module: str) -> str:
    return "/".join(LAYERS[layer(module)])


def module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _resolve(name: str) -> str | None:
    """The longest prefix of a dotted name that is a module of the package."""
    parts = name.split(".")
    while parts and not (ROOT.joinpath(*parts).with_suffix(".py").exists()
                         or ROOT.joinpath(*parts, "__init__.py").exists()):
        parts.pop()
    return ".".join(parts) if parts and parts[0] == "mmjax" and len(parts) > 1 else None


def _names(node) -> list[str]:
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        return [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    return []


def mmjax_imports(source: str) -> set[str]:
    """The mmjax modules `source` imports, at module level or inside functions."""
    return {m for node in ast.walk(ast.parse(source)) for name in _names(node)
            if (m := _resolve(name))}


FILES = sorted((ROOT / "mmjax").rglob("*.py"))
MODULES = {module_name(p): p.read_text() for p in FILES}


def violations(me: str, deps) -> list[str]:
    return [f"{me} ({layer_name(me)}) imports {dep} ({layer_name(dep)})"
            for dep in sorted(deps) if layer(dep) > layer(me)]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each import circle once (Tarjan's strongly connected components of size > 1, and
    modules importing themselves)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_every_module_has_a_layer():
    assert {m: layer_name(m) for m in MODULES}  # raises KeyError naming the module


def test_no_module_imports_a_higher_layer():
    bad = [v for me, src in MODULES.items() for v in violations(me, mmjax_imports(src))]
    assert bad == []


def test_no_import_circles():
    graph = {me: mmjax_imports(src) - {me} for me, src in MODULES.items()}
    assert cycles(graph) == []


def test_the_check_sees_an_upward_import():
    """The check can fail: a models file that lazily imports the runtime is reported."""
    src = "def f():\n    from mmjax.pipeline.runtime import PipelineRuntime\n"
    assert violations("mmjax.models.llm", mmjax_imports(src)) == [
        "mmjax.models.llm (models) imports mmjax.pipeline.runtime (pipeline)"]


def test_the_check_sees_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert cycles(graph) == [["a", "b", "c"], ["e"]]


@pytest.mark.parametrize("module,expected", [("mmjax.data.loader", "data"),
                                             ("mmjax.models.llm", "models"),
                                             ("mmjax.schedule.schedule", "schedule"),
                                             ("mmjax.planner.plan", "planner"),
                                             ("mmjax.errors", "errors/host_info/cpu_threads/values"),
                                             ("mmjax.cli", "launch/cli"),
                                             ("mmjax.train.trainer", "train/settings")])
def test_layer_assignment(module, expected):
    assert layer_name(module) == expected


def test_mmjax_is_a_regular_package_with_a_version():
    """A namespace package would let an editable install load modules from another checkout."""
    import importlib.metadata
    import mmjax
    assert mmjax.__file__ == str(ROOT / "mmjax" / "__init__.py")
    assert mmjax.__version__ == importlib.metadata.version("mmjax")
    assert mmjax_imports((ROOT / "mmjax" / "__init__.py").read_text()) == set()
