"""Frozen: `SampleStream.select` as it was before issue 41's array selection (one
candidate at a time: grain's `index_shuffle` per stream position, the source's `spec`,
`problem` and `layout.check_shapes` per candidate). tests/test_selection.py checks the
array selection (data/selection.py) against it."""
from grain.experimental import index_shuffle

from mmjax.data.sample_stream import REPLACEMENTS
from mmjax.data.layout import check_shapes
from mmjax.data.records import source_problem
from mmjax.data.row_budget import fill_rows
from mmjax.data.skipped import Skipped
from mmjax.data.spec_list import meta_columns_of
from mmjax.errors import UserError


def _index(b, pos: int, salt: int = 0) -> int:
    n = len(b.source)
    epoch, i = divmod(pos, n)
    if b.settings.shuffle or salt:
        seed = (b.settings.seed * 1_000_003 + epoch + salt * 7_919) % (1 << 32)
        i = index_shuffle(index=i, max_index=n - 1, seed=seed, rounds=4)
    return int(i)


def _draws(b, p0: int):
    w = b.window
    for p in range(p0, p0 + w):
        yield _index(b, p)
    for j in range(min(len(b.source), REPLACEMENTS * w)):
        yield _index(b, p0 + j, salt=1)


def select(b, step: int, skipped: list | None = None, start: int | None = None):
    """(indices, specs, skip reasons) of stream `b`'s global batch `step`, the old way."""
    gb, mbs = b.global_batch, b.microbatches
    budget = b.settings.row_budget
    need = gb if budget is None else mbs
    idx, specs, reasons, seen = [], [], {}, set()
    for drawn, i in enumerate(_draws(b, b.start(step) if start is None else start)):
        if (len(idx) == gb if budget is None
                else drawn >= b.window and len(idx) >= need):
            break
        if i in seen:
            continue
        seen.add(i)
        spec = b.source.spec(i)
        why = source_problem(b.source, i) or check_shapes(spec, b.layout)
        if why:
            kind = why.split(":")[0]
            reasons[kind] = reasons.get(kind, 0) + 1
            if skipped is not None:
                skipped.append(Skipped.of(b.source, i, why))
        else:
            idx.append(i)
            specs.append(spec)
    if budget is not None:
        lens = meta_columns_of(idx, specs, b.layout.rules).llm_length.tolist()
        keep = fill_rows(lens, budget, b.layout.seq_len)
        keep = keep[:len(keep) - len(keep) % mbs]
        if len(keep) < need <= len(idx):
            raise UserError(f"row_budget: {len(keep)} samples")
        idx, specs = [idx[k] for k in keep], [specs[k] for k in keep]
    if len(idx) < need:
        raise UserError(f"global batch {step}: only {len(idx)} of {len(seen)} samples drawn "
                        f"are usable ({reasons})")
    return idx, specs, reasons
