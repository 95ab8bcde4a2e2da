"""planner/elementwise.py: the layers' memory-bound passes are the kept activations' bytes
times the accesses the forward, the backward and recomputation make to them, at the
device's streaming bandwidth (exact formulas, no timing)."""
from dataclasses import replace

import pytest

from mmjax.models.tiny import tiny
from mmjax.planner.elementwise import (BACKWARD_ACCESSES, FORWARD_ACCESSES, REMAT_ACCESSES,
                                       accesses, elementwise_bytes, elementwise_s)
from mmjax.planner.hardware import H100
from mmjax.planner.workload import Workload


def test_accesses():
    assert accesses(0, "none") == FORWARD_ACCESSES == 2
    assert accesses(2, "none") == accesses(1, "none") == 2 + 3 == (FORWARD_ACCESSES
                                                                   + BACKWARD_ACCESSES)
    assert accesses(2, "dots") == accesses(2, "full") == 5 + REMAT_ACCESSES
    assert accesses(0, "full") == 2  # a frozen unit recomputes nothing for a backward


def test_llm_bytes_by_hand():
    """The tiny LLM (d 64, f 128, 4 layers) keeps 10 d + 3 f activations a token and layer;
    the head's logits are not counted (the step model's head term prices them)."""
    model = tiny()
    c = model.llm
    wl = Workload("w", (256,))
    per_token_layer = 2 * (10 * c.hidden_size + 3 * c.ffn_size)  # bf16
    want = 5 * per_token_layer * 256 * c.num_layers
    assert elementwise_bytes(model, wl, "llm") == pytest.approx(want)
    assert elementwise_bytes(model, wl, "llm", act_bytes=4) == pytest.approx(2 * want)
    assert elementwise_bytes(model, wl, "llm", "full") == pytest.approx(want * 7 / 5)
    hw = replace(H100, hbm_bw=1e9)
    assert elementwise_s(model, wl, "llm", hw) == pytest.approx(want / 1e9)


def test_encoder_bytes_by_hand():
    """An encoder layer (d 32, f 64, 2 layers) keeps 10 d + 2 f a token, plus its patch
    embedding's input (patch_dim) on the first layer and its projector's widths."""
    model = tiny()
    e = model.encoder("vision")
    enc = e.encoder
    wl = Workload("w", (64,), {"vision": ((100,),)})
    layers = enc.num_layers * (10 * enc.hidden_size + 2 * enc.ffn_size) + enc.patch_dim
    projector = enc.hidden_size * e.projector.downsample + sum(
        [model.llm.hidden_size] * e.projector.num_layers)
    want = 5 * 2 * 100 * (layers + projector)
    assert elementwise_bytes(model, wl, "vision") == pytest.approx(want)
