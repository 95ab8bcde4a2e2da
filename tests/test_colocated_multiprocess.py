"""A 2-process co-located run (gloo, one CPU device per process: two collectives in flight
with more than one device per process deadlock on CPU) equals the 1-process run on the same
two devices: every step's losses and gradient norm to the parity tolerance, ZeRO-3."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = [sys.executable, os.path.join(ROOT, "scripts", "launch_local.py")]
ARGS = ['--gin_param=named_model_config.overrides={"llm.num_layers": 2}',
        "--gin_param=train.global_batch=4", "--gin_param=data_layout.seq_len=384",
        "--gin_param=train.checkpoint_every=2", "--gin_param=train.progress=False",
        "--gin_param=train.steps=3", "--gin_param=Loader.shuffle=False",
        "--gin_param=Loader.reserve=0", "--plan=manual",
        '--gin_param=manual_plan.layout="colocated"', "--gin_param=manual_plan.zero_stage=3"]


def _run(workdir, processes, devices):
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if processes == 1:  # no distributed runtime: XLA's in-process collectives
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
        cmd = [sys.executable, os.path.join(ROOT, "scripts", "train.py"), *ARGS,
               f"--workdir={workdir}"]
    else:
        cmd = LAUNCH + [f"--num_processes={processes}", f"--devices_per_process={devices}",
                        "--timeout=500", "--", *ARGS, f"--workdir={workdir}"]
    p = subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=560, check=False)
    assert p.returncode == 0, p.stdout[-6000:]
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_two_process_colocated_run_equals_one_process(tmp_path, gloo_jobs):
    one = _run(str(tmp_path / "one"), 1, 2)
    two = _run(str(tmp_path / "two"), 2, 1)
    assert [r["step"] for r in two] == [r["step"] for r in one] == [1, 2, 3]
    for a, b in zip(two, one):
        for k in ("loss", "lm_loss", "diffusion_loss", "grad_norm"):
            np.testing.assert_allclose(a[k], b[k], rtol=1e-5, err_msg=f"step {a['step']} {k}")
