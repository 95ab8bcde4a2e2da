"""The host-side planning modules import no JAX. docs/design.md: they "import no JAX, so they
run in milliseconds and are testable alone". That covers the schedule and simulator, the
planner's cost model / evaluation / partitioning, the data reordering and balancing, and CP
token distribution (Cornstarch §4.3.2).

mmjax.planner.orchestrate is in: its default method (numpy bounds, closed-form relaxations)
needs no cvxpy; cvxpy, which itself imports jax when it is installed, is imported only when
method="cvxpy" (the formulation of record) runs.
"""
import json
import subprocess
import sys

PURE = (
    "mmjax.models.units",
    "mmjax.models.config",
    "mmjax.data.token_distribution",
    "mmjax.schedule.stage_graph",
    "mmjax.schedule.dependencies",
    "mmjax.schedule.schedule",
    "mmjax.schedule.simulate",
    "mmjax.data.reorder",
    "mmjax.data.balance",
    "mmjax.data.routes",
    "mmjax.data.layout",
    "mmjax.data.batch_shapes",
    "mmjax.data.assemble",
    "mmjax.data.feed",
    "mmjax.data.records",
    "mmjax.data.batch_plan",
    "mmjax.data.global_batch",
    "mmjax.data.loader",
    "mmjax.data.loader_settings",
    "mmjax.data.sample_stream",
    "mmjax.data.skipped",
    "mmjax.values",
    "mmjax.data.tokenizer",
    "mmjax.data.chat",
    "mmjax.data.preprocess",
    "mmjax.data.image_ops",
    "mmjax.data.qwen2_vl_processor",
    "mmjax.data.index",
    "mmjax.data.stream",
    "mmjax.data.sources.llava",
    "mmjax.data.sources.webdataset",
    "mmjax.planner.costs",
    "mmjax.planner.evaluate",
    "mmjax.planner.partition",
    "mmjax.planner.candidates",
    "mmjax.planner.relax",
    "mmjax.planner.repair",
    "mmjax.planner.orchestrate",
    "mmjax.planner.infeasible",
    "mmjax.planner.relaxed_problem",
    "mmjax.data.data_spec",
    "mmjax.planner.measured",
    "mmjax.data.node_milp",
    "mmjax.data.colocated_layout",
    "mmjax.data.colocated_batch",
    "mmjax.planner.colocated",
    "mmjax.planner.cornstarch_colocated",
    "mmjax.planner.layout_choice",
)

# Imports each module in order in a fresh interpreter and records, after each, whether any
# jax module has been loaded, so a failure names the module that pulled it in.
_PROBE = """
import importlib, json, sys
seen = {}
for name in sys.argv[1:]:
    importlib.import_module(name)
    seen[name] = sorted(m for m in sys.modules if m == "jax" or m.startswith("jax."))[:5]
print(json.dumps(seen))
"""


def _jax_modules_after_import(modules):
    out = subprocess.run([sys.executable, "-c", _PROBE, *modules], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_planning_modules_import_no_jax():
    seen = _jax_modules_after_import(PURE)
    assert list(seen) == list(PURE)
    offenders = {name: mods for name, mods in seen.items() if mods}
    assert not offenders, f"these imports loaded jax: {offenders}"


def test_probe_detects_a_jax_import():
    """The probe can fail: a module that does use JAX shows up."""
    seen = _jax_modules_after_import(["mmjax.data.token_distribution",
                                      "mmjax.parallel.context"])
    assert seen["mmjax.data.token_distribution"] == []
    assert "jax" in seen["mmjax.parallel.context"]
