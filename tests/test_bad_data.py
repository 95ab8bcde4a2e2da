"""Bad data never stops a run (issue 28): a LLaVA JSONL set with ~10% bad items (lines that
are not JSON, undecodable and missing images, conversations the template cannot render)
trains to the end; every bad item is in skipped.jsonl with its file, line and reason; a
stopped and resumed run draws exactly the same batches and skips."""
import json
import os

import gin
import numpy as np
import pytest

import mmjax.data.loader  # noqa: F401  (registers Loader with gin)
from mmjax.data.example_data import write_llava_example
from mmjax.train.trainer import train

REPO = os.path.join(os.path.dirname(__file__), os.pardir)
STEPS = 16  # x 8 samples with no reserve: every line of the first epoch is drawn


def _bad_llava_jsonl(root: str) -> tuple[str, dict]:
    """-> (the JSONL path, {id: expected reason prefix}) of ~10% bad items."""
    ex = write_llava_example(root, num_samples=100)
    with open(ex["json"]) as f:
        records = json.load(f)
    images = ex["image_root"]
    want = {"corrupt-image": ("unreadable", "decode"), "missing-image": ("missing",)}
    for name in ("0002.png", "0004.png"):  # header intact, pixels cut: fails at decode
        raw = open(os.path.join(images, name), "rb").read()
        open(os.path.join(images, name), "wb").write(raw[:len(raw) // 2])
    for r in records:
        if r.get("image") in ("0002.png", "0004.png"):
            want[r["id"]] = ("decode",)
    records += [
        {"id": "robot-turn", "conversations": [{"from": "robot", "value": "beep"}]},
        {"id": "turns-not-a-list", "conversations": "hello"},
        {"id": "two-placeholders", "image": "0006.png", "conversations": [
            {"from": "human", "value": "<image>\n<image>\nWhat?"},
            {"from": "gpt", "value": "Two."}]}]
    want.update({"robot-turn": ("chat",), "turns-not-a-list": ("chat",),
                 "two-placeholders": ("placeholders",)})
    lines = [json.dumps(r) for r in records]
    rng = np.random.default_rng(0)
    for k, junk in enumerate(['{"id": "cut", "conversations": [', "not json at all",
                              '{"id": 3, "image": ', "]"]):
        at = int(rng.integers(1, len(lines)))
        lines.insert(at, junk)
    path = os.path.join(root, "train.jsonl")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    for n, line in enumerate(lines, 1):
        try:
            json.loads(line)
        except ValueError:
            want[f"line-{n}"] = ("json",)
    return path, want


def _run(work, root, path, *extra):
    gin.parse_config_files_and_bindings(
        [os.path.join(REPO, "configs", "examples", "llava_tiny.gin")],
        [f"tokenizer.path = '{root}/tokenizer'", f"llava_source.json_path = '{path}'",
         f"llava_source.image_root = '{root}/images'", f"train.steps = {STEPS}",
         "train.checkpoint_every = 100", "train.progress = False",
         # no reserve: each bad draw is replaced from the second stream (GlobalBatchBuilder)
         "Loader.reserve = 0", *extra],
        finalize_config=False)
    try:
        return train(work)
    finally:
        gin.clear_config()


def _rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_a_tenth_bad_llava_set_trains_to_the_end_naming_every_bad_item(tmp_path):
    root = str(tmp_path / "data")
    path, want = _bad_llava_jsonl(root)
    n_lines = sum(1 for _ in open(path))
    assert 0.08 < len(want) / n_lines < 0.15, (len(want), n_lines)
    straight = str(tmp_path / "straight")
    recs = _run(straight, root, path)
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    assert all(np.isfinite(r["loss"]) for r in recs)
    skipped = _rows(os.path.join(straight, "skipped.jsonl"))
    by_id = {r["id"]: r for r in skipped}
    assert set(want) <= set(by_id), sorted(set(want) - set(by_id))
    assert recs[-1]["skipped_samples"] == len(skipped)
    for sid, prefixes in want.items():
        row = by_id[sid]
        assert row["reason"].split(":")[0] in prefixes, row
        assert row["file"] == path and isinstance(row["line"], int), row
    for n, line in enumerate(open(path), 1):  # each row names its own line
        if line.strip() and f"line-{n}" not in want:
            rec = json.loads(line)
            if rec.get("id") in by_id:
                assert by_id[rec["id"]]["line"] == n
    # a restart makes the same choices: stopped after 6 steps, resumed, the same rows
    work = str(tmp_path / "resumed")
    _run(work, root, path, "train.stop_after = 6", "train.checkpoint_every = 3")
    _run(work, root, path, "train.checkpoint_every = 3")
    a, b = _rows(os.path.join(straight, "metrics.jsonl")), _rows(os.path.join(work,
                                                                             "metrics.jsonl"))
    keys = ("step", "loss", "grad_norm", "tokens_seen", "tokens_trained", "skipped_samples")
    assert [{k: r[k] for k in keys} for r in a] == [{k: r[k] for k in keys} for r in b]
    assert _rows(os.path.join(work, "skipped.jsonl")) == skipped


@pytest.mark.slow
def test_a_mostly_bad_set_stops_with_one_line_naming_the_worst_file(tmp_path):
    root = str(tmp_path / "data")
    path, _ = _bad_llava_jsonl(root)
    from mmjax.train.trainer import TrainingStopped

    with pytest.raises(TrainingStopped) as e:
        _run(str(tmp_path / "run"), root, path, "Loader.max_bad_fraction = 0.02")
    msg = str(e.value).splitlines()[0]  # gin appends "In call to configurable" lines
    assert "Loader.max_bad_fraction=0.02" in msg and "see skipped.jsonl" in msg, msg
    assert "most in: train.jsonl (" in msg, msg


def test_the_bad_fraction_rule_names_the_worst_files(tmp_path):
    from mmjax.train.bad_data import too_much_bad_data

    log = tmp_path / "skipped.jsonl"
    log.write_text("".join(json.dumps({"step": 1, "id": str(k), "file": f, "line": k,
                                       "reason": "json: x"}) + "\n"
                           for k, f in enumerate(["/d/a.jsonl"] * 3 + ["/d/b.jsonl"] * 5)))
    assert too_much_bad_data(3, 8, 8, 0.5, str(log)) is None  # 8 of 32: under 4 batches
    assert too_much_bad_data(4, 8, 8, 0.5, str(log)) is None  # 8 of 40 = 20%
    why = too_much_bad_data(4, 8, 8, 0.1, str(log))
    assert why.startswith("8 of 40 samples drawn by step 4 were bad (20% > "
                          "Loader.max_bad_fraction=0.1); most in: b.jsonl (5), a.jsonl (3)")
    assert too_much_bad_data(4, 8, 8, 1.0, str(log)) is None
