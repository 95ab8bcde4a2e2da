#!/usr/bin/env python
"""Export a training checkpoint as Hugging Face checkpoints:
`python scripts/export_hf.py --workdir=DIR [--step=N] --out=OUT`.

Writes OUT/llm (Llama / Qwen2 safetensors + config.json, sharded above 5 GB with
model.safetensors.index.json), OUT/<encoder> for CLIP / SigLIP-shaped towers and Whisper
encoders (written back over the checkpoint each was imported from: untouched tensors
copied), OUT/model for a run started from a whole LLaVA (`pretrained.model`), and
OUT/mmjax_extra.safetensors for projectors / generator. Frozen pretrained units are re-read
from the files the run recorded (refused in one line if gone or changed). Single-program and
plan checkpoints alike, on any host: no plan device count is needed. Each checkpoint keeps its
source's config.json, processor / tokenizer files, dtype and layout; --dtype casts every
checkpoint (mmjax_extra.safetensors too), --layout=tf4|tf5 writes a Qwen2-VL or whole-LLaVA
run in transformers 4's or 5's layout. A LoRA run (lora.units) takes --adapter (a peft adapter
of its base: OUT/adapter for a LLaVA run, OUT/llm_adapter otherwise) or --merge (the base with
the adapters merged, written as above)."""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mmjax.errors import UserError  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--workdir", required=True, help="training workdir (holds run.json, checkpoints/)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--max_shard_gb", type=float, default=5.0, help="shard size (GB)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="cast every checkpoint to this dtype (default: each source's own; "
                        "a unit with no source as trained)")
    p.add_argument("--layout", default=None, choices=["tf4", "tf5"],
                   help="a Qwen2-VL or whole-LLaVA run's config / tensor-name layout: "
                        "transformers 4 or 5 "
                        "(default: its source's)")
    p.add_argument("--adapter", action="store_true",
                   help="a LoRA run: write its peft adapter (adapter_config.json + "
                        "adapter_model.safetensors)")
    p.add_argument("--merge", action="store_true",
                   help="a LoRA run: write the base checkpoint with the adapters merged")
    args = p.parse_args(argv)
    from mmjax.train.checkpoint import CheckpointUnusable
    from mmjax.train.export import export_workdir

    try:
        written = export_workdir(args.workdir, args.out, args.step,
                                 int(args.max_shard_gb * 10 ** 9), args.dtype, args.layout,
                                 args.adapter, args.merge)
    except (UserError, ValueError, FileNotFoundError, CheckpointUnusable) as e:
        raise UserError(f"{e}")
    for unit, path in written.items():
        print(f"{unit}: {path}")
    return 0


if __name__ == "__main__":
    from mmjax.cli import run_main

    sys.exit(run_main(main))
