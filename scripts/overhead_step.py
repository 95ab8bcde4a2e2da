"""scripts/bench_overhead.py's step part: mmjax's train step against a minimal pure-JAX +
optax step of the same text-only Llama-style model, alternating, on the same batch."""
from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

LR, B1, B2, EPS, WD, CLIP = 1e-4, 0.9, 0.95, 1e-8, 0.01, 1.0


# ---- the plain program ---------------------------------------------------------------------
def rms(x, w, eps=1e-6):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope_tables(seq: int, head_dim: int, theta: float = 10000.0):
    inv = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    ang = jnp.arange(seq, dtype=jnp.float32)[:, None] * inv
    return jnp.cos(ang)[None, :, None, :], jnp.sin(ang)[None, :, None, :]


def rotate(x, cos, sin):
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def plain_loss(params, tokens, targets, mask, heads: int):
    """Mean next-token cross-entropy of a Llama-style decoder: stacked layer weights
    [L, ...] scanned, dense causal attention, SwiGLU."""
    b, s = tokens.shape
    d = params["embed"].shape[1]
    hd = d // heads
    cos, sin = rope_tables(s, hd)
    causal = jnp.tril(jnp.ones((s, s), bool))

    def layer(x, p):
        h = rms(x, p["attn_norm"])
        q, k, v = ((h @ p[w]).reshape(b, s, heads, hd) for w in ("wq", "wk", "wv"))
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(hd)
        probs = jax.nn.softmax(jnp.where(causal, logits, -1e30), axis=-1)
        o = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, d)
        x = x + o @ p["wo"]
        h = rms(x, p["mlp_norm"])
        return x + (jax.nn.silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"], None

    x, _ = jax.lax.scan(layer, params["embed"][tokens], params["layers"])
    logits = rms(x, params["final_norm"]) @ params["lm_head"]
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return jnp.sum(ce * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def plain_step_fn(heads: int):
    tx = optax.chain(optax.clip_by_global_norm(CLIP),
                     optax.adamw(LR, b1=B1, b2=B2, eps=EPS, weight_decay=WD))

    def step(params, opt, tokens, targets, mask):
        loss, grads = jax.value_and_grad(plain_loss)(params, tokens, targets, mask, heads)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, loss

    return tx, jax.jit(step, donate_argnums=(0, 1))


LAYER_KEYS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")


def plain_params(trainable) -> dict:
    """mmjax's initial LLM weights as the plain program's stacked dict (same values)."""
    from flax import nnx

    llm = nnx.to_pure_dict(trainable)["llm"]
    layers = [llm["layers"][i] for i in sorted(llm["layers"])]
    leaf = lambda t: np.array(t["scale"] if isinstance(t, dict) else t)  # a copy: the
    return {"embed": jnp.asarray(leaf(llm["embed"])),  # mmjax step donates its own
            "lm_head": jnp.asarray(leaf(llm["lm_head"])),
            "final_norm": jnp.asarray(leaf(llm["final_norm"])),
            "layers": {k: jnp.stack([leaf(l[k]) for l in layers])
                       for k in LAYER_KEYS}}


# ---- mmjax ---------------------------------------------------------------------------------
def mmjax_setup(a):
    """(step function, state, frozen, batch inputs, limits, rate, config)."""
    from mmjax.models.config import with_overrides
    from mmjax.models.mllm import MultimodalModel, trainable_filter
    from mmjax.models.tiny import tiny
    from mmjax.train.optimizer import OptimizerSettings, optimizer_from_settings, rate_as_input
    from mmjax.train.state import whole_model_state
    from mmjax.train.step import make_train_step, split_model

    cfg = with_overrides(tiny(), {
        "encoders": (), "generator": None, "llm.vocab_size": a.vocab,
        "llm.hidden_size": a.hidden, "llm.num_layers": a.layers, "llm.num_heads": a.heads,
        "llm.num_kv_heads": a.heads, "llm.ffn_size": a.ffn, "llm.qkv_bias": False,
        "llm.scan_layers": True})
    model = MultimodalModel(cfg, jax.random.key(0))
    graphdef, trainable, frozen = split_model(model, trainable_filter(cfg))
    settings = OptimizerSettings(weight_decay=WD, clip_norm=CLIP, b1=B1, b2=B2, eps=EPS)
    schedule = lambda count: jnp.float32(LR) + 0.0 * count
    tx = optimizer_from_settings(schedule, settings)
    tx_at, _ = rate_as_input(schedule, settings)
    step = make_train_step(graphdef, tx, jnp.float32, "auto", "causal", tx_at=tx_at)
    state = whole_model_state(trainable, tx.init(trainable), jnp.int32(0))
    return step, state, frozen, cfg


def batch_arrays(a, seed: int = 1):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, a.vocab, (a.batch, a.seq + 1)).astype(np.int32)
    inp, tgt = tokens[:, :-1], tokens[:, 1:]
    ones = np.ones((a.batch, a.seq), np.int32)
    mmjax = {"tokens": inp, "targets": tgt, "loss_mask": ones.astype(np.float32),
             "positions": np.broadcast_to(np.arange(a.seq, dtype=np.int32), inp.shape).copy(),
             "doc": ones, "sub": ones * 0, "bam": ones, "encoders": {},
             "num_target_tokens": np.float32(inp.size), "num_gen_elements": np.float32(1)}
    return mmjax, (inp, tgt, ones.astype(np.float32))


def compare_steps(a) -> dict:
    step, state, frozen, cfg = mmjax_setup(a)
    batch, (tok, tgt, mask) = batch_arrays(a)
    params = plain_params(state.stages["model"].master)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    tx, plain = plain_step_fn(a.heads)
    opt = tx.init(params)
    limits, rate = np.full(2, np.inf, np.float32), np.float32(LR)
    batch = jax.device_put(batch)
    tok, tgt, mask = jax.device_put((tok, tgt, mask))
    box = {"state": state, "params": params, "opt": opt}

    def run_mmjax():
        box["state"], m = step(box["state"], frozen, batch, limits, rate)
        return float(m["loss"])

    def run_plain():
        box["params"], box["opt"], loss = plain(box["params"], box["opt"], tok, tgt, mask)
        return float(loss)

    t = time.perf_counter()
    first = {"mmjax": run_mmjax()}
    compile_m = time.perf_counter() - t
    t = time.perf_counter()
    first["plain"] = run_plain()
    compile_p = time.perf_counter() - t
    if not np.isclose(first["mmjax"], first["plain"], rtol=1e-4):
        raise SystemExit(f"error: the two steps disagree: first loss mmjax {first['mmjax']} "
                         f"vs plain {first['plain']} (the reference is not the same model)")
    times = {"mmjax": [], "plain": []}
    cpu = {"mmjax": [], "plain": []}
    for r in range(a.rounds):
        order = (("mmjax", run_mmjax), ("plain", run_plain))
        for name, fn in (order if r % 2 == 0 else order[::-1]):
            t, c = time.perf_counter(), time.process_time()
            fn()
            times[name].append(time.perf_counter() - t)
            cpu[name].append(time.process_time() - c)
    med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    med_cpu = {k: 1e3 * statistics.median(v) for k, v in cpu.items()}
    return {"params": n_params, "first_loss": first,
            "first_call_s": {"mmjax": compile_m, "plain": compile_p},
            "mmjax_ms": med["mmjax"], "plain_ms": med["plain"],
            "ratio": med["mmjax"] / med["plain"],
            "mmjax_cpu_ms": med_cpu["mmjax"], "plain_cpu_ms": med_cpu["plain"],
            "cpu_ratio": med_cpu["mmjax"] / med_cpu["plain"],
            "times_s": times}
