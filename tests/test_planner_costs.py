"""Cost model: parameter layout vs the Flax modules, FLOPs, frozen rule, memory, no JAX."""
import dataclasses
import ast
import glob
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from mmjax.errors import UserError

from mmjax.models.config import LLMConfig
from mmjax.models.named import named_config
from mmjax.models.tiny import tiny, tiny_valm
from mmjax.planner.costs import unit_cost
from mmjax.planner.module_params import llm_params, module_params
from mmjax.planner.unit_work import backward_factor, module_backward_factors, unit_work
from mmjax.planner.evaluate import Choice, memory_bytes
from mmjax.planner.hardware import A800, H100, H200, hardware
from mmjax.planner.workload import Workload, cornstarch_like, default_workload


def _count(build):
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(nnx.eval_shape(build),
                                                                        nnx.Param)))


@pytest.mark.parametrize("cfg", [tiny(), tiny_valm(), named_config("cornstarch/valm_ss")],
                         ids=lambda c: c.name)
def test_params_match_flax_modules(cfg):
    from mmjax.models.audio import AudioEncoder
    from mmjax.models.generator import DiffusionGenerator
    from mmjax.models.llm import LLM
    from mmjax.models.projector import make_projector
    from mmjax.models.vision import VisionEncoder

    key = jax.random.key(0)
    got = {"llm": _count(lambda: LLM(cfg.llm, key))}
    for e in cfg.encoders:
        cls = VisionEncoder if e.modality == "image" else AudioEncoder
        got[e.name] = _count(lambda: cls(e.encoder, key))
        got[f"{e.name}.projector"] = _count(
            lambda: make_projector(e.projector, e.encoder.hidden_size, cfg.llm.hidden_size, key))
    if cfg.generator is not None:
        got["generator"] = _count(
            lambda: DiffusionGenerator(cfg.generator, cfg.llm.hidden_size, key))
    assert module_params(cfg) == got


def test_llm_params_known_model():
    # Llama-2-7B (vocab 32000, MHA, untied): 6,738,415,616 parameters
    c = LLMConfig(vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32,
                  num_kv_heads=32, ffn_size=11008)
    assert llm_params(c) == 6_738_415_616


def test_llm_flops_are_6nd_plus_attention():
    m = named_config("disttrain/mllm_9b")
    wl = Workload("fixed", (4096,) * 4, {"vision": (((256,),),) * 4}, (0,) * 4)
    uw = unit_work(m, wl, "llm")
    c = m.llm
    n = 4096
    matmul = c.num_layers * (4 * c.hidden_size ** 2 + 3 * c.hidden_size * c.ffn_size)
    attn = c.num_layers * 2 * n * n * c.hidden_size  # causal: half of 4 n^2 d
    head = c.hidden_size * c.vocab_size
    assert sum(w.flops for w in uw.layers) == pytest.approx(2 * n * (matmul + head) + attn)
    cost = unit_cost(m, wl, "llm", A800)
    assert cost.flops == pytest.approx(3 * (2 * n * (matmul + head) + attn))


def test_encoder_cost_sees_size_skew():
    """Same mean tokens, more skew -> more attention FLOPs (E[n^2] > E[n]^2)."""
    m = named_config("disttrain/mllm_9b")
    even = Workload("even", (8192,) * 2, {"vision": ((512, 512), (512, 512))})
    skew = Workload("skew", (8192,) * 2, {"vision": ((1000, 24), (1000, 24))})
    f = lambda wl: sum(w.flops for w in unit_work(m, wl, "vision").layers)
    assert f(skew) > f(even)


def test_backward_rule_table():
    """Cornstarch §4.2: 0 (frozen, nothing trainable before), 1 (frozen, trainable before),
    2 (trainable)."""
    assert [backward_factor(f, b) for f in (True, False) for b in (False, True)] == [0, 1, 2, 2]
    cs = named_config("cornstarch/vlm_m")  # frozen encoder + LLM, trainable projector
    assert module_backward_factors(cs) == {"vision": 0, "vision.projector": 2, "llm": 1}
    dt = named_config("disttrain/mllm_9b", {"encoders.vision.frozen": True,
                                            "encoders.vision.projector_frozen": True,
                                            "llm_frozen": True})
    assert module_backward_factors(dt) == {"vision": 0, "vision.projector": 0, "llm": 0,
                                           "generator": 2}
    dt2 = named_config("disttrain/mllm_9b", {"generator_frozen": True})
    assert module_backward_factors(dt2)["generator"] == 1


def test_frozen_unit_time_and_memory():
    m = named_config("cornstarch/vlm_m")
    wl = cornstarch_like(m)
    frozen = unit_cost(m, wl, "llm", A800)
    train = unit_cost(m.replace(llm_frozen=False), wl, "llm", A800)
    # frozen LLM after a trainable projector: backward = forward, so C = 2 fwd vs 3 fwd
    assert frozen.time_s[1] / frozen.fwd_s[1] == pytest.approx(2.0)
    assert train.time_s[1] / train.fwd_s[1] == pytest.approx(3.0)
    assert frozen.optimizer_bytes == 0 and frozen.grad_bytes == 0
    enc = unit_cost(m, wl, "vision", A800)
    assert enc.optimizer_bytes == 12 * module_params(m)["vision.projector"]


def test_zero1_and_pipeline_memory():
    m = named_config("disttrain/mllm_15b")
    cost = unit_cost(m, default_workload(m, 64), "llm", A800)
    # one TP rank holds the split parameters / 8 and the replicated ones (norms) whole
    share = lambda pp: ((1 - cost.replicated) / 8 + cost.replicated) / pp
    assert 0 < cost.replicated < 1e-3
    a = memory_bytes(cost, Choice(8, 2, 4), 2, 16)
    b = memory_bytes(cost, Choice(8, 4, 4), 4, 16)
    assert a - b == pytest.approx(cost.optimizer_bytes * share(4) * (1 / 2 - 1 / 4))
    # 1F1B: activations per GPU do not shrink with PP while PP <= microbatches ("none":
    # nothing rebuilt; the score buffers and stage I/O are one microbatch's)
    act = lambda pp: memory_bytes(cost, Choice(8, 1, pp), 1, 64) - (
        (cost.weight_bytes + cost.optimizer_bytes) * share(pp) + cost.fixed_bytes[8])
    assert cost.remat == "none" and cost.work_bytes[8] == 0
    assert act(2) == pytest.approx(act(8)) == pytest.approx(cost.activation_bytes[8])


def test_tp_sizes_respect_heads():
    m = named_config("cornstarch/alm_s")  # whisper-S: 20 heads
    cost = unit_cost(m, cornstarch_like(m), "audio", A800)
    assert sorted(cost.time_s) == [1, 2, 4]


def test_hardware():
    assert hardware("H100") is H100 and H200.hbm_bytes > H100.hbm_bytes
    assert A800.efficiency(1024) > A800.efficiency(128)
    with pytest.raises(UserError, match="a800"):
        hardware("tpu")


def test_planner_imports_no_jax():
    """planner/* (but profile.py) and models/named.py import no JAX themselves. (cvxpy 1.9
    imports jax while probing its optional MPAX solver; that is cvxpy's, not ours.)"""
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "mmjax")
    files = (glob.glob(os.path.join(root, "planner", "*.py"))
             + [os.path.join(root, "models", "named.py")])
    for path in files:
        if path.endswith("profile.py"):
            continue
        for node in ast.walk(ast.parse(open(path).read())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for n in names:
                assert n.split(".")[0] not in ("jax", "flax", "jaxlib"), (path, n)
    code = ("import sys; import mmjax.planner.partition, mmjax.planner.costs, "
            "mmjax.planner.evaluate, mmjax.models.named; assert 'jax' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_attention_cost_follows_the_implementations_tiles():
    """Tile counts, not S^2: exact tables for small cases, and the LLM's FLOPs / kept bytes
    per implementation (dense pays every pair and keeps [S, S] float32 buffers)."""
    from mmjax.planner.attention_cost import causal_tiles, computed_pairs, kept_bytes_per_head

    assert causal_tiles(8, 4, 2) == 2 + 4  # query block 0 sees key blocks 0-1, block 1 all 4
    assert causal_tiles(10, 4, 4) == 1 + 2 + 3
    assert computed_pairs(10, "dense", True) == 100
    assert computed_pairs(300, "chunked", False) == 3 * 128 * 3 * 128
    assert computed_pairs(256, "chunked", True) == 3 * 128 * 128
    assert computed_pairs(256, "pallas", True) == (4 + 8) * 128 * 32
    assert kept_bytes_per_head(1000, "dense") == 8 * 10 ** 6
    assert kept_bytes_per_head(1000, "pallas") == 4000
    assert computed_pairs(300, "cudnn", False) == 3 * 128 * 3 * 128  # the generator's full mask
    m = named_config("disttrain/mllm_9b")
    c, n = m.llm, 4096
    wl = Workload("fixed", (n,) * 4, {"vision": (((256,),),) * 4}, (0,) * 4)
    exact = unit_work(m, wl, "llm").layers[1]
    per = {i: unit_work(m, wl, "llm", {"llm": i}).layers[1] for i in ("dense", "chunked", "pallas")}
    hq = c.num_heads * c.dim_per_head
    attn = lambda w: w.flops - (exact.flops - 2 * n * n * hq)
    assert attn(per["dense"]) == pytest.approx(4 * n * n * hq)
    assert attn(per["chunked"]) == pytest.approx(4 * causal_tiles(n, 128, 128) * 128 * 128 * hq)
    # aligned causal: 128 x 32 tiles cover the same pairs as 128 x 128 ones
    assert attn(per["pallas"]) == attn(per["chunked"]) < attn(per["dense"])
    assert per["dense"].act_bytes - exact.act_bytes == 8 * n * n * c.num_heads
    assert per["pallas"].act_bytes - exact.act_bytes == 4 * n * c.num_heads


def _brute_window(n, window, bq, bk):
    """(allowed pairs, non-empty bq x bk tiles) of a causal sliding-window mask, by building
    the mask from its definition (idx_k <= idx_q, idx_q - idx_k < window)."""
    i = np.arange(n)
    diff = i[:, None] - i[None, :]
    mask = (diff >= 0) & (diff < (window if window is not None else n + 1))
    tiles = sum(bool(mask[a:a + bq, b:b + bk].any())
                for a in range(0, n, bq) for b in range(0, n, bk))
    return int(mask.sum()), tiles


def test_sliding_window_attention_costs_its_window():
    """Windowed layers pay the pairs / tiles inside their window (checked against the mask
    built from its definition), and a Gemma-3-like local/global pattern costs each layer by
    its own kind: local layers by the window, global ones by full causal attention."""
    from mmjax.planner.attention_cost import (computed_pairs, exact_pairs, window_tiles,
                                              causal_tiles)
    for n, w, bq, bk in [(10, 3, 4, 2), (37, 5, 8, 4), (64, 16, 16, 16), (50, 100, 8, 8),
                         (300, 128, 128, 32), (33, 1, 4, 4)]:
        pairs, tiles = _brute_window(n, w, bq, bk)
        assert exact_pairs(n, True, w) == pairs
        assert window_tiles(n, bq, bk, w) == tiles
    assert exact_pairs(7, True) == 28 and exact_pairs(7, False) == 49
    # a window no shorter than the sequence is no window
    assert computed_pairs(200, "chunked", True, 500) == computed_pairs(200, "chunked", True)
    assert computed_pairs(4096, "chunked", True, 1024) == window_tiles(4096, 128, 128,
                                                                       1024) * 128 * 128
    assert window_tiles(4096, 128, 128, 1024) == 32 * 9 - 36  # 8 diagonals + the last partial
    assert computed_pairs(4096, "dense", True, 1024) == 4096 ** 2  # dense computes them all

    m = named_config("disttrain/mllm_9b")
    L, n, w = m.llm.num_layers, 4096, 1024
    pattern = tuple((i + 1) % 6 != 0 for i in range(L))  # Gemma 3: 5 local, 1 global
    gemma = dataclasses.replace(m, llm=dataclasses.replace(m.llm, sliding_window=w,
                                                           sliding_layers=pattern))
    wl = Workload("fixed", (n,) * 4, {"vision": (((256,),),) * 4}, (0,) * 4)
    hq = m.llm.num_heads * m.llm.dim_per_head
    base = unit_work(m, wl, "llm")
    for impl in (None, "chunked", "pallas", "dense"):
        full = unit_work(m, wl, "llm", None if impl is None else {"llm": impl}).layers
        mixed = unit_work(gemma, wl, "llm", None if impl is None else {"llm": impl}).layers
        for i in range(L - 1):  # the last carries the LM head
            if impl is None:
                want = 4 * hq * exact_pairs(n, True, w) if pattern[i] else 2 * n * n * hq
            elif impl == "dense":
                want = 4 * hq * n * n
            else:
                want = 4 * hq * computed_pairs(n, impl, True, w if pattern[i] else None)
            assert mixed[i].attn_flops == pytest.approx(want)
            assert mixed[i].flops - mixed[i].attn_flops == pytest.approx(
                base.layers[i].flops - base.layers[i].attn_flops)
            assert mixed[i].act_bytes == full[i].act_bytes  # kept rows / [S, S] as before
        local = [i for i in range(L - 1) if pattern[i]]
        if impl != "dense":
            assert mixed[local[0]].attn_flops < full[local[0]].attn_flops
    assert causal_tiles(n, 128, 128) > window_tiles(n, 128, 128, w)


def test_qwen2_5_vl_window_blocks_cost_their_windows():
    """Qwen2.5-VL's tower: blocks outside fullatt_block_indexes pay their windows' exact
    pairs (checked against windows cut from a square grid by definition); full blocks and
    the tiled kernels (windows interleaved in patch order) pay the whole image."""
    from mmjax.models.qwen2_vl_config import window_patches
    from mmjax.models.tiny import tiny_qwen2_5_vl
    from mmjax.planner.attention_cost import image_window_pairs

    def by_definition(rows, cols, side):
        r, c = np.divmod(np.arange(rows * cols), cols)
        win = (r // side) * 1000 + c // side
        return int((win[:, None] == win[None, :]).sum())

    for rows, side in [(8, 4), (10, 4), (7, 3), (3, 8)]:
        assert image_window_pairs(rows * rows, side) == by_definition(rows, rows, side)
    m = tiny_qwen2_5_vl()
    c = m.encoder("vision").encoder
    side = window_patches(c)
    assert side and c.fullatt_block_indexes
    sizes = ((144, 64), (256,), (100,), (36, 36))
    wl = Workload("q", (300,) * 4, {"vision": sizes}, (0,) * 4)
    layers = unit_work(m, wl, "vision").layers
    d = c.hidden_size
    full = 4 * d * np.mean([sum(n * n for n in s) for s in sizes])
    win = 4 * d * np.mean([sum(image_window_pairs(n, side) for n in s) for s in sizes])
    assert win < full
    for i, w in enumerate(layers[1:], 1):  # layer 0 carries the patch embedding
        assert w.attn_flops == pytest.approx(full if i in c.fullatt_block_indexes else win)
    tiled = unit_work(m, wl, "vision", {"vision": "chunked"}).layers
    assert len({w.attn_flops for w in tiled[1:]}) == 1
