"""The Pallas kernels' block lists (models/attention_pallas.py): per query block the count of
non-empty key tiles, how many need the mask, then masked tiles first and all-allowed tiles
after. On a causal row only the diagonal tile is masked; two packed documents add their
boundary tiles; padding is never all-allowed."""
import jax.numpy as jnp
import numpy as np
import pytest

from mmjax.models.attention_mask import TokenMeta
from mmjax.models.attention_pallas import block_lists, tile_classes


def _meta(docs):
    doc = jnp.asarray([docs], jnp.int32)
    idx = jnp.arange(doc.shape[1], dtype=jnp.int32)[None]
    return TokenMeta((doc > 0).astype(jnp.int32), doc, (doc > 0).astype(jnp.int32), idx)  # text


def test_causal_lists_mask_only_the_diagonal():
    meta = _meta([1] * 256)
    lists = np.asarray(block_lists(*tile_classes(meta, meta, 64, 64)))[0]
    for i in range(4):
        assert lists[i, 0] == i + 1 and lists[i, 1] == 1
        assert lists[i, 2] == i and sorted(lists[i, 3:3 + i]) == list(range(i))


def test_packed_documents_and_padding_are_masked():
    meta = _meta([1] * 64 + [2] * 160 + [0] * 32)  # two documents, padding in tile 3
    anyt, full = (np.asarray(x)[0] for x in tile_classes(meta, meta, 64, 64))
    want_any = np.array([[1, 0, 0, 0], [0, 1, 0, 0], [0, 1, 1, 0], [0, 1, 1, 1]], bool)
    np.testing.assert_array_equal(anyt, want_any)
    np.testing.assert_array_equal(full, np.array([[0, 0, 0, 0], [0, 0, 0, 0], [0, 1, 0, 0],
                                                  [0, 0, 0, 0]], bool))
    lists = np.asarray(block_lists(jnp.asarray(anyt)[None], jnp.asarray(full)[None]))[0]
    assert list(lists[2, :4]) == [2, 1, 2, 1]  # masked diagonal first, then the full tile


def test_shared_tiles_are_the_kernels_lists():
    """`shared_tiles` builds the lists a Pallas layer would (CPU: 128 x 32 tiles), and none
    for an implementation that is not Pallas."""
    from mmjax.models.attention import shared_tiles

    meta = _meta([1] * 40 + [2] * 20 + [0] * 4)
    assert shared_tiles(meta, "dense") is None and shared_tiles(meta, "auto") is None
    tiles = shared_tiles(meta, "pallas")
    assert tiles.q_lists.shape[:2] == (1, 1)  # 64 tokens: one query block
    np.testing.assert_array_equal(tiles.q_lists, block_lists(*tile_classes(meta, meta, 64, 32)))
    anyt, full = tile_classes(meta, meta, 64, 32)
    np.testing.assert_array_equal(tiles.k_lists, block_lists(anyt.transpose(0, 2, 1),
                                                             full.transpose(0, 2, 1)))


@pytest.mark.slow
def test_layer_stack_shares_one_tile_list_and_matches_dense():
    """An LLM layer stack over two packed documents: the Pallas hook (block lists built once by
    `meta_attend`, the same arrays for every layer) gives the dense path's loss and grads."""
    import jax
    from flax import nnx

    from mmjax.models.llm import LLM, meta_attend
    from mmjax.models.tiny import TINY_LLM

    meta = _meta([1] * 40 + [2] * 20 + [0] * 4)
    model = LLM(TINY_LLM, jax.random.key(0), 0, 2)
    graph, params = nnx.split(model)
    tokens = jnp.arange(64, dtype=jnp.int32)[None] % 97
    positions = meta.idx

    def loss(p, impl):
        mod = nnx.merge(graph, p)
        h = mod.run_layers(mod.embed_tokens(tokens), positions, meta_attend(meta, impl))
        return jnp.sum(jnp.where(meta.doc[..., None] > 0, h, 0.0) ** 2)

    ld, gd = jax.jit(jax.value_and_grad(loss), static_argnums=1)(params, "dense")
    lp, gp = jax.jit(jax.value_and_grad(loss), static_argnums=1)(params, "pallas")
    np.testing.assert_allclose(lp, ld, rtol=1e-5)
    # as test_attention's parity: atol relative to the largest gradient of each leaf
    jax.tree.map(lambda a, b: np.testing.assert_allclose(
        a, b, rtol=1e-4, atol=1e-4 * float(np.abs(b).max())), gp, gd)
