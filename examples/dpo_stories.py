"""Direct preference optimisation of the stories260K model with a rule-based judge.

A small, complete DPO run on a real checkpoint. The preference is a simple rule — a
story is better when it mentions an animal — so the effect of training is easy to see:
after 60 DPO steps (about half a minute on two CPU cores) the tiny model writes about
animals in most of its stories instead of one in seven.

The steps, each a small function below:

1. **Load** the stories260K Llama-2 model and its 512-piece tokenizer (`load_llama2c`).
2. **Sample** `--samples` completions for each training prompt (the story openings in
   `TRAIN_PROMPTS`) from the current policy with `generate_batch`.
3. **Judge** each completion (`judge`): reward 1 if it mentions one of the target words
   (`--words`, default `ANIMALS`; whole words, any case), else 0. For each prompt the
   best and the worst completion form a (chosen, rejected) pair when their rewards
   differ. The pairs are tokenised as `prompt + completion` text and collated into a
   `PreferenceBatch` (`rlhf_eqx.data.tokenize_preferences`, `collate_preferences`).
4. **Train** with the sigmoid DPO loss (Rafailov et al. 2023; TRL `DPOTrainer`,
   `--beta`) on LoRA adapters only: the reference model is the same model without its
   adapters (`without_lora`: no second copy of the weights), its log-probabilities are
   computed once per round and cached (`compute_reference_logps`), and the optimiser
   is AdamW with warmup + cosine decay (`make_optimizer`). Steps 2–4 repeat for
   `--rounds` rounds, each sampling fresh completions from the policy being trained —
   iterative, on-policy-style DPO (Xu et al. 2023, "Some things are more CRINGE than
   others"; Guo et al. 2024, "Direct Language Model Alignment from Online AI Feedback").
5. **Evaluate** on held-out prompts (`EVAL_PROMPTS`): sample from the base policy and
   from the trained one, its adapters merged into the weights (`merge_lora`, checked to
   give the logits of the unmerged model), with the same random key; compare the
   fraction of completions that mention a target word (the mean reward) and, as a
   guard against reward hacking, the base model's negative log-likelihood per token of
   the completions (word salad that games the judge would make it jump).
6. Optionally (`--save DIR`) write the merged policy as a Hugging Face checkpoint
   (`save_hf`), reload it (`load_hf`) and check that it computes the same logits.

    python examples/dpo_stories.py [--rounds 3] [--steps 20] [--batch-size 16] [--lr 5e-4]
                                   [--beta 0.1] [--words dog,cat] [--seed 0] [--save DIR]

By default the model is the stories260K checkpoint shipped in `rlhf_eqx/assets/`. The
same run, folded into the package with PPO and GRPO beside it, is `python -m rlhf_eqx`.
Training metrics use TRL's names (`loss`, `rewards/accuracies`, `rewards/margins`,
`grad_norm`); the loss starts at ln 2, as the policy starts equal to the reference.
The script exits with an error if the loss becomes NaN or infinite.
"""

import argparse
import dataclasses
import math
import os
import re
import sys
import time
from collections.abc import Callable, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import rlhf_eqx as rx
from rlhf_eqx import data
from rlhf_eqx.assets import asset_path

# Story openings the policy is trained on (completions are sampled for each of them).
TRAIN_PROMPTS = [
    "Once upon a time, there was a",
    "Once upon a time, in a big forest, there lived a",
    "Once upon a time, there was a little girl named Lily. She",
    "Once upon a time, there was a boy named Tim. He",
    "One day, a little",
    "One day, Lily went to the",
    "One day, Tom and his mom",
    "Lily and Tom went to the",
    "Lily liked to play with her",
    "Tim had a big red",
    "Sam wanted to",
    "Mia was very happy because",
    "The sun was shining and",
    "It was a rainy day, so",
    "In the park, there was a",
    "At the beach, Ben found a",
    "Mom said, \"Let's go to the",
    "Dad gave Anna a",
    "The little boy was sad because",
    "Every morning, Sue would",
    "There was a big tree in the garden. Under the tree,",
    "Max looked out of the window and saw a",
    "The old man had a small house. In the house, there was a",
    "Lucy found a box. Inside the box, there was a",
    "Jack and Jill were friends. They liked to",
    "Once upon a time, a happy",
    "One night, Lily heard a",
    "Tom went to the farm with his dad. On the farm,",
    "The girl opened the door and saw a",
    "Ben had a new toy. It was a",
    "Kate was playing in the yard when",
    "The sky was blue and",
]

# Held-out openings for the before/after evaluation (never trained on).
EVAL_PROMPTS = [
    "Once upon a time, there was a little",
    "One day, Ben went to the",
    "Sara loved to play with her",
    "In the morning, the boy saw a",
    "Once upon a time, in a small town, there was a",
    "Lily was walking home when she saw a",
    "Tim and his sister went to the",
    "The girl had a pretty",
]

# The judge's default target words: a completion that mentions one of them gets reward 1.
ANIMALS = ("dog", "cat", "bird", "puppy", "kitten", "fish", "frog", "duck", "bunny", "bear")


@dataclasses.dataclass(frozen=True)
class Config:
    """Settings of a run (the command-line flags of the same names)."""

    model: str = asset_path("stories260K.bin")
    tokenizer: str = asset_path("tok512.bin")
    words: tuple[str, ...] = ANIMALS
    train_prompts: tuple[str, ...] = tuple(TRAIN_PROMPTS)
    eval_prompts: tuple[str, ...] = tuple(EVAL_PROMPTS)
    samples: int = 4  # completions sampled per training prompt and round
    eval_samples: int = 16  # completions sampled per held-out prompt
    new_tokens: int = 40
    temperature: float = 1.0
    rounds: int = 3
    steps: int = 20  # DPO steps per round
    batch_size: int = 16
    lr: float = 5e-4
    beta: float = 0.1
    lora_rank: int = 8
    prompt_length: int = 32  # prompts are left-padded (or cut) to this many tokens
    max_length: int = 80  # prompt + completion tokens of a training sequence
    log_every: int = 10
    seed: int = 0
    save: str | None = None
    verbose: bool = True


# --- 2. sampling -----------------------------------------------------------------------


def sample_completions(
    policy: rx.Policy,
    tok: data.Tokenizer,
    prompts: Sequence[str],
    key: jax.Array,
    *,
    samples: int,
    prompt_length: int,
    new_tokens: int,
    temperature: float,
) -> list[list[str]]:
    """`samples` completions (as text) for each prompt, in one `generate_batch` call.

    Prompts are left-padded to `prompt_length` tokens, so that calls with the same
    number of rows reuse one compiled sampler.
    """
    ids, report = data.tokenize_prompts(
        list(prompts), tok, max_prompt_length=prompt_length, truncation="drop"
    )
    if report.num_dropped:
        raise ValueError(f"a prompt is longer than prompt_length={prompt_length} tokens")
    repeated = [p for p in ids for _ in range(samples)]
    batch = data.collate_prompts(repeated, max_length=prompt_length, pad_id=tok.pad_id)
    out = rx.generate_batch(
        policy,
        batch.tokens,
        batch.mask,
        key,
        max_new_tokens=new_tokens,
        temperature=temperature,
        eos_id=tok.eos_id,
        pad_id=tok.pad_id,
    )
    tokens, completion_mask = np.asarray(out.tokens), np.asarray(out.completion_mask)
    texts = []
    for i, prompt in enumerate(p for p in prompts for _ in range(samples)):
        completion_ids = tokens[i][completion_mask[i]].tolist()
        texts.append(completion_text(tok, prompt, completion_ids))
    return [texts[i * samples : (i + 1) * samples] for i in range(len(prompts))]


def completion_text(tok: data.Tokenizer, prompt: str, completion_ids: list[int]) -> str:
    """The text a completion adds to its prompt (`prompt + completion_text(...)` is the story)."""
    return data.decode_continuation(tok, tok.encode(prompt), completion_ids)


# --- 3. judging and pairing ------------------------------------------------------------


def count_words(text: str, words: Sequence[str]) -> int:
    """Occurrences of `words` in `text`: whole words, any case, plural `-s` included."""
    pattern = r"\b(?:" + "|".join(re.escape(w) for w in words) + r")s?\b"
    return len(re.findall(pattern, text, flags=re.IGNORECASE))


def judge(text: str, words: Sequence[str]) -> float:
    """The rule-based reward: 1 if the completion mentions one of `words`, else 0.

    Counting every mention instead would reward repeating the word ("a dog dog dog"),
    which a policy learns quickly and which reads badly.
    """
    return 1.0 if count_words(text, words) > 0 else 0.0


def make_pairs(
    prompts: Sequence[str], completions: Sequence[Sequence[str]], words: Sequence[str]
) -> list[data.PreferenceRecord]:
    """For each prompt, (best, worst) completion by the judge, when their rewards differ."""
    pairs = []
    for prompt, texts in zip(prompts, completions):
        rewards = [judge(t, words) for t in texts]
        best, worst = int(np.argmax(rewards)), int(np.argmin(rewards))
        if rewards[best] > rewards[worst]:
            pairs.append(data.PreferenceRecord(prompt, texts[best], texts[worst]))
    return pairs


def collate_pairs(
    pairs: Sequence[data.PreferenceRecord], tok: data.Tokenizer, cfg: Config
) -> rx.PreferenceBatch:
    """Tokenise `prompt + chosen` / `prompt + rejected`, right-padded to `cfg.max_length`.

    Completions stop after `new_tokens`, usually mid-story, so no EOS is appended.
    """
    tokenized, _ = data.tokenize_preferences(
        pairs,
        tok,
        max_length=cfg.max_length,
        max_prompt_length=cfg.prompt_length,
        add_eos=False,
    )
    return data.collate_preferences(tokenized, max_length=cfg.max_length, pad_id=tok.pad_id)


# --- 4. DPO training -------------------------------------------------------------------


def take(batch: rx.PreferenceBatch, idx: np.ndarray) -> rx.PreferenceBatch:
    """Rows `idx` of every field of a batch."""
    return jax.tree.map(lambda x: x[idx], batch)


@eqx.filter_jit
def dpo_loss_on(model: rx.Policy, batch: rx.PreferenceBatch, beta: float) -> jax.Array:
    """Mean sigmoid DPO loss of `model` on a batch with cached reference log-probs
    (the loss the training step reports, without the update)."""
    chosen = rx.train.sequence_logps(
        model, batch.chosen_tokens, batch.chosen_mask, batch.chosen_completion_mask
    )
    rejected = rx.train.sequence_logps(
        model, batch.rejected_tokens, batch.rejected_mask, batch.rejected_completion_mask
    )
    losses = rx.losses.dpo_batch_loss(
        chosen, rejected, batch.ref_chosen_logp, batch.ref_rejected_logp, beta=beta
    )
    return jnp.mean(losses)


def train_round(
    state: rx.train.TrainState,
    step_fn: Callable[..., tuple],
    batch: rx.PreferenceBatch,
    cfg: Config,
    *,
    round_index: int,
) -> tuple[rx.train.TrainState, list[dict[str, float]]]:
    """`cfg.steps` DPO updates on shuffled mini-batches of `batch`; returns the metrics."""
    n = batch.chosen_tokens.shape[0]
    batches = data.BatchIterator(n, min(cfg.batch_size, n), seed=cfg.seed + round_index)
    history = []
    for i, idx in zip(range(cfg.steps), batches):
        state, metrics = state.apply(step_fn, take(batch, idx))
        metrics = {k: float(v) for k, v in metrics.items()}
        history.append(metrics)
        if not math.isfinite(metrics["loss"]):
            step = len(history) - 1
            raise FloatingPointError(f"the DPO loss is {metrics['loss']} at step {step}")
        if cfg.verbose and (i % cfg.log_every == 0 or i == cfg.steps - 1):
            print(
                f"  step {int(state.step) - 1:3d}  loss {metrics['loss']:.4f}  "
                f"rewards/accuracies {metrics['rewards/accuracies']:.2f}  "
                f"rewards/margins {metrics['rewards/margins']:+.3f}  "
                f"grad_norm {metrics['grad_norm']:.3f}  lr {metrics['learning_rate']:.1e}"
            )
    return state, history


# --- 5. evaluation ---------------------------------------------------------------------


@dataclasses.dataclass
class Evaluation:
    """Scores of one policy's completions for the held-out prompts."""

    hit_rate: float  # fraction of completions that mention a target word (the mean reward)
    words_per_sample: float  # target words per completion (counts repetitions)
    base_nll: float  # per-token NLL of the completions under the base model (fluency)
    completions: list[list[str]]


@eqx.filter_jit
def mean_nll(model: rx.Policy, batch: rx.SequenceBatch) -> jax.Array:
    """Mean negative log-likelihood per completion token of `batch` under `model`."""
    logps = rx.train.sequence_logps(model, batch.tokens, batch.mask, batch.completion_mask)
    count = jnp.sum(batch.completion_mask & batch.mask).astype(jnp.float32)
    return -jnp.sum(logps) / count


def evaluate(
    policy: rx.Policy, base: rx.Policy, tok: data.Tokenizer, key: jax.Array, cfg: Config
) -> Evaluation:
    """Sample `cfg.eval_samples` completions per held-out prompt with `policy` and score them.

    Besides the judge, the completions are scored by the base model's NLL per token: a
    policy that games the judge with word salad writes text the base model finds
    unlikely, and this number goes up.
    """
    completions = sample_completions(
        policy,
        tok,
        cfg.eval_prompts,
        key,
        samples=cfg.eval_samples,
        prompt_length=cfg.prompt_length,
        new_tokens=cfg.new_tokens,
        temperature=cfg.temperature,
    )
    records = [(p, t) for p, texts in zip(cfg.eval_prompts, completions) for t in texts]
    seqs, _ = data.tokenize_sft(
        records,
        tok,
        max_length=cfg.max_length,
        max_prompt_length=cfg.prompt_length,
        add_eos=False,
    )
    batch = data.collate_sft(seqs, max_length=cfg.max_length, pad_id=tok.pad_id)
    texts = [t for _, t in records]
    return Evaluation(
        hit_rate=float(np.mean([judge(t, cfg.words) for t in texts])),
        words_per_sample=float(np.mean([count_words(t, cfg.words) for t in texts])),
        base_nll=float(mean_nll(base, batch)),
        completions=completions,
    )


@eqx.filter_jit
def max_logit_difference(a: rx.Policy, b: rx.Policy, batch: rx.PreferenceBatch) -> jax.Array:
    """Largest |logit difference| of two models on the real tokens of `batch.chosen_*`."""
    logits_a = jax.vmap(a)(batch.chosen_tokens, batch.chosen_mask)
    logits_b = jax.vmap(b)(batch.chosen_tokens, batch.chosen_mask)
    diff = jnp.abs(logits_a - logits_b)
    return jnp.max(jnp.where(batch.chosen_mask[:, :, None], diff, 0.0))


# --- the whole run ---------------------------------------------------------------------


@dataclasses.dataclass
class Result:
    """What `run` measured (the numbers it prints)."""

    before: Evaluation  # the base policy on the held-out prompts
    after: Evaluation  # the trained (merged) policy, same prompts and random key
    history: list[dict[str, float]]  # metrics of every DPO step, all rounds
    num_pairs: list[int]  # pairs formed in each round
    loss_before: float  # DPO loss on the last round's pairs at the reference (ln 2)
    loss_after: float  # the same pairs, trained policy
    merge_error: float  # max |logits(merged) - logits(with adapters)|
    save_error: float | None  # max |logits(reloaded) - logits(merged)| with `save`


def run(cfg: Config) -> Result:
    """Steps 1–6 of the module docstring; prints progress unless `cfg.verbose` is off."""
    log = print if cfg.verbose else (lambda *args: None)
    start = time.perf_counter()

    # 1. Load the model and the tokenizer.
    policy, tok = rx.load_llama2c(cfg.model, cfg.tokenizer)
    log(f"loaded {os.path.basename(cfg.model)}: {policy.cfg.num_params():,} parameters")
    key_lora, key_eval, key_rounds = jax.random.split(jax.random.key(cfg.seed), 3)

    # LoRA adapters on every projection; only they are trained. Their `B` starts at 0,
    # so at first the policy equals the reference and the DPO loss is ln 2.
    lora = rx.LoRAConfig(
        rank=cfg.lora_rank,
        alpha=2 * cfg.lora_rank,
        dropout=0.0,
        targets=("q", "k", "v", "o", "gate", "up", "down"),
    )
    model = rx.apply_lora(policy, lora, key=key_lora)
    reference = rx.without_lora(model)  # the frozen base, sharing its arrays with `model`
    trainable = rx.lora_filter(model)
    optimizer = rx.train.make_optimizer(
        learning_rate=cfg.lr, total_steps=cfg.rounds * cfg.steps, warmup_ratio=0.1
    )
    state = rx.train.init_train_state(model, optimizer, filter_spec=trainable)
    step_fn = rx.train.make_dpo_step(optimizer, beta=cfg.beta, reference="cached")
    log(f"LoRA rank {cfg.lora_rank}: {rx.count_params(model, trainable):,} trainable parameters")

    history, num_pairs = [], []
    for r, key in enumerate(jax.random.split(key_rounds, cfg.rounds)):
        # 2-3. Sample from the current policy, judge, pair, tokenise.
        completions = sample_completions(
            state.model,
            tok,
            cfg.train_prompts,
            key,
            samples=cfg.samples,
            prompt_length=cfg.prompt_length,
            new_tokens=cfg.new_tokens,
            temperature=cfg.temperature,
        )
        pairs = make_pairs(cfg.train_prompts, completions, cfg.words)
        num_pairs.append(len(pairs))
        hits = np.mean([judge(t, cfg.words) for texts in completions for t in texts])
        log(f"round {r}: {hits:.0%} of the samples mention a target word -> {len(pairs)} pairs")
        if not pairs:
            raise ValueError(
                "no prompt got completions with different rewards; "
                "sample more (--samples) or change --words"
            )
        # 4. Reference log-probs once per round, then DPO steps on mini-batches.
        batch = rx.train.compute_reference_logps(reference, collate_pairs(pairs, tok, cfg))
        state, round_history = train_round(state, step_fn, batch, cfg, round_index=r)
        history += round_history

    # 5. Merge the adapters into the weights; the merged model computes the same logits.
    merged = rx.merge_lora(state.model)
    merge_error = float(max_logit_difference(merged, state.model, batch))
    log(f"max |logits(merged) - logits(adapters)| = {merge_error:.1e}")
    loss_before = float(dpo_loss_on(reference, batch, cfg.beta))
    loss_after = float(dpo_loss_on(merged, batch, cfg.beta))  # merged == trained policy
    log(f"DPO loss on the last round's pairs: {loss_before:.4f} (reference) -> {loss_after:.4f}")

    before = evaluate(policy, policy, tok, key_eval, cfg)
    after = evaluate(merged, policy, tok, key_eval, cfg)
    n_eval = len(cfg.eval_prompts) * cfg.eval_samples
    log(f"\nheld-out prompts ({n_eval} samples)     before  after")
    log(f"  mention a target word (reward)  {before.hit_rate:6.1%}  {after.hit_rate:6.1%}")
    log(
        f"  target words per sample         {before.words_per_sample:6.2f}  "
        f"{after.words_per_sample:6.2f}"
    )
    log(f"  base-model NLL per token        {before.base_nll:6.2f}  {after.base_nll:6.2f}")
    for i in range(min(2, len(cfg.eval_prompts))):
        prompt = cfg.eval_prompts[i]
        log(f"\n[before] {prompt}{before.completions[i][0]}")
        log(f"[after]  {prompt}{after.completions[i][0]}")

    # 6. Optionally save the merged policy and check the reloaded one.
    save_error = None
    if cfg.save is not None:
        rx.save_hf(merged, cfg.save)
        save_error = float(max_logit_difference(rx.load_hf(cfg.save), merged, batch))
        log(f"\nsaved to {cfg.save}; max |logits(reloaded) - logits(merged)| = {save_error:.1e}")

    log(f"\ndone in {time.perf_counter() - start:.0f}s")
    return Result(
        before, after, history, num_pairs, loss_before, loss_after, merge_error, save_error
    )


def parse_args(argv: Sequence[str] | None = None) -> Config:
    defaults = Config()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=defaults.model)
    parser.add_argument("--tokenizer", default=defaults.tokenizer)
    parser.add_argument(
        "--words",
        default=",".join(defaults.words),
        help="comma-separated target words of the judge",
    )
    for name in (
        "samples",
        "eval_samples",
        "new_tokens",
        "rounds",
        "steps",
        "batch_size",
        "lora_rank",
        "prompt_length",
        "max_length",
        "log_every",
        "seed",
    ):
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, type=int, default=getattr(defaults, name))
    for name in ("temperature", "lr", "beta"):
        parser.add_argument("--" + name, type=float, default=getattr(defaults, name))
    parser.add_argument("--save", default=None, help="write the merged policy here (HF format)")
    args = parser.parse_args(argv)
    for path in (args.model, args.tokenizer):
        if not os.path.isfile(path):
            parser.error(f"{path} does not exist (pass --model / --tokenizer)")
    words = tuple(w.strip() for w in args.words.split(",") if w.strip())
    return dataclasses.replace(defaults, **{**vars(args), "words": words})


def main(argv: Sequence[str] | None = None) -> None:
    cfg = parse_args(argv)
    try:
        run(cfg)
    except FloatingPointError as e:
        sys.exit(f"error: training diverged: {e} (try a smaller --lr)")


if __name__ == "__main__":
    main()
