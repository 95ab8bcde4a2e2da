"""`held_out_loss`: the one evaluation loop of every runner (train/runner.py `Runner.evaluate`):
the mean LM loss per trained token over the held-out set's first global batches, selected
unshuffled by the loader exactly as for training, so every runner and plan evaluates the
same samples and reports the same `eval_loss` (docs/design.md "Validation on a plan")."""
from __future__ import annotations

from typing import Any, Callable

from mmjax.data.sources import eval_batches


def held_out_loss(source, max_batches: int, global_batch: int,
                  open_batches: Callable[[int], Any],
                  loss_and_tokens: Callable[[Any], tuple[float, int]]) -> float:
    """`open_batches(n)`: the runner's stream of the held-out set's first n global batches
    (closed here); `loss_and_tokens(item)`: one item's mean LM loss per trained token and
    its trained tokens."""
    n = eval_batches(source, max_batches, global_batch)
    data = open_batches(n)
    total, count = 0.0, 0
    try:
        for _ in range(n):
            loss, tokens = loss_and_tokens(next(data))
            total += loss * tokens
            count += tokens
    finally:
        data.close()
    return total / max(count, 1)
