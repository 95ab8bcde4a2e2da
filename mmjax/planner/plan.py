"""`Plan`: the parallelisation of every unit of a multimodal model (no JAX).

A unit (an encoder branch with its projector, the LLM, the generator) gets its own devices
and its own DP/TP/PP (DistTrain §4.1 "parallelism unit"); the LLM may also have CP
(Cornstarch §4.3). Each stage is `dp * cp * tp` devices with TP innermost; which global
device indices it owns is `stage_devices()`: contiguous in `units` order, or node-aware
when `devices_per_node > 0` (every cp*tp group inside one node, planner/placement.py). The Megatron-style rigid plan (DistTrain §2.1,
Fig. 2) is just another Plan: encoders and generator are extra stages that share the LLM's
dp and tp (`Plan.rigid`).

Microbatches: the global batch of `global_batch` samples is cut into `num_microbatches`
microbatches of `global_batch // num_microbatches` samples; each unit splits every
microbatch over its own dp ranks.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from mmjax.errors import UserError
from mmjax.planner.placement import stage_devices
from mmjax.models.attention_names import IMPLEMENTATIONS
from mmjax.models.units import GENERATOR_UNIT, is_generator, is_llm, is_vae


class PlanError(UserError):
    """A plan that cannot run; the message names the field and the fix."""


@dataclass(frozen=True)
class UnitPlan:
    name: str
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    layers: tuple[int, ...] = ()  # layers per virtual stage (pp * num_chunks entries)
    num_chunks: int = 1  # interleaved 1F1B virtual stages per device stage
    frozen: bool = False
    overlap_tp: bool = False
    remat: str = "full"  # full / dots / none: pipeline/stage.py `remat_wrap`
    tp_chunks: int = 2  # overlap_tp: pieces per ring step (DistTrain §7, footnote 1)
    tp_bidirectional: bool = True  # overlap_tp: both ring directions
    cp_head_groups: int = 1  # cp > 1: K/V all-gathered in this many head groups (Cornstarch §5.3)
    attention_impl: str = "auto"  # models/attention.py bam_attention: auto/dense/chunked/pallas/cudnn
    zero_stage: int = 1  # ZeRO 1/2/3 over each stage's dp ranks (parallel/zero.py, pipeline/stage.py)
    fsdp_group: int = 0  # devices per ZeRO group in a stage (0: all), replicated across groups

    @property
    def devices_per_stage(self) -> int:
        return self.dp * self.cp * self.tp

    @property
    def num_devices(self) -> int:
        return self.devices_per_stage * self.pp

    def stage_layers(self, stage: int, chunk: int = 0) -> tuple[int, int]:
        """[start, end) layer range of virtual stage `chunk * pp + stage`."""
        v = chunk * self.pp + stage
        start = sum(self.layers[:v])
        return start, start + self.layers[v]


@dataclass(frozen=True)
class Plan:
    units: tuple[UnitPlan, ...]
    global_batch: int
    num_microbatches: int
    kind: str = "disaggregated"  # or "rigid", "ratio", "manual"
    devices_per_node: int = 0  # > 0: node-aware placement (planner/placement.py); 0: contiguous
    predicted: dict = field(default_factory=dict, compare=False)

    # ---- access -------------------------------------------------------------------------
    def unit(self, name: str) -> UnitPlan:
        for u in self.units:
            if u.name == name:
                return u
        raise KeyError(f"plan has no unit {name!r}; units: {[u.name for u in self.units]}")

    @property
    def unit_names(self) -> tuple[str, ...]:
        return tuple(u.name for u in self.units)

    @property
    def num_devices(self) -> int:
        return sum(u.num_devices for u in self.units)

    @property
    def microbatch_size(self) -> int:
        return self.global_batch // self.num_microbatches

    def stage_devices(self) -> dict[str, list[list[int]]]:
        """Per unit, per pipeline stage, its indices into the global device list (mesh
        order: dp-major, then cp, then tp); see planner/placement.py."""
        return stage_devices(self.units, self.devices_per_node)

    # ---- construction -------------------------------------------------------------------
    @staticmethod
    def even_layers(num_layers: int, num_stages: int) -> tuple[int, ...]:
        """Split `num_layers` over `num_stages`, earlier stages taking the remainder."""
        if num_stages < 1 or num_layers < num_stages:
            raise PlanError(f"cannot split {num_layers} layers over {num_stages} stages")
        q, r = divmod(num_layers, num_stages)
        return tuple(q + (1 if i < r else 0) for i in range(num_stages))

    @classmethod
    def uniform(cls, model, global_batch: int, num_microbatches: int, kind="manual",
                devices_per_node: int = 0, **unit_kw) -> "Plan":
        """Every unit with the given dp/tp/pp (per-unit dicts allowed: dp={"llm": 2})."""
        units = []
        for name in model.unit_names:
            kw = {k: (v.get(name, _UNIT_DEFAULTS[k]) if isinstance(v, dict)
                      else v) for k, v in unit_kw.items()}
            if is_vae(name):  # one whole stage: plain (all-unit) tp / pp / chunks skip it
                kw = {k: v for k, v in kw.items()
                      if k not in ("tp", "pp", "num_chunks") or isinstance(unit_kw[k], dict)}
            if not is_llm(name):
                kw.pop("cp", None)
                kw.pop("cp_head_groups", None)
            pp, chunks = kw.get("pp", 1), kw.get("num_chunks", 1)
            kw.setdefault("layers", cls.even_layers(model.num_layers(name), pp * chunks))
            units.append(UnitPlan(name=name, frozen=model.frozen(name), **kw))
        return cls(tuple(units), global_batch, num_microbatches, kind=kind,
                   devices_per_node=devices_per_node)

    @classmethod
    def rigid(cls, model, dp: int, tp: int, pp: int, global_batch: int,
              num_microbatches: int) -> "Plan":
        """Megatron-LM's rigid orchestration (DistTrain §2.1): the LLM on dp x tp x pp, each
        encoder and the generator one extra pipeline stage with the LLM's dp and tp."""
        units = []
        for name in model.unit_names:
            upp = pp if is_llm(name) else 1
            units.append(UnitPlan(name=name, dp=dp, tp=1 if is_vae(name) else tp, pp=upp,
                                  layers=cls.even_layers(model.num_layers(name), upp),
                                  frozen=model.frozen(name)))
        return cls(tuple(units), global_batch, num_microbatches, kind="rigid")

    # ---- validation ---------------------------------------------------------------------
    def validate(self, model, num_devices: int) -> "Plan":
        """Reject a plan that cannot run on `model` with `num_devices`, before any work."""
        known = set(model.unit_names)
        names = [u.name for u in self.units]
        for n in names:
            if n not in known:
                raise PlanError(f"Plan.units: unknown unit {n!r}; the model has units "
                                f"{sorted(known)}: rename or remove it")
        missing = known - set(names)
        if missing:
            raise PlanError(f"Plan.units: no entry for {sorted(missing)}; add a UnitPlan for each")
        if len(set(names)) != len(names):
            raise PlanError(f"Plan.units: duplicate unit names {names}")
        if self.num_devices > num_devices:
            raise PlanError(f"Plan needs {self.num_devices} devices (sum of dp*cp*tp*pp over "
                            f"units) but only {num_devices} exist: lower dp/tp/pp, or on CPU "
                            f"force host devices with XLA_FLAGS=--xla_force_host_platform_"
                            f"device_count={self.num_devices}")
        if not isinstance(self.devices_per_node, int) or self.devices_per_node < 0:
            raise PlanError(f"Plan.devices_per_node={self.devices_per_node!r} must be an int "
                            f">= 0 (0: contiguous placement)")
        self.stage_devices()  # a placement that cannot pack says so now
        if self.num_microbatches < 1 or self.global_batch % self.num_microbatches:
            raise PlanError(f"Plan.global_batch={self.global_batch} is not divisible by "
                            f"num_microbatches={self.num_microbatches}: pick a divisor")
        mb = self.microbatch_size
        for u in self.units:
            where = f"Plan.unit[{u.name!r}]"
            for k in ("dp", "tp", "pp", "cp", "num_chunks"):
                if getattr(u, k) < 1:
                    raise PlanError(f"{where}.{k}={getattr(u, k)} must be >= 1")
            if mb % u.dp:
                raise PlanError(f"{where}.dp={u.dp} does not divide the microbatch size {mb} "
                                f"(global_batch/num_microbatches): choose dp dividing {mb}")
            if u.overlap_tp and (not is_llm(u.name) or u.tp < 2 or u.cp > 1):
                raise PlanError(f"{where}.overlap_tp=True needs the llm unit with tp >= 2 and "
                                f"cp == 1 (got tp={u.tp}, cp={u.cp}): set overlap_tp=False")
            if u.overlap_tp and u.attention_impl == "pallas":
                raise PlanError(f"{where}: overlap_tp=True runs attention inside a type-checked "
                                f"shard_map the Pallas kernel cannot enter: set attention_impl "
                                f"to 'chunked' or overlap_tp=False")
            if u.cp > 1 and not is_llm(u.name):
                raise PlanError(f"{where}.cp={u.cp}: context parallelism is for the llm only")
            if is_vae(u.name):
                _validate_vae(self, u, where)
            _validate_zero(u, where)
            _validate_knobs(model, u, where)
            n_layers = model.num_layers(u.name)
            nv = u.pp * u.num_chunks
            if n_layers < nv:
                raise PlanError(f"{where}: {n_layers} layers cannot fill pp*num_chunks={nv} "
                                f"stages: lower pp or num_chunks")
            if len(u.layers) != nv or sum(u.layers) != n_layers or min(u.layers) < 1:
                raise PlanError(f"{where}.layers={u.layers} must have pp*num_chunks={nv} "
                                f"positive entries summing to {n_layers}")
            if u.num_chunks > 1 and self.num_microbatches % u.pp:
                raise PlanError(f"{where}: interleaved 1F1B needs num_microbatches "
                                f"({self.num_microbatches}) to be a multiple of pp={u.pp}")
            for what, size in tp_divisible(model, u.name):
                if size % u.tp:
                    raise PlanError(f"{where}.tp={u.tp} does not divide {what}={size}: "
                                    f"choose tp dividing {size}"
                                    + (" or pad the vocabulary to a multiple of tp"
                                       if what == "llm.vocab_size" else ""))
        return self

    # ---- JSON ---------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"units": [dataclasses.asdict(u) for u in self.units],
                "global_batch": self.global_batch, "num_microbatches": self.num_microbatches,
                "kind": self.kind, "devices_per_node": self.devices_per_node,
                "predicted": self.predicted}

    @classmethod
    def from_json(cls, d: dict) -> "Plan":
        """A Plan from its JSON; every field is checked for presence and type (PlanError
        naming it), so a hand-edited plan never silently falls back to a default."""
        if not isinstance(d, dict):
            raise PlanError(f"Plan JSON: expected an object, got {type(d).__name__}")
        # scripts/plan.py --json also records what it compared (read by people, not here)
        report = {"model", "solve_time_s", "baselines"}
        unknown = set(d) - {"units", "global_batch", "num_microbatches", "kind",
                            "devices_per_node", "predicted"}
        unknown -= report
        if unknown:
            raise PlanError(f"Plan JSON: unknown fields {sorted(unknown)}; allowed: units, "
                            f"global_batch, num_microbatches, kind, devices_per_node, "
                            f"predicted (and the "
                            f"report fields {sorted(report)})")
        for k in ("global_batch", "num_microbatches"):
            _check_type(f"Plan JSON {k}", d.get(k, _MISSING), int)
        _check_type("Plan JSON kind", d.get("kind", "manual"), str)
        _check_type("Plan JSON predicted", d.get("predicted", {}), dict)
        _check_type("Plan JSON devices_per_node", d.get("devices_per_node", 0), int)
        if not isinstance(d.get("units"), list) or not d["units"]:
            raise PlanError("Plan JSON units: must be a non-empty list of unit objects "
                            "(write plans with scripts/plan.py --json)")
        return cls(tuple(_unit_from_json(u) for u in d["units"]), d["global_batch"],
                   d["num_microbatches"], kind=d.get("kind", "manual"),
                   devices_per_node=d.get("devices_per_node", 0),
                   predicted=d.get("predicted", {}))

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=2)

    @classmethod
    def load(cls, path: str) -> "Plan":
        try:
            with open(path) as f:
                d = json.load(f)
        except (OSError, ValueError) as e:
            raise PlanError(f"plan file {path}: cannot read it as JSON ({e}); write it with "
                            f"scripts/plan.py --json") from None
        return cls.from_json(d)


_UNIT_DEFAULTS = {f.name: f.default for f in dataclasses.fields(UnitPlan)}
_UNIT_REQUIRED = ("name", "dp", "tp", "pp", "layers")  # the rest have defaults (older JSON)
_MISSING = object()


def _check_type(where: str, value, kind) -> None:
    if value is _MISSING:
        raise PlanError(f"{where}: missing; add it (scripts/plan.py --json writes every field)")
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if not ok:
        want = "true/false" if kind is bool else kind.__name__
        raise PlanError(f"{where}={value!r}: must be {want}")


def _unit_from_json(u) -> UnitPlan:
    if not isinstance(u, dict):
        raise PlanError(f"Plan JSON units: each entry must be an object, got {u!r}")
    name = u.get("name", "?")
    extra = set(u) - set(_UNIT_DEFAULTS) - {"name"}
    if extra:
        raise PlanError(f"Plan JSON unit {name!r}: unknown fields {sorted(extra)}; allowed: "
                        f"{sorted(_UNIT_DEFAULTS)}")
    for k in _UNIT_REQUIRED:
        if k not in u:
            raise PlanError(f"Plan JSON unit {name!r}: field {k!r} is missing; add it")
    _check_type("Plan JSON unit name", u["name"], str)
    for k, v in u.items():
        if k in ("name", "layers"):
            continue
        _check_type(f"Plan JSON unit {name!r} {k}", v, type(_UNIT_DEFAULTS[k]))
    layers = u["layers"]
    if not isinstance(layers, (list, tuple)) or not all(
            isinstance(x, int) and not isinstance(x, bool) for x in layers):
        raise PlanError(f"Plan JSON unit {name!r} layers={layers!r}: must be a list of ints")
    return UnitPlan(**{**u, "layers": tuple(layers)})
REMAT_POLICIES = ("full", "dots", "none")  # pipeline/stage.py `remat_wrap` implements them
ATTENTION_IMPLS = IMPLEMENTATIONS  # models/attention.py implements them


def _validate_knobs(model, u: UnitPlan, where: str) -> None:
    """remat policy, attention implementation, overlapped-TP chunking and CP head groups."""
    if u.remat not in REMAT_POLICIES:
        raise PlanError(f"{where}.remat={u.remat!r}: must be one of {list(REMAT_POLICIES)}")
    if u.attention_impl not in ATTENTION_IMPLS:
        raise PlanError(f"{where}.attention_impl={u.attention_impl!r}: must be one of "
                        f"{list(ATTENTION_IMPLS)}")
    if u.attention_impl == "cudnn" and not is_generator(u.name):
        raise PlanError(f"{where}.attention_impl='cudnn': cuDNN runs only plain causal or full "
                        f"masks (the generator's), and {u.name!r} attends under segment or "
                        f"bitfield masks: use 'auto', 'chunked' or 'pallas'")
    if isinstance(u.tp_chunks, bool) or not isinstance(u.tp_chunks, int) or u.tp_chunks < 1:
        raise PlanError(f"{where}.tp_chunks={u.tp_chunks!r} must be an int >= 1")
    if not isinstance(u.tp_bidirectional, bool):
        raise PlanError(f"{where}.tp_bidirectional={u.tp_bidirectional!r} must be true/false")
    g = u.cp_head_groups
    if isinstance(g, bool) or not isinstance(g, int) or g < 1:
        raise PlanError(f"{where}.cp_head_groups={g!r} must be an int >= 1")
    if g > 1 and not is_llm(u.name):
        raise PlanError(f"{where}.cp_head_groups={g}: CP head groups are for the llm only; "
                        f"set it to 1")
    if g > 1 and model.llm.num_kv_heads % (u.tp * g):
        raise PlanError(f"{where}.cp_head_groups={g}: tp * cp_head_groups = {u.tp * g} must "
                        f"divide llm.num_kv_heads={model.llm.num_kv_heads} (each tp rank "
                        f"gathers its kv heads in cp_head_groups groups): lower it")


def _validate_vae(plan: Plan, u: UnitPlan, where: str) -> None:
    """The frozen VAE unit: one stage, no tensor parallelism, its dp dividing the
    generator's (its latents reach the generator's ranks in row order, DistTrain §7's
    order-preserving broker)."""
    if u.tp != 1 or u.num_chunks != 1:
        raise PlanError(f"{where}: the VAE unit runs whole on each of its devices: set tp=1 "
                        f"and num_chunks=1 (got tp={u.tp}, num_chunks={u.num_chunks})")
    gen = plan.unit(GENERATOR_UNIT).dp
    if gen % u.dp:
        raise PlanError(f"{where}.dp={u.dp} does not divide the generator's dp={gen}: "
                        f"give the VAE unit a divisor of {gen} devices")


ZERO_STAGES = (1, 2, 3)


def _validate_zero(u: UnitPlan, where: str) -> None:
    """ZeRO-3 runs each stage's layers on shared (dp-sharded) weights, gathered per layer
    inside the scan; the CP and overlapped-TP paths keep per-rank weight copies. An FSDP
    group (OrchMLLM §7 hybrid sharding) is whole dp ranks of a stage."""
    if isinstance(u.zero_stage, bool) or u.zero_stage not in ZERO_STAGES:
        raise PlanError(f"{where}.zero_stage={u.zero_stage!r}: no such ZeRO stage (use 1: "
                        f"optimizer state sharded, 2: also the gradients, 3: also the "
                        f"parameters)")
    g, size = u.fsdp_group, u.devices_per_stage
    if isinstance(g, bool) or not isinstance(g, int) or g < 0 or (g and (
            size % g or g % (u.tp * u.cp))):
        raise PlanError(f"{where}.fsdp_group={g!r}: must divide the stage's {size} devices "
                        f"(dp x cp x tp) and be a multiple of cp x tp = {u.tp * u.cp} (e.g. "
                        f"{u.tp * u.cp}, or 0: one group of all of them)")
    if u.zero_stage == 3 and (u.cp > 1 or u.overlap_tp):
        knob = "cp" if u.cp > 1 else "overlap_tp"
        raise PlanError(f"{where}.zero_stage=3 with {knob}={getattr(u, knob)!r}: ZeRO-3 "
                        f"gathers each layer's weights in the layer scan, which the "
                        f"{knob} path does not run (use zero_stage 1 or 2, or drop {knob})")


def tp_divisible(model, unit: str):
    """(name, size) pairs that tensor parallelism must divide for this unit."""
    if is_llm(unit):
        c = model.llm
        # tensor.py also shards the embedding and lm_head over the vocabulary
        return [("llm.num_heads", c.num_heads), ("llm.num_kv_heads", c.num_kv_heads),
                ("llm.ffn_size", c.ffn_size), ("llm.vocab_size", c.vocab_size)]
    if is_generator(unit):
        c = model.generator
        return [("generator.num_heads", c.num_heads), ("generator.ffn_size", c.ffn_size)]
    if is_vae(unit):  # tp = 1 (`_validate_vae`)
        return []
    c = model.encoder(unit).encoder
    return [(f"{unit}.num_heads", c.num_heads), (f"{unit}.ffn_size", c.ffn_size)]
