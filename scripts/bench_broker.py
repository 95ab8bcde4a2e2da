"""Benchmark the broker's cost of a new route map (a step with a new balanced assignment).

For each (src mesh, dst mesh) case, `Broker.transfer` runs on K different random route maps
of the same shapes (random permutations of the parts, as a balanced data assignment gives
every step), each twice: the first call of a map pays any compile, the second is the warm
step. Prints per map the first / warm wall time and the broker's compiled-program count;
`--json` writes them. The broker compiles per shape and round sizes (which only grow), so
after the first maps a new map should cost about a warm step (docs/design.md "The broker").

    python scripts/bench_broker.py [--maps 4] [--part 16,256] [--json bench_results/broker.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from mmjax.cpu_threads import force_cpu_devices  # noqa: E402

force_cpu_devices(8)

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mmjax.parallel.broker import Broker, Routes
from mmjax.parallel.mesh import stage_mesh

CASES = [  # (src dp, src tp, dst dp, dst tp, parts per source rank)
    (2, 2, 4, 1, 4),
    (4, 1, 2, 2, 2),
]


def random_routes(rng, a, ps, b) -> Routes:
    """A balanced reassignment: the a * ps parts permuted onto b ranks, a*ps/b slots each."""
    total = a * ps
    perm = rng.permutation(total)
    pr = total // b
    return Routes.from_pairs(a, ps, b, pr, [(int(p) // ps, int(p) % ps, k // pr, k % pr)
                                            for k, p in enumerate(perm)])


def timed(broker, x, routes):
    t0 = time.perf_counter()
    jax.block_until_ready(broker.transfer(x, routes))
    return time.perf_counter() - t0


def run_case(case, maps, part, rng):
    a, ta, b, tb, ps = case
    d = jax.devices()
    sm = stage_mesh(d[:a * ta], a, ta)
    dm = stage_mesh(d[a * ta:a * ta + b * tb], b, tb)
    broker = Broker(sm, dm)
    g = rng.standard_normal((a * ps,) + part).astype(np.float32)
    x = jax.device_put(g, NamedSharding(sm, P("dp")))
    rows = []
    for k in range(maps):
        r = random_routes(rng, a, ps, b)
        first, warm = timed(broker, x, r), timed(broker, x, r)
        np.testing.assert_array_equal(np.asarray(broker.transfer(x, r)), r.apply(g))
        programs = len(getattr(broker, "programs", getattr(broker, "compiled", {})))
        rows.append({"case": f"dp{a}xtp{ta}->dp{b}xtp{tb}", "map": k, "first_s": first,
                     "warm_s": warm, "programs": programs})
        print(f"{rows[-1]['case']:>16} map {k}  first {first:8.4f} s  warm {warm:8.4f} s"
              f"  compiled programs {programs}", flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--maps", type=int, default=4)
    ap.add_argument("--part", default="16,256", help="part shape, comma separated")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    part = tuple(int(v) for v in args.part.split(","))
    rng = np.random.default_rng(0)
    rows = [row for case in CASES for row in run_case(case, args.maps, part, rng)]
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"backend": jax.default_backend(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    from mmjax.cli import run_main

    sys.exit(run_main(main))
