"""Driver for tests/test_multiprocess.py: train a small Plan for a few steps on the global
device list and print the per-step losses (process 0: a line `LOSSES <json>`).

Run in one process (the reference) through `run_steps`, or in N processes through
`python scripts/launch_local.py --num_processes=2 --script=tests/multiprocess_driver.py
-- --layout=split --steps=2`. Every process builds the same model, plan, global batch and
feeds (deterministic), so only the device placement differs between the two runs.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from helpers import global_batch, make_cfg  # noqa: E402

from mmjax.data.feed import microbatch_feed  # noqa: E402
from mmjax.planner.plan import Plan  # noqa: E402
from mmjax.train.pipelined import PipelinedRunner  # noqa: E402

# Indices into [process 0's 4 devices, process 1's 4 devices] for the plan's device list:
# vision (1) | llm stage 0 (dp 2) | llm stage 1 (dp 2) | generator (1).
LAYOUTS = {
    # every stage inside one process; the LLM's two stages in different processes
    "split": (0, 1, 2, 4, 5, 3),
    # LLM stage 1 spans both processes (its dp all-reduce crosses them), generator on p1
    "span": (0, 1, 2, 3, 4, 5),
}


def small_plan(cfg) -> Plan:
    return Plan.uniform(cfg, 8, 2, dp={"vision": 1, "llm": 2, "generator": 1}, pp={"llm": 2})


def ordered_devices(layout: str) -> list:
    devs = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    if len(devs) != 8:
        raise ValueError(f"the driver needs 8 devices (2 processes x 4), got {len(devs)}")
    return [devs[k] for k in LAYOUTS[layout]]


def pretrained_cfg(dirs: dict):
    """The tiny model with a CLIP-style tower and the LLM and tower shapes of the HF
    checkpoints in `dirs` (tests/test_pretrained_training.py writes them)."""
    from test_vit_training import CLIP_TINY

    from mmjax.models import hf
    return hf.prepare_pretrained(make_cfg(**{"encoders.vision.encoder": CLIP_TINY}), dirs)


def run_steps(layout: str, steps: int, pretrained: dict | None = None) -> list[dict]:
    cfg = pretrained_cfg(pretrained) if pretrained else make_cfg()
    plan = small_plan(cfg)
    lay, samples = global_batch(cfg, plan.global_batch)
    step = PipelinedRunner(cfg, plan, optax.constant_schedule(1e-2),
                        devices=ordered_devices(layout), pretrained=pretrained)
    n, dp = plan.microbatch_size, {u.name: u.dp for u in plan.units}
    feeds = [microbatch_feed(samples[m * n:(m + 1) * n], lay, dp)
             for m in range(plan.num_microbatches)]
    keys = ("loss", "lm_loss", "diffusion_loss", "grad_norm", "nonfinite", "spike")
    return [{k: float(getattr(m, k)) for k in keys}
            for m in (step.train_on(feeds) for _ in range(steps))]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--layout", choices=sorted(LAYOUTS), default="split")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--pretrained", default="",
                   help="unit=DIR,unit=DIR: HF checkpoints to start from; each process then "
                        "prints `READS <json>`, the checkpoint tensors it read")
    args = p.parse_args(argv)
    dirs = dict(kv.split("=", 1) for kv in args.pretrained.split(",") if kv)
    reads = []
    if dirs:  # record every tensor this process reads (names only), as the in-process
        # test does with pytest's monkeypatch
        from mmjax.models.hf.checkpoint import Checkpoint

        read_slice, read = Checkpoint.read_slice, Checkpoint.read
        Checkpoint.read_slice = lambda self, n, i: reads.append(n) or read_slice(self, n, i)
        Checkpoint.read = lambda self, n: reads.append(n) or read(self, n)
    out = run_steps(args.layout, args.steps, dirs or None)
    if dirs:
        print("READS " + json.dumps(sorted(set(reads))), flush=True)
    if jax.process_index() == 0:
        print("LOSSES " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
