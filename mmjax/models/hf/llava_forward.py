"""transformers' `LlavaForConditionalGeneration` forward on an mmjax `MultimodalModel`
(`hf_forward`, `hf.generate`): the tower's patch states at the feature layer, projected,
scattered in order over the image tokens; the causal LLM."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx


def hf_patches(pixel_values, p: int):
    """HF pixel values [B, C, H, W] -> the tower's inputs: flattened p x p patches in
    row-major order [B, N, p*p*C], one segment per image, (row, column) positions."""
    b, c, h, w = pixel_values.shape
    gh, gw = h // p, w // p
    x = pixel_values.transpose(0, 2, 3, 1)[:, : gh * p, : gw * p]
    patches = x.reshape(b, gh, p, gw, p, c).transpose(0, 1, 3, 2, 4, 5).reshape(b, gh * gw, -1)
    seg = jnp.ones((b, gh * gw), jnp.int32)
    pos = jnp.broadcast_to(jnp.stack(jnp.divmod(jnp.arange(gh * gw), gw), -1), (b, gh * gw, 2))
    return patches, seg, pos


def llava_embed(model, input_ids, pixel_values, image_token: int):
    """The LLM's input embeddings [B, S, d]: the tower's patch states at the feature layer,
    projected, scattered in order over the image tokens."""
    tower, proj, llm = model.encoders["vision"], model.projectors["vision"], model.llm
    patches, seg, pos = hf_patches(pixel_values, tower.cfg.patch_size)
    feats = tower.finish(tower.run_layers(tower.embed(patches, seg, pos), seg))  # no class token
    image = proj(feats).reshape(-1, llm.cfg.hidden_size)
    emb = llm.embed_tokens(input_ids)
    is_image = input_ids == image_token
    order = jnp.clip(jnp.cumsum(is_image.reshape(-1)) - 1, 0, image.shape[0] - 1)
    return jnp.where(is_image[..., None], image[order].reshape(emb.shape), emb)


@nnx.jit(static_argnames=("image_token",))
def _llava_logits(model, input_ids, pixel_values, allowed, image_token: int):
    from mmjax.models.llm import mask_attend
    llm = model.llm
    emb = llava_embed(model, input_ids, pixel_values, image_token)
    positions = jnp.broadcast_to(jnp.arange(input_ids.shape[1]), input_ids.shape)
    hidden = llm.final_hidden(llm.run_layers(emb, positions, mask_attend(allowed)))
    return llm.logits(hidden)


def check_image_tokens(model, image_token: int, input_ids, pixel_values) -> None:
    """input_ids hold one image token per projected patch of pixel_values (ValueError)."""
    n_img = int((np.asarray(input_ids) == image_token).sum())
    shape = np.shape(pixel_values)
    p = model.cfg.encoder("vision").encoder.patch_size
    per = (shape[2] // p) * (shape[3] // p)
    if n_img != shape[0] * per:
        raise ValueError(f"input_ids hold {n_img} image tokens (id {image_token}); "
                         f"pixel_values give {shape[0]} x {per} features: put {per} "
                         f"image tokens per image, as LlavaProcessor does")


def llava_forward(model, image_token: int, input_ids, pixel_values, attention_mask=None):
    """HF LlavaForConditionalGeneration.forward(...).logits: the tower's patch states at the
    feature layer, projected, scattered in order over the image tokens; causal LLM."""
    check_image_tokens(model, image_token, input_ids, pixel_values)
    ids = jnp.asarray(input_ids)
    pixels = jnp.asarray(pixel_values, jnp.float32)
    s = ids.shape[1]
    allowed = jnp.tril(jnp.ones((s, s), bool))[None]
    if attention_mask is not None:
        allowed = allowed & (jnp.asarray(attention_mask) != 0)[:, None, :]
    return _llava_logits(model, ids, pixels, allowed, image_token=image_token)
