"""Records read lazily from a `SpecTable` (data/table_records.py, issue 41) equal the
gathered columns exactly: `meta_columns` (one gather of the table's per-segment metadata)
equals `TokenRules.meta_from_shapes` and `SpecColumns.meta_columns` of the same records,
under markers and without; `take`, `spec`, `concat_records` and `SpecList` give back the
specs; an unknown modality is refused."""
import numpy as np
import pytest

from mmjax.data.layout import AssemblyLayout
from mmjax.data.meta_columns import MetaColumns
from mmjax.data.spec_columns import SpecColumns, SpecTable
from mmjax.data.table_records import TableRecords, concat_records
from mmjax.data.spec_list import SpecList, meta_columns_of
from test_meta_columns import _model, random_specs


def _same(a: MetaColumns, b: MetaColumns) -> bool:
    return all(np.array_equal(getattr(a, f), getattr(b, f)) and
               getattr(a, f).dtype == getattr(b, f).dtype
               for f in ("ids", "counts", "modality", "llm_tokens", "encoder_tokens",
                         "input_size", "masked", "delimiters"))


@pytest.mark.parametrize("markers", [True, False])
def test_meta_columns_equal_the_gathered_columns(markers):
    layout = AssemblyLayout.from_config(_model(True), 1024, "pack", vision_caps=(256, 1024))
    rules = layout.rules if markers else layout.rules.__class__(
        **{**layout.rules.__dict__, "markers": False})
    rng = np.random.default_rng(5)
    specs = [[e if e[0] != "image_out" else ("image_out", (4, 8, 8), 16) for e in s]
             for s in random_specs(rng, 400)]
    table = SpecTable.from_specs(specs)
    items = rng.permutation(len(specs))[:250]
    ids = (items * 7 + 1).tolist()
    lazy = TableRecords(table, items)
    assert len(lazy) == 250 and np.array_equal(lazy.counts, table.take(items).counts)
    got = lazy.meta_columns(ids, rules)
    assert _same(got, table.take(items).meta_columns(ids, rules))
    assert got.metas() == [rules.meta_from_shapes(i, specs[k]) for i, k in zip(ids, items)]
    assert _same(meta_columns_of(ids, SpecList(lazy), rules), got)
    parts = [lazy.take(np.arange(0, 100)), lazy.take(np.arange(100, 250))]
    joined = concat_records(parts)
    assert isinstance(joined, TableRecords) and np.array_equal(joined.items, items)
    mixed = concat_records([parts[0], parts[1].columns])
    assert isinstance(mixed, SpecColumns)
    back = SpecList(joined)
    assert list(back) == [specs[k] for k in items] == list(SpecList(mixed))
    assert back[3] == lazy.spec(3) == specs[items[3]]


def test_an_unknown_modality_is_refused():
    table = SpecTable.from_specs([[("text", (5,), 0)], [("video", (3,), 0)]])
    rules = AssemblyLayout.from_config(_model(False), 256, "pack").rules
    with pytest.raises(ValueError, match="unknown modality; use one of"):
        TableRecords(table, np.array([0, 1])).meta_columns([0, 1], rules)


@pytest.mark.parametrize("gen", [False, True])
def test_table_meta_plans_as_the_gathered_columns(gen):
    """A table batch's lazy `MetaColumns` (data/table_meta.py: per-record totals and shape
    columns gathered, per-segment fields on read) equals the gathered columns': per-sample
    totals, `shape_columns` (every slot's items per sample), each unit's rank shapes,
    `meta(p)`, and the plan of the batch (splits and every unit's shapes)."""
    from mmjax.data.batch_plan import plan_global_batch, unit_policies
    from mmjax.data.batch_shapes import rank_shapes
    from mmjax.data.sample import MODALITIES
    from mmjax.data.shape_columns import shape_columns
    from mmjax.data.table_meta import TableMetaColumns
    from mmjax.planner.plan import Plan
    from test_meta_columns import _model as model_of
    model = model_of(gen)
    layout = AssemblyLayout.from_config(model, 2048, "pack", vision_caps=(256, 1024, 4096))
    rng = np.random.default_rng(41)
    specs = [[e if e[0] != "image_out" else ("image_out", (4, 8, 8), 16) for e in s
              if e[0] != "image_out" or gen] for s in random_specs(rng, 300)]
    table = SpecTable.from_specs(specs)
    items = rng.choice(len(specs), 240, replace=False)
    ids = (items * 3).tolist()
    lazy = TableRecords(table, items).meta_columns(ids, layout.rules)
    want = table.take(items).meta_columns(ids, layout.rules)
    assert isinstance(lazy, TableMetaColumns) and len(lazy) == 240
    for got, ref in [(lazy.llm_length, want.llm_length), (lazy.num_targets, want.num_targets),
                     *((lazy.count(m), want.count(m)) for m in MODALITIES)]:
        assert got.dtype == np.int64 and np.array_equal(got, ref)
    assert [lazy.meta(p) for p in range(0, 240, 7)] == [want.meta(p) for p in range(0, 240, 7)]
    mods = tuple(e.modality for e in model.encoders)
    a, b = shape_columns(lazy, layout, mods), shape_columns(want, layout, mods)
    assert np.array_equal(a.llm, b.llm) and np.array_equal(a.image_out, b.image_out)
    assert all(np.array_equal(a.encoder_tokens[m], b.encoder_tokens[m]) for m in mods)
    order = rng.permutation(240)
    for s in b.items:
        assert all(np.array_equal(x, y) for x, y in zip(a.items[s].take(order),
                                                         b.items[s].take(order)))
    import pickle
    for s in a.items:  # pickled (a plan sent by a producer) as the batch's runs alone
        back = pickle.loads(pickle.dumps(a.items[s]))
        assert back.values.size == back.counts.sum()
        assert all(np.array_equal(x, y) for x, y in zip(back.take(order),
                                                         b.items[s].take(order)))
    counts = np.array([0, 50, 1, 120, 69])
    assert rank_shapes(a, order, counts, layout) == rank_shapes(b, order, counts, layout)
    plan = Plan.uniform(model, 240, 2, dp={"llm": 4, "vision": 3, "audio": 2, "generator": 2})
    policies = unit_policies("orchmllm", model)
    x, y = (plan_global_batch(m, model, plan, layout, policies) for m in (lazy, want))
    assert [mp.positions for mp in x] == [mp.positions for mp in y]
    assert all(dict(p.shapes) == dict(q.shapes) and all(
        np.array_equal(p.splits[u].items, q.splits[u].items) for u in p.splits)
        for p, q in zip(x, y))
