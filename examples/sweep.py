"""Train 8 seeds x 4 DPO betas of stories260K in one compiled call, and plot the spread.

PureJaxRL style: the whole DPO run — LoRA initialisation, `--steps` updates of the
library's DPO step (`rx.train.make_dpo_step`, cached reference, built with the run's
beta) on mini-batches of a fixed set of preference pairs (animal-task pairs judged by
the built-in scorer: up to 4 per prompt from 16 base-model samples, a completion with an
animal against one without), held-out pair accuracy at the end — is a pure function
`train(key, beta)` whose loop is a `lax.scan`; `jax.vmap` over seeds and betas (beta
traced) and one `jax.jit` give all 32 runs in one program.

    python examples/sweep.py [--steps 20] [--out sweep.png] [--benchmark]

Prints, for each beta, the final DPO loss and held-out accuracy (implicit reward of the
chosen completion above the rejected one) as mean +- std over the seeds, and writes a
plot of the loss curves (mean and min-max band over seeds) when matplotlib is
installed. `--benchmark` also times the 32 runs one after another (each one compiled
call) against the vmapped call.
"""

import argparse
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import rlhf_eqx as rx
from rlhf_eqx import data, pipelines as pl

BETAS = (0.03, 0.1, 0.3, 1.0)
SEEDS = 8


def contrast_pairs(prompts, texts, labels, samples, *, per_prompt):
    """Up to `per_prompt` pairs per prompt, each a completion the scorer accepts (chosen)
    against one it rejects, from the prompt's `samples` completions."""
    pairs = []
    for j, prompt in enumerate(prompts):
        group = range(j * samples, (j + 1) * samples)
        good = [texts[k] for k in group if labels[k] > 0]
        bad = [texts[k] for k in group if labels[k] <= 0]
        for chosen, rejected in list(zip(good, bad))[:per_prompt]:
            pairs.append(data.PreferenceRecord(prompt, chosen, rejected))
    return pairs


def make_pairs(
    policy, tok, key, *, prompts, samples=16, per_prompt=4, new_tokens=32, max_length=64
):
    """Preference pairs (completions with an animal vs without, by the built-in scorer,
    from `samples` base-model completions per prompt) as a batch with the base model's
    (reference) log-probs cached."""
    roll = pl.runs.sample_rollout(
        policy, tok, prompts, key, group_size=samples, prompt_length=32, max_new_tokens=new_tokens
    )
    labels = [pl.task.animal_score(t) for t in roll.texts]
    pairs = contrast_pairs(prompts, roll.texts, labels, samples, per_prompt=per_prompt)
    tokenized, _ = data.tokenize_preferences(
        pairs, tok, max_length=max_length, max_prompt_length=32, add_eos=False
    )
    batch = data.collate_preferences(tokenized, max_length=max_length, pad_id=tok.pad_id)
    return jax.tree.map(jnp.asarray, rx.train.compute_reference_logps(policy, batch))


def make_train(policy, train_batch, held_batch, *, steps, batch_size, lr):
    """`train(key, beta) -> (losses [steps], held-out accuracy)`: one pure DPO run.

    Each update is the library's DPO step (`make_dpo_step`, cached reference) built with
    the run's `beta`, which is traced when the runs are vmapped over betas.
    """
    lora = rx.LoRAConfig(rank=4, alpha=8.0, dropout=0.0, targets=("q", "v", "up", "down"))
    opt = optax.adamw(lr)
    n = train_batch.chosen_tokens.shape[0]
    slp = rx.train.sequence_logps

    def margins(model, b):
        c = slp(model, b.chosen_tokens, b.chosen_mask, b.chosen_completion_mask)
        r = slp(model, b.rejected_tokens, b.rejected_mask, b.rejected_completion_mask)
        return c, r

    def train(key, beta):
        k_lora, k_data = jax.random.split(key)
        model = rx.apply_lora(policy, lora, key=k_lora)
        params, frozen = eqx.partition(model, rx.lora_filter(model))
        opt_state = opt.init(params)
        step = rx.train.make_dpo_step(opt, beta=beta, reference="cached", donate=False)

        def body(carry, i):
            params, opt_state = carry
            idx = jax.random.choice(jax.random.fold_in(k_data, i), n, (batch_size,), replace=False)
            mb = jax.tree.map(lambda x: x[idx], train_batch)
            params, opt_state, metrics = step(params, opt_state, mb, frozen=frozen)
            return (params, opt_state), metrics["loss"]

        (params, _), losses = jax.lax.scan(body, (params, opt_state), jnp.arange(steps))
        c, r = margins(eqx.combine(params, frozen), held_batch)
        acc = jnp.mean(
            ((c - held_batch.ref_chosen_logp) > (r - held_batch.ref_rejected_logp)).astype(
                jnp.float32
            )
        )
        return losses, acc

    return train


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--out", default="sweep.png")
    p.add_argument("--benchmark", action="store_true")
    args = p.parse_args()

    policy, tok = pl.tools.load_model("builtin")
    k_train, k_held, k_seeds = jax.random.split(jax.random.key(0), 3)
    train_batch = make_pairs(policy, tok, k_train, prompts=pl.task.TRAIN_PROMPTS)
    held_batch = make_pairs(policy, tok, k_held, prompts=pl.task.HELDOUT_PROMPTS)
    print(
        f"{train_batch.chosen_tokens.shape[0]} training pairs, "
        f"{held_batch.chosen_tokens.shape[0]} held-out pairs"
    )
    train = make_train(
        policy, train_batch, held_batch, steps=args.steps, batch_size=args.batch_size, lr=args.lr
    )
    seeds = jax.random.split(k_seeds, SEEDS)
    betas = jnp.asarray(BETAS, jnp.float32)
    sweep = jax.jit(jax.vmap(jax.vmap(train, in_axes=(0, None)), in_axes=(None, 0)))

    t0 = time.perf_counter()
    losses, acc = jax.block_until_ready(
        sweep(seeds, betas)
    )  # [betas, seeds, steps], [betas, seeds]
    t_first = time.perf_counter() - t0
    losses, acc = np.asarray(losses), np.asarray(acc)
    print(
        f"{len(BETAS) * SEEDS} runs x {args.steps} steps in one call: {t_first:.1f} s "
        "(including compilation)"
    )
    for b, beta in enumerate(BETAS):
        print(
            f"  beta {beta:<5}  final loss {losses[b, :, -1].mean():.3f} +- "
            f"{losses[b, :, -1].std():.3f}   held-out accuracy {acc[b].mean():.1%} +- "
            f"{acc[b].std():.1%}"
        )

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.2))
        for b, beta in enumerate(BETAS):
            x = np.arange(args.steps)
            ax.plot(x, losses[b].mean(0), label=f"beta {beta}")
            ax.fill_between(x, losses[b].min(0), losses[b].max(0), alpha=0.25)
        ax.set_xlabel("step")
        ax.set_ylabel("DPO loss")
        ax.set_title(f"{SEEDS} seeds per beta (band: min-max)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(args.out, dpi=90)
        print(f"plot: {args.out}")
    except ImportError:
        print("install matplotlib for the plot")

    if args.benchmark:
        t0 = time.perf_counter()
        jax.block_until_ready(sweep(seeds, betas))
        t_vmap = time.perf_counter() - t0
        one = jax.jit(train)
        jax.block_until_ready(one(seeds[0], betas[0]))  # compile once
        t0 = time.perf_counter()
        for beta in betas:
            for s in seeds:
                jax.block_until_ready(one(s, beta))
        t_seq = time.perf_counter() - t0
        print(
            f"benchmark ({len(BETAS) * SEEDS} runs, compiled): vmapped {t_vmap:.2f} s, "
            f"sequential {t_seq:.2f} s ({t_seq / t_vmap:.2f}x)"
        )


if __name__ == "__main__":
    main()
