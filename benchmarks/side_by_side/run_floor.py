"""A minimal hand-written JAX decode loop of the benchmark model: the floor that
rlhf_eqx's sampler is measured against (no library code, no validation, no EOS
handling: prefill once, then `max_new` steps of one token with a KV cache).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/side_by_side/run_floor.py gen_sample --inputs DIR

`gen135`: greedy decoding of SmolLM2-135M-Instruct from the float32 Hugging Face
directory `make_inputs.py --smollm2` wrote (tied embeddings: the head is the embedding).
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

LIB = "floor"


def load_weights(model_dir):
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    t = load_file(os.path.join(model_dir, "model.safetensors"))
    L = cfg["num_hidden_layers"]

    def stack(name):
        return jnp.stack([jnp.asarray(t[f"model.layers.{i}.{name}"]).T for i in range(L)])

    def stack_vec(name):
        return jnp.stack([jnp.asarray(t[f"model.layers.{i}.{name}"]) for i in range(L)])

    cat = lambda *names: jnp.concatenate([stack(n) for n in names], axis=-1)  # fused projections
    layers = dict(
        wqkv=cat("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        wo=stack("self_attn.o_proj.weight"),
        wgu=cat("mlp.gate_proj.weight", "mlp.up_proj.weight"),
        wd=stack("mlp.down_proj.weight"),
        n1=stack_vec("input_layernorm.weight"),
        n2=stack_vec("post_attention_layernorm.weight"),
    )
    head = t.get("lm_head.weight", t["model.embed_tokens.weight"])
    w = dict(
        embed=jnp.asarray(t["model.embed_tokens.weight"]),
        norm=jnp.asarray(t["model.norm.weight"]),
        head=jnp.asarray(head).T,
        layers=layers,
    )
    return cfg, w


def rms(x, g, eps):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * g


def rope(x, pos, theta):
    hd = x.shape[-1]
    inv = 1.0 / theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd)
    ang = pos[..., None].astype(jnp.float32) * inv
    ang = jnp.concatenate([ang, ang], -1)[..., None, :]  # [B, T, 1, hd]
    rot = jnp.concatenate([-x[..., hd // 2 :], x[..., : hd // 2]], -1)
    return x * jnp.cos(ang) + rot * jnp.sin(ang)


def make_generate(cfg, B, P, N, sample):
    H, K = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    D = cfg["hidden_size"]
    hd, eps, theta = D // H, cfg["rms_norm_eps"], cfg["rope_theta"]
    S = P + N

    def layer(x, lw, kc, vc, pos, start, allowed):
        """x [B, T, D]; head-major caches [B, K, S, hd]; writes the T new keys at `start`."""
        T = x.shape[1]
        h = rms(x, lw["n1"], eps).reshape(B * T, D)
        qkv = h @ lw["wqkv"]
        q = rope(qkv[:, :D].reshape(B, T, H, hd), pos, theta)
        k = rope(qkv[:, D : D + K * hd].reshape(B, T, K, hd), pos, theta)
        v = qkv[:, D + K * hd :].reshape(B, T, K, hd)
        kc = jax.lax.dynamic_update_slice(kc, k.transpose(0, 2, 1, 3), (0, 0, start, 0))
        vc = jax.lax.dynamic_update_slice(vc, v.transpose(0, 2, 1, 3), (0, 0, start, 0))
        # [B, T, K, G, hd] -> [B, K, G·T, hd]: one batched matmul per kv head
        qg = q.reshape(B, T, K, H // K, hd).transpose(0, 2, 3, 1, 4).reshape(B, K, -1, hd)
        s = jnp.einsum("bkqd,bksd->bkqs", qg, kc) * (1.0 / hd**0.5)
        s = jnp.where(jnp.tile(allowed, (1, H // K, 1))[:, None], s, -1e30)
        o = jnp.einsum("bkqs,bksd->bkqd", jax.nn.softmax(s, -1), vc)
        o = o.reshape(B, K, H // K, T, hd).transpose(0, 3, 1, 2, 4).reshape(B * T, D)
        x = x + (o @ lw["wo"]).reshape(B, T, D)
        h = rms(x, lw["n2"], eps).reshape(B * T, D)
        gu = h @ lw["wgu"]
        F = gu.shape[-1] // 2
        x = x + ((jax.nn.silu(gu[:, :F]) * gu[:, F:]) @ lw["wd"]).reshape(B, T, D)
        return x, kc, vc

    def forward(w, tokens, kcs, vcs, start):
        T = tokens.shape[1]
        pos = jnp.broadcast_to(start + jnp.arange(T), (B, T))
        allowed = jnp.broadcast_to(
            jnp.arange(S)[None, :] <= (start + jnp.arange(T))[:, None], (B, T, S)
        )  # [B, T, S]
        x = w["embed"][tokens]

        def body(x, xs):
            lw, kc, vc = xs
            x, kc, vc = layer(x, lw, kc, vc, pos, start, allowed)  # allowed tiled over G inside
            return x, (kc, vc)

        x, (kcs, vcs) = jax.lax.scan(body, x, (w["layers"], kcs, vcs))
        return rms(x[:, -1], w["norm"], eps) @ w["head"], kcs, vcs

    @jax.jit
    def generate(w, prompts, key):
        L = w["layers"]["wo"].shape[0]
        kcs = jnp.zeros((L, B, K, S, hd), jnp.float32)
        vcs = jnp.zeros((L, B, K, S, hd), jnp.float32)
        logits, kcs, vcs = forward(w, prompts, kcs, vcs, 0)
        out = jnp.zeros((B, N), jnp.int32)

        def step(i, carry):
            logits, kcs, vcs, out = carry
            if sample:
                tok = jax.random.categorical(jax.random.fold_in(key, i), logits).astype(jnp.int32)
            else:
                tok = jnp.argmax(logits, -1).astype(jnp.int32)
            out = out.at[:, i].set(tok)
            logits, kcs, vcs = forward(w, tok[:, None], kcs, vcs, P + i)
            return logits, kcs, vcs, out

        return jax.lax.fori_loop(0, N, step, (logits, kcs, vcs, out))[3]

    return generate


def main():
    args, inputs = common.start("the floor", ("gen_sample", "gen_greedy", "gen135"))
    extra = {}
    if args.workload == "gen135":
        cfg, w = load_weights(os.path.join(common.smollm2_dir(args.inputs), "hf"))
        prompts = jnp.asarray(inputs["s135_gen_prompt"])
        B, P = prompts.shape
        new = int(inputs["s135_gen_new"])
        # the embedding is read by the gather only; the head's copy of it once a step
        leaves = jax.tree.leaves({k: v for k, v in w.items() if k != "embed"})
        extra.update(
            weight_bytes=int(sum(x.nbytes for x in leaves)), decode_steps=new, weights="float32"
        )
    else:
        cfg, w = load_weights(os.path.join(args.inputs, "model"))
        g = common.GEN
        prompts = jnp.asarray(inputs["gen_prompt"])
        B, P, new = g["batch"], g["prompt"], g["new"]
    gen = make_generate(cfg, B, P, new, args.workload == "gen_sample")
    run = lambda key: gen(w, prompts, key).block_until_ready()
    first, times = common.time_keyed_steps(run, args.steps)
    peak = common.jax_matmul_peak()
    common.emit(LIB, args.workload, first, times, peak_gflops=peak, new_tokens=B * new, **extra)


if __name__ == "__main__":
    main()
