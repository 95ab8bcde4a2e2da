"""The units of a multimodal model and their roles, as types (no JAX).

A unit is an encoder branch (named by its config: "vision", "audio", ...), the LLM, the
generator or the generator's frozen VAE encoder (a unit when the planner places it on
devices: it turns target pixels into the latents the generator denoises). Its `UnitRole` decides what it reads and computes, so code asks `role(name)`
instead of comparing names. `UnitDag` is the one execution DAG (every encoder -> LLM ->
generator, Cornstarch §4.1), built from the model config (`MLLMConfig.units`) or from a
plan's unit names; the model, the stage graph, the planner and the runtime read it.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Iterable, Sequence


class UnitRole(enum.Enum):
    ENCODER = "encoder"
    LLM = "llm"
    GENERATOR = "generator"
    VAE = "vae"  # the generator's frozen image encoder: pixels -> latents, forward only


# The units whose names are fixed; an encoder is named by its config.
LLM_UNIT = UnitRole.LLM.value
GENERATOR_UNIT = UnitRole.GENERATOR.value
VAE_UNIT = UnitRole.VAE.value
_FIXED = {LLM_UNIT: UnitRole.LLM, GENERATOR_UNIT: UnitRole.GENERATOR, VAE_UNIT: UnitRole.VAE}


def role(name: str) -> UnitRole:
    """The role of the unit called `name`: the fixed names, else an encoder branch."""
    return _FIXED.get(name, UnitRole.ENCODER)


def is_encoder(name: str) -> bool:
    return role(name) is UnitRole.ENCODER


def is_llm(name: str) -> bool:
    return role(name) is UnitRole.LLM


def is_generator(name: str) -> bool:
    return role(name) is UnitRole.GENERATOR


def is_vae(name: str) -> bool:
    return role(name) is UnitRole.VAE


def has_vae(names: Iterable[str]) -> bool:
    """Whether the units `names` include the generator's VAE as a unit (device placement)."""
    return any(is_vae(n) for n in names)


def has_llm(names: Iterable[str]) -> bool:
    """Whether the units `names` (or a per-unit dict's keys) include the LLM."""
    return any(is_llm(n) for n in names)


def has_generator(names: Iterable[str]) -> bool:
    """Whether the units `names` (a config's, a plan's, or a per-unit dict) include one."""
    return any(is_generator(n) for n in names)


def topological_order(names: Sequence[str], edges: Sequence[tuple[str, str]]) -> list[str]:
    """`names` in a topological order of `edges` (Kahn's algorithm; ties keep the given
    order). Raises ValueError on an edge naming an unknown unit or a cycle."""
    units = list(names)
    for src, dst in edges:
        if src not in units or dst not in units:
            raise ValueError(f"dag() edge ({src!r}, {dst!r}) names a unit that is not "
                             f"in the model; units: {units}")
    indeg = {u: sum(1 for _, d in edges if d == u) for u in units}
    order, ready = [], [u for u in units if indeg[u] == 0]
    while ready:
        u = ready.pop(0)
        order.append(u)
        for src, dst in edges:
            if src == u:
                indeg[dst] -= 1
                if indeg[dst] == 0:
                    ready.append(dst)
    if len(order) != len(units):
        raise ValueError(f"dag() has a cycle through {[u for u in units if u not in order]}")
    return order


@dataclass(frozen=True)
class UnitDag:
    """The unit execution DAG: `names` in execution order (encoders in config order, the
    VAE if it is a unit, the LLM, the generator if any) and `edges` (encoder -> LLM,
    LLM -> generator, VAE -> generator)."""

    names: tuple[str, ...]
    edges: tuple[tuple[str, str], ...]

    @classmethod
    def of(cls, names: Iterable[str]) -> "UnitDag":
        """The DAG over the units `names` (any order; encoders keep theirs). Raises
        ValueError unless there is exactly one LLM and names are unique, or on a VAE
        without a generator."""
        names = tuple(names)
        if len(set(names)) != len(names):
            raise ValueError(f"unit names repeat: {list(names)}")
        if LLM_UNIT not in names:
            raise ValueError(f"no {LLM_UNIT!r} unit (units: {list(names)}); every model has one")
        if has_vae(names) and not has_generator(names):
            raise ValueError(f"a {VAE_UNIT!r} unit without a {GENERATOR_UNIT!r} (units: "
                             f"{list(names)}): the VAE encodes the generator's targets")
        encoders = tuple(n for n in names if is_encoder(n))
        vae = (VAE_UNIT,) if has_vae(names) else ()
        tail = (LLM_UNIT,) + ((GENERATOR_UNIT,) if has_generator(names) else ())
        edges = (tuple((e, LLM_UNIT) for e in encoders) + tuple(zip(tail[:-1], tail[1:]))
                 + tuple((v, GENERATOR_UNIT) for v in vae))
        return cls(encoders + vae + tail, edges)

    @classmethod
    def from_config(cls, cfg) -> "UnitDag":
        """The DAG of an `MLLMConfig`: its encoders, its VAE unit if it has one (`cfg.vae`),
        the LLM, its generator if it has one."""
        return cls.of(tuple(e.name for e in cfg.encoders)
                      + ((VAE_UNIT,) if cfg.vae is not None else ())
                      + (LLM_UNIT,) + ((GENERATOR_UNIT,) if cfg.generator is not None else ()))

    @property
    def encoders(self) -> tuple[str, ...]:
        return tuple(n for n in self.names if is_encoder(n))

    @property
    def has_generator(self) -> bool:
        return has_generator(self.names)

    def predecessors(self, name: str) -> list[str]:
        return [a for a, b in self.edges if b == name]

    def successors(self, name: str) -> list[str]:
        return [b for a, b in self.edges if a == name]
