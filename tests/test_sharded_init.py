"""Sharded initialisation (parallel/sharded_init.py): a real-width unit is created by one
jitted program straight into its shards, so no device ever holds the whole unit and the
process never builds a whole copy before placing it.

The mid-size config's LLM (MLLM-9B widths, 2 layers, 32000 vocabulary: 0.67B parameters,
2.67 GB in fp32) is initialised with tp = 8 on 8 CPU devices in a fresh process (the
process boundary is what makes its peak RSS a clean measurement). The compiled init's
`memory_analysis` is the per-device account: each device writes only its eighth."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import make_cfg
from jax.sharding import Mesh

from mmjax.models.mllm import MultimodalModel, trainable_filter
from mmjax.parallel.sharded_init import init_split
from mmjax.parallel.tensor import state_shardings
from mmjax.pipeline.stage_modules import stage_module

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the tp-8 init of the mid-size LLM on 8 devices, its peak RSS growth measured
INIT = r"""
import json, resource
import jax, numpy as np
from flax import nnx
from jax.sharding import Mesh
from mmjax.models.named import named_config
from mmjax.parallel.sharded_init import _init_states, init_split
from mmjax.pipeline.stage_modules import stage_module

cfg = named_config("disttrain/mllm_9b_mid")
mesh = Mesh(np.array(jax.devices()).reshape(1, 8), ("dp", "tp"))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
gd, tr, fr = init_split(stage_module, (cfg, "llm", 0, cfg.llm.num_layers), jax.random.key(0),
                        (nnx.Param, ...), mesh)
jax.block_until_ready(tr)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
"""

DRIVER = INIT + r"""
args, filters = (cfg, "llm", 0, cfg.llm.num_layers), (nnx.Param, ...)
mem = _init_states.lower(stage_module, args, filters, mesh, jax.random.key(0)).compile()
mem = mem.memory_analysis()
per_device, leaves = {}, []
for path, x in jax.tree_util.tree_flatten_with_path(tr)[0]:
    shards = [s.data.shape for s in x.addressable_shards]
    for s in x.addressable_shards:
        per_device[str(s.device)] = per_device.get(str(s.device), 0) + s.data.nbytes
    leaves.append([jax.tree_util.keystr(path), list(x.shape), [list(s) for s in shards]])
print(json.dumps({"unit_bytes": sum(x.nbytes for x in jax.tree.leaves(tr)),
                  "per_device": per_device, "leaves": leaves, "rss_growth": peak - before,
                  "temp_per_device": mem.temp_size_in_bytes,
                  "output_per_device": mem.output_size_in_bytes}))
"""


def _same_bits(got, want):
    for (p, a), (_, b) in zip(jax.tree_util.tree_flatten_with_path(got)[0],
                              jax.tree_util.tree_flatten_with_path(want)[0], strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b),
                                      err_msg=jax.tree_util.keystr(p))


def test_jitted_sharded_init_gives_the_eager_bits_in_the_stage_shardings():
    cfg = make_cfg()
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("dp", "tp"))
    for unit, start, end in (("vision", 0, 2), ("llm", 0, 2), ("llm", 2, 4),
                             ("generator", 0, 2)):
        args, key = (cfg, unit, start, end), jax.random.key(0)
        _, tr, fr = init_split(stage_module, args, key, (nnx.Param, ...), mesh)
        _, eager, _ = nnx.split(stage_module(*args, key), nnx.Param, ...)
        _same_bits(tr, eager)
        want = state_shardings(eager, mesh)
        for a, sh in zip(jax.tree.leaves(tr), jax.tree.leaves(want), strict=True):
            assert a.sharding.is_equivalent_to(sh, a.ndim), (unit, a.shape, a.sharding, sh)
        assert any(len({s.data.shape for s in a.addressable_shards}) == 1
                   and a.addressable_shards[0].data.shape != a.shape
                   for a in jax.tree.leaves(tr))  # some leaves really are split


def test_the_single_programs_jitted_init_is_the_eager_model():
    cfg = make_cfg()
    filters = (trainable_filter(cfg), ...)
    _, tr, fr = init_split(MultimodalModel, (cfg,), jax.random.key(0), filters)
    _, etr, efr = nnx.split(MultimodalModel(cfg, jax.random.key(0)), *filters)
    _same_bits((tr, fr), (etr, efr))


@pytest.mark.slow
def test_mid_size_llm_initialises_sharded_without_a_whole_copy():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
           "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-c", DRIVER], env=env, capture_output=True,
                         text=True, timeout=900, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    unit = r["unit_bytes"]
    assert unit > 2.6e9  # the whole LLM unit in fp32
    # no device holds the unit: each holds its 1/8 (plus the small replicated norms)
    assert len(r["per_device"]) == 8
    assert max(r["per_device"].values()) < 0.13 * unit
    for name, shape, shards in r["leaves"]:
        if len(shape) == 2:  # every matrix is split 8 ways on one dimension
            for s in shards:
                assert [b / a for a, b in zip(s, shape) if a != b] == [8.0], (name, s, shape)
    # the compiled init: each device writes its eighth; its scratch (random bits of the
    # embedding's and head's shards, 0.26 GB) stays below one whole matrix (0.52 GB each)
    assert abs(r["output_per_device"] - max(r["per_device"].values())) < 1e6
    largest = max(4 * np.prod(shape) for _, shape, _ in r["leaves"])
    assert r["temp_per_device"] < 0.6 * largest, (r["temp_per_device"], largest)
    # this one process holds all 8 devices, so it grows by every shard plus 8 devices'
    # scratch (measured 1.55-1.81x the unit); an eager build holds a whole copy and every
    # shard, 2x the unit before any scratch
    assert r["rss_growth"] < 2.0 * unit, (r["rss_growth"], unit)


PER_PROCESS = INIT + r"""
held = sum(s.data.nbytes for x in jax.tree.leaves(tr) for s in x.addressable_shards)
print("RESULT " + json.dumps({"unit_bytes": sum(x.nbytes for x in jax.tree.leaves(tr)),
                              "held": held, "rss_growth": peak - before}))
"""


@pytest.mark.slow
def test_mid_size_llm_on_eight_processes_no_host_holds_the_unit(tmp_path, gloo_jobs):
    """The same tp-8 init over 8 processes of one device each (as on 8 hosts): each
    process creates only its own shard, so its memory grows by far less than the unit."""
    script = tmp_path / "init.py"
    script.write_text(PER_PROCESS)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update({"JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT})
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "launch_local.py"),
                          "--num_processes=8", "--devices_per_process=1", "--timeout=800",
                          f"--script={script}"], env=env, capture_output=True, text=True,
                         timeout=900, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [json.loads(line.split("RESULT ", 1)[1]) for line in out.stdout.splitlines()
            if "RESULT " in line]
    assert len(rows) == 8
    unit = rows[0]["unit_bytes"]
    assert unit > 2.6e9
    for r in rows:
        assert r["held"] < 0.13 * unit  # its eighth (plus the small replicated norms)
        # its shard plus one device's scratch (0.26 GB): far below the 2.67 GB unit
        assert r["rss_growth"] < 0.35 * unit, (r["rss_growth"], unit)
    print("per-process RSS growth / unit:", [round(r["rss_growth"] / unit, 3) for r in rows])
