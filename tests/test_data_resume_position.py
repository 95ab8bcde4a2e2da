"""The loader's position in samples (issue 43 item 7, data/stream_position.py): a run
resumed with another global batch goes on from the sample it stopped at, reading exactly
what an uninterrupted run with the new batch reads from there; a state that stores only the
step (written before) resumes as it always did."""
from mmjax.data.layout import AssemblyLayout
from mmjax.data.loader import Loader
from mmjax.data.stream_position import StreamOrigin, resume_notice

from test_data_loader import CFG, LAYOUT, SCAN, digest, plan, source

# windows: 4 + reserve 2 = 6 and 8 + reserve 1 = 9, so 3 old steps end at sample 18 = 2 * 9:
# the resumed run's batches are global batches 2, 3, 4 of an uninterrupted run at batch 8
OLD, NEW = dict(gb=4, reserve=2), dict(gb=8, reserve=1)


def _loader(gb, reserve, bad=0.2, layout=LAYOUT):
    return Loader.build(source(bad=bad), CFG, plan(gb=gb), layout, seed=4, reserve=reserve,
                  shape_scan_steps=SCAN, balance="orchmllm")


def test_a_larger_global_batch_resumes_at_the_stored_sample():
    old = _loader(**OLD)
    before = [next(old) for _ in range(3)]
    state = old.get_state()
    old.close()
    assert state == {"step": 3, "sample": 18, "global_batch": 4, "seq_len": 192}
    new = _loader(**NEW)
    new.set_state(state)
    after = [next(new) for _ in range(3)]
    assert [g.step for g in after] == [3, 4, 5]
    assert new.get_state() == {"step": 6, "sample": 18 + 3 * 9, "global_batch": 8,
                               "seq_len": 192}
    # the candidates of all six batches are the stream's first 18 + 27 positions, in order,
    # each once: nothing read twice, nothing skipped
    windows = [old.stream.candidates(s) for s in range(3)] + \
              [new.stream.candidates(s) for s in range(3, 6)]
    stream = [new.stream._index(p) for p in range(18 + 27)]
    assert [i for w in windows for i in w] == stream
    # bit for bit the batches an uninterrupted run at batch 8 draws from sample 18 on
    straight = _loader(**NEW)
    ref = [next(straight) for _ in range(5)][2:]
    straight.close()
    assert [digest(g) for g in after] == [digest(g) for g in ref]
    assert [g.sample_ids for g in after] == [g.sample_ids for g in ref]
    assert all(len(g.sample_ids) == 8 for g in after)
    assert not set(i for g in before for i in g.sample_ids) & \
        set(i for g in after for i in g.sample_ids)
    new.close()


def test_a_smaller_global_batch_resumes_mid_window():
    """Two steps at window 9 end at sample 18; at window 6 (batch 4, reserve 2) batch k >= 2
    then starts at 18 + (k - 2) * 6, not at k * 6 (12: six samples read twice)."""
    big = _loader(**NEW)
    for _ in range(2):
        next(big)
    state = big.get_state()  # sample 18
    big.close()
    small = _loader(**OLD, bad=0.0)
    small.set_state(state)
    got = [next(small) for _ in range(2)]
    assert [small.stream.start(s) for s in (2, 3)] == [18, 24]
    for g in got:
        assert small.stream.candidates(g.step) == [
            small.stream._index(p) for p in range(small.stream.start(g.step),
                                                   small.stream.start(g.step) + 6)]
    assert small.get_state()["sample"] == 30
    small.close()


def test_an_unchanged_resume_is_the_uninterrupted_run():
    a = _loader(**OLD)
    want = [digest(next(a)) for _ in range(5)]
    a.close()
    b = _loader(**OLD)
    for _ in range(2):
        next(b)
    state = b.get_state()
    b.close()
    c = _loader(**OLD)
    c.set_state(state)
    assert [digest(next(c)) for _ in range(3)] == want[2:]
    c.close()
    # a state that stores only the step (positions in batches, before): the same batches
    d = _loader(**OLD)
    d.set_state({"step": 2})
    assert [digest(next(d)) for _ in range(3)] == want[2:]
    d.close()


def test_a_changed_sequence_length_keeps_the_position_and_is_named():
    short = AssemblyLayout.from_config(CFG, 160, packing="pack", vision_caps=(16, 64),
                                       audio_frame_caps=(32, 128), gen_num_queries=2)
    a = _loader(**OLD)
    for _ in range(2):
        next(a)
    state = a.get_state()
    a.close()
    b = _loader(**OLD, layout=short)
    b.set_state(state)
    g = next(b)
    assert b.stream.start(g.step) == 12
    assert b.get_state() == {"step": 3, "sample": 18, "global_batch": 4, "seq_len": 160}
    b.close()
    assert resume_notice(state, 2, 4, 160) == (
        "resumed with data_layout.seq_len 192 -> 160: the data stream goes on from sample "
        "12 (global batch 2 on), no sample read twice or skipped")
    assert resume_notice(state, 2, 8, 160) == (
        "resumed with train.global_batch 4 -> 8, data_layout.seq_len 192 -> 160: the data "
        "stream goes on from sample 12 (global batch 2 on), no sample read twice or skipped")
    assert resume_notice(state, 2, 4, 192) is None
    assert resume_notice({"step": 2}, 2, 8, 160) is None  # an older state: nothing to compare


def test_origin_arithmetic():
    assert [StreamOrigin().start(k, 6) for k in range(3)] == [0, 6, 12]
    assert [StreamOrigin(3, 18).start(k, 9) for k in (3, 4, 5)] == [18, 27, 36]
