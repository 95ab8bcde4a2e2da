"""The pipelined trainer reads a gin-bound ArrayRecord dataset written by
scripts/make_dataset.py (`loader_source.path`), decoding in the loader (DistTrain §4.2);
records that are truncated or whose Riegeli chunk checksum fails are skipped, counted and
named; a file that cannot be opened is a one-line error naming it."""
import importlib.util
import json
import os

import gin
import numpy as np
import pytest

from mmjax.data.records import ArrayRecordSource, DecodeError
from mmjax.data.loader import Loader  # noqa: F401 (gin: the `Loader.*` bindings below)
from mmjax.data.batch_plan import unit_policies
from mmjax.errors import UserError
from mmjax.models.config import with_overrides
from mmjax.models.tiny import tiny
from mmjax.planner.plan import Plan
from mmjax.train.data_config import data_layout
from mmjax.train.trainer import train

_PATH = os.path.join(os.path.dirname(__file__), os.pardir, "scripts", "make_dataset.py")
_spec = importlib.util.spec_from_file_location("make_dataset_script", _PATH)
make_dataset = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_dataset)


@pytest.mark.slow
def test_pipelined_training_from_make_dataset_arrayrecord(tmp_path):
    data = str(tmp_path / "tiny.arrayrecord")
    make_dataset.main(["--model=tiny", "--kind=laion", "--num_samples=40", "--seed=1",
                       "--corrupt_fraction=0.3", f"--out={data}"])
    src = ArrayRecordSource(data)
    assert len(src) == 40 and src.patch_size == 4 and src.max_grid == 16
    cfg = with_overrides(tiny(), {"llm.num_layers": 2, "encoders.vision.encoder.num_layers": 1,
                                  "generator.num_layers": 1})
    plan_path = str(tmp_path / "plan.json")
    Plan.uniform(cfg, 4, 2, dp={"vision": 2}, pp={"llm": 2}).save(plan_path)
    builder = Loader.build(src, cfg, Plan.load(plan_path), data_layout(cfg),
                                 unit_policies("orchmllm", cfg), reserve=8).builder
    # flip 16 bytes inside the chunks of two intact records the run will read: their
    # Riegeli chunk checksums fail (a RuntimeError from the reader)
    intact = [i for step in range(2) for i in builder.stream.select(step)[0] if _decodes(src, i)]
    flipped = intact[:1] + intact[-1:]
    raw = bytearray(open(data, "rb").read())
    for i in flipped:
        at = raw.index(b'{"id": %d, "segments"' % i) + 40
        raw[at:at + 16] = bytes(b ^ 0xFF for b in raw[at:at + 16])
    open(data, "wb").write(bytes(raw))
    src = ArrayRecordSource(data)
    for i in flipped:
        with pytest.raises(DecodeError, match=rf"unreadable: {data} record {i} \(RuntimeError: "
                                              rf"Corrupted Riegeli/records file: chunk"):
            src.load(i)
    with gin.unlock_config():
        gin.parse_config([f"loader_source.path = '{data}'", "Loader.balance = 'orchmllm'",
                          "Loader.reserve = 8"])
    try:
        recs = train(str(tmp_path / "run"), model=cfg, steps=2, global_batch=4,
                     progress=False, plan=plan_path, checkpoint_every=100)
    finally:
        gin.clear_config()
    assert [r["step"] for r in recs] == [1, 2]
    assert all(np.isfinite(r["loss"]) and r["loss"] > 0 for r in recs)
    # exactly the file's skips: bad shapes, and truncated records (blanked, counted) that
    # the synthetic fallback does not have
    builder = Loader.build(src, cfg, Plan.load(plan_path), data_layout(cfg),
                                 unit_policies("orchmllm", cfg), reserve=8).builder
    gbs = [builder(step) for step in range(2)]
    undecodable = [i for g in gbs for i in g.sample_ids if not _decodes(src, i)]
    assert set(flipped) < set(undecodable)
    assert sum(g.skip_reasons.get("decode", 0) for g in gbs) == len(undecodable)
    assert [r["skipped_samples"] for r in recs] == list(np.cumsum([g.skipped_samples
                                                                   for g in gbs]))
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        assert [json.loads(x)["step"] for x in f] == [1, 2]


def _decodes(src, i) -> bool:
    try:
        src.load(i)
        return True
    except DecodeError:
        return False


@pytest.mark.parametrize("damage", ["emptied", "truncated", "no index", "missing"])
def test_unopenable_dataset_is_one_line_error_naming_the_file(tmp_path, damage):
    data = str(tmp_path / "d.arrayrecord")
    make_dataset.main(["--model=tiny", "--kind=laion", "--num_samples=12", f"--out={data}"])
    raw = open(data, "rb").read()
    if damage == "emptied":
        open(data, "wb").close()
    elif damage == "truncated":
        open(data, "wb").write(raw[:len(raw) // 2])
    elif damage == "no index":
        os.remove(data + ".index.json")
    else:
        os.remove(data)
    with pytest.raises(UserError) as e:
        from mmjax.data.records import as_source
        as_source(data)
    msg = str(e.value)
    assert data in msg and "\n" not in msg and "scripts/make_dataset.py" in msg, msg


@pytest.mark.slow
def test_three_damaged_records_are_each_skipped_and_named(tmp_path):
    """Issue 28: three separate damaged records (Riegeli chunk checksums broken at three
    places of the file) are each skipped, counted and written to skipped.jsonl with the
    file, the record index and an "unreadable" reason; the run trains to the end. A damaged
    record the index already rejects (too long) is skipped for that reason without a read,
    and damage in a record never drawn has nothing to report, so the three are chosen among
    the records the run reads."""
    data = str(tmp_path / "three.arrayrecord")
    make_dataset.main(["--model=tiny", "--kind=laion", "--num_samples=16", "--seed=1",
                       f"--out={data}"])
    cfg = with_overrides(tiny(), {"llm.num_layers": 1, "encoders.vision.encoder.num_layers": 1,
                                  "generator.num_layers": 1})
    src = ArrayRecordSource(data)
    layout = data_layout(cfg)
    from mmjax.data.layout import check_shapes
    usable = [i for i in range(16) if check_shapes(src.spec(i), layout) is None]
    damaged = [usable[1], usable[len(usable) // 2], usable[-1]]
    raw = bytearray(open(data, "rb").read())
    for i in damaged:
        at = raw.index(b'{"id": %d, "segments"' % i) + 40
        raw[at:at + 16] = bytes(b ^ 0xFF for b in raw[at:at + 16])
    open(data, "wb").write(bytes(raw))
    with gin.unlock_config():  # in order, no reserve: steps 1-4 draw records 0-15
        gin.parse_config([f"loader_source.path = '{data}'", "Loader.shuffle = False",
                          "Loader.reserve = 0"])
    try:
        recs = train(str(tmp_path / "run"), model=cfg, steps=4, global_batch=4,
                     progress=False, checkpoint_every=100)
    finally:
        gin.clear_config()
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert all(np.isfinite(r["loss"]) for r in recs)
    with open(tmp_path / "run" / "skipped.jsonl") as f:
        rows = [json.loads(x) for x in f]
    assert recs[-1]["skipped_samples"] == len(rows)
    unreadable = {r["record"]: r for r in rows if r["reason"].startswith("unreadable:")}
    assert sorted(unreadable) == sorted(damaged)
    for i, row in unreadable.items():
        assert row["file"] == data and row["id"] == f"{data}:{i}"
        assert f"record {i} (RuntimeError: Corrupted Riegeli/records file: chunk" in row["reason"]
    # the rest of the rows are the index's own rejections, never a damaged record's
    assert all(r["reason"].startswith("too_long") for r in rows
               if not r["reason"].startswith("unreadable:"))
