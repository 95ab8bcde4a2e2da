"""`manual_plan.layout` / `zero_stage` / `fsdp_group` checked into a `Colocation` (no JAX).

"disaggregated" (default): every unit on its own sub-mesh (the pipeline runtime, ZeRO 1-3
per unit over each stage's dp ranks: `UnitPlan.zero_stage`).
"colocated": every unit on one mesh of all devices (train/colocated.py), data-parallel over
it, the LLM and each encoder optionally tensor-parallel (`tp = {"vision": 2, "llm": 4}`: the
tp sizes must form a chain, each dividing the next, so each unit's tp group is the innermost
devices of the next larger one), each unit at ZeRO stage 1, 2 or 3, FSDP groups of
`fsdp_group` devices. A value a layout cannot take is one `UserError` line naming the
setting and the fix, raised before any work.
"""
from __future__ import annotations

from dataclasses import dataclass

from mmjax.errors import UserError
from mmjax.models.units import is_encoder, is_llm
from mmjax.planner.plan import tp_divisible
from mmjax.values import is_int

LAYOUTS = ("disaggregated", "colocated")
ZERO_STAGES = (1, 2, 3)
# manual_plan knobs of the pipeline runtime that the co-located layout does not read
_PIPELINE_ONLY = ("dp", "pp", "cp", "num_chunks", "overlap_tp", "remat", "tp_chunks",
                  "tp_bidirectional", "cp_head_groups", "attention_impl")


@dataclass(frozen=True)
class Colocation:
    """The co-located layout: the LLM's tp, each unit's ZeRO stage (`stages`; units not
    named: `default_stage`), the FSDP group size in devices (None: all devices), the
    encoders' tp (`unit_tp`; units not named: 1)."""
    tp: int = 1
    stages: tuple = ()  # ((unit, stage), ...)
    default_stage: int = 1
    fsdp_group: int | None = None
    unit_tp: tuple = ()  # ((encoder, tp), ...)

    def stage(self, unit: str) -> int:
        return dict(self.stages).get(unit, self.default_stage)

    def tp_of(self, unit: str) -> int:
        """A unit's tensor-parallel size (the LLM's `tp`, an encoder's `unit_tp`)."""
        return self.tp if is_llm(unit) else dict(self.unit_tp).get(unit, 1)

    @property
    def tp_sizes(self) -> tuple[int, ...]:
        """The distinct tp sizes above 1, ascending (a chain: each divides the next)."""
        return tuple(sorted({self.tp, *(t for _, t in self.unit_tp)} - {1}))

    @property
    def max_tp(self) -> int:
        """The largest tp group: FSDP groups and nodes hold whole ones."""
        return max(self.tp_sizes, default=1)


def _stages(units, zero_stage) -> tuple[int, dict]:
    if zero_stage is None:
        return 1, {}
    per_unit = zero_stage if isinstance(zero_stage, dict) else {}
    unknown = [u for u in per_unit if u not in units]
    if unknown:
        raise UserError(f"manual_plan.zero_stage={zero_stage!r}: unknown unit(s) {unknown} "
                        f"(the model's units are {list(units)})")
    for u, v in (per_unit.items() if per_unit else [("", zero_stage)]):
        if not is_int(v) or v not in ZERO_STAGES:
            where = f"manual_plan.zero_stage[{u!r}]" if u else "manual_plan.zero_stage"
            raise UserError(f"{where}={v!r}: no such ZeRO stage (use 1: optimizer state "
                            f"sharded, 2: also the gradients, 3: also the parameters)")
    return (1, dict(per_unit)) if per_unit else (zero_stage, {})


def check_layout(units, num_devices: int, layout="disaggregated", zero_stage=None,
                 fsdp_group=None, tp=None, model=None, **knobs) -> Colocation | None:
    """The co-located layout's `Colocation`, or None for the disaggregated one (whose
    `zero_stage` the Plan carries); `knobs`: the other manual_plan settings (bound ones are
    not None); `model` (an MLLMConfig): an encoder's tp must divide its heads and FFN."""
    if layout not in LAYOUTS:
        raise UserError(f"manual_plan.layout={layout!r}: no such layout (use "
                        f"\"disaggregated\", the default, or \"colocated\")")
    default, stages = _stages(units, zero_stage)
    if layout == "disaggregated":  # ZeRO 1-3 and FSDP groups per unit: the Plan carries
        unknown = [u for u in (fsdp_group if isinstance(fsdp_group, dict) else {})
                   if u not in units]  # them (Plan.validate checks each stage's size)
        if unknown:
            raise UserError(f"manual_plan.fsdp_group={fsdp_group!r}: unknown unit(s) "
                            f"{unknown} (the model's units are {list(units)})")
        return None
    for knob, value in knobs.items():
        if knob in _PIPELINE_ONLY and value is not None and value != {} and not (
                knob in ("pp", "cp", "num_chunks") and _all_one(value)):
            raise UserError(f"manual_plan.{knob}={value!r}: the co-located layout runs every "
                            f"unit data-parallel over all {num_devices} devices in one "
                            f"program, without pipelining, cp or per-unit dp (drop "
                            f"manual_plan.{knob}, or use manual_plan.layout=\"disaggregated\")")
    llm_tp, enc_tp = 1, {}
    for u, v in (tp.items() if isinstance(tp, dict) else [("", tp)] if tp is not None else []):
        where = f"manual_plan.tp[{u!r}]" if u else "manual_plan.tp"
        if u and u not in units:
            raise UserError(f"manual_plan.tp={tp!r}: unknown unit {u!r} (the model's units "
                            f"are {list(units)})")
        if not is_int(v) or v < 1:
            raise UserError(f"{where}={v!r}: must be an int >= 1")
        if v > 1 and not (u and (is_llm(u) or is_encoder(u))):
            raise UserError(f"{where}={v!r}: in the co-located layout only the llm and the "
                            f"encoders take tp, per unit; {u or 'the other units'} run "
                            f"data-parallel over every device (use manual_plan.tp = "
                            f"{{\"llm\": {v}}} or {{\"<encoder>\": {v}}})")
        if num_devices % v:
            raise UserError(f"{where}={v!r}: does not divide the {num_devices} devices (use a "
                            f"divisor of {num_devices})")
        # an encoder's heads and FFN (the LLM's tp splits what it divides, as before)
        for what, size in (tp_divisible(model, u) if model is not None and v > 1
                           and is_encoder(u) else []):
            if size % v:
                raise UserError(f"{where}={v!r}: does not divide {what}={size} (use a tp "
                                f"dividing {size})")
        if is_llm(u):
            llm_tp = v
        elif v > 1:
            enc_tp[u] = v
    sizes = sorted({llm_tp, *enc_tp.values()})
    for a, b in zip(sizes, sizes[1:]):
        if b % a:
            alt = next(m for m in range(b - b % a, a - 1, -a) if num_devices % m == 0)
            raise UserError(f"manual_plan.tp={tp!r}: tp {a} does not divide tp {b} (the "
                            f"co-located mesh nests each unit's tp group inside the next "
                            f"larger one: use sizes that divide each other, e.g. {a} and "
                            f"{alt} for {b})")
    top = sizes[-1]
    if fsdp_group is not None and (not is_int(fsdp_group) or fsdp_group < 1
                                   or num_devices % fsdp_group or fsdp_group % top):
        raise UserError(f"manual_plan.fsdp_group={fsdp_group!r}: must divide the "
                        f"{num_devices} devices and be a multiple of the largest tp {top} "
                        f"(e.g. {max(top, num_devices // 2)}, or drop it: one group of "
                        f"all devices)")
    return Colocation(llm_tp, tuple(sorted(stages.items())), default, fsdp_group,
                      tuple(sorted(enc_tp.items())))


def _all_one(value) -> bool:
    return all(v == 1 for v in (value.values() if isinstance(value, dict) else [value]))


def check_colocated_run(replan_every: int, trace_every: int, trace_steps) -> None:
    """The trainer settings a co-located run (one program, no plan) cannot honour."""
    for name, value in (("replan_every", replan_every), ("trace_every", trace_every),
                        ("trace_steps", trace_steps)):
        if value:
            raise UserError(f"train.{name}={value!r}: the co-located layout is one SPMD "
                            f"program with no pipeline plan to re-plan or trace (drop it, "
                            f"or use manual_plan.layout=\"disaggregated\")")
