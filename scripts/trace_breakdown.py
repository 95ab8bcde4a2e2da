"""Where a step's device time goes: a `jax.profiler` trace (Perfetto / Chrome JSON, as
`bench_step.py --trace` writes) split into attention / matmuls / norms and reductions /
other kernels / idle.

Device events are the kernels on the accelerator's streams (process "/device:GPU:N"); on
CPU, where there is no device process, the XLA thunks that name an `hlo_op` stand in. A
kernel is classed by its name and HLO op: attention (cuDNN fused attention, the Pallas
block-sparse kernels `bam_flash_*`, any flash / fmha kernel), matmuls (cuBLAS / CUTLASS /
nvjet GEMMs, XLA dots), norms and reductions (reduce fusions: RMSNorm / LayerNorm,
softmax-cross-entropy, gradient norms), other (elementwise fusions, copies, the optimizer).
Idle is the span from the first kernel to the last minus the union of busy intervals.

  python scripts/trace_breakdown.py TRACE.json.gz [--json out.json]
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import sys

CLASSES = ("attention", "matmuls", "norms/reductions", "other")
_RULES = (("attention", re.compile(r"cudnn|fmha|flash|attention|bam_|sdpa|softmax_fused")),
          ("matmuls", re.compile(r"gemm|nvjet|cutlass|xmma|cublas|gemv|wgmma|\bdot\b|dot[._]|"
                                 r"matmul|convolution")),
          ("norms/reductions", re.compile(r"reduce|norm")))


def classify(name: str, hlo_op: str = "") -> str:
    text = f"{name} {hlo_op}".lower()
    for cls, rule in _RULES:
        if rule.search(text):
            return cls
    return "other"


def load_events(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def device_kernels(events: list[dict]) -> list[dict]:
    """Complete events on the accelerator's streams (not the derived "XLA Ops" / "XLA
    Modules" lines, which repeat them), or (CPU) the XLA thunks with an hlo_op."""
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    devices = {pid for pid, n in names.items() if re.search(r"/device:(GPU|TPU)", n)}
    threads = {(e["pid"], e.get("tid")): e.get("args", {}).get("name", "") for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    streams = {k for k, n in threads.items() if k[0] in devices and n.startswith("Stream")}
    xs = [e for e in events if e.get("ph") == "X" and e.get("dur") is not None]
    if devices:
        on_device = [e for e in xs if e["pid"] in devices]
        if streams:
            on_device = [e for e in on_device if (e["pid"], e.get("tid")) in streams]
        return on_device
    return [e for e in xs if "hlo_op" in e.get("args", {})]


def breakdown(events: list[dict]) -> dict:
    """Seconds per class, idle and the device span, and the ten longest kernels."""
    kernels = device_kernels(events)
    if not kernels:
        raise ValueError("no device kernels in the trace (was it taken around a step?)")
    per = dict.fromkeys(CLASSES, 0.0)
    by_name: dict[str, float] = {}
    spans = []
    for e in kernels:
        args = e.get("args", {})
        cls = classify(e.get("name", ""), str(args.get("hlo_op", "")))
        per[cls] += e["dur"] * 1e-6
        key = f"{cls}: {e.get('name', '')[:60]}"
        by_name[key] = by_name.get(key, 0.0) + e["dur"] * 1e-6
        spans.append((e["ts"], e["ts"] + e["dur"]))
    spans.sort()
    busy, (lo, hi) = 0.0, spans[0]
    start, end = spans[0][0], max(b for _, b in spans)
    for a, b in spans[1:]:  # union of busy intervals (streams may overlap)
        if a > hi:
            busy += hi - lo
            lo, hi = a, b
        else:
            hi = max(hi, b)
    busy += hi - lo
    span = (end - start) * 1e-6
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:10]
    return {"span_s": span, "busy_s": busy * 1e-6, "idle_s": span - busy * 1e-6,
            "classes_s": per, "kernels": len(kernels), "top": top}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    if not os.path.exists(args.trace):
        raise SystemExit(f"error: trace {args.trace!r} not found (take one with "
                         f"scripts/bench_step.py --trace DIR)")
    r = breakdown(load_events(args.trace))
    total = sum(r["classes_s"].values()) + r["idle_s"]
    print(f"{r['kernels']} kernels over {r['span_s'] * 1e3:.1f} ms of device time")
    for cls, s in list(r["classes_s"].items()) + [("idle", r["idle_s"])]:
        print(f"  {cls:>17}: {s * 1e3:9.2f} ms  {100 * s / total:5.1f}%")
    print("longest kernels (summed by name):")
    for name, s in r["top"]:
        print(f"  {s * 1e3:9.2f} ms  {name}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    return r


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
