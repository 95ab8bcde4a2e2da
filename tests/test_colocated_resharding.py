"""README's co-located example (ZeRO-3, the LLM and vision at tp 2, 8 generated images over
the LLM's dp 4) compiles its step without XLA's "Involuntary full rematerialization": the
adaLN modulations outside the layer stacks (the generator's `final_modulation`) are gathered
where the step starts (parallel/fsdp.py `gather_split_products`), so XLA never computes
their product feature-sharded and then replicates its split chunks to reach the batch's
layout (issue 41). The command is README's own line, run for one step with no compilation
cache at all (neither the run's nor the test session's), so the step is compiled (XLA
prints the warning while compiling, never on a cache hit) whatever ran before."""
import os
import shlex
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARNING = "Involuntary full rematerialization"


def readme_colocated_command() -> list[str]:
    with open(os.path.join(REPO, "README.md")) as f:
        (line,) = [ln for ln in f if "scripts/train.py" in ln and
                   'manual_plan.layout="colocated"' in ln]
    return shlex.split(line)


def one_step(argv: list[str], workdir: str) -> tuple[dict, list[str]]:
    """README's `VAR=value python scripts/train.py ...` -> (environment, argv) for one
    uncached step in `workdir`."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env.update(JAX_PLATFORMS="cpu", JAX_ENABLE_COMPILATION_CACHE="false")  # no cache at all
    while "=" in argv[0]:
        name, value = argv.pop(0).split("=", 1)
        env[name] = value
    assert argv[:2] == ["python", "scripts/train.py"], argv
    args = [a for a in argv[2:] if not a.startswith(("--workdir=", "--gin_param=train.steps="))]
    assert len(args) == len(argv) - 4, argv  # README's own steps and workdir replaced
    return env, [sys.executable, "scripts/train.py", *args, "--gin_param=train.steps=1",
                 "--gin_param=train.compilation_cache_dir='off'", f"--workdir={workdir}"]


@pytest.mark.slow
def test_readme_colocated_step_compiles_without_involuntary_rematerialization(tmp_path):
    argv = readme_colocated_command()
    assert "--gin_param=manual_plan.zero_stage=3" in argv
    env, cmd = one_step(argv, str(tmp_path / "run"))
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    assert WARNING not in out.stderr, [ln for ln in out.stderr.splitlines() if WARNING in ln]
