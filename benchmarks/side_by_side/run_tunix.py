"""Tunix side of the side-by-side benchmark, on the benchmark model loaded from the same
safetensors (`tunix.models.llama3`):

- `gen_sample`, `gen_greedy`: its sampler (`tunix.generate.sampler.Sampler`). Prompts are
  given as text of a word-level tokenizer whose words are the token ids, so Tunix sees
  exactly the ids the other libraries do.
- `dpo`, `curve_T`: its `DPOTrainer` (`tunix.sft.dpo`), one step = what `train()` does
  per batch: `_prepare_inputs` (the reference model's log-probabilities, on the fly) and
  the jitted train step (AdamW 1e-5 after clipping the gradient norm to 1.0, as the
  other libraries), on the same pre-tokenised batch (`TrainingInput`: left-padded
  prompts, right-padded completions; no padding here).

    "$TUNIX_VENV"/bin/python benchmarks/side_by_side/run_tunix.py gen_sample --inputs DIR
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

LIB = "tunix"


DPO_WORKLOADS = ("dpo",) + tuple(f"curve_{t}" for t in common.CURVE_T)


def dpo(args, inputs, load_model):
    """One Tunix DPO step per call, reference on the fly."""
    import numpy as np
    import optax
    from tunix.sft.dpo import dpo_trainer as dpo_lib

    key = "dpo" if args.workload == "dpo" else args.workload
    P, C, R = (np.asarray(inputs[f"{key}_{part}"]) for part in ("prompt", "chosen", "rejected"))
    example = dpo_lib.TrainingInput(
        prompt_ids=jnp.asarray(P),
        prompt_mask=jnp.ones(P.shape, jnp.int32),
        chosen_ids=jnp.asarray(C),
        chosen_mask=jnp.ones(C.shape, jnp.int32),
        rejected_ids=jnp.asarray(R),
        rejected_mask=jnp.ones(R.shape, jnp.int32),
    )
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-5))
    config = dpo_lib.DPOTrainingConfig(eval_every_n_steps=10**6, max_steps=10**6, beta=0.1)
    trainer = dpo_lib.DPOTrainer(load_model(), load_model(), optimizer, config)
    train_step, _ = trainer.jit_train_and_eval_step()

    def run():
        ex = trainer._prepare_inputs(example)
        if hasattr(trainer, "_shard_input"):
            ex = trainer._shard_input(ex)
        loss, _, _ = train_step(ex)
        jax.block_until_ready(loss)

    steps = args.steps if args.workload == "dpo" else max(2, args.steps - 2)
    first, times = common.time_steps(run, steps)
    T = P.shape[1] + C.shape[1]
    extra = dict(
        flops=common.dpo_flops(P.shape[0], T, with_reference=True), tokens=int(2 * P.shape[0] * T)
    )
    common.emit(LIB, args.workload, first, times, peak_gflops=common.jax_matmul_peak(), **extra)


def main():
    args, inputs = common.start("Tunix", ("gen_sample", "gen_greedy") + DPO_WORKLOADS)
    from tunix.generate import sampler as sampler_lib
    from tunix.models.llama3 import model as llama_lib, params as params_lib

    model_dir = os.path.join(args.inputs, "model")
    hf = json.load(open(os.path.join(model_dir, "config.json")))
    cfg = llama_lib.ModelConfig(
        num_layers=hf["num_hidden_layers"],
        vocab_size=hf["vocab_size"],
        embed_dim=hf["hidden_size"],
        hidden_dim=hf["intermediate_size"],
        num_heads=hf["num_attention_heads"],
        head_dim=hf["hidden_size"] // hf["num_attention_heads"],
        num_kv_heads=hf["num_key_value_heads"],
        rope_theta=int(hf["rope_theta"]) if "rope_theta" in hf else 10000,
        norm_eps=hf["rms_norm_eps"],
        weight_tying=hf.get("tie_word_embeddings", False),
    )
    load_model = lambda: params_lib.create_model_from_safe_tensors(
        model_dir, cfg, None, dtype=jnp.float32
    )
    if args.workload in DPO_WORKLOADS:
        return dpo(args, inputs, load_model)
    model = load_model()
    g = common.GEN
    tok = common.word_tokenizer(hf["vocab_size"])
    sampler = sampler_lib.Sampler(
        model,
        tok,
        sampler_lib.CacheConfig(
            cache_size=2 * (g["prompt"] + g["new"]) + 8,
            num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
        ),
    )
    prompts = [common.ids_as_text(row) for row in inputs["gen_prompt"]]
    sample = args.workload == "gen_sample"
    state = {"seed": 0}

    def run():
        state["seed"] += 1
        out = sampler(
            prompts,
            max_generation_steps=g["new"],
            max_prompt_length=g["prompt"],
            temperature=1.0 if sample else 0.0,
            top_p=1.0 if sample else None,
            eos_tokens=[hf["vocab_size"] + 7],
            seed=state["seed"],
            pad_output=True,
        )
        jax.block_until_ready(out.tokens if hasattr(out, "tokens") else out.text)

    first, times = common.time_steps(run, args.steps)
    peak = common.jax_matmul_peak()
    new_tokens = g["batch"] * g["new"]
    common.emit(LIB, args.workload, first, times, peak_gflops=peak, new_tokens=new_tokens)


if __name__ == "__main__":
    main()
