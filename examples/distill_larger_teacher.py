"""Distil a larger, trained teacher into the shipped model on the built-in animal task.

Generalized knowledge distillation (GKD, Agarwal et al. 2024; TRL `GKDTrainer`) needs a
teacher that shares the student's tokenizer. No larger model of the stories260K family
can be downloaded here, so this example grows one and trains it:

1. **Grow** the shipped stories260K (5 layers) into a deeper teacher (`--layers`, 8 by
   default): the new layers are copies of the last one with their output projections
   (attention `wo`, MLP `w_down`) set to zero, so they add nothing to the residual
   stream and the grown model computes exactly the shipped model's logits (checked).
   It is saved as a Hugging Face checkpoint with the tokenizer beside it (`save_hf`).
2. **Train the teacher** on the animal task with the built-in pipeline: SFT, then GRPO
   with the task's verifiable reward (`run_pipeline`, `model.source` = the grown
   checkpoint, `stages=("sft", "grpo")`).
3. **Distil** it into the shipped model: the student is the shipped model after SFT;
   the `distill` stage trains its LoRA adapters toward the teacher's token
   distributions with the generalized JSD (`distill.beta`), half of the steps on the
   student's own samples (`distill.lmbda`), the rest on the teacher's samples.

It prints the animal-task score (fraction of held-out completions about the requested
animal) and the base model's NLL per token of the completions for the teacher, the
student after SFT and the student after distillation.

    python examples/distill_larger_teacher.py [--layers 8] [--steps 40] [--out runs/distill-example]

About a minute and a half on two CPU cores (the teacher 79% on the task, the student 23%
after SFT and 83% after distillation, its base-model NLL within 0.05 nat/token).
"""

import argparse
import dataclasses
import os

import equinox as eqx
import jax
import jax.numpy as jnp

import rlhf_eqx as rx
from rlhf_eqx import pipelines as pl
from rlhf_eqx.assets import asset_path


def grow(policy: rx.models.Policy, n_layers: int) -> rx.models.Policy:
    """`policy` with `n_layers` layers: the added ones copy the last layer, their output
    projections zeroed, so the grown model computes the same function."""
    extra = n_layers - policy.cfg.n_layers
    if extra < 1:
        raise ValueError(f"--layers={n_layers}: must exceed the model's {policy.cfg.n_layers}")

    def stack(path, x):
        new = jnp.repeat(x[-1:], extra, axis=0)
        if path[-1].name in ("wo", "w_down"):
            new = jnp.zeros_like(new)
        return jnp.concatenate([x, new], axis=0)

    # a model of the new shape (its configuration is a static field), then its weights
    grown = rx.Policy(dataclasses.replace(policy.cfg, n_layers=n_layers), key=jax.random.key(0))
    old = policy.transformer
    layers = jax.tree_util.tree_map_with_path(stack, old.layers)
    parts = lambda p: (p.transformer.embed, p.transformer.layers, p.transformer.final_norm)
    grown = eqx.tree_at(parts, grown, (old.embed, layers, old.final_norm))
    if policy.lm_head is not None:
        grown = eqx.tree_at(lambda p: p.lm_head, grown, policy.lm_head)
    return grown


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8, help="the teacher's number of layers")
    p.add_argument("--steps", type=int, default=40, help="distillation steps")
    p.add_argument("--out", default="runs/distill-example")
    args = p.parse_args()

    student, tok = pl.tools.load_model("builtin")
    teacher = grow(student, args.layers)
    tokens = jnp.asarray([[tok.bos_id, *tok.encode("Once upon a time, there was a cat")]])
    mask = jnp.ones_like(tokens, dtype=bool)
    gap = jnp.max(jnp.abs(teacher(tokens, mask) - student(tokens, mask)))
    print(f"grown teacher: {args.layers} layers, max |logit difference| {float(gap):.1e}")
    grown_dir = os.path.join(args.out, "grown")
    rx.save_hf(teacher, grown_dir)
    pl.runs.copy_tokenizer(asset_path("tok512.bin"), grown_dir)

    base = dataclasses.replace(pl.animal_task_config(), ops=pl.OpsConfig(quiet=True))
    teach_cfg = dataclasses.replace(
        base,
        model=pl.ModelConfig(source=grown_dir),
        stages=("sft", "grpo"),
        out=os.path.join(args.out, "teacher"),
    )
    t = pl.run_pipeline(teach_cfg, overwrite=True)
    hf = os.path.join(teach_cfg.out, "grpo", "hf")
    student_cfg = dataclasses.replace(
        base,
        stages=("sft", "distill"),
        distill=dataclasses.replace(base.distill, teacher=hf, steps=args.steps),
        out=os.path.join(args.out, "student"),
    )
    s = pl.run_pipeline(student_cfg, overwrite=True)
    print(f"{'model':<34} {'score':>6} {'base NLL':>9}")
    rows = [
        (f"teacher ({args.layers} layers, SFT + GRPO)", t["grpo"]),
        ("student (5 layers, SFT)", s["sft"]),
        ("student after distillation", s["distill"]),
    ]
    for name, m in rows:
        print(f"{name:<34} {m['score']:>6.1%} {m['base_nll']:>9.3f}")


if __name__ == "__main__":
    main()
