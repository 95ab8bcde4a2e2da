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
from mmjax.parallel.sharded_init import abstract_split
from mmjax.planner.colocated_memory import colocated_memory
from mmjax.train.colocated import colocated_step, frozen_shardings, state_shardings
from mmjax.train.colocated_plan import Colocation
from mmjax.train.inputs import model_inputs
from mmjax.train.memory_check import colocated_loads
from mmjax.train.optimizer import OptimizerSettings, optimizer_from_settings
from mmjax.train.single_program import round_counts
from mmjax.train.state import WHOLE_MODEL, whole_model_state


@pytest.fixture(scope="module")
def setup():
    cfg = make_cfg()
    lay, samples = global_batch(cfg, 8)
    n = len(jax.devices())
    shapes = round_counts(batch_shapes([[lay.rules.meta(s) for s in samples]], lay), n)
    gd, tr, fr = abstract_split(MultimodalModel, (cfg,), jax.random.key(0),
                                (trainable_filter(cfg), ...))  # shapes only: nothing runs
    return cfg, lay, shapes, model_inputs(assemble(samples, lay, shapes)), gd, tr, fr


def compiled_peak(setup, colo) -> int:
    cfg, lay, shapes, inputs, gd, tr, fr = setup
    mesh = colocated_mesh(jax.devices(), colo)
    tx = optimizer_from_settings(1e-3, OptimizerSettings())
    abstract = jax.eval_shape(lambda: whole_model_state(tr, tx.init(tr),
                                                        jnp.zeros((), jnp.int32)))
    sh = state_shardings(abstract, mesh, colo)
    on = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
    state = jax.tree.map(on, abstract, sh)
    frozen = jax.tree.map(on, fr, frozen_shardings(fr, mesh, colo))
    step = colocated_step(gd, tx, mesh, colo, abstract)
    m = step.lower(state, frozen, place_batch(mesh, inputs, colo),
                   np.full(2, np.inf, np.float32)).compile().memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
            + m.temp_size_in_bytes)


@pytest.mark.slow
@pytest.mark.parametrize("zero,tp", [(1, {}), (2, {}), (3, {}), (1, {"vision": 2}),
                                     (3, {"vision": 2, "llm": 2})])
def test_prediction_within_15_percent_of_compiled_peak(setup, zero, tp):
    cfg, lay, shapes, inputs, gd, tr, fr = setup
    colo = Colocation(tp.get("llm", 1), (), zero, None,
                      tuple((u, t) for u, t in tp.items() if u != "llm"))
    n = len(jax.devices())
    assert n == 8
    model = colocated_memory(colocated_loads(cfg, shapes, lay.seq_len, tr, fr, colo, n,
                                             jnp.float32, "auto"))
    got = compiled_peak(setup, colo)
    print(f"ZeRO-{zero} tp {tp}: predicted {model.peak / 1e6:.2f} MB, compiled {got / 1e6:.2f} MB "
          f"({model.peak / got:.2f})")
    assert abs(model.peak / got - 1) < 0.15, (model, got)


def test_terms_by_stage_and_attention_implementation(setup):
    """Host side: ZeRO-3 holds 1/d of the parameters and gradients, stage 2 the same peak
    as stage 1 (gradients formed whole before the reduce-scatter); a tiled attention
    implementation (GPU) builds no score buffers, so the working set shrinks (the "dots"
    residuals keep no scores either way)."""
    cfg, lay, shapes, inputs, gd, tr, fr = setup
    est = {z: colocated_memory(colocated_loads(cfg, shapes, lay.seq_len, tr, fr,
                                               Colocation(default_stage=z), 8, jnp.float32))
           for z in (1, 2, 3)}
    assert est[2].peak == est[1].peak
    assert est[3].params == pytest.approx(est[1].params / 8)
    assert est[3].gradients == pytest.approx(est[1].gradients / 8)
    assert est[3].optimizer == est[1].optimizer and est[3].gathered > 0
    chunked = colocated_memory(colocated_loads(cfg, shapes, lay.seq_len, tr, fr,
                                               Colocation(), 8, jnp.float32, "chunked"))
    assert chunked.work < est[1].work and chunked.residuals == est[1].residuals


def test_a_step_that_cannot_fit_is_refused_with_the_estimate_and_the_fix(setup):
    from mmjax.data.batch_shapes import BatchShapes
    from mmjax.errors import UserError
    from mmjax.train.memory_check import check_colocated

    cfg, lay, shapes, inputs, gd, tr, fr = setup
    huge = BatchShapes(8 * 4096, (("vision", 8 * 1024, 256),), 8)
    colo = Colocation(default_stage=2)
    with pytest.raises(UserError) as e:
        check_colocated(cfg, huge, 8192, tr, fr, colo, 8, jnp.float32, "auto", 8 * 4096,
                        jax.devices()[0])
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("the co-located step needs about ")
    assert "manual_plan.zero_stage (now 2)" in msg and "train.check_memory=False" in msg
    est, line = check_colocated(cfg, shapes, lay.seq_len, tr, fr, colo, 8, jnp.float32,
                                "auto", 8, jax.devices()[0])
    assert line.startswith("memory: the co-located step needs about ") and est.peak > 0


@pytest.mark.parametrize("zero,tp", [(1, {}), (3, {}), (3, {"vision": 2, "llm": 2})])
def test_the_planner_prices_the_same_terms(setup, zero, tp):
    """planner/colocated.py `evaluate_colocated` (UnitCosts of a workload of the padded
    shapes: 160-token rows, 256-patch images; the planner costs bfloat16 activations) gives
    the memory the runner's check computes from the model's trees at those shapes in
    bfloat16 with dense attention, up to the planner's coarser per-layer weights (a unit's
    parameters / its layers)."""
    from mmjax.planner.build import model_costs
    from mmjax.planner.colocated import evaluate_colocated
    from mmjax.planner.hardware import H100
    from mmjax.planner.workload import Workload

    cfg, lay, shapes, inputs, gd, tr, fr = setup
    count, cap = shapes.encoder("vision")
    wl = Workload("padded", (lay.seq_len,) * shapes.rows, {"vision": ((cap,),) * count},
                  (1,) * shapes.gen)
    costs, _ = model_costs(cfg, H100, wl, attention_impl="dense")
    ev = evaluate_colocated(costs, 8, shapes.rows, H100, tp, {c.name: zero for c in costs},
                            "dots", 1)
    colo = Colocation(tp.get("llm", 1), (), zero, None,
                      tuple((u, t) for u, t in tp.items() if u != "llm"))
    check = colocated_memory(colocated_loads(cfg, shapes, lay.seq_len, tr, fr, colo, 8,
                                             jnp.bfloat16, "dense"))
    assert ev.memory_gb * 1e9 == pytest.approx(check.peak, rel=0.03)


def test_the_runner_prints_the_estimate_before_compiling():
    """The co-located runner checks its step against the device's memory at the shapes its
    loader scanned (nothing compiled yet) and prints the estimate."""
    from mmjax.models.config import with_overrides
    from mmjax.models.tiny import tiny
    from mmjax.train.colocated import ColocatedMesh
    from mmjax.train.data_config import layout_and_source
    from mmjax.train.memory_check import check_colocated
    from mmjax.train.whole_model import WholeModelRunner

    cfg = with_overrides(tiny(), {"llm.num_layers": 2, "encoders.vision.encoder.num_layers": 1,
                                  "generator.num_layers": 1})
    lay, src = layout_and_source(cfg, None)
    colo = Colocation(default_stage=3)
    runner = WholeModelRunner(cfg, lay, 8, 1e-3, jnp.float32, 0,
                              ColocatedMesh(colo, cfg, jnp.float32), src)
    est, line = check_colocated(cfg, runner.data.floor, lay.seq_len,
                                runner.abstract.stages[WHOLE_MODEL].master,
                                runner.abstract_frozen, colo, 8, jnp.float32, "auto", 8,
                                jax.local_devices()[0], shared_by=8)
    assert runner.memory_line == line and line.endswith("on cpu:0")
    assert f"{est.peak / 1e9:.3f} GB per device" in line


@pytest.mark.slow
def test_prediction_with_per_phase_balancing(setup):
    """"sum"-balanced phases (OrchMLLM Algorithm 1) at the per-rank shapes they pad to, the
    encoder outputs moved by the staged exchange (one node of 8: 128 rows in each of its 7
    intra-node shifts, forward and backward): within 15% too."""
    from mmjax.data.batch_shapes import BatchShapes
    from mmjax.parallel.phase_inputs import balanced_inputs, colocated_route
    from mmjax.train.memory_check import check_colocated

    cfg, lay, shapes, inputs, gd, tr, fr = setup
    _, samples = global_batch(cfg, 8)
    colo, row = Colocation(), 4 * cfg.llm.hidden_size
    cap = ((128,) * 7 + (0,) * 7,) * 2  # (forward, backward) rows per shift
    mesh = colocated_mesh(jax.devices(), colo)
    batch, pb = balanced_inputs(samples, lay, mesh, "sum", capacity=cap, row_bytes=row)
    llm = pb.shapes["llm"]  # per rank; every rank pads to it
    step_shapes = BatchShapes(llm.rows * 8, tuple(
        (n, c * 8, k) for e, s in pb.shapes.items() if e != "llm"
        for n, c, k in s.encoders if n == e), llm.gen * 8)
    est, _ = check_colocated(cfg, step_shapes, lay.seq_len, tr, fr, colo, 8, jnp.float32,
                             "auto", 8, jax.devices()[0], exchange=2 * 7 * 128 * row)
    tx = optimizer_from_settings(1e-3, OptimizerSettings())
    abstract = jax.eval_shape(lambda: whole_model_state(tr, tx.init(tr),
                                                        jnp.zeros((), jnp.int32)))
    on = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
    state = jax.tree.map(on, abstract, state_shardings(abstract, mesh, colo))
    frozen = jax.tree.map(on, fr, frozen_shardings(fr, mesh, colo))
    step = colocated_step(gd, tx, mesh, colo, abstract, route=colocated_route(mesh))
    m = step.lower(state, frozen, batch,
                   np.full(2, np.inf, np.float32)).compile().memory_analysis()
    got = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
           + m.temp_size_in_bytes)
    print(f"balanced: predicted {est.peak / 1e6:.2f} MB, compiled {got / 1e6:.2f} MB "
          f"({est.peak / got:.2f})")
    assert abs(est.peak / got - 1) < 0.15, (est, got)
