"""The co-located memory model (planner/colocated_memory.py, train/memory_check.py
`colocated_loads`) against the compiled step's own account: per device, arguments +
outputs - aliased (donated) + temporaries of `memory_analysis()`, at the shapes the runner
pads the batch to, for ZeRO 1, 2 and 3 (lower and compile only; nothing runs)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import global_batch, make_cfg
from mmjax.data.assemble import assemble
from mmjax.data.batch_shapes import batch_shapes
from mmjax.models.mllm import MultimodalModel, trainable_filter
from mmjax.parallel.fsdp import colocated_mesh, place_batch
from mmjax.planner.colocated_memory import colocated_memory
from mmjax.train.colocated import colocated_step, state_shardings
from mmjax.train.colocated_plan import Colocation
from mmjax.train.inputs import model_inputs
from mmjax.train.memory_check import colocated_loads
from mmjax.train.optimizer import OptimizerSettings, optimizer_from_settings
from mmjax.train.single_program import round_counts
from mmjax.train.step import TrainState, split_model


@pytest.fixture(scope="module")
def setup():
    cfg = make_cfg()
    lay, samples = global_batch(cfg, 8)
    n = len(jax.devices())
    shapes = round_counts(batch_shapes([[lay.rules.meta(s) for s in samples]], lay), n)
    mdl = MultimodalModel(cfg, jax.random.key(0))
    gd, tr, fr = split_model(mdl, trainable_filter(cfg))
    return cfg, lay, shapes, model_inputs(assemble(samples, lay, shapes)), gd, tr, fr


def compiled_peak(setup, colo) -> int:
    cfg, lay, shapes, inputs, gd, tr, fr = setup
    mesh = colocated_mesh(jax.devices(), colo)
    tx = optimizer_from_settings(1e-3, OptimizerSettings())
    abstract = jax.eval_shape(lambda: TrainState(jnp.zeros((), jnp.int32), tr, fr, tx.init(tr)))
    sh = state_shardings(abstract, mesh, colo)
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                         abstract, sh)
    step = colocated_step(gd, tx, mesh, colo, abstract)
    m = step.lower(state, place_batch(mesh, inputs),
                   np.full(2, np.inf, np.float32)).compile().memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
            + m.temp_size_in_bytes)


@pytest.mark.slow
@pytest.mark.parametrize("zero", [1, 2, 3])
def test_prediction_within_15_percent_of_compiled_peak(setup, zero):
    cfg, lay, shapes, inputs, gd, tr, fr = setup
    colo = Colocation(default_stage=zero)
    n = len(jax.devices())
    assert n == 8
    model = colocated_memory(colocated_loads(cfg, shapes, lay.seq_len, tr, fr, colo, n,
                                             jnp.float32, "auto"))
    got = compiled_peak(setup, colo)
    print(f"ZeRO-{zero}: predicted {model.peak / 1e6:.2f} MB, compiled {got / 1e6:.2f} MB "
          f"({model.peak / got:.2f})")
    assert abs(model.peak / got - 1) < 0.15, (model, got)
