"""A step that cannot fit stops before compiling: the single program's peak memory is
estimated from planner/memory.py's terms at the run's largest batch shapes and compared
with the device's (train/memory_check.py); XLA's RESOURCE_EXHAUSTED becomes one line."""
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from mmjax.cli import run_main
from mmjax.data.batch_shapes import BatchShapes
from mmjax.errors import UserError
from mmjax.models.tiny import TINY_CONFIGS
from mmjax.planner import memory
from mmjax.train.memory_check import (check_single_program, out_of_memory_line,
                                      single_program_bytes)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_estimate_counts_state_and_grows_with_the_batch():
    cfg = TINY_CONFIGS["tiny"]()
    small = BatchShapes(8, (("vision", 2, 256),), 1)
    est = single_program_bytes(cfg, small, 256, 1000, 10, jnp.float32)
    # fp32 master + AdamW m, v + gradients per trainable parameter, fp32 frozen
    assert est["state"] == 16 * 1000 + 4 * 10
    big = single_program_bytes(cfg, BatchShapes(16, (("vision", 4, 256),), 2), 256, 1000, 10,
                               jnp.float32)
    assert big["activations"] == pytest.approx(2 * est["activations"], rel=1e-9)
    llm = memory.llm_acts(cfg.llm, 256, 256 * 256, 1, 4, "dense")
    assert est["activations"] > 8 * llm.none
    assert est["peak"] >= est["state"] + est["activations"]


def test_a_batch_that_cannot_fit_is_refused_with_the_estimate_and_the_fix():
    cfg = TINY_CONFIGS["tiny"]()
    huge = BatchShapes(4096, (("vision", 1024, 256),), 0)
    with pytest.raises(UserError) as e:
        check_single_program(cfg, huge, 8192, 292_720, 0, jnp.float32, "auto", 4096,
                             jax.devices()[0])
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("the training step needs about ")
    assert "4096 rows x 8192 tokens" in msg and "lower train.global_batch (now 4096)" in msg
    assert "manual_plan.remat" in msg and "train.check_memory=False" in msg
    est = check_single_program(cfg, huge, 8192, 292_720, 0, jnp.float32, "auto", 4096,
                               jax.devices()[0], refuse=False)
    assert est["peak"] > est["device"]


@pytest.mark.slow
def test_the_cli_stops_before_compiling(tmp_path):
    """scripts/train.py with a batch far beyond the machine: one line, exit 2, in seconds,
    and no compile (no 'compiling' line; the run's compilation cache, its own here, holds
    no training step nor parameter init: at most the key's and the like's tiny programs)."""
    work = tmp_path / "run"
    cache = tmp_path / "compilation_cache"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": str(cache)}
    env.pop("XLA_FLAGS", None)
    p = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "train.py"),
                        f"--workdir={work}", "--gin_param=train.global_batch=4096",
                        "--gin_param=data_layout.seq_len=8192", "--gin_param=train.steps=1"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr[-2000:]
    lines = p.stderr.strip().splitlines()
    assert lines[-1].startswith("error: the training step needs about "), p.stderr[-2000:]
    assert "compiling" not in p.stderr
    made = sorted(os.listdir(cache)) if cache.exists() else []
    assert not [n for n in made if n.startswith(("jit_train_step", "jit_init", "jit__init"))
                or os.path.getsize(cache / n) > 100_000], made


@pytest.mark.slow
def test_check_runs_the_memory_check(tmp_path):
    """`--check` refuses what the run would refuse (issue 41 item 6): seq_len 1,000,000
    gives the run's own memory error, exit 2, not "good"; the check writes nothing."""
    work = tmp_path / "run"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    p = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "train.py"),
                        f"--workdir={work}", "--gin_param=data_layout.seq_len=1000000",
                        "--check"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr[-2000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the training step needs about "), p.stderr[-2000:]
    assert "x 1000000 tokens" in last and "train.check_memory=False" in last
    assert "good" not in p.stdout
    assert not work.exists()


def test_resource_exhausted_is_one_line_with_a_hint(capsys):
    def oom(argv):
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate "
                           "116364593816 bytes.\nBufferAssignment OOM Debugging ...")

    assert run_main(oom, []) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "(116.4 GB requested)" in err
    assert "lower train.global_batch" in err and "--plan=auto" in err
    assert out_of_memory_line(ValueError("other")) is None
    with pytest.raises(RuntimeError):
        run_main(oom, ["--debug"])


def test_a_plan_is_checked_per_unit_with_the_planners_memory_model():
    """The tiny manual plan fits (a few MB per stage, as tests/test_memory_model.py
    measures); 65536 samples in one microbatch of 8192 tokens do not: refused naming
    the LLM, before anything is built."""  # CPU: host memory over the 8 forced devices
    from mmjax.planner.plan import Plan
    from mmjax.train.data_config import train_source
    from mmjax.train.memory_check import check_plan

    cfg = TINY_CONFIGS["tiny"]()
    plan = Plan.uniform(cfg, 8, 2, dp={"vision": 2}, pp={"llm": 2})
    line = check_plan(cfg, plan, train_source(cfg), jax.devices()[0])
    assert line.startswith("memory per device (estimate): vision ") and " llm " in line
    big = Plan.uniform(cfg, 65536, 1)
    with pytest.raises(UserError) as e:
        check_plan(cfg, big, train_source(cfg), jax.devices()[0])
    msg = str(e.value)
    assert "\n" not in msg and "more pp or tp" in msg
    assert re.search(r"devices: (\w+ [\d.]+ GB, )*llm [\d.]+ GB", msg), msg
    assert "(now 65536)" in msg


def test_only_the_device_allocators_message_is_out_of_memory():
    """Issue 43: tensorstore's RESOURCE_EXHAUSTED for a full disk ("Failed to write 698306
    bytes ... No space left on device") is not the device's memory (it read as "0.0 GB
    requested" before); the allocators' messages are, with the size they name."""
    disk = ValueError(
        'RESOURCE_EXHAUSTED: Error writing "leaf_00321/0.0" in OCDBT database at local file '
        '"/w/checkpoints/4.orbax-checkpoint-tmp/state": Failed writing: "/w/d/fa": Failed to '
        "write 698306 bytes to file 18: No space left on device [os_error_code='28']")
    assert out_of_memory_line(disk) is None
    assert out_of_memory_line(RuntimeError("RESOURCE_EXHAUSTED: quota 117572 bytes")) is None
    tpu = RuntimeError("RESOURCE_EXHAUSTED: Error allocating device buffer: Attempting to "
                       "allocate 2.00G. That was not possible. There are 1.50G free.")
    assert "(2.1 GB requested)" in out_of_memory_line(tpu)
    gpu = RuntimeError("RESOURCE_EXHAUSTED: Failed to allocate request for 1.00GiB "
                       "(1073741824B) on device ordinal 0")
    assert "(1.1 GB requested)" in out_of_memory_line(gpu)
