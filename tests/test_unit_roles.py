"""Unit roles are types: what a unit does is asked of `mmjax.models.units` (`role(name)`,
`is_llm`, `UnitDag`), never decided by comparing its name. Read statically from every file
of mmjax/ and scripts/ (an AST scan), so a new `unit == "llm"` anywhere fails here."""
import ast
import pathlib

import pytest

from mmjax.models.units import (GENERATOR_UNIT, LLM_UNIT, UnitDag, UnitRole, has_generator,
                                role, topological_order)

ROOT = pathlib.Path(__file__).resolve().parent.parent
ROLE_MODULE = ROOT / "mmjax" / "models" / "units.py"
NAMES = {r.value for r in UnitRole}                 # "encoder", "llm", "generator"
CONSTANTS = {"LLM_UNIT", "GENERATOR_UNIT", "VAE_UNIT"}  # the fixed names, as units.py spells them
COMPARE = (ast.Eq, ast.NotEq, ast.In, ast.NotIn, ast.Is, ast.IsNot)


def _names_a_role(node) -> bool:
    """A role's name as a literal, in a literal tuple / list / set, or as units.py's
    constant (`LLM_UNIT`, `units.GENERATOR_UNIT`)."""
    if isinstance(node, ast.Constant):
        return node.value in NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_a_role(e) for e in node.elts)
    if isinstance(node, ast.Name):
        return node.id in CONSTANTS
    if isinstance(node, ast.Attribute):
        return node.attr in CONSTANTS
    return False


def role_comparisons(source: str) -> list[int]:
    """Lines comparing against a unit role's name: ==, !=, in, is (and their negations), a
    `case "llm":` pattern, or a dispatch table `{"llm": ...}.get(unit)` / `[unit]`."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            if any(isinstance(op, COMPARE) for op in node.ops) and any(
                    _names_a_role(x) for x in [node.left, *node.comparators]):
                lines.append(node.lineno)
        elif isinstance(node, ast.MatchValue) and _names_a_role(node.value):
            lines.append(node.lineno)
        elif isinstance(node, (ast.Call, ast.Subscript)):
            table = node.func.value if (isinstance(node, ast.Call)
                                        and isinstance(node.func, ast.Attribute)
                                        and node.func.attr == "get") else (
                node.value if isinstance(node, ast.Subscript) else None)
            if isinstance(table, ast.Dict) and any(k is not None and _names_a_role(k)
                                                   for k in table.keys):
                lines.append(node.lineno)
    return sorted(set(lines))


def test_no_role_name_comparison_outside_the_role_module():
    files = sorted((ROOT / "mmjax").rglob("*.py")) + sorted((ROOT / "scripts").rglob("*.py"))
    bad = [f"{path.relative_to(ROOT)}:{line}" for path in files if path != ROLE_MODULE
           for line in role_comparisons(path.read_text())]
    assert bad == []


@pytest.mark.parametrize("source", [
    'if unit == "llm": pass', 'if "generator" != u: pass', 'x = u in ("llm", "generator")',
    'x = u not in {"encoder"}', 'x = name is LLM_UNIT', 'x = u == units.GENERATOR_UNIT',
    'match u:\n    case "llm":\n        pass', 'f = {"llm": 1, "generator": 2}.get(u, 0)',
    'f = {"llm": 1}[u]'])
def test_the_scan_sees_a_role_comparison(source):
    assert role_comparisons(source) != []


@pytest.mark.parametrize("source", [
    'x = side["llm"]', 'd = {"llm": feed}', 'x = role(u) is UnitRole.LLM',
    'x = u == "vision"', 'x = "llm.num_layers" in keys'])
def test_the_scan_passes_lookups_and_other_names(source):
    assert role_comparisons(source) == []


def test_roles_and_the_dag():
    assert [role(n) for n in ("vision", LLM_UNIT, GENERATOR_UNIT)] == [
        UnitRole.ENCODER, UnitRole.LLM, UnitRole.GENERATOR]
    dag = UnitDag.of(["generator", "audio", "llm", "vision"])
    assert dag.names == ("audio", "vision", "llm", "generator")
    assert dag.edges == (("audio", "llm"), ("vision", "llm"), ("llm", "generator"))
    assert dag.encoders == ("audio", "vision") and dag.has_generator
    assert dag.predecessors("llm") == ["audio", "vision"] and dag.successors("llm") == [
        "generator"]
    assert not has_generator(["vision", "llm"])
    assert topological_order(["b", "a"], [("a", "b")]) == ["a", "b"]


@pytest.mark.parametrize("names,match", [(["vision"], "no 'llm' unit"),
                                         (["llm", "vision", "vision"], "repeat")])
def test_dag_errors(names, match):
    with pytest.raises(ValueError, match=match):
        UnitDag.of(names)


def test_dag_from_config():
    from mmjax.models.tiny import tiny, tiny_valm
    assert tiny().units.edges == (("vision", "llm"), ("llm", "generator"))
    assert tiny_valm().units == UnitDag.of(tiny_valm().unit_names)
    assert tiny_valm().units.edges == (("vision", "llm"), ("audio", "llm"))


@pytest.mark.parametrize("m", [2, 8, 64])
def test_pipeline_in_flight_reads_the_dag(m):
    """The planner's in-flight count walks the UnitDag: an encoder holds its own stages and
    every virtual stage after it, the LLM its own plus the generator's (per chunk), the
    generator its own; the same numbers as the runtime schedule's warm-up depths."""
    from mmjax.planner.evaluate import Choice, in_flight, pipeline_in_flight
    for vpp in (1, 2):
        ch = {"vision": Choice(1, 1, 2), "audio": Choice(1, 1, 1), "llm": Choice(1, 1, 4, vpp),
              "generator": Choice(1, 1, 3)}
        want = {"vision": min(m, 2 + 4 * vpp + 3), "audio": min(m, 1 + 4 * vpp + 3),
                "llm": min(m, in_flight(ch["llm"], m) + 3 / vpp),
                "generator": in_flight(ch["generator"], m)}
        assert pipeline_in_flight(ch, m) == want
        no_gen = {k: v for k, v in ch.items() if k != "generator"}
        assert pipeline_in_flight(no_gen, m) == {
            "vision": min(m, 2 + 4 * vpp), "audio": min(m, 1 + 4 * vpp),
            "llm": in_flight(ch["llm"], m)}
