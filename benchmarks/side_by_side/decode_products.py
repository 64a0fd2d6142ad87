"""A lower bound on decoding the benchmark model with XLA on this machine: only the
matrix products of each generated token, run back to back in one jitted loop.

Per token and layer the fused QKV projection, the output projection, the fused
gate/up projection and the down projection, then the LM head, for `rows` rows
(8: the generation workload; 32: a GRPO group of 8 prompts × 4), `new` tokens.
No attention, cache, normalisation or sampling, so a real decode loop of this model
cannot be faster than this; it is what the generation targets are weighed against
in RESULTS.md. With `--inputs` (from `make_inputs.py`), rlhf_eqx's `generate_batch` on
the benchmark model and prompts is timed in the same loop, calls alternating (8 rows
greedy from the generation prompts; 32 rows sampled, 4 per GRPO prompt). Prints medians
of `--repeats` calls and a `jnp.dot` peak measured in the same process.

    python benchmarks/side_by_side/decode_products.py [--inputs DIR] [--rows 8,32]
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402


def weights(cfg, key):
    D, F, L, V = cfg["d_model"], cfg["d_ff"], cfg["n_layers"], cfg["vocab_size"]
    kv = D // cfg["n_heads"] * cfg["n_kv_heads"]
    shapes = dict(
        qkv=(L, D, D + 2 * kv), o=(L, D, D), gu=(L, D, 2 * F), down=(L, F, D), head=(D, V)
    )
    keys = jax.random.split(key, len(shapes))
    return {
        n: 0.02 * jax.random.normal(k, s, jnp.float32) for (n, s), k in zip(shapes.items(), keys)
    }


def products_only(w, x, *, new: int, cfg):
    """`new` tokens of the decode chain's products; each token's result feeds the next."""
    D, F, L = cfg["d_model"], cfg["d_ff"], cfg["n_layers"]

    def token(_, x):
        for layer in range(L):
            h = x @ w["qkv"][layer]
            x = x + h[:, :D] @ w["o"][layer]
            g = x @ w["gu"][layer]
            x = x + (g[:, :F] * g[:, F:]) @ w["down"][layer]
        logits = x @ w["head"]
        return x + 1e-3 * logits[:, :D]

    return jax.lax.fori_loop(0, new, token, x)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="8,32")
    p.add_argument("--new", type=int, default=common.GEN["new"])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--inputs", help="benchmark inputs: also time rlhf_eqx's generate_batch")
    args = p.parse_args()
    cfg = common.CONFIG
    w = weights(cfg, jax.random.key(0))
    f = jax.jit(lambda w, x: products_only(w, x, new=args.new, cfg=cfg))
    print(f"jnp.dot peak {common.jax_matmul_peak():.0f} GFLOP/s")
    for rows in (int(r) for r in args.rows.split(",")):
        x = jnp.ones((rows, cfg["d_model"]), jnp.float32)
        runs = {"products only": lambda: f(w, x).block_until_ready()}
        if args.inputs:
            runs["rlhf_eqx generate_batch"] = library_generation(args.inputs, rows, args.new)
        times = {name: [] for name in runs}
        for run in runs.values():
            run()
        for _ in range(args.repeats):
            for name, run in runs.items():
                t0 = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - t0)
        medians = {name: common.median(t) for name, t in times.items()}
        line = ", ".join(f"{name} {m:.3f} s" for name, m in medians.items())
        if len(medians) == 2:
            line += (
                f" (products {medians['products only'] / medians['rlhf_eqx generate_batch']:.0%}"
                " of it)"
            )
        print(f"{rows} rows × {args.new} tokens: {line}")


def library_generation(inputs_dir, rows: int, new: int):
    """A call of rlhf_eqx's `generate_batch` for `rows` rows of the benchmark inputs:
    greedy from the generation prompts when they have that many rows, else sampled,
    `rows // prompts` per GRPO prompt (each prompt prefilled once)."""
    import rlhf_eqx as rx

    inputs = common.load_inputs(inputs_dir)
    policy = rx.load_hf(os.path.join(inputs_dir, "model"))
    if rows <= len(inputs["gen_prompt"]):
        prompts, group, temperature = jnp.asarray(inputs["gen_prompt"][:rows]), 1, 0.0
    else:
        prompts = jnp.asarray(inputs["grpo_prompt"])
        group, temperature = rows // len(prompts), 1.0
        prompts = prompts[: rows // group]
    mask = jnp.ones(prompts.shape, bool)
    gen = jax.jit(
        lambda p, k: (
            rx.generate_batch(
                policy, p, mask, k, max_new_tokens=new, temperature=temperature, num_samples=group
            ).tokens
        )
    )
    return lambda: gen(prompts, jax.random.key(0)).block_until_ready()


if __name__ == "__main__":
    main()
