"""TRL side of the side-by-side benchmark (torch CPU): one workload per process.

    "$TRL_VENV"/bin/python benchmarks/side_by_side/run_trl.py dpo --inputs DIR

The trainers are built as a user would (`DPOTrainer`, `RewardTrainer` with their
default collators, AdamW, gradient clipping at 1.0); each timed step is
`trainer.training_step` (forward, loss, backward) followed by the clip and the
optimiser step, on batches collated from the same token ids every library uses.
Generation is Hugging Face `generate`. Prints one `RESULT {...}` line.

The SmolLM2-135M-Instruct workloads (`common.WORKLOADS_135`) load the float32 Hugging
Face directory `make_inputs.py --smollm2` wrote (the same weights rlhf_eqx dequantises
from the GGUF file) with its tokenizer; see `run_135`.
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


def dpo_trainer(
    model_dir,
    tok,
    *,
    max_length: int,
    batch_size: int = 8,
    precompute: bool = False,
    padding_free: bool = False,
    peft_config=None,
):
    """A `DPOTrainer` in float32 with its optimiser and schedule built. `precompute`
    (TRL's `precompute_ref_log_probs`) and `peft_config` (LoRA through peft) load no
    separate reference model: TRL uses the policy itself (before training), or the model
    with its adapters disabled."""
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    out = tempfile.mkdtemp()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ref = None
    if not precompute and peft_config is None:
        ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    args = DPOConfig(
        output_dir=out,
        per_device_train_batch_size=batch_size,
        learning_rate=1e-5,
        max_grad_norm=1.0,
        max_length=max_length,
        report_to=[],
        use_cpu=True,
        logging_steps=10**9,
        save_strategy="no",
        precompute_ref_log_probs=precompute,
        padding_free=padding_free,
        dataloader_num_workers=0,
        **FLOAT32,
    )
    trainer = DPOTrainer(
        model=model,
        ref_model=ref,
        args=args,
        train_dataset=text_dataset(),
        processing_class=tok,
        peft_config=peft_config,
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
    tok=None,
):
    """`GRPOTrainer.train()` for `n_steps` iterations on the same prompts (`group`
    completions each, then one update), timed per step by a callback. With `budgets`
    (one per completion, in TRL's row order: each prompt's `group` rows together) the
    model's `generate` gets a `BudgetEOS` processor, so that row `i` ends with the stop id
    as its `budgets[i]`-th token; `generate` still steps every row until the batch's
    longest is done. Returns `(first_s, [step s], info)`, `info` the median seconds of
    generation and of the rest of a step, and whether every completion had its budget's
    length. `tok`: the model's tokenizer (prompts given to TRL as its decoded text; default
    the word tokenizer of the random model, prompts as `ids_as_text`); `info` then says
    whether TRL's prompt ids were `prompt_ids`."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, LogitsProcessorList, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    real_tok = tok is not None
    if tok is None:
        tok = common.word_tokenizer(common.CONFIG["vocab_size"])
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if real_tok:
        prompts = [tok.decode([int(i) for i in row]) for row in prompt_ids]
    else:
        prompts = [common.ids_as_text(row) for row in prompt_ids]
    seen_prompts = []
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
        if not seen_prompts:
            seen_prompts.append(k["input_ids"].tolist())
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
    if real_tok and seen_prompts:
        want_rows = sorted([int(i) for i in row] for row in prompt_ids)
        info["prompt_ids_match"] = sorted(map(list, {tuple(r) for r in seen_prompts[0]})) == (
            want_rows
        )
    return marks[0], marks[1:], info


def check_logits(model, inputs) -> float:
    """Largest |difference| between `model`'s logits of the check text and the float32
    reference logits of rlhf_eqx that `make_inputs.py` stored."""
    ids = torch.as_tensor(inputs["s135_check_ids"][None].astype("int64"))
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float().numpy()
    return float(abs(logits - inputs["s135_check_logits"]).max())


def param_bytes(model) -> int:
    """Bytes of the model's parameters (a tied embedding counted once): what a decode
    step reads once."""
    return int(sum(p.numel() * p.element_size() for p in model.parameters()))


def run_135(args, inputs):
    """One SmolLM2-135M-Instruct workload; returns `(first, times, extra)`.

    - `dpo135`: `DPOTrainer`, full fine-tune, a reference model run every step.
    - `dpo135_saving`: TRL's savings: `precompute_ref_log_probs=True` (the reference
      log-probabilities of the batch computed once beforehand by the trainer's own
      `compute_ref_log_probs`) and `padding_free=True`, which TRL 1.16 turns off for DPO
      ("temporarily unavailable"; recorded in `extra`).
    - `dpo135_lora`: `DPOTrainer` with a peft `LoraConfig` (`common.LORA135`, no dropout)
      on every projection; the reference is the model with its adapters disabled.
    - `dpo135_lora_saving`: as `dpo135_lora` with the savings of `dpo135_saving`.
    - `gen135`: greedy Hugging Face `generate`, float32.
    - `grpo135`: `GRPOTrainer.train()` (`grpo_run`), full fine-tune, `beta=0`.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    w = args.workload
    hf = os.path.join(common.smollm2_dir(args.inputs), "hf")
    tok = AutoTokenizer.from_pretrained(hf)
    extra = {}
    if w.startswith("dpo135"):
        from trl.trainer.dpo_trainer import DataCollatorForPreference

        P, C, R = (inputs[f"s135_dpo_{k}"] for k in ("prompt", "chosen", "rejected"))
        T = P.shape[1] + C.shape[1]
        kw = {}
        if w in ("dpo135_saving", "dpo135_lora_saving"):
            kw = dict(precompute=True, padding_free=True)
        if w in ("dpo135_lora", "dpo135_lora_saving"):
            from peft import LoraConfig

            c = common.LORA135
            kw["peft_config"] = LoraConfig(
                r=c["rank"],
                lora_alpha=c["alpha"],
                lora_dropout=0.0,
                target_modules=[f"{t}_proj" for t in c["targets"]],
                task_type="CAUSAL_LM",
            )
        trainer = dpo_trainer(hf, tok, max_length=T, batch_size=len(P), **kw)
        extra["load_peak_rss_mb"] = common.peak_rss_mb()  # loading alone, before any step
        extra["logits_max_abs_diff"] = check_logits(trainer.model, inputs)
        collate = DataCollatorForPreference(pad_token_id=tok.pad_token_id)
        batch = collate(
            [
                {"prompt_ids": p.tolist(), "chosen_ids": c.tolist(), "rejected_ids": r.tolist()}
                for p, c, r in zip(P, C, R)
            ]
        )
        if w in ("dpo135_saving", "dpo135_lora_saving"):
            extra["padding_free"] = bool(trainer.padding_free)
            if not trainer.padding_free:
                extra["padding_free_note"] = "TRL 1.16 turns padding_free off for DPO"
            c_lp, r_lp = trainer.compute_ref_log_probs(trainer.ref_model or trainer.model, batch)
            batch = dict(batch, ref_chosen_logps=c_lp, ref_rejected_logps=r_lp)
        if w in ("dpo135_lora", "dpo135_lora_saving"):
            extra["trainable_params"] = int(
                sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
            )
        run = step_fn(trainer, lambda: dict(batch))
        first, times = common.time_steps(run, args.steps)
        extra["tokens"] = int(2 * len(P) * T)
        extra["flops"] = common.dpo_flops(
            len(P),
            T,
            with_reference="saving" not in w,
            cfg=common.SMOL_CONFIG,
            lora=w.startswith("dpo135_lora"),
        )
    elif w == "gen135":
        model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
        extra["load_peak_rss_mb"] = common.peak_rss_mb()  # loading alone, before any step
        extra["logits_max_abs_diff"] = check_logits(model, inputs)
        prompts = torch.as_tensor(inputs["s135_gen_prompt"], dtype=torch.long)
        attn = torch.ones_like(prompts)
        new = int(inputs["s135_gen_new"])

        def run():
            with torch.no_grad():
                model.generate(
                    input_ids=prompts,
                    attention_mask=attn,
                    max_new_tokens=new,
                    min_new_tokens=new,
                    do_sample=False,
                    pad_token_id=tok.pad_token_id,
                    eos_token_id=None,
                )

        first, times = common.time_steps(run, args.steps)
        extra["new_tokens"] = int(prompts.shape[0] * new)
        extra["weight_bytes"] = param_bytes(model)
        extra["decode_steps"] = new
        extra["weights"] = "float32"
    elif w == "grpo135":
        new = int(inputs["s135_grpo_new"])
        first, times, info = grpo_run(
            hf,
            inputs["s135_grpo_prompt"],
            inputs["s135_grpo_rewards"],
            group=int(inputs["s135_grpo_group"]),
            max_completion=new,
            n_steps=args.steps + 1,
            generation_kwargs={"min_new_tokens": new},  # every completion `new` tokens long
            tok=tok,
        )
        extra.update(info)
        extra["fine_tune"] = "full"
    else:
        raise SystemExit(f"workload {w} is not run for TRL")
    return first, times, extra


def main():
    args, inputs = common.start(LIB)
    w = args.workload
    model_dir = os.path.join(args.inputs, "model")
    extra = {}
    torch.manual_seed(0)
    if w in common.WORKLOADS_135:
        first, times, extra = run_135(args, inputs)
        common.emit(LIB, w, first, times, peak_gflops=matmul_peak(), **extra)
        return
    if w in ("dpo", "dpo_cached") or w.startswith("curve_"):
        from trl.trainer.dpo_trainer import DataCollatorForPreference

        key = "dpo" if w in ("dpo", "dpo_cached") else w
        tok = common.word_tokenizer(common.CONFIG["vocab_size"])
        T = inputs[f"{key}_prompt"].shape[1] + inputs[f"{key}_chosen"].shape[1]
        trainer = dpo_trainer(model_dir, tok, max_length=T)
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
