"""Each host materialises only the inputs of its own devices (the pipeline feeds of
data/global_batch.py with several hosts), and hosts agree on decode failures before the
step (train/host_failures.py): checked against one host decoding everything."""
import dataclasses
import threading

import numpy as np
import pytest

from mmjax.data.feed import gen_elements_per_image
from mmjax.data.global_batch import host_devices, owned_ranks
from mmjax.data.loader import Loader
from mmjax.data.records import DecodeError
from mmjax.data.sample import Sample
from mmjax.train.host_failures import agree_on_failures
from test_data_loader import CFG, LAYOUT, plan, source

POL = {u: "orchmllm" for u in CFG.unit_names}
GEN_ELEMENTS = gen_elements_per_image(LAYOUT)
STEP = 3


class CountingSource:
    """A source that records what it decodes ((index, modalities)); the images of `bad`
    samples fail to decode, so only hosts that read those images see the failure."""

    def __init__(self, inner, bad=()):
        self.inner, self.bad, self.loaded = inner, set(bad), []

    def __len__(self):
        return len(self.inner)

    def spec(self, i):
        return self.inner.spec(i)

    def load(self, i):
        return self.load_parts(i, None)

    def load_parts(self, i, modalities):
        self.loaded.append((i, modalities))
        if i in self.bad and (modalities is None or "image" in modalities):
            raise DecodeError(f"sample {i}: corrupt image (test)")
        s = self.inner.load(i)
        if modalities is None:
            return s
        return Sample(s.id, tuple(
            g if g.modality == "text" or g.modality in modalities
            else dataclasses.replace(g, data=np.zeros_like(g.data)) for g in s.segments))


READS = {"vision": "image", "audio": "audio", "llm": "text", "generator": "image_out"}
PLANS = {"ranks split": {"vision": 2, "audio": 1, "llm": 2, "generator": 2},
         "units split": {"vision": 2, "audio": 2, "llm": 2, "generator": 2}}


def unit_arrays(feed, unit):
    """The feed arrays a unit's stages take, each split over that unit's DP ranks along
    its leading axis (pipeline/transfers.py `Transfers.side`)."""
    if unit == "llm":
        return {**{f"llm.{k}": v for k, v in feed.llm.items()}, "gen_pack": feed.gen_pack}
    if unit == "generator":
        return {f"gen.{k}": v for k, v in feed.gen.items()}
    return {**{f"{unit}.{k}": v for k, v in feed.enc_inputs[unit].items()},
            "pack": feed.enc_pack[unit]}


def build(p, bad, local):
    src = CountingSource(source(), bad)
    gb = Loader.build(src, CFG, p, LAYOUT, POL, seed=5,
                            local_devices=local).builder(STEP)
    return gb, src


def agree(gbs):
    """agree_on_failures on every host at once, with an in-process all-gather."""
    slots, barrier, deltas = [None] * len(gbs), threading.Barrier(len(gbs)), [None] * len(gbs)

    def run(k):
        def allgather(x):
            slots[k] = np.asarray(x)
            barrier.wait()
            out = np.stack(slots)
            barrier.wait()
            return out
        deltas[k] = agree_on_failures(gbs[k], allgather, GEN_ELEMENTS)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(gbs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return deltas


@pytest.mark.parametrize("dp", PLANS.values(), ids=PLANS.keys())
def test_hosts_decode_only_their_ranks_parts_and_agree_with_one_host(dp):
    p = plan(gb=12, mbs=2, dp=dp)
    ids = build(p, (), None)[0].sample_ids
    with_image = [i for i in ids if any(k == "image" for k, *_ in source().spec(i))]
    bad = set(with_image[:3])
    full, full_src = build(p, bad, None)
    assert sorted(i for i, _ in full_src.loaded) == sorted(ids)
    assert full.decode_failures == len(bad)
    hosts = [build(p, bad, host_devices(p, h, 2)) for h in range(2)]
    for h, (gb, src) in enumerate(hosts):
        local = host_devices(p, h, 2)
        reads = {}
        for mb, ref in zip(gb.microbatches, full.microbatches):
            assert mb.plan.ranks == ref.plan.ranks  # one plan on every host
            for unit in CFG.unit_names:
                for r in owned_ranks(p, unit, local):
                    for q in mb.plan.ranks[unit][r]:
                        reads.setdefault(gb.sample_ids[q], set()).add(READS[unit])
        # each sample decoded once, in exactly the modalities this host's ranks read
        assert sorted(i for i, _ in src.loaded) == sorted(reads)
        assert all(set(m) == reads[i] for i, m in src.loaded)
        assert len(reads) < len(ids) or all(len(m) < 4 for m in reads.values())
    seen = [len(gb.failed_at) for gb, _ in hosts]
    assert min(seen) < len(bad)  # some host learns of a failure only from another
    deltas = agree([gb for gb, _ in hosts])
    for h, (gb, _) in enumerate(hosts):
        local = host_devices(p, h, 2)
        assert gb.skipped_samples == full.skipped_samples
        assert gb.skip_reasons == full.skip_reasons and gb.decode_failures == len(bad)
        assert sorted(gb.skipped) == sorted(full.skipped)
        for mb, ref in zip(gb.microbatches, full.microbatches):
            assert mb.feed.num_target_tokens == ref.feed.num_target_tokens  # one normaliser
            assert mb.feed.num_gen_elements == ref.feed.num_gen_elements
            # a failed sample's text may be real where its image was not read: masked from
            # the loss like the blank, so it adds exactly nothing; compare the rest
            text = np.ones(ref.feed.llm["tokens"].shape, bool)
            for i, q in enumerate(mb.plan.positions):
                if q in gb.failed_at:
                    row, doc = ref.feed.sample_rows[i]
                    text[row] &= ref.feed.llm["doc"][row] != doc
            for unit in CFG.unit_names:
                dp_u = p.unit(unit).dp
                mine, want = unit_arrays(mb.feed, unit), unit_arrays(ref.feed, unit)
                if unit == "llm":
                    mine["llm.tokens"] = np.where(text, mine["llm.tokens"], -1)
                    want["llm.tokens"] = np.where(text, want["llm.tokens"], -1)
                for key, a in want.items():
                    b = mine[key]
                    assert a.shape == b.shape and a.shape[0] % dp_u == 0, key
                    k = a.shape[0] // dp_u
                    for r in owned_ranks(p, unit, local):  # the one-host values, exactly
                        np.testing.assert_array_equal(
                            b[r * k:(r + 1) * k], a[r * k:(r + 1) * k],
                            err_msg=f"host {h} {unit} rank {r} {key}")
    assert deltas == [len(bad) - n for n in seen]  # the loaders' running totals


def test_a_failed_sample_trains_nothing_on_one_host():
    """One host: the failed sample's LLM targets and generator images are masked (as the
    single program masks them), and the normalisers count only what trains."""
    p = plan(gb=12, mbs=2, dp=PLANS["units split"])
    ids = build(p, (), None)[0].sample_ids
    clean, _ = build(p, (), None)
    bad = {ids[0], ids[5]}
    full, _ = build(p, bad, None)
    for mb, ref in zip(full.microbatches, clean.microbatches):
        lost = [i for i, q in enumerate(mb.plan.positions) if full.sample_ids[q] in bad]
        for i in lost:
            row, doc = mb.feed.sample_rows[i]
            m = mb.feed.llm["doc"][row] == doc
            assert m.any() and not mb.feed.llm["loss_mask"][row][m].any()
            assert all(mb.feed.gen["gen_valid"][g] == 0 for g in mb.feed.sample_gen[i])
        assert mb.feed.num_target_tokens == int(mb.feed.llm["loss_mask"].sum())
        per = int(np.prod(mb.feed.gen["gen_latents"].shape[1:]))
        assert mb.feed.num_gen_elements == int(mb.feed.gen["gen_valid"].sum()) * per
        assert mb.feed.num_gen_elements == ref.feed.num_gen_elements - per * sum(
            len(mb.feed.sample_gen[i]) for i in lost)
        assert mb.feed.num_target_tokens == sum(
            full.position_targets[q] for q in mb.plan.positions if full.sample_ids[q] not in bad)


def test_agreement_without_failures_is_one_gather_and_changes_nothing():
    p = plan(gb=12, mbs=2, dp=PLANS["ranks split"])
    full, _ = build(p, (), None)
    hosts = [build(p, (), host_devices(p, h, 2))[0] for h in range(2)]
    calls = []

    def one_host(x):
        calls.append(np.asarray(x).shape)
        return np.asarray(x)[None]

    assert agree_on_failures(hosts[0], one_host, 8) == 0 and calls == [(1,)]
    assert hosts[0].skipped == full.skipped and hosts[0].skipped_samples == full.skipped_samples
    for mb, ref in zip(hosts[0].microbatches, full.microbatches):
        assert mb.feed.num_target_tokens == ref.feed.num_target_tokens
