"""Load the stories260K Llama-2 model (llama2.c format) and sample stories from it.

This is the project's main job until the training pipelines land: it reads a real
checkpoint and tokenizer, decodes greedily from BOS (the model's known opening is
"Once upon a time, there was a little girl named Lily."), then samples a batch of
stories with temperature and top-p in one compiled program, and checks that the
sampler's log-probabilities agree with a full forward pass.

    python examples/sample_stories.py [--model PATH] [--tokenizer PATH] [--new-tokens N]

By default the model is read from `../shared/models/stories260K/` next to the checkout.
"""

import argparse
import os
import time

import jax
import jax.numpy as jnp

import rlhf_eqx as rx

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_DIR = os.path.join(HERE, "..", "..", "shared", "models", "stories260K")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=os.path.join(DEFAULT_DIR, "stories260K.bin"))
    parser.add_argument("--tokenizer", default=os.path.join(DEFAULT_DIR, "tok512.bin"))
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    for path in (args.model, args.tokenizer):
        if not os.path.isfile(path):
            raise SystemExit(f"error: {path} does not exist (pass --model / --tokenizer)")

    policy, tok = rx.load_llama2c(args.model, args.tokenizer)
    cfg = policy.cfg
    print(
        f"loaded {os.path.basename(args.model)}: d_model {cfg.d_model}, {cfg.n_layers} layers, "
        f"{cfg.n_heads} heads / {cfg.n_kv_heads} kv heads, vocab {cfg.vocab_size}, "
        f"{cfg.num_params():,} parameters"
    )

    bos = jnp.array([[tok.bos_id]], jnp.int32)
    one = jnp.ones((1, 1), bool)
    start = time.perf_counter()
    greedy = rx.generate_batch(
        policy,
        bos,
        one,
        jax.random.key(0),
        max_new_tokens=args.new_tokens,
        temperature=0.0,
        eos_id=tok.eos_id,
        pad_id=tok.pad_id,
    )
    ids = [int(t) for t, m in zip(greedy.tokens[0], greedy.completion_mask[0]) if m]
    print(f"\n[greedy, {time.perf_counter() - start:.1f}s incl. compile]\n{tok.decode(ids)}")

    n = args.samples
    prompts = jnp.full((n, 1), tok.bos_id, jnp.int32)
    masks = jnp.ones((n, 1), bool)
    start = time.perf_counter()
    out = rx.generate_batch(
        policy,
        prompts,
        masks,
        jax.random.key(args.seed),
        max_new_tokens=args.new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        eos_id=tok.eos_id,
        pad_id=tok.pad_id,
    )
    jax.block_until_ready(out.tokens)
    elapsed = time.perf_counter() - start
    for i in range(n):
        ids = [int(t) for t, m in zip(out.tokens[i], out.completion_mask[i]) if m]
        print(
            f"\n[sample {i}, temperature {args.temperature}, top-p {args.top_p}]\n{tok.decode(ids)}"
        )

    recomputed = jax.jit(
        jax.vmap(lambda t, m: rx.token_logprobs(policy, t, m, temperature=args.temperature))
    )(out.tokens, out.mask)
    err = float(jnp.max(jnp.abs(jnp.where(out.completion_mask, recomputed - out.logprobs, 0.0))))
    n_tokens = int(out.completion_mask.sum())
    print(
        f"\n{n_tokens} tokens sampled in {elapsed:.1f}s (incl. compile); "
        f"max |sampler log-prob - full-forward log-prob| = {err:.2e}"
    )


if __name__ == "__main__":
    main()
