"""How close the parity tests come to their tolerance: reads the comparisons that
`MMJAX_PARITY_LOG=<file> pytest -m parity` recorded (tests/helpers.py) and prints, per kind
(loss, gradients), the worst ratios of a plan's error to the single float32 program's error
(both against the float64 truth) and of the error to the allowed bound; writes JSON.

  MMJAX_PARITY_LOG=/tmp/o0.jsonl pytest -q -m parity
  XLA_FLAGS="--xla_backend_optimization_level=2 --xla_cpu_max_isa=AVX2" \\
      MMJAX_PARITY_LOG=/tmp/o2.jsonl pytest -q -m parity
  python scripts/tolerance_report.py /tmp/o0.jsonl /tmp/o2.jsonl --out=tolerance.json
"""
import argparse
import json
import math

import numpy as np


def summarise(rows: list[dict]) -> dict:
    """Worst and 99th-percentile ratios over the comparisons with a nonzero truth."""
    ratio = np.array([r["err"] / r["err_ref"] for r in rows if r["err_ref"] > 0])
    margin = np.array([r["err"] / r["allowed"] for r in rows if r["allowed"] > 0])
    rel = np.array([r["err"] / r["scale"] for r in rows if r["scale"] > 0])
    pick = lambda a, f: float(f(a)) if a.size else math.nan
    return {"comparisons": len(rows),
            "err/err_ref p99": pick(ratio, lambda a: np.percentile(a, 99)),
            "err/err_ref max": pick(ratio, np.max),
            "err/allowed max": pick(margin, np.max),
            "relative err max": pick(rel, np.max)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--out", default="tolerance_report.json")
    args = ap.parse_args(argv)
    table = {}
    for path in args.logs:
        rows = [r for r in map(json.loads, open(path))  # the rule's own test fails on purpose
                if "test_tolerance_rule" not in r.get("test", "")]
        for what in sorted({r["what"] for r in rows}):
            table[f"{path}:{what}"] = summarise([r for r in rows if r["what"] == what])
    cols = ["comparisons", "err/err_ref p99", "err/err_ref max", "err/allowed max",
            "relative err max"]
    print(f"{'log:kind':40s}" + "".join(f"{c:>18s}" for c in cols))
    for name, row in table.items():
        print(f"{name[-40:]:40s}" + "".join(
            f"{row[c]:>18d}" if c == "comparisons" else f"{row[c]:>18.3g}" for c in cols))
    with open(args.out, "w") as f:
        json.dump(table, f, indent=1)


if __name__ == "__main__":
    main()
