"""Measure this machine's hardware profile, CPU included: the dense matmul peak (float32
and bfloat16), the memory bandwidth of a streaming kernel, the all-reduce bandwidth over
every device (on a CPU, `--devices N` forces N host devices; train/device_measure.py), XLA's
dense attention per (query, key, head) pair, the host's cores and how many one device keeps
busy, and
one generic transformer layer (SwiGLU + causal attention, and GELU MLP + full attention)
timed forward and backward at a grid of widths and sequence lengths, in bf16
(planner/profile.py `profile_hardware`). The JSON it writes is what `plan.py --profile=FILE`,
`bench_step.py --profile=FILE` and `replan.py --profile=FILE` price a run with: the measured
peak and bandwidths as the device's spec (planner/measured_hardware.py), the layers at
their measured efficiency instead of the assumed curve (planner/hardware_profile.py).

  python scripts/profile_hardware.py --out configs/hardware/h100.json
      [--widths 768,1152,2048,4096,8192] [--tokens 512,2048,8192] [--repeats 5]
  python scripts/profile_hardware.py --out cpu.json --devices 8   # this CPU, 8 devices
      [--skip_layers]   # the peak and bandwidths only (seconds)

Default grid: the one above on a GPU; widths 128..1024 and tokens 128..1024 on a CPU.
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
    ap.add_argument("--widths", default="", help="layer widths (default: by platform)")
    ap.add_argument("--tokens", default="", help="layer tokens (default: by platform)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="", help="the layers' dtype (default: bfloat16 on a "
                    "GPU, float32 on a CPU: what runs there compute in by default)")
    ap.add_argument("--devices", type=int, default=0,
                    help="on a CPU: force this many host devices for the collective")
    ap.add_argument("--skip_layers", action="store_true",
                    help="measure the peak and bandwidths only, not the layer grid")
    args = ap.parse_args(argv)
    if args.devices:
        from mmjax.cpu_threads import force_cpu_devices
        force_cpu_devices(args.devices)

    import jax
    import jax.numpy as jnp

    from mmjax.cli import write_json
    from mmjax.planner.profile import profile_hardware
    from mmjax.train.device_measure import measure_device

    gpu = jax.devices()[0].platform == "gpu"
    widths = _ints(args.widths or ("768,1152,2048,4096,8192" if gpu else "128,256,512,1024"))
    tokens = _ints(args.tokens or ("512,2048,8192" if gpu else "128,256,1024"))
    measured = measure_device(repeats=args.repeats)
    print(f"{measured['device']} x {measured['device_count']}: matmul peak " + ", ".join(
        f"{d} {v / 1e9:,.1f} GFLOP/s" for d, v in measured["matmul_peak_flops"].items())
        + f"; memory {measured['memory_bw'] / 1e9:,.2f} GB/s; all-reduce "
        + (f"{measured['collective_bw'] / 1e9:,.2f} GB/s" if measured["collective_bw"]
           else "- (one device)")
        + f"; dense attention {measured['dense_attention_pair_s'] * 1e9:.1f} ns a pair, one "
          f"device keeps {measured['device_busy_cores']:.2f} of {measured['cpu_cores']} "
          f"cores busy", flush=True)

    def show(p):
        print(f"{p['kind']:>12} width {p['width']:>5} tokens {p['tokens']:>6}: "
              f"fwd {p['fwd_s'] * 1e3:8.3f} ms  bwd {p['bwd_s'] * 1e3:8.3f} ms", flush=True)

    prof = {"points": []} if args.skip_layers else profile_hardware(
        widths, tokens, repeats=args.repeats, on_point=show,
        dtype=jnp.dtype(args.dtype or ("bfloat16" if gpu else "float32")))
    prof.update(measured)
    write_json(args.out, prof)
    print(f"{len(prof['points'])} points on {prof['device']}")
    return prof


if __name__ == "__main__":
    main()
