"""Where the generator's frozen VAE encodes target images: on CPU in the data path (the
host's or the producers' cores) or on an accelerator (no JAX).

DistTrain treats a frozen module as a unit the planner places; for the VAE the choice is
between CPU time, which the producers overlap with the step (DistTrain §4.2: it costs the
step only what exceeds the step time), and accelerator time, which is fast but sits on the
critical path of the devices it runs on. Costs per training step, analytic (DistTrain §5.1:
time = FLOPs / achieved throughput, transfer = bytes / bandwidth):
- host: images x encoder FLOPs / (cores x per-core CPU rate), minus the step time it hides
  behind (clipped at 0);
- device: images x encoder FLOPs / (accelerator peak x efficiency at the VAE's width), plus
  the pixels' host-to-device copy (float32) at `pcie_bw`.
The smaller cost wins (host on a tie: it keeps the accelerators for training).
"""
from __future__ import annotations

from dataclasses import dataclass

from mmjax.planner.hardware import Hardware

CPU_FLOPS_PER_CORE = 50e9  # fp32 convolutions, one AVX-512 server core, achieved
PCIE_BW = 25e9  # host -> device, bytes/s (PCIe 4 x16, achieved)
PLACEMENTS = ("auto", "host", "device")


def vae_encoder_flops(block_out_channels, layers_per_block: int, in_channels: int,
                      latent_channels: int, side: int, attention: bool = True) -> float:
    """Multiply-adds x 2 of diffusers' AutoencoderKL encoder (+ quant_conv) on one
    side x side image (models/vae.py's layout)."""
    def conv(h, cin, cout, k):
        return 2.0 * h * h * k * k * cin * cout

    ch = list(block_out_channels)
    h, flops = side, conv(side, in_channels, ch[0], 3)
    for i, c in enumerate(ch):
        for j in range(layers_per_block):
            cin = ch[max(i - 1, 0)] if j == 0 else c
            flops += conv(h, cin, c, 3) + conv(h, c, c, 3) + (conv(h, cin, c, 1) if cin != c else 0)
        if i < len(ch) - 1:
            h //= 2
            flops += conv(h, c, c, 3)
    c = ch[-1]
    flops += 2 * (conv(h, c, c, 3) * 2)  # two mid-block ResNets
    if attention:
        n = h * h
        flops += 4 * 2.0 * n * c * c + 2 * 2.0 * n * n * c
    flops += conv(h, c, 2 * latent_channels, 3) + conv(h, 2 * latent_channels,
                                                        2 * latent_channels, 1)
    return flops


@dataclass(frozen=True)
class VAEPlacement:
    placement: str  # "host" or "device"
    host_s: float  # cost to the step, seconds
    device_s: float
    reason: str


def choose_vae_placement(images_per_step: int, flops_per_image: float, side: int,
                         hardware: Hardware, cpu_cores: int, step_time_s: float = 0.0,
                         num_devices: int = 1, channel_width: int = 512,
                         cpu_flops_per_core: float = CPU_FLOPS_PER_CORE,
                         pcie_bw: float = PCIE_BW) -> VAEPlacement:
    """The cheaper placement for one training step (see the module doc)."""
    if images_per_step <= 0:
        return VAEPlacement("host", 0.0, 0.0, "no images to encode")
    work = images_per_step * flops_per_image
    cpu = work / (max(cpu_cores, 1) * cpu_flops_per_core)
    host = max(0.0, cpu - step_time_s)
    rate = hardware.peak_flops * hardware.efficiency(channel_width) * max(num_devices, 1)
    device = work / rate + images_per_step * side * side * 3 * 4 / pcie_bw
    choice = "host" if host <= device else "device"
    return VAEPlacement(choice, host, device,
                        f"host {host * 1e3:.1f} ms/step ({cpu * 1e3:.1f} ms on {cpu_cores} "
                        f"core(s), {step_time_s * 1e3:.0f} ms hidden by the step) vs device "
                        f"{device * 1e3:.1f} ms/step on {hardware.name}")


def vae_params(block_out_channels, layers_per_block: int, in_channels: int,
               latent_channels: int, out_channels: int = 3, attention: bool = True,
               quant_conv: bool = True, post_quant_conv: bool = True) -> int:
    """Parameters of the whole diffusers AutoencoderKL (encoder and decoder; models/vae.py),
    exactly: what the VAE unit holds on each of its devices."""
    def conv(cin, cout, k):
        return k * k * cin * cout + cout

    def resnet(cin, cout):
        return 2 * cin + conv(cin, cout, 3) + 2 * cout + conv(cout, cout, 3) + (
            conv(cin, cout, 1) if cin != cout else 0)

    def mid(c):
        return 2 * resnet(c, c) + ((2 * c + 4 * (c * c + c)) if attention else 0)

    ch, n = list(block_out_channels), len(block_out_channels)
    enc = conv(in_channels, ch[0], 3) + mid(ch[-1]) + 2 * ch[-1] + conv(ch[-1], 2 * latent_channels, 3)
    for i, c in enumerate(ch):
        enc += sum(resnet(ch[max(i - 1, 0)] if j == 0 else c, c) for j in range(layers_per_block))
        enc += conv(c, c, 3) if i < n - 1 else 0
    rev = ch[::-1]
    dec = conv(latent_channels, rev[0], 3) + mid(rev[0]) + 2 * rev[-1] + conv(rev[-1], out_channels, 3)
    for i, c in enumerate(rev):
        dec += sum(resnet(rev[max(i - 1, 0)] if j == 0 else c, c)
                   for j in range(layers_per_block + 1))
        dec += conv(c, c, 3) if i < n - 1 else 0
    return (enc + dec + (conv(2 * latent_channels, 2 * latent_channels, 1) if quant_conv else 0)
            + (conv(latent_channels, latent_channels, 1) if post_quant_conv else 0))


def plan_with_vae(plan_fn, model, hardware: Hardware, num_gpus: int, images_per_step: float,
                  cpu_cores: int, placement: str = "auto", max_vae_gpus: int = 8,
                  cpu_flops_per_core: float = CPU_FLOPS_PER_CORE, pcie_bw: float = PCIE_BW):
    """The planner's allocation with the generator's frozen VAE placed by cost (DistTrain
    §4.2 / §5): -> (Plan, VAEPlacement).

    `plan_fn(model, gpus)` plans the trained units (the model without its VAE unit) on
    `gpus` GPUs (planner/build.py `plan_model`). Host: the trained units on all
    `num_gpus`, and the producers' `cpu_cores` encode the step's `images_per_step` images,
    costing the step what exceeds its predicted iteration time. Device: the VAE as a unit
    on k GPUs (k dividing the generator's dp: its latents reach the generator's ranks in
    row order), the trained units re-planned on `num_gpus - k`; the VAE runs beside the
    pipeline (a source stage, forward only), so the step takes the longer of the two, plus
    the pixels' host-to-device copy. The cheaper wins (host on a tie); `placement` "host"
    or "device" forces that side (its cost still reported)."""
    import dataclasses

    from mmjax.planner.plan import PlanError, UnitPlan
    from mmjax.models.units import GENERATOR_UNIT, VAE_UNIT, is_llm

    v = model.vae
    trained = model.replace(vae=None)
    side = model.generator.latent_size * v.downsample
    flops = images_per_step * vae_encoder_flops(v.block_out_channels, v.layers_per_block,
                                                v.in_channels, v.latent_channels, side,
                                                v.mid_block_add_attention)
    base = plan_fn(trained, num_gpus)
    it = base.predicted["iteration_time_s"]
    cpu = flops / (max(cpu_cores, 1) * cpu_flops_per_core)
    host = it + max(0.0, cpu - it)
    rate = hardware.peak_flops * hardware.efficiency(max(v.block_out_channels))
    copy = images_per_step * side * side * 3 * 4 / pcie_bw
    best = None  # (step seconds, k, plan)
    for k in range(1, min(max_vae_gpus, num_gpus - 1) + 1):
        try:
            rest = plan_fn(trained, num_gpus - k)
        except PlanError:
            continue
        if rest.unit(GENERATOR_UNIT).dp % k:
            continue
        t = max(rest.predicted["iteration_time_s"], flops / (k * rate)) + copy
        if best is None or t < best[0]:
            best = (t, k, rest)
    if placement == "device" and best is None:
        raise PlanError(f"vae.placement='device': no plan leaves a GPU for the VAE unit on "
                        f"{num_gpus} GPUs whose count divides the generator's dp")
    if placement == "host" or (placement == "auto" and (best is None or host <= best[0])):
        why = (f"host {host * 1e3:.1f} ms/step ({cpu * 1e3:.1f} ms of VAE encoding on "
               f"{cpu_cores} producer core(s) behind a {it * 1e3:.1f} ms step) vs "
               + (f"device {best[0] * 1e3:.1f} ms/step (VAE on {best[1]} GPU(s), the rest "
                  f"on {num_gpus - best[1]})" if best else "no device plan (no GPU to spare)"))
        base.predicted["vae"] = {"placement": "host", "reason": why}
        return base, VAEPlacement("host", host, best[0] if best else float("inf"), why)
    assert best is not None  # placement 'device' without a plan raised; 'auto' chose host
    t, k, rest = best
    why = (f"device {t * 1e3:.1f} ms/step (VAE on {k} GPU(s): {flops / (k * rate) * 1e3:.1f} "
           f"ms of encoding beside a {rest.predicted['iteration_time_s'] * 1e3:.1f} ms step on "
           f"{num_gpus - k} GPUs) vs host {host * 1e3:.1f} ms/step ({cpu * 1e3:.1f} ms on "
           f"{cpu_cores} producer core(s))")
    units = list(rest.units)
    at = next(i for i, u in enumerate(units) if is_llm(u.name))
    units.insert(at, UnitPlan(name=VAE_UNIT, dp=k, tp=1, pp=1, layers=(1,), frozen=True))
    plan = dataclasses.replace(rest, units=tuple(units), predicted=dict(rest.predicted))
    plan.predicted["vae"] = {"placement": "device", "reason": why, "gpus": k}
    plan.predicted["gpus"] = rest.predicted.get("gpus", num_gpus - k) + k
    return plan, VAEPlacement("device", host, t, why)
