"""Data source specs and the planner's workload from them (no JAX).

A spec names a loader source in one string, `<scheme>:<argument>`:

- `synthetic:laion`, `synthetic:mix` (optionally `synthetic:laion@7`, seed 7): the
  synthetic sets of data/synthetic.py, shaped for the model (`SyntheticConfig.for_model`);
- `arrayrecord:/data/train.arrayrecord`, or a bare path with `<path>.index.json` next to it:
  a file written by scripts/make_dataset.py (shapes from its index; no pixels are read).

A new scheme (e.g. a LLaVA JSON manifest) is one function `(argument, model) -> source`
added to `SCHEMES`: a source is anything with `__len__` and `spec(index)` (the loader's
interface; `load` is not needed for planning). `sample_workload` draws samples from the
source and reduces their shapes to the planner's `Workload` (DistTrain §3: the manager
samples the training data to analyse its distribution), so the orchestrator plans for the
user's data instead of a synthetic distribution.
"""
from __future__ import annotations

import os

import numpy as np

from mmjax.errors import UserError
from mmjax.data.sample import TokenRules
from mmjax.data.synthetic import KINDS, SyntheticConfig, SyntheticDataset
from mmjax.planner.workload import Workload, workload_from_metas


def _synthetic(arg: str, model):
    kind, _, seed = arg.partition("@")
    if kind not in KINDS:
        raise UserError(f"data spec synthetic:{arg}: unknown set {kind!r}; use one of "
                        f"{list(KINDS)} (e.g. synthetic:laion@0)")
    if seed and not seed.isdigit():
        raise UserError(f"data spec synthetic:{arg}: seed {seed!r} must be an integer")
    return SyntheticDataset(kind, SyntheticConfig.for_model(model), seed=int(seed or 0))


def _arrayrecord(arg: str, model):
    from mmjax.data.records import as_source  # grain / array_record on use only

    return as_source(arg)


SCHEMES = {"synthetic": _synthetic, "arrayrecord": _arrayrecord}


def open_source(spec: str, model):
    """The source a spec names (see the module docstring); one-line errors say the fix."""
    scheme, sep, arg = spec.partition(":")
    if sep and scheme in SCHEMES:
        if not arg:
            raise UserError(f"data spec {spec!r}: nothing after '{scheme}:'")
        return SCHEMES[scheme](arg, model)
    if os.path.exists(spec + ".index.json"):
        return _arrayrecord(spec, model)
    raise UserError(f"data spec {spec!r}: use one of {sorted(SCHEMES)} as '<scheme>:<arg>' "
                    f"(synthetic:laion, arrayrecord:/path) or the path of a file written by "
                    f"scripts/make_dataset.py")


def sample_workload(source, model, num_samples: int = 512, seed: int = 0,
                    name: str = "data") -> Workload:
    """The planner's workload of `num_samples` samples drawn without replacement from
    `source` (all of them when it holds fewer), from their shapes alone."""
    if num_samples < 1:
        raise UserError(f"num_samples={num_samples} must be >= 1")
    n = len(source)
    if n == 0:
        raise UserError(f"data source {name!r} is empty")
    rng = np.random.default_rng(seed)
    idx = (np.arange(n) if n <= num_samples
           else np.sort(rng.choice(n, num_samples, replace=False)))
    rules = TokenRules.from_config(model)
    metas = [rules.meta_from_shapes(int(i), source.spec(int(i))) for i in idx]
    return workload_from_metas(name, metas, model)
