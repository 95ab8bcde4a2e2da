"""A standard (CLIP-shaped) ViT encoder in training: planner costs, assembly limits and the
design's invariant (a Plan with the tower split over pipeline stages gives the
single-device loss and gradients)."""
import dataclasses

import pytest
from helpers import check, make_cfg

from mmjax.data.layout import AssemblyLayout
from mmjax.data.batch_shapes import pack_images
from mmjax.models.config import VisionConfig
from mmjax.planner.module_params import num_params
from mmjax.planner.plan import Plan

CLIP_TINY = VisionConfig(hidden_size=32, num_layers=3, num_heads=2, ffn_size=64, patch_size=4,
                         max_grid=16, kind="vit", image_size=16, class_token=True,
                         pre_norm=True, post_norm=False, patch_bias=False, act="quick_gelu",
                         feature_layer=-2, max_images=2, norm_eps=1e-5)


def clip_cfg():
    return make_cfg(**{"encoders.vision.encoder": CLIP_TINY, "generator": None,
                       "llm.num_layers": 2})


def test_param_count_and_depth_follow_the_flax_layout():
    import jax
    from flax import nnx

    from mmjax.models.vit import StandardViT
    for cfg in (CLIP_TINY, dataclasses.replace(CLIP_TINY, class_token=False, pre_norm=False,
                                               post_norm=True, patch_bias=True,
                                               feature_layer=None)):
        m = nnx.eval_shape(lambda: StandardViT(cfg, jax.random.key(0)))
        n = sum(x.size for x in jax.tree.leaves(nnx.state(m, nnx.Param)))
        assert n == num_params(cfg)
    assert CLIP_TINY.depth == 2 and clip_cfg().num_layers("vision") == 2


def test_class_token_slots_limit_images_per_buffer():
    lay = AssemblyLayout.from_config(clip_cfg(), 160)
    slot = lay.slot("image")
    assert slot.items_per_buffer == 2
    placed = pack_images([4, 4, 4, 4, 4], 64, slot.items_per_buffer)
    per_buffer = [sum(1 for b, _, _ in placed if b == k) for k in range(3)]
    assert per_buffer == [2, 2, 1]


@pytest.mark.slow
def test_clip_tower_pp2_parity():
    """CLIP tower (class tokens, feature_layer -2) split over two pipeline stages, LLM tp2."""
    cfg = clip_cfg()
    plan = Plan.uniform(cfg, 2, 1, pp={"vision": 2}, tp={"llm": 2})
    check(cfg, plan, n=2)
