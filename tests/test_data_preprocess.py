"""Image processors and the Whisper feature extractor against float64 references written
from the published definitions (HF image_transforms / audio_utils semantics)."""
import json

import numpy as np
import pytest
from PIL import Image

from mmjax.errors import UserError
from mmjax.data.preprocess import (ImageProcessor, NativeResizeProcessor, WhisperFeatureExtractor,
                                   audio_num_samples, center_crop, load_audio, load_processor)

CLIP_CONF = {"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": 24},
             "crop_size": {"height": 20, "width": 20}, "do_center_crop": True, "resample": 3,
             "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
             "image_mean": [0.48145466, 0.4578275, 0.40821073],
             "image_std": [0.26862954, 0.26130258, 0.27577711], "do_convert_rgb": True}


def _image(h, w, seed=0, mode="RGB"):
    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    return img.convert(mode)


def _normalise64(arr, mean, std):
    return ((arr.astype(np.float64) / 255.0 - np.array(mean)) / np.array(std)).transpose(2, 0, 1)


@pytest.mark.parametrize("h,w", [(37, 53), (60, 25)])
def test_clip_shortest_edge_then_centre_crop(tmp_path, h, w):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(CLIP_CONF))
    proc = load_processor(str(tmp_path))
    assert isinstance(proc, ImageProcessor)
    img = _image(h, w)
    out = proc(img)
    # Short side -> 24, long side -> int(24 * long / short) (truncated), PIL bicubic.
    short, long = min(h, w), max(h, w)
    rh, rw = (24, int(24 * long / short)) if h <= w else (int(24 * long / short), 24)
    assert proc.resize_size(h, w) == (rh, rw)
    resized = np.asarray(img.resize((rw, rh), resample=Image.BICUBIC))
    top, left = (rh - 20) // 2, (rw - 20) // 2
    want = _normalise64(resized[top:top + 20, left:left + 20], CLIP_CONF["image_mean"],
                        CLIP_CONF["image_std"])
    assert out.dtype == np.float32 and out.shape == (3, 20, 20) == (3, *proc.output_size(h, w))
    np.testing.assert_allclose(out, want, atol=2e-6)


def test_siglip_fixed_size_and_grey_input(tmp_path):
    conf = {"image_processor_type": "SiglipImageProcessor", "size": {"height": 16, "width": 12},
            "resample": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}
    (tmp_path / "p.json").write_text(json.dumps(conf))
    proc = load_processor(str(tmp_path / "p.json"))
    img = _image(31, 17, seed=1, mode="L")  # converted to RGB first
    out = proc(img)
    ref = np.asarray(img.convert("RGB").resize((12, 16), resample=Image.BILINEAR))
    np.testing.assert_allclose(out, _normalise64(ref, [0.5] * 3, [0.5] * 3), atol=2e-6)
    assert proc.output_size(31, 17) == (16, 12) and not proc.do_center_crop


def test_center_crop_pads_small_images():
    arr = np.arange(3 * 5, dtype=np.uint8).reshape(3, 5, 1) + 1
    out = center_crop(arr, 6, 4)  # taller than the image: zero rows, offset ceil(3/2) = 2
    assert out.shape == (6, 4, 1)
    want = np.zeros((6, 4), np.uint8)
    want[2:5] = arr[:, 0:4, 0]  # left = (5 - 4) // 2 = 0
    np.testing.assert_array_equal(out[..., 0], want)


def test_native_resize_keeps_aspect_in_patches():
    proc = NativeResizeProcessor(patch_size=4, max_grid=8)
    assert proc.output_size(13, 30) == (12, 32)
    assert proc.output_size(1, 100) == (4, 32)
    out = proc(_image(13, 30))
    assert out.shape == (3, 12, 32) and 0.0 <= out.min() and out.max() <= 1.0


def _mel_filters_reference(sr, n_fft, n_mels):
    """Slaney filters written out from librosa's definition, one filter at a time."""
    def hz_to_mel(f):
        return 3 * f / 200 if f < 1000 else 15 + np.log(f / 1000) / (np.log(6.4) / 27)

    def mel_to_hz(m):
        return 200 * m / 3 if m < 15 else 1000 * np.exp((np.log(6.4) / 27) * (m - 15))

    edges = [mel_to_hz(m) for m in np.linspace(hz_to_mel(0.0), hz_to_mel(sr / 2), n_mels + 2)]
    freqs = np.arange(n_fft // 2 + 1) * sr / n_fft
    out = np.zeros((n_fft // 2 + 1, n_mels))
    for i in range(n_mels):
        lo, c, hi = edges[i], edges[i + 1], edges[i + 2]
        for k, f in enumerate(freqs):
            tri = max(0.0, min((f - lo) / (c - lo), (hi - f) / (hi - c)))
            out[k, i] = tri * 2.0 / (hi - lo)
    return out


def _whisper_reference(wave, n_mels, n_fft=400, hop=160, sr=16000, n_samples=None):
    x = np.asarray(wave, np.float64)
    if n_samples is not None:
        x = np.concatenate([x[:n_samples], np.zeros(max(0, n_samples - len(x)))])
    pad = n_fft // 2
    x = np.concatenate([x[1:pad + 1][::-1], x, x[-pad - 1:-1][::-1]])  # reflect
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n_fft) / n_fft)  # periodic Hann
    frames = [x[t:t + n_fft] * window for t in range(0, len(x) - n_fft + 1, hop)]
    power = np.abs(np.stack([np.fft.rfft(f) for f in frames])) ** 2
    mel = np.log10(np.maximum(power @ _mel_filters_reference(sr, n_fft, n_mels), 1e-10)).T
    mel = mel[:, :-1]
    return (np.maximum(mel, mel.max() - 8.0) + 4.0) / 4.0


@pytest.mark.parametrize("make", ["clip", "native", "qwen2_vl"])
def test_channels_last_is_the_processed_image_transposed(tmp_path, make):
    """What the data sources keep (float32 [H, W, 3], contiguous, made without the
    [3, H, W] copy) is the HF-layout output, value for value, for every processor."""
    from mmjax.data.qwen2_vl_processor import Qwen2VLImageProcessor

    (tmp_path / "preprocessor_config.json").write_text(json.dumps(CLIP_CONF))
    proc = {"clip": lambda: load_processor(str(tmp_path)),
            "native": lambda: NativeResizeProcessor(patch_size=4, max_grid=8),
            "qwen2_vl": lambda: Qwen2VLImageProcessor(min_pixels=16 * 16, max_pixels=64 * 64,
                                                      patch_size=4, merge_size=2)}[make]()
    img = _image(37, 53, mode="RGBA")
    hwc = proc.channels_last(img)
    assert hwc.dtype == np.float32 and hwc.flags.c_contiguous and hwc.shape[2] == 3
    np.testing.assert_array_equal(hwc, proc(img).transpose(1, 2, 0))


@pytest.mark.parametrize("n_mels", [80, 128])
def test_whisper_log_mel_matches_reference(tmp_path, n_mels):
    conf = {"feature_extractor_type": "WhisperFeatureExtractor", "feature_size": n_mels,
            "sampling_rate": 16000, "hop_length": 160, "chunk_length": 30, "n_fft": 400}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(conf))
    fe = load_processor(str(tmp_path))
    assert isinstance(fe, WhisperFeatureExtractor)
    np.testing.assert_allclose(fe.mel_filters, _mel_filters_reference(16000, 400, n_mels),
                               rtol=1e-9, atol=1e-12)
    t = np.arange(8000) / 16000
    rng = np.random.default_rng(0)
    wave = (0.5 * np.sin(2 * np.pi * 1000 * t) + 0.05 * rng.standard_normal(t.size)).astype(np.float32)
    short = fe(wave, sampling_rate=16000, padding="longest")
    assert short.shape == (n_mels, 50) == (n_mels, fe.num_frames(8000, "longest"))
    np.testing.assert_allclose(short, _whisper_reference(wave, n_mels), atol=2e-5)
    full = fe(wave, sampling_rate=16000)  # padded to 30 s: 3000 frames
    assert full.shape == (n_mels, 3000) == (n_mels, fe.num_frames(8000))
    np.testing.assert_allclose(full[:, :40], _whisper_reference(wave, n_mels, n_samples=480000)[:, :40],
                               atol=2e-5)
    assert full.min() >= full.max() - 2.0 - 1e-6  # the 8.0 (log10) clamp, after /4
    # The 1 kHz tone peaks in the mel band whose centre is nearest 1 kHz.
    band = int(np.argmax(short[:, 10:40].mean(axis=1)))
    peak_hz = np.argmax(fe.mel_filters[:, band]) * 8000 / 200
    assert abs(peak_hz - 1000) < 100
    with pytest.raises(ValueError, match="16000 Hz"):
        fe(wave, sampling_rate=8000)


def test_load_audio_resamples(tmp_path):
    import soundfile as sf

    t = np.arange(4000) / 8000
    stereo = np.stack([np.sin(2 * np.pi * 440 * t)] * 2, axis=1).astype(np.float32)
    sf.write(str(tmp_path / "a.wav"), stereo, 8000)
    wave = load_audio(str(tmp_path / "a.wav"), 16000)
    assert wave.shape == (8000,) == (audio_num_samples(str(tmp_path / "a.wav"), 16000),)
    # A 440 Hz tone stays a 440 Hz tone after 2x polyphase upsampling.
    spectrum = np.abs(np.fft.rfft(wave))
    assert abs(np.argmax(spectrum) * 16000 / wave.size - 440) < 3


def test_bad_processor_configs(tmp_path):
    with pytest.raises(UserError, match="no preprocessor_config.json"):
        load_processor(str(tmp_path))
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"do_resize": True}))
    with pytest.raises(UserError, match="neither an image"):
        load_processor(str(tmp_path))
