"""The frozen VAE (models/vae.py) imported from diffusers' AutoencoderKL layout
(models/hf/vae.py) against a float64 numpy reference of the same architecture."""
import numpy as np
import pytest

from tests.vae_reference import TINY_CONFIG, Ref, write_tiny_vae


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from mmjax.models.hf.vae import load_vae_safetensors
    d = tmp_path_factory.mktemp("vae")
    tensors = write_tiny_vae(d)
    vae, cfg = load_vae_safetensors(d)
    return vae, cfg, Ref(tensors, TINY_CONFIG), d


def test_config_from_hf(tiny):
    _, cfg, _, _ = tiny
    assert cfg.block_out_channels == (8, 16) and cfg.layers_per_block == 1
    assert cfg.norm_num_groups == 4 and cfg.latent_channels == 4
    assert cfg.scaling_factor == pytest.approx(0.18215) and cfg.downsample == 2


def test_encode_decode_match_float64_reference(tiny):
    import jax.numpy as jnp
    vae, cfg, ref, _ = tiny
    rng = np.random.default_rng(1)
    img = rng.uniform(-1, 1, (2, 16, 12, 3))  # non-square: H and W are not confused
    mean, logvar = vae.encode(jnp.asarray(img, jnp.float32))
    rmean, rlogvar = ref.encode(img.transpose(0, 3, 1, 2))
    assert mean.shape == (2, 8, 6, 4)
    np.testing.assert_allclose(np.asarray(mean), rmean.transpose(0, 2, 3, 1), atol=1e-4, rtol=0)
    np.testing.assert_allclose(np.asarray(logvar), rlogvar.transpose(0, 2, 3, 1), atol=1e-4,
                               rtol=0)
    z = rng.normal(size=(2, 8, 6, 4))
    rec = vae.decode(jnp.asarray(z, jnp.float32))
    rrec = ref.decode(z.transpose(0, 3, 1, 2))
    assert rec.shape == (2, 16, 12, 3)
    np.testing.assert_allclose(np.asarray(rec), rrec.transpose(0, 2, 3, 1), atol=1e-4, rtol=0)
    # the generator's latents and their inverse carry the scaling factor
    lat = vae.latents(jnp.asarray(img, jnp.float32))
    np.testing.assert_allclose(np.asarray(lat), rmean.transpose(0, 2, 3, 1) * 0.18215,
                               atol=1e-5, rtol=0)
    back = vae.images(jnp.asarray(z * 0.18215, jnp.float32))
    np.testing.assert_allclose(np.asarray(back), rrec.transpose(0, 2, 3, 1), atol=1e-4, rtol=0)


def test_missing_tensor_is_one_line_naming_it(tmp_path):
    from mmjax.models.hf.vae import load_vae_safetensors
    name = "decoder.up_blocks.0.upsamplers.0.conv.weight"
    write_tiny_vae(tmp_path, drop=name)
    with pytest.raises(ValueError) as e:
        load_vae_safetensors(tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and repr(name) in msg and "missing tensor" in msg


def test_export_roundtrip(tiny, tmp_path):
    from safetensors.numpy import load_file

    from mmjax.models.hf.vae import export_vae_safetensors, vae_config_from_hf
    vae, cfg, ref, d = tiny
    export_vae_safetensors(vae, cfg, tmp_path)
    a = load_file(str(d / "diffusion_pytorch_model.safetensors"))
    b = load_file(str(tmp_path / "diffusion_pytorch_model.safetensors"))
    assert set(a) == set(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    assert vae_config_from_hf(tmp_path) == cfg


def test_matches_diffusers_itself():
    """A tiny AutoencoderKL built and saved by diffusers 0.42 (tests/fixtures/
    make_diffusers_vae.py): our import and the numpy reference both give diffusers' float64
    outputs (posterior mean and logvar, decode) within 1e-4."""
    import os

    import jax.numpy as jnp
    from safetensors.numpy import load_file

    from mmjax.models.hf.vae import load_vae_safetensors
    d = os.path.join(os.path.dirname(__file__), "data", "diffusers_tiny_vae")
    want = np.load(os.path.join(d, "expected.npz"))
    vae, cfg = load_vae_safetensors(d)
    img = want["images"].transpose(0, 2, 3, 1)
    mean, logvar = vae.encode(jnp.asarray(img, jnp.float32))
    for got, key in ((mean, "mean"), (logvar, "logvar")):
        np.testing.assert_allclose(np.asarray(got), want[key].transpose(0, 2, 3, 1), atol=1e-4,
                                   rtol=0, err_msg=key)
    rec = vae.decode(jnp.asarray(want["latents"].transpose(0, 2, 3, 1), jnp.float32))
    np.testing.assert_allclose(np.asarray(rec), want["decoded"].transpose(0, 2, 3, 1),
                               atol=1e-4, rtol=0)
    import json
    ref = Ref(load_file(os.path.join(d, "diffusion_pytorch_model.safetensors")),
              json.load(open(os.path.join(d, "config.json"))))
    rmean, rlogvar = ref.encode(want["images"])
    np.testing.assert_allclose(rmean, want["mean"], atol=1e-9, rtol=0)
    np.testing.assert_allclose(ref.decode(want["latents"]), want["decoded"], atol=1e-9, rtol=0)
