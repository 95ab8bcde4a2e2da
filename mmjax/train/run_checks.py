"""The trainer's checks of its own settings, in the order a run meets them: the plain
settings before the model is built (`check_run_settings`), then those that need the model
and the chosen layout (`check_run_model`). Each refuses with one `UserError` line."""
from __future__ import annotations

import jax

from mmjax.data.sources import eval_source
from mmjax.errors import UserError
from mmjax.settings import check_bound_settings, check_train_args
from mmjax.train.colocated_data import check_colocated_loader
from mmjax.train.data_config import layout_and_source, train_source
from mmjax.train.validate import (check_data_path, check_replan_settings, check_train_settings,
                                  parse_trace_steps)


def check_run_settings(steps, global_batch, compute_dtype, dtypes, seed, checkpoint_every,
                       progress, stop_after, plan, keep_checkpoints, keep_every,
                       max_bad_steps, eval_every, attention_impl, trace_every,
                       compilation_cache_dir, replan_every, replan_min_gain, replanner,
                       spike_factor, spike_window, startup_timeout,
                       trace_steps) -> tuple[int, int]:
    """`train`'s settings that need no model, checked; -> `train.trace_steps` as (A, B)."""
    check_train_settings(steps, global_batch, compute_dtype, dtypes, seed, checkpoint_every,
                         progress, stop_after, plan, keep_checkpoints, keep_every, max_bad_steps)
    check_train_args(eval_every=eval_every, attention_impl=attention_impl,
                     trace_every=trace_every, compilation_cache_dir=compilation_cache_dir,
                     replan_every=replan_every, spike_factor=spike_factor,
                     spike_window=spike_window)
    if isinstance(startup_timeout, bool) or not isinstance(startup_timeout, (int, float)) \
            or not 1 <= startup_timeout <= 86400:
        raise UserError(f"train.startup_timeout={startup_timeout!r}: must be seconds in "
                        f"[1, 86400] (how long processes wait for each other at start-up)")
    if 0 < spike_factor <= 1:
        raise UserError(f"train.spike_factor={spike_factor!r}: must be 0 (off) or > 1 (a "
                        f"step above that many times the median is held back; e.g. 100)")
    check_bound_settings(None, plan, eval_every, replan_every)  # types and ranges
    trace_range = parse_trace_steps(trace_steps, plan)
    check_replan_settings(replan_every, replan_min_gain, plan, replanner)
    check_data_path()
    return trace_range


def check_run_model(cfg, tok, dirs, plan, colo, global_batch, eval_every, replan_every,
                    attention_impl, dtype):
    """The settings that need the model and the layout (`colo`: the co-located layout's
    settings or None), checked; -> the held-out set (`train.eval_every`) or None."""
    if cfg.vae is not None and (colo is not None or replan_every):
        raise UserError(f"vae.placement chose the device (a frozen VAE unit), which "
                        f"{'the co-located layout' if colo is not None else 'train.replan_every'}"
                        f" does not place: set vae.placement='host' (the data path encodes)")
    if colo is not None:  # the loader's balancing settings, as the co-located layout reads them
        lay, src = layout_and_source(cfg, tok)
        check_colocated_loader(cfg, lay, src if src is not None else train_source(cfg),
                               global_batch, jax.device_count(), colo.max_tp)
    held_out = eval_source(cfg, tok) if eval_every else None
    if eval_every and held_out is None:
        raise UserError("train.eval_every needs a held-out set: set eval_source.json_path "
                        "(a LLaVA JSON/JSONL) or eval_source.urls (WebDataset shards)")
    if attention_impl is not None:
        from mmjax.models.attention import choose_implementation

        choose_implementation(attention_impl, 1, 1, dtype)  # reject a bad name up front
    return held_out
