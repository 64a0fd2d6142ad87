"""Model-layer throughput on this machine, measured side by side in one run.

Prints, for the reference Llama-architecture model (vocab 4096, d_model 256, 4 layers,
8 heads / 4 kv heads, d_ff 688, float32) at sequence length 256:

- the `jnp.dot` float32 peak of this machine (measured now, same process);
- forward+backward tokens/s and model FLOP utilisation (MFU) against that peak;
- compile time of the forward+backward step for 2 vs 12 layers (the layer scan keeps
  the ratio near 1);
- sampler decode tokens/s at batch 8 (sampling and greedy).

Usage: `python benchmarks/bench_model.py [--quick]` (`--quick` shrinks everything for
a smoke run). Ratios, not absolute times, are what to compare across machines.
"""

import argparse
import time

import equinox as eqx
import jax
import jax.numpy as jnp

import rlhf_eqx as rx


def best_time(fn, *args, repeats: int) -> float:
    """Minimum wall time of `fn(*args)` over `repeats` runs (after one warm-up)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return min(times)


def matmul_peak(n: int, repeats: int) -> float:
    """float32 GFLOP/s of an n×n @ n×n `jnp.dot`."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
    f = jax.jit(jnp.dot)
    t = best_time(f, a, b, repeats=repeats)
    return 2 * n**3 / t / 1e9


def nll(model, tokens, mask):
    """Mean next-token NLL of a batch; rlhf_eqx models take the batch directly (as the steps do)."""
    lp = jax.vmap(rx.logprobs_from_logits)(model(tokens, mask), tokens, mask)
    return -jnp.sum(lp) / jnp.sum(mask[:, 1:])


def nll_vmapped(model, tokens, mask):
    """The same loss with the per-sample model mapped by `jax.vmap` (how any custom model runs)."""
    lp = jax.vmap(lambda t, m: rx.token_logprobs(model, t, m))(tokens, mask)
    return -jnp.sum(lp) / jnp.sum(mask[:, 1:])


def grad_step(loss):
    return eqx.filter_jit(eqx.filter_value_and_grad(loss))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()

    if args.quick:
        base = dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128)
        batch, seq, new, repeats, peak_n = 2, 32, 8, 2, 256
    else:
        base = dict(vocab_size=4096, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, d_ff=688)
        batch, seq, new, repeats, peak_n = args.batch, args.seq, args.new_tokens, 5, 2048
    cfg = rx.TransformerConfig(**base, max_seq_len=max(seq, 512))
    print(f"devices: {jax.devices()}  jax {jax.__version__}")
    print(f"model: {base}, {cfg.num_params() / 1e6:.2f}M parameters, batch {batch} x seq {seq}")

    peak = matmul_peak(peak_n, repeats)
    print(f"jnp.dot float32 peak ({peak_n}x{peak_n}): {peak:.1f} GFLOP/s")

    policy = rx.Policy(cfg, key=jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (batch, seq), 0, cfg.vocab_size, dtype=jnp.int32)
    mask = jnp.ones((batch, seq), bool)
    t = best_time(grad_step(nll), policy, tokens, mask, repeats=repeats)
    n_tok = batch * seq
    flops = 3 * cfg.flops_per_token(seq) * n_tok  # forward + backward ≈ 3× forward
    achieved = flops / t / 1e9
    print(
        f"forward+backward: {t * 1e3:.1f} ms/step, {n_tok / t:,.0f} tokens/s, "
        f"{achieved:.1f} GFLOP/s, MFU {100 * achieved / peak:.1f}% of the measured peak"
    )
    t_vmap = best_time(grad_step(nll_vmapped), policy, tokens, mask, repeats=repeats)
    print(
        f"forward+backward with the per-sample model under jax.vmap: {t_vmap * 1e3:.1f} ms/step "
        f"(batched call is {t_vmap / t:.2f}x faster)"
    )

    compile_times = {}
    for n_layers in (2, 12):
        c = rx.TransformerConfig(**{**base, "n_layers": n_layers}, max_seq_len=max(seq, 512))
        m = rx.Policy(c, key=jax.random.key(0))

        jax.clear_caches()  # time a cold compile, not a cache hit
        start = time.perf_counter()
        grad_step(nll).lower(m, tokens, mask).compile()
        compile_times[n_layers] = time.perf_counter() - start
    ratio = compile_times[12] / compile_times[2]
    print(
        f"compile forward+backward: 2 layers {compile_times[2]:.2f} s, 12 layers "
        f"{compile_times[12]:.2f} s, ratio {ratio:.2f}"
    )

    prompt_len = 16
    prompts = jax.random.randint(
        jax.random.key(2), (batch, prompt_len), 3, cfg.vocab_size, dtype=jnp.int32
    )
    pmask = jnp.ones((batch, prompt_len), bool)
    for name, kwargs in (("sampling", dict(temperature=1.0)), ("greedy", dict(temperature=0.0))):

        def run(key, kwargs=kwargs):
            return rx.generate_batch(
                policy, prompts, pmask, key, max_new_tokens=new, **kwargs
            ).tokens

        t = best_time(run, jax.random.key(3), repeats=max(2, repeats // 2))
        print(f"decode ({name}), batch {batch}, {new} new tokens: {batch * new / t:,.0f} tokens/s")


if __name__ == "__main__":
    main()
