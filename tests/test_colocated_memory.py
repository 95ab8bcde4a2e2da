"""ZeRO-3 in the co-located layout, measured: per-device parameter + gradient + optimizer
bytes (live arrays and the gradients' shardings) are 1/d of the replicated figure, and the
compiled step's temporary memory (`memory_analysis()`) grows with depth by less than one
layer's full weights, its depth-independent part holding at most two layers' full weights
(the gathered layer and its full gradient) besides the non-layer parameters."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import global_batch, make_cfg
from mmjax.data.assemble import assemble
from mmjax.models.mllm import MultimodalModel, trainable_filter
from mmjax.parallel.fsdp import colocated_mesh, place_batch, tree_shardings
from mmjax.train.colocated import colocated_step, frozen_shardings, state_shardings
from mmjax.train.colocated_plan import Colocation
from mmjax.train.inputs import model_inputs
from mmjax.train.optimizer import OptimizerSettings, optimizer_from_settings
from mmjax.train.state import whole_model_state
from mmjax.train.step import split_model

WIDE = {"llm.hidden_size": 512, "llm.ffn_size": 2048}  # weights dominate the activations


def measure(layers: int) -> dict:
    cfg = make_cfg(**WIDE, **{"llm.num_layers": layers})
    lay, samples = global_batch(cfg, 8)
    colo = Colocation(default_stage=3)
    mesh = colocated_mesh(jax.devices(), colo)
    mdl = MultimodalModel(cfg, jax.random.key(0))
    gd, tr, fr = split_model(mdl, trainable_filter(cfg))
    tx = optimizer_from_settings(1e-3, OptimizerSettings())
    state = whole_model_state(tr, tx.init(tr), jnp.zeros((), jnp.int32))
    abstract = jax.eval_shape(lambda: state)
    state = jax.device_put(state, state_shardings(abstract, mesh, colo))
    frozen = jax.device_put(fr, frozen_shardings(fr, mesh, colo))
    step = colocated_step(gd, tx, mesh, colo, abstract)
    batch = place_batch(mesh, model_inputs(assemble(samples, lay)))
    compiled = step.lower(state, frozen, batch, np.full(2, np.inf, np.float32)).compile()
    dev = jax.devices()[0]
    on_dev = lambda arrays: sum(s.data.nbytes for x in arrays for s in x.addressable_shards
                                if s.device == dev)
    grads = jax.tree.leaves(tree_shardings(tr, mesh, colo, "grads"))
    grad_dev = sum(np.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
                   for s, x in zip(grads, jax.tree.leaves(tr)))
    params = sum(x.nbytes for x in jax.tree.leaves((tr, fr)))
    return {"state_dev": on_dev(jax.tree.leaves((state, frozen))) + grad_dev,
            "state_full": sum(x.nbytes for x in jax.tree.leaves((state, frozen))) +
            sum(x.nbytes for x in jax.tree.leaves(tr)),
            "temp": compiled.memory_analysis().temp_size_in_bytes,
            "layer": sum(x.nbytes for x in jax.tree.leaves(nnx.state(mdl.llm.layers[0]))),
            "params": params}


@pytest.mark.slow
def test_zero3_state_is_one_dth_and_temp_holds_about_one_layer():
    a, b = measure(2), measure(4)
    for m in (a, b):  # 1/d of the replicated figure within 5%
        ratio = m["state_dev"] / m["state_full"]
        assert abs(ratio * 8 - 1) < 0.05, ratio
    layer = a["layer"]
    per_layer = (b["temp"] - a["temp"]) / 2  # activations + the layer's 1/d optimizer temps
    assert per_layer < 0.75 * layer, (per_layer / layer)  # hoisted gathers: >= 2 layers
    fixed = a["temp"] - 2 * per_layer
    rest = a["params"] - 2 * layer  # every non-layer parameter, whole
    assert fixed <= 2 * layer + 2 * rest, (fixed / layer, rest / layer)
    print(f"ZeRO-3 dp 8: state {a['state_dev'] / a['state_full']:.4f} of replicated; temp "
          f"{a['temp'] / layer:.2f} layers (2 layers), {b['temp'] / layer:.2f} (4 layers); "
          f"per layer {per_layer / layer:.2f}, depth-independent {fixed / layer:.2f} layers")
