"""Single-device training step: time, throughput and MFU, measured against the planner's
analytic prediction (DistTrain §5.1's per-unit cost C(tp) at tp = 1).

Builds the whole-model runner (train/whole_model.py: the whole model as one jitted
step, real optimizer, the synthetic LAION-like stream through the real loader) for a preset
model, runs `--warmup` untimed steps (compile) and `--steps` timed ones, and reports:

* step time (median), data wait, tokens/s;
* model FLOPs per step from the planner's cost model (`planner/costs.py` `unit_costs` on
  the workload of the samples the timed run's global batches hold, after the loader's
  skips: forward + required backward, real tokens only) and MFU = those FLOPs / step time /
  the device's measured matmul peak in the run's dtype (`--profile FILE` of this device, from
  scripts/profile_hardware.py, or measured at start-up: train/device_measure.py; a CPU run
  is priced by the CPU, never by a GPU's spec);
* XLA's own FLOP count of the compiled step (`cost_analysis`; custom calls such as cuDNN
  attention and Triton kernels count 0 there, so it is a lower bound);
* the planner's predicted step time for the same samples on that measured device (its
  layers at the profile's measured efficiencies when the profile has them), and measured /
  predicted per
  unit is what `planner/profile.py` would learn (the calibration factor);
* the compiled step's memory per device (`memory_analysis()`) and, on GPU, the allocator's
  peak.

`--colocated_zero N` runs the co-located runner (train/colocated.py, every unit at ZeRO-N
over all devices; on one GPU the ZeRO-3 layer gathers run over one rank) instead.

  python scripts/bench_step.py [--preset llava_1b] [--global_batch 8] [--seq_len 2048]
      [--dtype bfloat16] [--attention auto] [--override llm.num_layers=4 ...] [--lora 8]
      [--json bench_results/bench_step.json]

Presets: `tiny` (CPU, seconds); `small` (tiny at 4x the widths: CPU, about a second a step); `llava_1b`: a Llama-3.2-1B-wide LLM (2048 hidden,
16 layers, GQA 32/8, 128k vocabulary) behind a SigLIP-so400m-wide NaViT encoder (1152 hidden,
27 layers, patch 14) with a 1024-wide, 12-layer DiT generator: one GPU's worth, every
unit's layers in one `lax.scan` (compile time flat in depth).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
from rich.console import Console
from rich.table import Table

from mmjax.cli import write_json
from mmjax.host_info import machine
from mmjax.planner.costs import unit_costs
from mmjax.planner.hardware import hardware_of_device
from mmjax.planner.measured_hardware import check_device, hardware_from_profile, has_measurement
from mmjax.planner.step_model import PALLAS_VS_CUDNN, SlotShapes, single_step_time
from mmjax.planner.workload import workload_from_metas
from mmjax.train.config import named_model_config
from mmjax.data.records import SyntheticSource
from mmjax.data.synthetic import LLAVA_LIKE
from mmjax.train.data_config import data_layout, synthetic_dataset
from mmjax.train.optimizer import learning_rate_schedule
from mmjax.train.colocated import ColocatedMesh
from mmjax.train.colocated_plan import Colocation
from mmjax.train.single_program import OneDevice
from mmjax.train.whole_model import WholeModelRunner
from mmjax.train.beside_profile import ProbeSet

PRESETS = {
    "tiny": {},
    "llava_1b": {
        "llm.vocab_size": 128256, "llm.hidden_size": 2048, "llm.num_layers": 16,
        "llm.num_heads": 32, "llm.num_kv_heads": 8, "llm.ffn_size": 8192,
        "llm.rope_theta": 500000.0, "llm.tie_embeddings": True, "llm.qkv_bias": False,
        "llm.scan_layers": True, "encoders.vision.encoder.scan_layers": True,
        "generator.scan_layers": True,
        "encoders.vision.encoder.hidden_size": 1152, "encoders.vision.encoder.num_layers": 27,
        "encoders.vision.encoder.num_heads": 16, "encoders.vision.encoder.ffn_size": 4304,
        "encoders.vision.encoder.patch_size": 14, "encoders.vision.encoder.max_grid": 32,
        "generator.hidden_size": 1024, "generator.num_layers": 12,
        "generator.num_heads": 16, "generator.ffn_size": 4096, "generator.latent_size": 32,
    },
    # four times tiny's widths (head dim 32): a CPU step of about a second, the second size
    # the CPU check of the step model runs at (docs/results.md)
    "small": {
        "llm.vocab_size": 4096, "llm.hidden_size": 256, "llm.num_heads": 8,
        "llm.num_kv_heads": 4, "llm.ffn_size": 768,
        "encoders.vision.encoder.hidden_size": 128, "encoders.vision.encoder.num_heads": 4,
        "encoders.vision.encoder.ffn_size": 512,
        "generator.hidden_size": 128, "generator.num_heads": 4, "generator.ffn_size": 512,
    },
    # a Llama-3-8B-wide LLM alone (text only), layers cut to fit one 80 GB GPU with AdamW
    "llama3_8b_cut": {
        "encoders": (), "generator": None,
        "llm.vocab_size": 128256, "llm.hidden_size": 4096, "llm.num_layers": 8,
        "llm.num_heads": 32, "llm.num_kv_heads": 8, "llm.ffn_size": 14336,
        "llm.rope_theta": 500000.0, "llm.tie_embeddings": False, "llm.qkv_bias": False,
        "llm.scan_layers": True,
    },
}


# the units of each preset (what --remat applies to)
PRESETS_UNITS = {"tiny": ("llm", "encoders.vision.encoder", "generator"),
                 "small": ("llm", "encoders.vision.encoder", "generator"),
                 "llava_1b": ("llm", "encoders.vision.encoder", "generator"),
                 "llama3_8b_cut": ("llm",)}


# the synthetic stream's shapes per preset (data/synthetic.py SyntheticConfig): LLaVA-like
# for llava_1b (one or two images of ~24 x 24 patches, a few hundred text tokens)
PRESET_DATA = {
    "tiny": {}, "small": {},
    "llava_1b": LLAVA_LIKE,
    "llama3_8b_cut": {"max_images": 0, "text_len_median": 1024.0,
                      "text_len_range": (64, 3000)},
}


def model_config(args):
    """The preset with --remat, --loss_chunk and --override applied."""
    overrides = dict(PRESETS[args.preset])
    if args.remat != "none":  # per-layer recomputation in every unit (models/scan.py)
        overrides.update({f"{u}.remat": args.remat for u in PRESETS_UNITS[args.preset]})
    if args.loss_chunk:  # the fused chunked head + cross-entropy (models/chunked_loss.py)
        overrides["llm.loss_chunk"] = args.loss_chunk
    for item in args.override:
        key, _, value = item.partition("=")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:  # a bare string: kind=vit
            overrides[key] = value
    cfg = named_model_config("tiny", overrides)
    if args.lora:  # LoRA rank --lora on the LLM's projections (models/lora.py), base frozen
        from mmjax.models.lora_config import LoRAConfig
        from mmjax.train.lora_setup import with_lora
        cfg = with_lora(cfg, ("llm",), LoRAConfig(args.lora, 2.0 * args.lora,
                                                  ("attention", "mlp")))
    return cfg


def loader_scope(args):
    """A gin scope in which the bench's `Loader` takes `--row_budget` (data/row_budget.py;
    0: `global_batch` samples a step); the binding stays out of every other scope."""
    import gin

    with gin.unlock_config():
        gin.bind_parameter("bench_step/Loader.row_budget", args.row_budget or None)
    return gin.config_scope("bench_step")


def run(args) -> dict:
    with loader_scope(args):
        return _run(args)


def _run(args) -> dict:
    cfg = model_config(args)
    dtype = jnp.dtype(args.dtype)
    layout = data_layout(cfg, seq_len=args.seq_len, packing=args.packing)
    source = SyntheticSource(synthetic_dataset(cfg, **PRESET_DATA[args.preset]))
    total = args.warmup + args.steps
    # the co-located mesh over every device, each unit's ZeRO stage `--colocated_zero` (at
    # one device the layer gathers run, over one rank); else one device
    place = (ColocatedMesh(Colocation(default_stage=args.colocated_zero), cfg, dtype.type)
             if args.colocated_zero else OneDevice())
    prog = WholeModelRunner(cfg, layout, args.global_batch, learning_rate_schedule(total),
                            dtype.type, 0, place, source=source, attention_impl=args.attention)
    steps, cpu_s, probes = [], [], None
    for i in range(total):
        if i == args.warmup and not args.profile:  # the profile beside the timed steps
            probes = ProbeSet(dtype=args.dtype)
        cpu0 = time.process_time()
        steps.append(prog.step())
        cpu_s.append(time.process_time() - cpu0)
        if probes is not None:
            probes.sample()
        m = steps[-1]
        print(f"step {i + 1}/{total}: {m.step_time_s * 1e3:.1f} ms, compile "
              f"{m.compile_s:.1f} s, loss {m.loss:.4f}", flush=True)
    trace_file = None
    if args.trace:  # one more step under the profiler (not counted in the timings)
        trace_file = traced_step(prog, args.trace)
    timed = steps[args.warmup:]
    step_s = statistics.median(m.step_time_s for m in timed)
    wait_s = statistics.median(m.data_wait_s for m in timed)
    tokens = statistics.mean(m.tokens for m in timed)

    compiled = next(iter(prog.compiled.values()))
    xla = compiled.cost_analysis()
    xla = xla[0] if isinstance(xla, (list, tuple)) else xla
    record = {
        "machine": machine(), "device": str(jax.devices()[0].device_kind),
        "backend": jax.default_backend(), "args": vars(args),
        "trainable_params": int(prog.num_trainable),
        # float32 master + AdamW moments, and float32 gradients, of what trains (LoRA:
        # the adapters and the parts not LoRA'd)
        "optimizer_bytes": 12 * int(prog.num_trainable),
        "gradient_bytes": 4 * int(prog.num_trainable),
        "compile_s": steps[0].compile_s, "step_time_s": step_s, "data_wait_s": wait_s,
        "step_times_s": [m.step_time_s for m in timed],
        # this process's CPU seconds per timed step and the host's 1-minute load average at
        # the end: on a shared host the wall time is the CPU work over the cores it got
        "step_cpu_s": cpu_s[args.warmup:], "load_average": os.getloadavg()[0],
        "tokens_per_step": tokens, "tokens_per_s": tokens / step_s,
        # LLM token slots of the step's static shape (rows x seq_len): real tokens / slots is
        # the packing's fill, the share of the step's LLM work that is not padding
        "llm_slots_per_step": prog.data.shapes.rows * args.seq_len,
        # per timed step real tokens / its slots (metrics.jsonl's llm_fill), their mean
        "llm_fill": statistics.mean(m.tokens / m.llm_slots for m in timed),
        "xla_flops_per_step": float(xla.get("flops", 0.0)),
        "losses": [m.loss for m in steps], "trace": trace_file,
        "memory": step_memory(compiled),
    }
    if args.lora:  # the same model trained whole, beside it (counts and memory model)
        record["trained_whole"] = lora_against_whole(args, cfg, prog)
    record["hardware_profile"] = (probes.profile() if probes is not None
                                  else device_profile(args.profile))
    record.update(cost_fields(args, cfg, layout, prog.data, total, tokens, step_s,
                              int(prog.num_trainable), record["hardware_profile"]))
    if probes is not None:  # the step's CPU time priced per CPU second of the same probes
        record["cpu_profile"] = probes.profile("cpu")
        cpu = cost_fields(args, cfg, layout, prog.data, total, tokens, step_s,
                          int(prog.num_trainable), record["cpu_profile"])
        record["step_model_cpu_s"] = cpu["step_model_s"]
        record["step_model_cpu_parts_s"] = step_parts(cpu)
    return record


def lora_against_whole(args, cfg, prog) -> dict:
    """With --lora: the trained parameters' float32 master + AdamW and gradient bytes of
    the LoRA run and of the model trained whole (counted from abstract shapes, nothing
    allocated), and the memory model's state and peak bytes per device for both
    (train/memory_check.py `single_program_bytes`, at the run's batch shapes)."""
    from mmjax.models.mllm import MultimodalModel, trainable_filter
    from mmjax.parallel.sharded_init import abstract_split
    from mmjax.train.memory_check import single_program_bytes

    whole = model_config(argparse.Namespace(**{**vars(args), "lora": 0}))
    out = {}
    for name, c in (("lora", cfg), ("whole", whole)):
        _, tr, fr = abstract_split(MultimodalModel, (c,), jax.random.key(0),
                                   (trainable_filter(c), ...))
        n, m = (sum(x.size for x in jax.tree.leaves(t)) for t in (tr, fr))
        est = single_program_bytes(c, prog.data.floor, args.seq_len, n, m,
                                   jnp.dtype(args.dtype), args.attention)
        out[name] = {"trainable_params": int(n), "optimizer_bytes": 12 * int(n),
                     "gradient_bytes": 4 * int(n), "model_state_bytes": float(est["state"]),
                     "model_peak_bytes": float(est["peak"])}
    return out


def step_parts(fields: dict) -> dict:
    """The step model's pieces: per unit compute and elementwise passes, AdamW, loss head."""
    out = {f"{u} compute": t for u, t in fields["step_model_unit_s"].items()}
    out.update({f"{u} elementwise": t for u, t in fields["step_model_elementwise_s"].items()})
    out.update({"AdamW": fields["step_model_optimizer_s"], "loss head": fields["step_model_head_s"]})
    return out


def samples_text(r: dict) -> str:
    """The global batch, or under a row budget the mean samples a step took."""
    if not r["args"].get("row_budget"):
        return str(r["args"]["global_batch"])
    return f"{r['samples_per_step']:.1f} (row budget {r['args']['row_budget']})"


def device_profile(path: str) -> dict:
    """The hardware profile of the device this run is on: `path`'s (it must be of this
    device), with the peak and bandwidths measured now when it has none (or no path)."""
    kind = str(jax.devices()[0].device_kind)
    profile = {}
    if path:
        with open(path) as f:
            profile = json.load(f)
        check_device(profile, kind, f"--profile={path}")
    if not has_measurement(profile):
        from mmjax.train.device_measure import measure_device

        profile.update(measure_device(dtypes=("float32", "bfloat16")))
    return profile


def step_memory(compiled) -> dict:
    """Bytes per device of the compiled step (`memory_analysis()`: arguments + outputs -
    donated aliases + temporaries = its peak) and the allocator's peak where the device
    reports one (GPU `memory_stats()`; None on CPU)."""
    ma = compiled.memory_analysis()
    parts = {"arguments": ma.argument_size_in_bytes, "outputs": ma.output_size_in_bytes,
             "aliased": ma.alias_size_in_bytes, "temporaries": ma.temp_size_in_bytes}
    parts["compiled_peak"] = (parts["arguments"] + parts["outputs"] - parts["aliased"]
                              + parts["temporaries"])
    stats = jax.devices()[0].memory_stats() or {}
    parts["device_peak"] = stats.get("peak_bytes_in_use")
    return parts


def cost_fields(args, cfg, layout, data, steps: int, tokens: float, step_s: float,
                trainable: int, profile: dict) -> dict:
    """Model FLOPs per step and MFU (of the measured peak of `profile`: this device's) for
    the samples the `steps` global batches trained, the planner's predicted step on that
    measured device, and the single-device step model (`planner/step_model.py`) on the
    step's own shapes (`data.shapes`)."""
    wl = trained_workload(data.stream, cfg, steps)
    hw = hardware_from_profile(profile, args.dtype, call_tokens=tokens)
    impl = None if args.attention == "auto" else args.attention  # None: exact pairs
    recompute = args.remat  # per-layer remat costs what the stage-level policy does
    costs = unit_costs(cfg, wl, hw, recompute=recompute, attention_impl=impl)
    samples = len(wl.llm_tokens) / steps  # per step (varies under a --row_budget)
    flops = samples * sum(c.flops for c in costs)
    predicted = {c.name: samples * c.time_s[1] for c in costs}
    step = single_step_time(cfg, wl, hw, samples, unit_remats(cfg),
                            slot_fills(cfg, layout, data.shapes, wl, samples),
                            trainable, data.shapes.rows * args.seq_len,
                            pallas_units(cfg, layout, args.attention, hw),
                            dense_slots(args, data.shapes, profile),
                            jnp.dtype(args.dtype).itemsize)
    return {"samples_per_step": samples, "model_flops_per_step": flops,
            "peak_flops": hw.peak_flops,
            "peak_measured": has_measurement(profile),
            "hardware_model": hw.name, "mfu": flops / step_s / hw.peak_flops,
            "predicted_step_s": sum(predicted.values()), "predicted_unit_s": predicted,
            "profile": args.profile or None,
            "step_model_s": step.total_s, "step_model_unit_s": step.units_s,
            "step_model_optimizer_s": step.optimizer_s, "step_model_head_s": step.head_s,
            "step_model_elementwise_s": step.elementwise_s}


def dense_slots(args, shapes, profile: dict) -> SlotShapes | None:
    """The step's static shapes when its attention is XLA's dense one (`--attention dense`,
    or "auto" on a CPU at this length: models/attention.py `choose_implementation`), which
    computes every pair of each row and buffer; None otherwise (tiled kernels)."""
    from mmjax.models.attention import AUTO_DENSE_MAX_PAIRS

    cpu_auto = (args.attention == "auto" and profile.get("platform") == "cpu"
                and args.seq_len ** 2 <= AUTO_DENSE_MAX_PAIRS)
    if args.attention != "dense" and not cpu_auto:
        return None
    return SlotShapes(shapes.rows, args.seq_len,
                      {name: (count, cap) for name, count, cap in shapes.encoders})


def unit_remats(cfg) -> dict:
    """Each unit's per-layer remat policy, as its config sets it."""
    out = {"llm": cfg.llm.remat}
    out.update({e.name: e.encoder.remat for e in cfg.encoders})
    if cfg.generator is not None:
        out["generator"] = cfg.generator.remat
    return out


def slot_fills(cfg, layout, shapes, wl, samples: int) -> dict:
    """Per unit: slots of the step's static shapes / the real tokens they hold."""
    llm = samples * sum(wl.llm_tokens) / len(wl.llm_tokens)
    fills = {"llm": shapes.rows * layout.seq_len / llm}
    for name, count, cap in shapes.encoders:
        real = samples * sum(sum(x) for x in wl.encoder_tokens[name]) / len(wl.llm_tokens)
        fills[name] = count * cap / real if real else 1.0
    return fills


def pallas_units(cfg, layout, attention: str, hw) -> dict:
    """{unit: Pallas / cuDNN time} for the units whose attention runs the Pallas kernel on a
    GPU while the measured profile timed cuDNN: the LLM on packed (bitfield) rows and the
    encoders' packed buffers; none without a profile."""
    profile = getattr(hw, "profile", None)
    if profile is None or profile.attention != "cudnn" or attention not in ("auto", "pallas"):
        return {}
    out = {e.name: PALLAS_VS_CUDNN for e in cfg.encoders}
    if layout.llm_mask_family == "bam" or attention == "pallas":
        out["llm"] = PALLAS_VS_CUDNN
    return out


def recount(path: str) -> dict:
    """A recorded run's FLOPs, MFU and predictions recomputed here from its arguments and the
    same global batches (the loader's selection, no model built, no device needed): for a
    GPU record after a change to the cost model."""
    from mmjax.data.batch_shapes import grow_shapes
    from mmjax.train.single_data import LoaderBatches

    with open(path) as f:
        record = json.load(f)
    args = argparse.Namespace(**{"loss_chunk": 0, "colocated_zero": 0, "row_budget": 0,
                                 "lora": 0,
                                 **record["args"]})
    cfg = model_config(args)
    layout = data_layout(cfg, seq_len=args.seq_len, packing=args.packing)
    source = SyntheticSource(synthetic_dataset(cfg, **PRESET_DATA[args.preset]))
    total = args.warmup + args.steps
    with loader_scope(args):
        data = LoaderBatches.from_gin(source, layout, args.global_batch,  # the run's scan
                                      lambda s, m: grow_shapes(s, m, layout))
    data.shapes = data.floor if data.floor is not None else data.shapes
    record.update(cost_fields(args, cfg, layout, data, total, record["tokens_per_step"],
                              record["step_time_s"], record["trainable_params"],
                              recorded_profile(record)))
    record.setdefault("optimizer_bytes", 12 * record["trainable_params"])  # older records
    record.setdefault("gradient_bytes", 4 * record["trainable_params"])
    record["recounted"] = True
    return record


def recorded_profile(record: dict) -> dict:
    """The hardware profile a recorded run was priced with: the one it recorded, else (runs
    before measured peaks) its `--profile` file or its GPU's spec (an empty profile)."""
    if record.get("hardware_profile"):
        return record["hardware_profile"]
    path = record["args"].get("profile")
    if path:
        with open(path) as f:
            return json.load(f)
    if hardware_of_device(record["device"]) is None:
        raise ValueError(f"the record of a run on {record['device']!r} has no measured "
                         f"profile to price it with (re-run bench_step.py)")
    return {"device": record["device"]}


def trained_workload(stream, cfg, steps: int):
    """The workload of the samples the `steps` global batches trained (the loader's own
    selection, after skipping samples longer than the layout's seq_len), so model FLOPs and
    predictions count exactly the tokens the step computed on."""
    metas = [m for _, _, ms in stream.scan(steps) for m in ms.metas()]
    return workload_from_metas("bench batches", metas, cfg)


def traced_step(prog, trace_dir: str) -> str | None:
    """Run one step under `jax.profiler.trace` and return the Perfetto trace it wrote
    (`scripts/trace_breakdown.py` splits its device time into attention / matmuls / norms /
    other / idle)."""
    import glob

    os.makedirs(trace_dir, exist_ok=True)
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        prog.step()
    found = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True),
                   key=os.path.getmtime)
    return found[-1] if found else None


def peak_text(r) -> str:
    """The peak MFU is of: "97.0 GFLOP/s measured" on a CPU, TFLOP/s on a GPU."""
    p = r["peak_flops"]
    amount = f"{p / 1e12:.0f} TFLOP/s" if p >= 1e13 else f"{p / 1e9:,.1f} GFLOP/s"
    return amount + (" measured" if r.get("peak_measured") else f" {r['hardware_model']} spec")


def show(console, r) -> None:
    runner = (f", co-located ZeRO-{r['args']['colocated_zero']}"
              if r['args'].get("colocated_zero") else "")
    t = Table(title=f"{r['args']['preset']} training step{runner} on {r['device']} "
                    f"({r['backend']}, {r['args']['dtype']}, attention {r['args']['attention']})")
    for col in ("quantity", "value"):
        t.add_column(col)
    rows = [("trainable parameters", f"{r['trainable_params'] / 1e6:,.1f} M"),
            ("master + AdamW, gradients", f"{r['optimizer_bytes'] / 1e9:,.3f} GB, "
                                          f"{r['gradient_bytes'] / 1e9:,.3f} GB"),
            ("samples x seq (packing)", f"{samples_text(r)} x {r['args']['seq_len']} "
                                        f"({r['args']['packing']})"),
            ("compile (first step)", f"{r['compile_s']:.1f} s"),
            ("step time (median)", f"{r['step_time_s'] * 1e3:.1f} ms"),
            ("data wait (median)", f"{r['data_wait_s'] * 1e3:.1f} ms"),
            ("LLM tokens / s", f"{r['tokens_per_s']:,.0f}"),
            ("LLM slot fill (tokens / rows x seq)",
             f"{r['llm_fill']:.3f}" if r.get("llm_fill") else "-"),
            ("model GFLOP / step (planner)", f"{r['model_flops_per_step'] / 1e9:,.1f}"),
            ("XLA GFLOP / step (lower bound)", f"{r['xla_flops_per_step'] / 1e9:,.1f}"),
            (f"MFU (of {peak_text(r)})", f"{100 * r['mfu']:.2f}%"),
            ("planner's unit costs (real tokens only)", f"{r['predicted_step_s'] * 1e3:.1f} ms"),
            ("measured / unit costs", f"{r['step_time_s'] / r['predicted_step_s']:.2f}")]
    if r.get("step_cpu_s"):
        rows.append(("step CPU time (median; host load)",
                     f"{statistics.median(r['step_cpu_s']) * 1e3:.1f} ms "
                     f"(load {r['load_average']:.1f})"))
    if r.get("step_model_s"):
        rows += [("step model (padding, kernels, optimizer, loss head)",
                  f"{r['step_model_s'] * 1e3:.1f} ms"),
                 ("measured / step model", f"{r['step_time_s'] / r['step_model_s']:.2f}")]
    for name, w in (r.get("trained_whole") or {}).items():  # --lora: LoRA and whole
        rows.append((f"{'LoRA' if name == 'lora' else 'trained whole'}: params, master + "
                     f"AdamW, gradients; model state / peak",
                     f"{w['trainable_params'] / 1e6:,.1f} M, {w['optimizer_bytes'] / 1e9:,.2f}"
                     f" GB, {w['gradient_bytes'] / 1e9:,.2f} GB; "
                     f"{w['model_state_bytes'] / 1e9:,.2f} / {w['model_peak_bytes'] / 1e9:,.2f}"
                     f" GB"))
    if r.get("step_model_cpu_s"):
        cpu = statistics.median(r["step_cpu_s"])
        rows += [("step model, CPU time (probes per CPU second)",
                  f"{r['step_model_cpu_s'] * 1e3:.1f} ms"),
                 ("measured CPU time / step model", f"{cpu / r['step_model_cpu_s']:.2f}")]
    mem = r.get("memory")
    if mem:
        rows.append(("step memory, compiled peak per device",
                     f"{mem['compiled_peak'] / 2 ** 30:.2f} GiB (temporaries "
                     f"{mem['temporaries'] / 2 ** 30:.2f})"))
        if mem.get("device_peak"):
            rows.append(("device memory peak (allocator)",
                         f"{mem['device_peak'] / 2 ** 30:.2f} GiB"))
    rows.append(("loss first -> last", f"{r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}"))
    for row in rows:
        t.add_row(*row)
    console.print(t)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--global_batch", type=int, default=8)
    ap.add_argument("--seq_len", type=int, default=256)
    ap.add_argument("--override", action="append", default=[], metavar="PATH=JSON",
                    help='a model config override on top of the preset, e.g. llm.num_layers=4')
    ap.add_argument("--packing", default="pack", choices=("pad", "pack"))
    ap.add_argument("--row_budget", type=int, default=0, metavar="ROWS",
                    help="LLM rows a step fills (Loader.row_budget: a variable number of "
                         "the window's samples, data/row_budget.py); 0: --global_batch "
                         "samples a step")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--remat", default="none", choices=("none", "dots", "full"),
                    help="per-layer recomputation in every unit (models/scan.py)")
    ap.add_argument("--loss_chunk", type=int, default=0, metavar="TOKENS",
                    help="fuse the LM head and cross-entropy over chunks of this many tokens "
                         "(0: plain float32 logits)")
    ap.add_argument("--profile", default="", metavar="FILE",
                    help="this device's measured hardware profile (scripts/"
                         "profile_hardware.py); without one, its peak and bandwidths are "
                         "measured at start-up")
    ap.add_argument("--trace", default="", metavar="DIR",
                    help="after the timed steps, profile one more step into DIR (Perfetto)")
    ap.add_argument("--colocated_zero", type=int, default=0, choices=(0, 1, 2, 3),
                    help="run the co-located runner (train/colocated.py) with every unit at "
                         "this ZeRO stage instead of the single program (0)")
    ap.add_argument("--lora", type=int, default=0, metavar="RANK",
                    help="LoRA adapters of this rank on the LLM's projections (its base "
                         "frozen; docs/lora.md); 0: train it whole")
    ap.add_argument("--json", default=os.path.join("bench_results", "bench_step.json"))
    ap.add_argument("--recount", default="", metavar="JSON",
                    help="recompute a recorded run's FLOPs, MFU and predictions here (no "
                         "device) and write them to --json")
    args = ap.parse_args(argv)
    record = recount(args.recount) if args.recount else run(args)
    show(Console(width=120), record)
    write_json(args.json, record)
    return record


if __name__ == "__main__":
    from mmjax.cli import run_main

    sys.exit(run_main(main))
