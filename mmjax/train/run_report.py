"""What a run tells on the console beyond the step lines: skipped samples (each reason the
first time it occurs, and a count with its share in the summary), the validation loss, and
which pretrained weights were loaded from where. The files (metrics.jsonl, skipped.jsonl)
hold the same facts per step; the console says them once, so a user sees them."""
from __future__ import annotations

from collections import Counter

from mmjax.models.units import is_vae


class SkipReport:
    """Per reason (the part of a skip reason before ':', e.g. `too_long`) the skips of this
    invocation; `say` prints the first sample skipped for each reason as it happens."""

    def __init__(self, say, skipped_path: str):
        self.say, self.path = say, skipped_path
        self.reasons: Counter = Counter()
        self.total = 0

    def step(self, n: int, count: int, listed: list[tuple[str, str]]) -> None:
        """Step `n` skipped `count` samples, `listed` as (sample id, reason, where...)."""
        self.total += count
        for name, why, *_ in listed:
            kind = why.partition(":")[0].strip() or "other"
            if not self.reasons[kind]:
                self.say(f"step {n}: skipped sample {name} ({why}); every skip is counted in "
                         f"metrics.jsonl and named in {self.path}")
            self.reasons[kind] += 1

    def summary(self, trained: int) -> str | None:
        """"skipped 18 samples (7.5% of the 240 trained): too_long 18 ..." or None."""
        if not self.total:
            return None
        unlisted = self.total - sum(self.reasons.values())
        parts = [f"{k} {v}" for k, v in self.reasons.most_common()]
        parts += [f"other {unlisted}"] if unlisted > 0 else []
        share = 100.0 * self.total / max(trained, 1)
        return (f"skipped {self.total} samples ({share:.1f}% of the {trained} trained, "
                f"replaced by others): {', '.join(parts)}; see {self.path}")


def pretrained_lines(cfg, dirs: dict) -> list[str]:
    """"loaded pretrained llm from DIR (N tensors)", one per unit read from a checkpoint
    (each tensor of the unit's load plan, every one checked before any work)."""
    from mmjax.models.hf.pretrained import load_plan, unit_config

    out = []
    for unit, path in dirs.items():
        if is_vae(unit):  # the generator's frozen VAE as a unit (vae.placement = device)
            out.append(f"loaded the frozen VAE unit from {path} (runs on devices)")
            continue
        if unit == "adapter":  # pretrained.adapter: a peft adapter on the base
            out.append(f"loaded the LoRA adapter from {path} on {list(cfg.lora_units())}")
            continue
        if unit == "model":  # a whole LLaVA: tower, projector and LLM
            from mmjax.models.hf.llava import llava_load_plan
            n = len(llava_load_plan(path, cfg).entries)
            out.append(f"loaded pretrained model (every unit) from {path} ({n} tensors)")
            continue
        n = len(load_plan(path, unit_config(cfg, unit)).entries)
        out.append(f"loaded pretrained {unit} from {path} ({n} tensors)")
    return out
