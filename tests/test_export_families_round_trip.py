"""Every decoder family of docs/guide.md's table round-trips through scripts/export_hf.py's
export (issue 42): a run from the family's checkpoint (tests/data/families, transformers 4
and 5 config layouts) as the LLM with a frozen CLIP tower, its LLM trained (moved off the
source), exported; the export holds the source's tensor names, shapes, dtypes and config.json,
the frozen tower byte for byte, and reloads to the trained LLM's logits exactly."""
import json

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import hf_reference as ref
from test_decoder_families import CASES, DATA, family_weights
from test_export_frozen import assert_bit_identical, fake_run
from test_pretrained_training import CLIP, base_cfg
from mmjax.models import hf
from mmjax.models.config import with_overrides
from mmjax.models.hf.dispatch import _llm_logits
from mmjax.train.export import export_workdir, restore_model


@pytest.mark.parametrize("layout", ["v4", "v5"])
@pytest.mark.parametrize("case", CASES)
def test_family_run_exported_over_its_source(tmp_path, case, layout):
    z = np.load(DATA / f"{case}.npz")
    names, shapes = [str(n) for n in z["names"]], json.loads(str(z["shapes"]))
    src = tmp_path / "llm"
    src.mkdir()
    (src / "config.json").write_text(str(z[f"config_{layout}"]))
    t = family_weights(names, shapes, int(z["seed"]))
    save_file(t, str(src / "model.safetensors"), metadata={"format": "pt"})
    clip = ref.write_checkpoint(tmp_path / "clip", CLIP,
                                ref.tower_tensors("clip", CLIP, seed=2, std=0.1))
    dirs = {"llm": str(src), "vision": str(clip)}
    run = str(tmp_path / "run")
    fake_run(run, dirs, with_overrides(base_cfg(), {"encoders.vision.frozen": True}))
    export_workdir(run, tmp_path / "out")
    out = tmp_path / "out" / "llm"
    assert json.loads((out / "config.json").read_text()) == json.loads(
        str(z[f"config_{layout}"]))
    got = load_file(str(out / "model.safetensors"))
    assert {k: (v.shape, v.dtype) for k, v in got.items()} == \
        {k: (v.shape, v.dtype) for k, v in t.items()}
    assert all(got[k].tobytes() != t[k].tobytes() for k in t)  # every tensor trained
    assert_bit_identical(tmp_path / "out" / "vision", clip)
    _, model, _, _ = restore_model(run)
    again, _ = hf.load(out)
    tokens = z["tokens"][None]
    allowed = jnp.tril(jnp.ones((tokens.shape[1],) * 2, bool))[None]
    np.testing.assert_array_equal(  # the exported LLM is the trained one
        np.asarray(hf.hf_forward(again, input_ids=tokens)["logits"]),
        np.asarray(_llm_logits(model.llm, jnp.asarray(tokens), allowed)))
