"""The planner prices LoRA (planner/lora_params.py): adapter parameters counted exactly as
the model holds them; a LoRA'd LLM's backward computes activation gradients only (between a
frozen LLM with a trained encoder upstream and a trained one), and only its adapters carry
gradients, accumulators and optimizer state (DistTrain MLLM-9B, A800)."""
import jax
import pytest
from flax import nnx

from mmjax.models.lora_config import LoRAConfig
from mmjax.models.mllm import MultimodalModel
from mmjax.models.named import named_config
from mmjax.models.tiny import tiny
from mmjax.planner import memory
from mmjax.planner.build import default_workload
from mmjax.planner.costs import unit_cost
from mmjax.planner.hardware import A800
from mmjax.planner.lora_params import lora_params
from mmjax.planner.module_params import llm_params, num_params
from mmjax.train.lora_setup import with_lora

LORA = LoRAConfig(rank=8, alpha=16.0, targets=("attention", "mlp"))


def test_adapter_parameters_counted_as_the_model_holds_them():
    cfg = with_lora(tiny(), ("llm", "vision", "vision.projector"),
                    LoRAConfig(rank=4, targets=("all",)))
    model = nnx.eval_shape(lambda: MultimodalModel(cfg, jax.random.key(0)))
    assert num_params(cfg) == sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    c = cfg.llm  # r (in + out) per projection per layer
    hq, hkv = c.num_heads * c.dim_per_head, c.num_kv_heads * c.dim_per_head
    d, f = c.hidden_size, c.ffn_size
    per_layer = 4 * ((d + hq) * 2 + 2 * (d + hkv) + 3 * (d + f))
    assert lora_params(cfg, "llm") == per_layer * c.num_layers


def test_lora_llm_is_priced_between_frozen_and_trained():
    full = named_config("disttrain/mllm_9b")
    lora = named_config("disttrain/mllm_9b", {"llm.lora": LORA})
    frozen = named_config("disttrain/mllm_9b", {"llm_frozen": True})  # ViT trained upstream
    wl = default_workload(full)
    cost = {k: unit_cost(m, wl, "llm", A800) for k, m in
            (("full", full), ("lora", lora), ("frozen", frozen))}
    adapters = lora_params(lora, "llm")
    assert 0 < adapters < 0.01 * llm_params(full.llm)
    assert cost["lora"].optimizer_bytes == memory.OPTIMIZER_BYTES * adapters
    assert cost["lora"].grad_bytes == 2.0 * adapters
    # frozen base in float32 (as the runtime holds it), adapters as any trained weight
    base = llm_params(full.llm)
    assert cost["lora"].weight_bytes == pytest.approx(
        memory.FROZEN_BYTES * base + (2 * 2 + memory.ACC_BYTES) * adapters)
    assert cost["full"].weight_bytes == pytest.approx((2 * 2 + memory.ACC_BYTES) * base)
    for t in cost["lora"].time_s:
        assert cost["frozen"].time_s[t] < cost["lora"].time_s[t] < cost["full"].time_s[t]
        # backward 1 x forward instead of 2 x, plus the adapters' own small work
        assert cost["lora"].time_s[t] == pytest.approx(2 / 3 * cost["full"].time_s[t],
                                                       rel=0.02)
