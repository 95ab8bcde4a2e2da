"""The trainer's checks of its own settings, in the order a run meets them: the plain
settings before the model is built (`check_run_settings`), then those that need the model
and the chosen layout (`check_run_model`). Each refuses with one `UserError` line."""
from __future__ import annotations

import jax

from mmjax.data.sources import eval_source
from mmjax.errors import UserError
from mmjax.settings import check_bound_settings
from mmjax.train.colocated_data import check_colocated_loader
from mmjax.train.data_config import layout_and_source
from mmjax.train.validate import check_data_path


def check_run_settings(spec, replanner=None) -> None:
    """`train`'s settings that need no model, beyond each field's own check (`RunSpec`):
    the gin bindings' types, ranges and modes, and the data file."""
    check_bound_settings(None, spec.plan, spec.eval_every, spec.replan_every)
    if replanner is not None and not spec.replan_every:
        raise UserError("train(replanner=...) is used every train.replan_every steps: set "
                        "train.replan_every=N")
    check_data_path()


def check_run_model(cfg, tok, dirs, plan, colo, global_batch, eval_every, replan_every,
                    attention_impl, dtype):
    """The settings that need the model and the layout (`colo`: the co-located layout's
    settings or None), checked; -> the held-out set (`train.eval_every`) or None."""
    if cfg.vae is not None and (colo is not None or replan_every):
        raise UserError(f"vae.placement chose the device (a frozen VAE unit), which "
                        f"{'the co-located layout' if colo is not None else 'train.replan_every'}"
                        f" does not place: set vae.placement='host' (the data path encodes)")
    if colo is not None:  # the loader's balancing settings, as the co-located layout reads them
        check_colocated_loader(cfg, layout_and_source(cfg, tok)[0], jax.device_count(),
                               colo.max_tp)
    held_out = eval_source(cfg, tok) if eval_every else None
    if eval_every and held_out is None:
        raise UserError("train.eval_every needs a held-out set: set eval_source.json_path "
                        "(a LLaVA JSON/JSONL) or eval_source.urls (WebDataset shards)")
    if attention_impl is not None:
        from mmjax.models.attention import choose_implementation

        choose_implementation(attention_impl, 1, 1, dtype)  # reject a bad name up front
    return held_out
