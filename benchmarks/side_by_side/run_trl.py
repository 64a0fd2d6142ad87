"""TRL side of the side-by-side benchmark (torch CPU): one workload per process.

    "$TRL_VENV"/bin/python benchmarks/side_by_side/run_trl.py dpo --inputs DIR

The trainers are built as a user would (`DPOTrainer`, `RewardTrainer` with their
default collators, AdamW, gradient clipping at 1.0); each timed step is
`trainer.training_step` (forward, loss, backward) followed by the clip and the
optimiser step, on batches collated from the same token ids every library uses.
Generation is Hugging Face `generate`. Prints one `RESULT {...}` line.
"""

import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import torch  # noqa: E402

LIB = "trl"
# TRL's configs default to bfloat16 autocast and gradient checkpointing; every library here
# computes in float32 without recomputation, so both are turned off. (On a CPU without
# bfloat16 instructions the autocast is emulated: TRL's GRPO iteration then took 60 s
# instead of about 5 s on an AVX2-only machine.)
FLOAT32 = dict(bf16=False, gradient_checkpointing=False)


def matmul_peak(n: int = 1024, repeats: int = 5) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    return common.matmul_gflops(lambda: torch.matmul(a, b), n, repeats)


def text_dataset():
    from datasets import Dataset

    return Dataset.from_list([{"prompt": "t5 t6", "chosen": " t7", "rejected": " t8"}] * 2)


def dpo_trainer(model_dir, tok, *, precompute: bool, max_length: int):
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    out = tempfile.mkdtemp()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    args = DPOConfig(
        output_dir=out,
        per_device_train_batch_size=8,
        learning_rate=1e-5,
        max_grad_norm=1.0,
        max_length=max_length,
        report_to=[],
        use_cpu=True,
        logging_steps=10**9,
        save_strategy="no",
        precompute_ref_log_probs=False,
        dataloader_num_workers=0,
        **FLOAT32,
    )
    trainer = DPOTrainer(
        model=model, ref_model=ref, args=args, train_dataset=text_dataset(), processing_class=tok
    )
    trainer.create_optimizer_and_scheduler(num_training_steps=1000)
    return trainer


def step_fn(trainer, get_inputs):
    model = trainer.model
    model.train()
    trainer.current_gradient_accumulation_steps = 1

    def run():
        inputs = get_inputs()
        trainer.training_step(model, inputs, None)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        trainer.optimizer.step()
        trainer.lr_scheduler.step()
        trainer.optimizer.zero_grad(set_to_none=True)

    return run


def ref_logps(trainer, inputs):
    """The reference model's summed completion log-probabilities (TRL's precompute)."""
    model = trainer.ref_model
    with torch.no_grad():
        labels = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, -100)
        out = model(
            input_ids=inputs["input_ids"],
            attention_mask=inputs["attention_mask"],
            labels=labels,
            use_cache=False,
            fused_lm_head=True,
        )
        lp = out.log_probs.sum(dim=1)
    return lp.chunk(2, dim=0)


class BudgetEOS:
    """A logits processor that ends row `i` of a `generate` call after exactly
    `budgets[i]` new tokens: before that the stop id cannot be drawn, at that token it
    is the only one that can (the stop id counts as the row's last completion token, as
    in TRL's completion mask). `eos_ids`: the stop ids (none can be drawn early; the
    first ends the row). `prompt_width`: the width of the left-padded prompts."""

    def __init__(self, budgets, eos_ids, prompt_width: int):
        self.budgets = torch.as_tensor(budgets, dtype=torch.long)
        self.eos_ids = list(eos_ids)
        self.prompt_width = prompt_width

    def __call__(self, input_ids, scores):
        if input_ids.shape[0] != len(self.budgets):
            raise ValueError(
                f"generate got {input_ids.shape[0]} rows, the budgets are for {len(self.budgets)}"
            )
        step = input_ids.shape[1] - self.prompt_width  # tokens generated so far
        last = (self.budgets - 1 == step)[:, None]
        scores = scores.clone()
        scores[:, self.eos_ids] = float("-inf")
        scores = torch.where(last, float("-inf"), scores)
        scores[last[:, 0], self.eos_ids[0]] = 0.0
        return scores


def grpo_run(
    model_dir,
    prompt_ids,
    rewards,
    *,
    group: int,
    max_completion: int,
    n_steps: int,
    generation_kwargs=None,
    budgets=None,
):
    """`GRPOTrainer.train()` for `n_steps` iterations on the same prompts (`group`
    completions each, then one update), timed per step by a callback. With `budgets`
    (one per completion, in TRL's row order: each prompt's `group` rows together) the
    model's `generate` gets a `BudgetEOS` processor, so that row `i` ends with the stop id
    as its `budgets[i]`-th token; `generate` still steps every row until the batch's
    longest is done. Returns `(first_s, [step s], info)`, `info` the median seconds of
    generation and of the rest of a step, and whether every completion had its budget's
    length."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, LogitsProcessorList, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tok = common.word_tokenizer(common.CONFIG["vocab_size"])
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prompts = [common.ids_as_text(row) for row in prompt_ids]
    ds = Dataset.from_list([{"prompt": p} for p in prompts] * n_steps)
    rewards = rewards.tolist()
    lengths = []

    def reward(completions, completion_ids=None, **kw):
        if completion_ids is not None:
            lengths.append([len(c) for c in completion_ids])
        return [rewards[i % len(rewards)] for i in range(len(completions))]

    gargs = GRPOConfig(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=len(prompts) * group,
        num_generations=group,
        max_completion_length=max_completion,
        learning_rate=1e-5,
        max_grad_norm=1.0,
        max_steps=n_steps,
        report_to=[],
        use_cpu=True,
        logging_steps=10**9,
        save_strategy="no",
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        shuffle_dataset=False,
        beta=0.0,
        generation_kwargs=generation_kwargs,
        **FLOAT32,
    )
    marks, gen = [], []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            marks.append(time.perf_counter())

        def on_step_end(self, *a, **k):
            marks[-1] = time.perf_counter() - marks[-1]

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=gargs,
        train_dataset=ds,
        processing_class=tok,
        callbacks=[Timer()],
    )
    generate = model.generate

    def timed_generate(*a, **k):
        if budgets is not None:
            width = k["input_ids"].shape[1]
            k["logits_processor"] = LogitsProcessorList(
                [BudgetEOS(budgets, trainer.eos_token_ids, width)]
            )
        t0 = time.perf_counter()
        out = generate(*a, **k)
        gen.append(time.perf_counter() - t0)
        return out

    model.generate = timed_generate  # the model TRL unwraps for generation on one CPU
    trainer.train()
    steps, gens = marks[1:], gen[1:]  # one generate call per step
    info = {}
    if steps and len(gens) == len(steps):
        info["gen_s"] = common.median(gens)
        info["update_s"] = common.median([s - g for s, g in zip(steps, gens)])
    if budgets is not None:
        want = [int(b) for b in budgets]
        info["lengths_match"] = bool(lengths) and all(row == want for row in lengths)
        info["generated_width"] = int(max(want))
    return marks[0], marks[1:], info


def main():
    args, inputs = common.start(LIB)
    w = args.workload
    model_dir = os.path.join(args.inputs, "model")
    extra = {}
    torch.manual_seed(0)
    if w in ("dpo", "dpo_cached") or w.startswith("curve_"):
        from trl.trainer.dpo_trainer import DataCollatorForPreference

        key = "dpo" if w in ("dpo", "dpo_cached") else w
        tok = common.word_tokenizer(common.CONFIG["vocab_size"])
        T = inputs[f"{key}_prompt"].shape[1] + inputs[f"{key}_chosen"].shape[1]
        trainer = dpo_trainer(model_dir, tok, precompute=w == "dpo_cached", max_length=T)
        collate = DataCollatorForPreference(pad_token_id=tok.pad_token_id)
        examples = [
            {"prompt_ids": p.tolist(), "chosen_ids": c.tolist(), "rejected_ids": r.tolist()}
            for p, c, r in zip(
                inputs[f"{key}_prompt"], inputs[f"{key}_chosen"], inputs[f"{key}_rejected"]
            )
        ]
        batch = collate(examples)
        if w == "dpo_cached":
            trainer.precompute_ref_logps = True
            c, r = ref_logps(trainer, batch)
            batch = dict(batch, ref_chosen_logps=c, ref_rejected_logps=r)
        run = step_fn(trainer, lambda: dict(batch))
        n = args.steps if not w.startswith("curve_") else max(2, args.steps - 2)
        first, times = common.time_steps(run, n)
        extra["flops"] = common.dpo_flops(len(examples), T, with_reference=w != "dpo_cached")
        extra["tokens"] = int(2 * len(examples) * T)
    elif w == "hh_dpo":
        from trl.trainer.dpo_trainer import DataCollatorForPreference

        tok = common.word_tokenizer(common.HH_VOCAB)
        trainer = dpo_trainer(
            os.path.join(args.inputs, "model_hh"),
            tok,
            precompute=False,
            max_length=common.HH_MAX_LEN,
        )
        collate = DataCollatorForPreference(pad_token_id=tok.pad_token_id)

        P, C, R = (common.ragged_rows(inputs, n) for n in ("hh_prompt", "hh_chosen", "hh_rejected"))
        n = common.HH["pairs"]
        batches = [
            collate(
                [
                    {"prompt_ids": P[i], "chosen_ids": C[i], "rejected_ids": R[i]}
                    for i in range(s, s + n)
                ]
            )
            for s in range(0, len(P) // n * n, n)
        ]
        it = {"i": 0}

        def get():
            b = batches[it["i"] % len(batches)]
            it["i"] += 1
            return dict(b)

        run = step_fn(trainer, get)
        t0 = time.perf_counter()
        first, times = common.time_steps(run, len(batches) - 1)
        total = time.perf_counter() - t0
        real = sum(int(b["attention_mask"].sum()) for b in batches)
        computed = sum(int(b["attention_mask"].numel()) for b in batches)
        extra.update(
            real_tokens_per_s=real / total,
            steady_real_tokens_per_s=real / total,
            padding_fraction=1 - real / computed,
            compiled_shapes=0,
            total_s=total,
            steps=len(batches),
        )
    elif w in ("gen_sample", "gen_greedy"):
        from transformers import AutoModelForCausalLM

        g = common.GEN
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        prompts = torch.as_tensor(inputs["gen_prompt"], dtype=torch.long)
        attn = torch.ones_like(prompts)
        sample = w == "gen_sample"

        def run():
            with torch.no_grad():
                model.generate(
                    input_ids=prompts,
                    attention_mask=attn,
                    max_new_tokens=g["new"],
                    min_new_tokens=g["new"],
                    do_sample=sample,
                    temperature=1.0 if sample else None,
                    top_k=0 if sample else None,
                    top_p=1.0 if sample else None,
                    pad_token_id=0,
                    eos_token_id=None,
                )

        first, times = common.time_steps(run, args.steps)
        extra["new_tokens"] = g["batch"] * g["new"]
    elif w == "rm":
        from transformers import AutoModelForSequenceClassification
        from trl import RewardConfig, RewardTrainer
        from trl.trainer.reward_trainer import DataCollatorForPreference

        tok = common.word_tokenizer(common.CONFIG["vocab_size"])
        model = AutoModelForSequenceClassification.from_pretrained(
            model_dir, num_labels=1, dtype=torch.float32
        )
        model.config.pad_token_id = 0
        out = tempfile.mkdtemp()
        rargs = RewardConfig(
            output_dir=out,
            per_device_train_batch_size=8,
            learning_rate=1e-5,
            max_grad_norm=1.0,
            max_length=common.RM["length"],
            report_to=[],
            use_cpu=True,
            logging_steps=10**9,
            save_strategy="no",
            **FLOAT32,
        )
        trainer = RewardTrainer(
            model=model, args=rargs, train_dataset=text_dataset(), processing_class=tok
        )
        trainer.create_optimizer_and_scheduler(num_training_steps=1000)
        collate = DataCollatorForPreference(pad_token_id=0)
        batch = collate(
            [
                {"chosen_ids": p.tolist() + c.tolist(), "rejected_ids": p.tolist() + r.tolist()}
                for p, c, r in zip(inputs["rm_prompt"], inputs["rm_chosen"], inputs["rm_rejected"])
            ]
        )
        run = step_fn(trainer, lambda: dict(batch))
        first, times = common.time_steps(run, args.steps)
    elif w == "grpo":
        g = common.GRPO
        first, times, info = grpo_run(
            model_dir,
            inputs["grpo_prompt"],
            inputs["grpo_rewards"],
            group=g["group"],
            max_completion=g["new"],
            n_steps=args.steps + 1,
            # every completion is 128 tokens, as in rlhf_eqx
            generation_kwargs={"min_new_tokens": g["new"]},
        )
        extra.update(info)
    elif w == "grpo_mix":
        g = common.GRPO_MIX
        budgets = inputs["grpo_mix_budgets"]
        first, times, info = grpo_run(
            model_dir,
            inputs["grpo_mix_prompt"],
            inputs["grpo_mix_rewards"],
            group=g["group"],
            max_completion=int(budgets.max()),
            n_steps=args.steps + 1,
            budgets=budgets,
        )
        extra.update(info)
        extra["completion_tokens"] = int(budgets.sum())
    else:
        raise SystemExit(f"workload {w} is not run for TRL")
    common.emit(LIB, w, first, times, peak_gflops=matmul_peak(), **extra)


if __name__ == "__main__":
    main()
