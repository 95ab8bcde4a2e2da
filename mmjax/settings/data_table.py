"""The data path's settings: layout, sources (synthetic, file, LLaVA, WebDataset, held-out),
tokenizer, the Loader's balancing and producers, and the VAE."""
from __future__ import annotations

import dataclasses

from mmjax.data.balance import POLICIES as _POST_BALANCE
from mmjax.data.batch_plan import NODE_WISE_METHODS as _NODE_WISE
from mmjax.data.batch_plan import POLICIES as _BALANCE
from mmjax.data.chat import LOSS_ON as _LOSS_ON
from mmjax.data.layout import PACKINGS as _PACKING
from mmjax.data.synthetic import KINDS as _KINDS
from mmjax.data.token_distribution import METHODS as _CP_METHODS
from mmjax.parallel.ragged_tables import EXCHANGES as _EXCHANGES
from mmjax.planner.vae_placement import PLACEMENTS as _VAE_PLACEMENTS
from mmjax.settings.run_table import HARDWARE_NAMES
from mmjax.settings.setting import _BOOL, _PROGRAM, Setting, _float, _int

DATA_SETTINGS: dict[str, dict[str, Setting]] = {
    "data_layout": {
        "cfg": _PROGRAM, "special": _PROGRAM, "seq_len": _int(256, 8, 1 << 22),
        "packing": Setting("choice", "pad", choices=_PACKING),
        "vision_caps": Setting("ints", (64, 256, 1024), 1, 1 << 24),
        "audio_frame_caps": Setting("ints", (128, 256, 512, 1024), 1, 1 << 24),
        "gen_num_queries": _int(16, 1, 4096)},
    "synthetic_dataset": {
        "cfg": _PROGRAM, "kind": Setting("choice", "laion", choices=_KINDS), "seed": _int(0),
        "bad_fraction": _float(0.0, 0, 1, open_hi=True)},  # + SyntheticConfig **overrides
    "loader_source": {"default": _PROGRAM, "path": Setting("file", None, none=True,
                      fix="write the dataset with scripts/make_dataset.py --out=PATH")},
    "tokenizer": {"path": Setting("dir", None, none=True,
                                  fix="a directory holding tokenizer.json")},
    "Loader": {  # data/loader_settings.py: StreamSettings + BalanceSettings
        "num_steps": _PROGRAM,
        "balance": Setting("choice", "none", choices=_BALANCE, per_unit=True, needs="plan"),
        "post_balance_policy": Setting("choice", "sum", choices=_POST_BALANCE, per_unit=True,
                                       needs="plan"),
        "ranks_per_node": _int(0, 0, 1 << 16, needs="plan"), "seed": _int(0),
        "reserve": _int(None, 0, 1 << 20, none=True,
                        fix="a few times the bad samples expected per global batch, e.g. 8"),
        "shuffle": _BOOL[True], "num_workers": _int(0, 0, 256, needs="plan"),
        "prefetch": _int(2, 2, 256, needs="plan"),
        "cp_method": Setting("choice", "lpt", choices=_CP_METHODS, needs="plan"),
        "cp_block": _int(128, 1, 1 << 20, needs="plan"),
        "node_wise_method": Setting("choice", "auto", choices=_NODE_WISE, needs="plan"),
        "exchange": Setting("choice", "auto", choices=_EXCHANGES, needs="plan",
                            fix="auto: staged permutes; ragged: GPU ragged all-to-all (opt-in)"),
        "node_wise_time_limit": _float(0.2, 0, 3600, open_lo=True, needs="plan"),
        "node_wise_max_milp_ranks": _int(32, 1, 1 << 16, needs="plan"),
        "hardware": Setting("choice", "h100", choices=HARDWARE_NAMES, needs="plan"),
        "shape_scan_steps": _int(None, 0, 1 << 20, none=True, needs="plan",
                                 fix="None scans the whole run (up to 1024 global batches)"),
        "producers": _int(0, 0, 256, fix="0 preprocesses in this process"),
        "producer_addresses": Setting("strs", None, none=True,
                                      fix='"HOST:PORT" of `python -m mmjax.data.producer`'),
        "producer_cpus": Setting("ints", None, 0, 1 << 16, none=True),
        "producer_timeout": _float(300.0, 0, 86400, open_lo=True),
        "max_bad_fraction": _float(0.5, 0, 1, open_lo=True,
                                   fix="a share in (0, 1], e.g. 0.2; 1 never stops"),
        "row_budget": _int(None, 1, 1 << 20, none=True,
                           fix="LLM rows a global batch fills; None takes global_batch "
                               "samples a step")},
    "vae": {"path": Setting("dir", None, none=True,
                            fix="a diffusers AutoencoderKL directory (config.json + safetensors)"),
            "placement": Setting("choice", "auto", choices=_VAE_PLACEMENTS),
            "hardware": Setting("choice", "h100", choices=HARDWARE_NAMES),
            "step_time_s": _float(0.0, 0, 1e6)},
    "llava_source": {
        "model": _PROGRAM, "tokenizer": _PROGRAM, "max_tokens": _PROGRAM,
        "json_path": Setting("file", None, none=True, fix="a LLaVA .json or .jsonl file"),
        "image_root": Setting("str", "", needs="llava"),
        "audio_root": Setting("str", None, none=True, needs="llava"),
        "chat_template": Setting("str", None, none=True, needs="llava"),
        "loss_on": Setting("choice", "assistant", choices=_LOSS_ON, needs="llava"),
        "image_processor": Setting("str", None, none=True, needs="llava"),
        "audio_processor": Setting("str", None, none=True, needs="llava"),
        "index_workers": _int(8, 1, 256, needs="llava"), "output_images": _PROGRAM},
    "webdataset_source": {
        "model": _PROGRAM, "tokenizer": _PROGRAM, "max_tokens": _PROGRAM, "urls": Setting("strs", None, none=True),
        "chat_template": Setting("str", "plain", needs="webdataset"),
        "loss_on": Setting("choice", "assistant", choices=_LOSS_ON, needs="webdataset"),
        "image_processor": Setting("str", None, none=True, needs="webdataset"),
        "index_workers": _int(8, 1, 256, needs="webdataset")},
    "eval_source": {
        "model": _PROGRAM, "tokenizer": _PROGRAM,
        "json_path": Setting("file", None, none=True, needs="eval"),
        "image_root": Setting("str", "", needs="eval"),
        "urls": Setting("strs", None, none=True, needs="eval"),
        "chat_template": Setting("str", None, none=True, needs="eval"),
        "loss_on": Setting("choice", "assistant", choices=_LOSS_ON, needs="eval"),
        "image_processor": Setting("str", None, none=True, needs="eval"),
        "audio_processor": Setting("str", None, none=True, needs="eval"),
        "max_batches": _int(4, 1, 1 << 20, needs="eval")},}


# the model's sizes (`SyntheticConfig.for_model`): another value makes every sample undecodable
_MODEL = Setting("program", fix="the synthetic set takes it from the model")

# synthetic_dataset's **overrides: SyntheticConfig fields (data/synthetic.py)
SYNTHETIC_OVERRIDES: dict[str, Setting] = {
    "vocab_size": _int(512, 300, 1 << 24), "patch_size": _MODEL,
    "image_side_median": _float(4.0, 0, 1e4, open_lo=True),
    "image_side_sigma": _float(0.5, 0, 10), "image_side_range": Setting("range", (1, 16), 1, 4096),
    "max_images": _int(6, 0, 1024), "image_count_p": _float(0.55, 0, 1, open_lo=True),
    "text_len_median": _float(20.0, 0, 1e6, open_lo=True), "text_len_sigma": _float(0.8, 0, 10),
    "text_len_range": Setting("range", (1, 256), 1, 1 << 22), "n_mels": _MODEL,
    "frames_median": _float(96.0, 0, 1e6, open_lo=True), "frames_sigma": _float(0.6, 0, 10),
    "frames_range": Setting("range", (8, 1000), 1, 1 << 22),
    "latent_shape": _MODEL, "gen_queries": _int(16, 1, 4096),
    "gen_fraction": _float(0.0, 0, 1), "too_long_tokens": _int(1 << 15, 1, 1 << 30)}


def synthetic_fields() -> list[str]:
    """SyntheticConfig's field names the overrides table must cover (tests)."""
    from mmjax.data.synthetic import SyntheticConfig

    return [f.name for f in dataclasses.fields(SyntheticConfig) if f.name != "bad_fraction"]
