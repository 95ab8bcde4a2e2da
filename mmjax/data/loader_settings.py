"""The `Loader.*` settings as two frozen groups (no JAX): `StreamSettings` (which samples a
step draws and how they are delivered: the sample stream's, data/sample_stream.py) and
`BalanceSettings` (how a plan spreads them over ranks: the batch planners'). gin stays the
user's syntax (`Loader.seed = 3`); `loader_settings(**given)` reads the bindings once,
`given` over them, and splits them. The settings table (mmjax/settings.py, a layer above)
validates gin's bindings and states the same defaults (tests/test_resume_schema.py holds
them equal); the checks below cover values passed in code.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import gin

from mmjax.data.batch_plan import NodeWise, post_balance_policies, unit_policies
from mmjax.errors import UserError

@dataclass(frozen=True)
class StreamSettings:
    """Sample choice (seed, shuffle, reserve, row_budget), its delivery (workers, prefetch,
    producers), the shape scan's length and the bad-data limit (data/loader.py's docstring
    describes each). `num_steps`: the stream's end, set by the program."""
    seed: int = 0
    shuffle: bool = True
    reserve: int | None = None
    row_budget: int | None = None
    max_bad_fraction: float = 0.5
    num_workers: int = 0
    prefetch: int = 2
    producers: int = 0
    producer_addresses: tuple | None = None
    producer_cpus: tuple | None = None
    producer_timeout: float = 300.0
    shape_scan_steps: int | None = None
    num_steps: int = 1 << 31

    def __post_init__(self):
        from mmjax.data.producer import endpoint

        if self.prefetch < 2:
            raise UserError(f"Loader.prefetch={self.prefetch}: use >= 2 (global batches "
                            f"prepared ahead, so planning and preprocessing stay off the "
                            f"training path; MMScale §6)")
        if self.producers < 0 or self.producer_timeout <= 0:
            raise UserError(f"Loader.producers={self.producers} / producer_timeout="
                            f"{self.producer_timeout}: use producers >= 0 and a timeout > 0 s")
        if self.delivered_by_producers and self.num_workers:
            raise UserError("Loader.num_workers and Loader.producers / producer_addresses are "
                            "both set: producers replace grain workers; keep one")
        for a in self.producer_addresses or ():
            try:
                endpoint(a)
            except ValueError as e:
                raise UserError(f"Loader.producer_addresses: {e}") from None
        if self.shape_scan_steps is not None and self.shape_scan_steps < 0:
            raise UserError(f"Loader.shape_scan_steps={self.shape_scan_steps}: use >= 0 (0: "
                            f"every microbatch at its own shapes, a compile per new shape)")

    @property
    def delivered_by_producers(self) -> bool:
        return bool(self.producers or self.producer_addresses)


@dataclass(frozen=True)
class BalanceSettings:
    """How a plan splits each microbatch over a unit's ranks: `balance` (one policy or unit
    -> policy), `post_balance_policy` (OrchMLLM's algorithm, one or per unit), the node-wise
    rearrangement (`node_wise`), context-parallel sharding (`cp_method`, `cp_block`), the
    hardware whose cost model times microbatches (DistTrain Algorithm 3) and the form of the
    data exchanges between layouts (`exchange`: "auto", "staged" or "ragged")."""
    balance: str | Mapping = "none"
    post_balance_policy: str | Mapping = "sum"
    ranks_per_node: int = 0
    node_wise_method: str = "auto"
    node_wise_time_limit: float = 0.2
    node_wise_max_milp_ranks: int = 32
    cp_method: str = "lpt"
    cp_block: int = 128
    hardware: str = "h100"
    exchange: str = "auto"  # the exchanges' form (parallel/ragged_exchange.py exchange_kind)

    def __post_init__(self):
        _ = self.node_wise  # a bad method or time limit fails here

    @property
    def node_wise(self) -> NodeWise:
        return NodeWise(self.ranks_per_node, self.node_wise_method, self.node_wise_time_limit,
                        self.node_wise_max_milp_ranks)

    def policies(self, model, packing: str = "pack") -> dict[str, str]:
        """Per unit its policy (`unit_policies`; one line for a bad entry)."""
        return unit_policies(self.balance, model, packing)

    def algos(self, model) -> dict[str, str]:
        """Per unit its OrchMLLM algorithm (`post_balance_policies`)."""
        return post_balance_policies(self.post_balance_policy, model)


@dataclass(frozen=True)
class LoaderSettings(StreamSettings, BalanceSettings):
    """Both groups' fields as one gin configurable, `Loader` (the name users write)."""

    def __post_init__(self):
        pass  # each group checks its own fields when `loader_settings` splits them


_configured = gin.external_configurable(LoaderSettings, "Loader")
_STREAM = {f.name for f in dataclasses.fields(StreamSettings)}
_BALANCE = {f.name for f in dataclasses.fields(BalanceSettings)}


def loader_settings(**given) -> tuple[StreamSettings, BalanceSettings]:
    """(stream, balance) settings from gin's `Loader.*` bindings, `given` over them."""
    unknown = sorted(set(given) - _STREAM - _BALANCE)
    if unknown:
        raise UserError(f"Loader: no setting {unknown[0]!r} (its settings: "
                        f"{sorted(_STREAM | _BALANCE)})")
    both = _configured(**given)
    kw = {f: getattr(both, f) for f in _STREAM | _BALANCE}
    for k in ("producer_addresses", "producer_cpus"):
        if kw[k] is not None:
            kw[k] = tuple(kw[k])
    return (StreamSettings(**{k: v for k, v in kw.items() if k in _STREAM}),
            BalanceSettings(**{k: v for k, v in kw.items() if k in _BALANCE}))
