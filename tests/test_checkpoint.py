"""Checkpoint integrity and fallback (train/checkpoint.py) on tiny pytrees: every kind of
damage to the newest checkpoint is named in one line and the previous one is restored;
checksums are sharding-independent; retention keeps the newest, the permanent and the
verified checkpoint."""
import glob
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from mmjax.train.checkpoint import CheckpointMismatch, Checkpointer
from mmjax.train.checkpoint_integrity import (NonFiniteState, global_checksums, leaf_checksum,
                                              partial_checksum)

LIKE = {"w": jnp.arange(4096, dtype=jnp.float32) / 7, "b": {"c": jnp.ones((3, 5), jnp.bfloat16)},
        "step": jnp.zeros((), jnp.int32)}


def state_at(step):
    return jax.tree.map(lambda x: x + step, LIKE)


def write(directory, steps=(1, 2), **kw):
    ck = Checkpointer(str(directory), **kw)
    for s in steps:
        ck.save(s, state_at(s), {"next": s})
    ck.close()


def data_files(step_dir):
    return sorted(glob.glob(os.path.join(step_dir, "state", "**", "d", "*"), recursive=True),
                  key=os.path.getsize)


def flip_bytes(d):  # 64 bytes inverted in the middle of the largest array file
    f = data_files(d)[-1]
    b = bytearray(open(f, "rb").read())
    for i in range(len(b) // 2, min(len(b), len(b) // 2 + 64)):
        b[i] ^= 0xFF
    open(f, "wb").write(bytes(b))


def truncate(d):
    f = data_files(d)[-1]
    b = open(f, "rb").read()
    open(f, "wb").write(b[:len(b) // 2])


def empty_files(d):
    for f in glob.glob(os.path.join(d, "**"), recursive=True):
        if os.path.isfile(f):
            open(f, "w").close()


def half_delete(d):
    for f in data_files(d)[::2]:
        os.remove(f)


def drop_state(d):
    shutil.rmtree(os.path.join(d, "state"))


def drop_integrity(d):
    shutil.rmtree(os.path.join(d, "integrity"))


def drop_manifest(d):
    os.remove(os.path.join(d, "state", "manifest.ocdbt"))


def edit_loader_state(d):  # the data item's JSON, a valid edit: next batch 2 -> 7
    files = [f for f in glob.glob(os.path.join(d, "data", "**"), recursive=True)
             if os.path.isfile(f) and '"next"' in open(f, errors="ignore").read()]
    assert len(files) == 1, files
    text = open(files[0]).read()
    open(files[0], "w").write(text.replace('"next": 2', '"next": 7').replace('"next":2',
                                                                             '"next":7'))
    assert open(files[0]).read() != text


DAMAGE = {"flipped bytes": (flip_bytes, "checksum mismatch"),
          "edited loader state": (edit_loader_state, "loader state checksum mismatch"),
          "truncated file": (truncate, "cannot read arrays"),
          "emptied files": (empty_files, "unreadable"),
          "half-deleted": (half_delete, "cannot read arrays"),
          "state item missing": (drop_state, "missing item(s) state"),
          "integrity item missing": (drop_integrity, "missing item(s) integrity"),
          "manifest missing": (drop_manifest, "cannot read arrays")}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damaged_newest_checkpoint_falls_back_to_previous(tmp_path, kind, capsys):
    ck_dir = tmp_path / "checkpoints"
    write(ck_dir)
    damage, reason = DAMAGE[kind]
    damage(str(ck_dir / "2"))
    lines = []
    ck = Checkpointer(str(ck_dir), log=lines.append)
    step, state, data = ck.restore_latest(LIKE)
    assert step == 1 and data == {"next": 1}
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(state_at(1))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert lines[0].startswith(f"checkpoint step 2 in {ck_dir} is unusable: ") and reason in lines[0]
    assert "moved to checkpoints.unusable/2, trying the next older one" in lines[0]
    assert len(lines[0]) < len(str(ck_dir)) + 300
    assert "Exception ignored" not in capsys.readouterr().err  # no page of tensorstore spec
    # set aside (kept for inspection), out of the way: step 2 can be saved again
    assert os.path.isdir(str(ck_dir) + ".unusable/2") and ck.steps() == [1]
    ck.save(2, state_at(2), {"next": 2})
    ck.close()
    step, _, _ = Checkpointer(str(ck_dir)).restore_latest(LIKE)
    assert step == 2


def test_stray_and_foreign_directories(tmp_path):
    """An empty dir named like a step is skipped (named); a stray temporary directory of an
    unfinished save is removed (named); other names are ignored."""
    ck_dir = tmp_path / "checkpoints"
    write(ck_dir)
    for name in ("9", "notes", "x_5", "3.orbax-checkpoint-tmp-1"):
        os.makedirs(ck_dir / name)
    lines = []
    ck = Checkpointer(str(ck_dir), log=lines.append)
    assert ck.steps() == [9, 2, 1]
    step, _, _ = ck.restore_latest(LIKE)
    assert step == 2
    assert len(lines) == 2 and lines[0].startswith("removed 3.orbax-checkpoint-tmp-1, the "
                                                   "temporary directory of an unfinished save")
    assert "checkpoint step 9" in lines[1] and "missing item(s)" in lines[1]
    assert not os.path.exists(ck_dir / "3.orbax-checkpoint-tmp-1")
    ck.close()
    assert os.path.isdir(ck_dir / "notes") and os.path.isdir(ck_dir / "x_5")


def test_every_checkpoint_damaged_starts_fresh_and_keeps_them(tmp_path):
    ck_dir = tmp_path / "checkpoints"
    write(ck_dir)
    for s in ("1", "2"):
        drop_state(str(ck_dir / s))
    lines = []
    ck = Checkpointer(str(ck_dir), log=lines.append)
    assert ck.restore_latest(LIKE) is None and len(lines) == 2
    assert sorted(os.listdir(str(ck_dir) + ".unusable")) == ["1", "2"]
    assert ck.set_aside == [2, 1]  # the trainer says it starts from step 0 because of them
    ck.close()


def test_other_models_checkpoint_is_a_user_error_not_damage(tmp_path):
    ck_dir = tmp_path / "checkpoints"
    named = {"params.w": LIKE["w"], "opt.count": LIKE["step"]}
    ck = Checkpointer(str(ck_dir))
    ck.save(1, named, {})
    ck.close()
    ck = Checkpointer(str(ck_dir), log=pytest.fail)
    state, _ = ck.restore(1, named)
    assert set(state) == set(named)  # a {name: array} state comes back by name
    with pytest.raises(CheckpointMismatch, match=r"params.w is float32\(4096,\), this run's "
                                                 r"is float32\(8,\): written by another model"):
        ck.restore_latest({**named, "params.w": jnp.zeros((8,), jnp.float32)})
    with pytest.raises(CheckpointMismatch, match=r"only in the checkpoint: \['params.w'\], "
                                                 r"only in this run: \['params.v'\]"):
        ck.restore_latest({"params.v": LIKE["w"], "opt.count": LIKE["step"]})
    assert ck.steps() == [1]  # nothing moved
    ck.close()


def test_nonfinite_state_is_never_written(tmp_path):
    ck = Checkpointer(str(tmp_path / "checkpoints"))
    with pytest.raises(NonFiniteState, match=r"params.w, float32\(3,\)"):
        ck.save(1, {"params.w": jnp.array([1.0, jnp.nan, 2.0])}, {})
    ck.close()
    assert ck.steps() == []


def test_retention_keeps_newest_permanent_and_verified(tmp_path):
    ck_dir = tmp_path / "checkpoints"
    write(ck_dir, steps=range(1, 8), keep=2, keep_every=3)
    assert Checkpointer(str(ck_dir)).steps() == [7, 6, 3]  # newest 2 + multiples of 3
    ck = Checkpointer(str(ck_dir), keep=1)
    step, _, _ = ck.restore_latest(LIKE)  # verified: never deleted by this run
    assert step == 7
    for s in (8, 9):
        ck.save(s, state_at(s), {"next": s})
    ck.close()
    assert ck.steps() == [9, 7]


def test_checksum_detects_one_flipped_bit_and_swaps_and_ignores_sharding():
    x = np.arange(64, dtype=np.float32).reshape(8, 8)
    base = leaf_checksum(x)
    for i in (0, 17, 63):
        for bit in (0, 13, 31):
            y = x.copy().reshape(-1)
            y.view(np.uint32)[i] ^= np.uint32(1 << bit)
            assert leaf_checksum(y.reshape(8, 8)) != base
    swapped = x.copy().reshape(-1)
    swapped[[3, 40]] = swapped[[40, 3]]
    assert leaf_checksum(swapped)[0] == base[0] and leaf_checksum(swapped) != base
    mesh = jax.make_mesh((4, 2), ("a", "b"), devices=jax.devices()[:8])
    for spec in (P("a", "b"), P("b", None), P()):
        assert leaf_checksum(jax.device_put(x, NamedSharding(mesh, spec))) == base
    for dt in (np.int64, np.float16, np.bool_, np.uint8):
        assert len(leaf_checksum(np.ones(5, dt))) == 2


def test_checksum_from_owned_shards_equals_the_whole_arrays():
    """What each process adds up in a multi-process save: the replica-0 shards it holds,
    positions in the global array. Over all shards it is the whole array's checksum."""
    mesh = jax.make_mesh((2, 2, 2), ("a", "b", "c"), devices=jax.devices()[:8])
    x = np.random.default_rng(0).standard_normal((4, 6, 8)).astype(np.float32)
    for spec in (P("a", "b", "c"), P(None, "c"), P("c", None, "a"), P()):
        y = jax.device_put(x, NamedSharding(mesh, spec))
        assert partial_checksum(y) == (*leaf_checksum(x), 0)
    x[1, 2, 3] = np.nan
    assert partial_checksum(jax.device_put(x, NamedSharding(mesh, P("a"))))[2] == 1
    scalar = np.array(5, np.int32)
    assert global_checksums([scalar, jnp.arange(10)]) == [
        (*leaf_checksum(scalar), False), (*leaf_checksum(np.arange(10, dtype=np.int32)), False)]


@pytest.mark.slow  # a benchmark smoke (orbax save/restore of ~300 arrays); saving and
# restoring themselves are covered by the default tests above
def test_bench_checkpoint_reports_save_and_restore(tmp_path):
    import json

    from helpers import load_script

    out = tmp_path / "bench.json"
    assert load_script("bench_checkpoint").main(
        ["--models", "tiny", "--repeats", "1", "--json", str(out)]) == 0
    r = json.loads(out.read_text())["models"]["tiny"]
    assert r["arrays"] > 300 and 0.003 < r["gb"] < 0.01  # params + two AdamW moments
    assert 0 < r["save_call_s"] <= r["commit_s"] and r["restore_s"] > 0


def _edit_integrity(step_dir, edit):
    path = os.path.join(step_dir, "integrity", "metadata")
    import json

    with open(path) as f:
        record = json.load(f)
    edit(record)
    with open(path, "w") as f:
        json.dump(record, f)


def _edit_data(step_dir):
    import json

    path = os.path.join(step_dir, "data", "metadata")
    with open(path) as f:
        data = json.load(f)
    data["next"] = 99
    with open(path, "w") as f:
        json.dump(data, f)


def test_a_checkpoint_of_this_version_without_its_loader_checksum_is_unusable(tmp_path):
    """Issue 43: a format-2 integrity record that lacks `data_sha256` (or an array's
    checksum) is refused, so an edited loader state cannot resume silently; step 1 is
    restored instead."""
    write(tmp_path)
    _edit_integrity(tmp_path / "2", lambda r: r.pop("data_sha256"))
    _edit_data(tmp_path / "2")
    logged = []
    step, _, data = Checkpointer(str(tmp_path), log=logged.append).restore_latest(LIKE)
    assert (step, data) == (1, {"next": 1})
    assert logged[0].startswith(f"checkpoint step 2 in {tmp_path} is unusable: the integrity "
                                f"record has no loader state checksum (edited or damaged); ")
    _edit_integrity(tmp_path / "1", lambda r: r["leaves"]["leaf_00000"].pop("checksum"))
    logged = []
    assert Checkpointer(str(tmp_path), log=logged.append).restore_latest(LIKE) is None
    assert logged[0].startswith(f"checkpoint step 1 in {tmp_path} is unusable: the integrity "
                                f"record has no checksum for 0 (edited or damaged); ")


def test_an_older_checkpoint_without_a_loader_checksum_is_named_once_as_unverified(tmp_path):
    write(tmp_path)
    _edit_integrity(tmp_path / "2", lambda r: (r.pop("data_sha256"), r.update(format=1)))
    logged = []
    step, _, data = Checkpointer(str(tmp_path), log=logged.append).restore_latest(LIKE)
    assert (step, data) == (2, {"next": 2})
    assert logged == [f"checkpoint step 2 in {tmp_path} was written before loader states "
                      f"were checksummed: its arrays are verified, its loader state is not"]
