"""Measure this device's hardware profile: one generic transformer layer (SwiGLU + causal
attention, and GELU MLP + full attention) timed forward and backward at a grid of widths and
sequence lengths, in bf16 (planner/profile.py `profile_hardware`). The JSON it writes is what
`plan.py --profile=FILE` and `bench_step.py --profile=FILE` price layers with instead of
the assumed efficiency curve (planner/hardware_profile.py).

  python scripts/profile_hardware.py --out configs/hardware/h100.json
      [--widths 768,1152,2048,4096,8192] [--tokens 512,2048,8192] [--repeats 5]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _ints(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise SystemExit(f"error: {text!r} is not a comma-separated list of integers "
                         f"(e.g. 512,2048)") from None
    if not vals or min(vals) <= 0:
        raise SystemExit(f"error: {text!r}: give positive integers (e.g. 512,2048)")
    return vals


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--widths", default="768,1152,2048,4096,8192")
    ap.add_argument("--tokens", default="512,2048,8192")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    widths, tokens = _ints(args.widths), _ints(args.tokens)

    from mmjax.cli import write_json
    from mmjax.planner.profile import profile_hardware

    def show(p):
        print(f"{p['kind']:>12} width {p['width']:>5} tokens {p['tokens']:>6}: "
              f"fwd {p['fwd_s'] * 1e3:8.3f} ms  bwd {p['bwd_s'] * 1e3:8.3f} ms", flush=True)

    prof = profile_hardware(widths, tokens, repeats=args.repeats, on_point=show)
    write_json(args.out, prof)
    print(f"{len(prof['points'])} points on {prof['device']}")
    return prof


if __name__ == "__main__":
    main()
