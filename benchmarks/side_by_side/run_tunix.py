"""Tunix side of the side-by-side benchmark: its sampler (`tunix.generate.sampler.Sampler`)
on the benchmark model loaded from the same safetensors (`tunix.models.llama3`).

    /work/venv-tunix/bin/python benchmarks/side_by_side/run_tunix.py gen_sample --inputs DIR

Prompts are given as text of a word-level tokenizer whose words are the token ids, so
Tunix sees exactly the ids the other libraries do.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

LIB = "tunix"


def main():
    args, inputs = common.start("Tunix", ("gen_sample", "gen_greedy"))
    from tunix.generate import sampler as sampler_lib
    from tunix.models.llama3 import model as llama_lib, params as params_lib

    model_dir = os.path.join(args.inputs, "model")
    hf = json.load(open(os.path.join(model_dir, "config.json")))
    cfg = llama_lib.ModelConfig(
        num_layers=hf["num_hidden_layers"], vocab_size=hf["vocab_size"], embed_dim=hf["hidden_size"],
        hidden_dim=hf["intermediate_size"], num_heads=hf["num_attention_heads"],
        head_dim=hf["hidden_size"] // hf["num_attention_heads"], num_kv_heads=hf["num_key_value_heads"],
        rope_theta=int(hf["rope_theta"]) if "rope_theta" in hf else 10000, norm_eps=hf["rms_norm_eps"],
        weight_tying=hf.get("tie_word_embeddings", False),
    )
    model = params_lib.create_model_from_safe_tensors(model_dir, cfg, None, dtype=jnp.float32)
    g = common.GEN
    tok = common.word_tokenizer(hf["vocab_size"])
    sampler = sampler_lib.Sampler(
        model, tok,
        sampler_lib.CacheConfig(cache_size=2 * (g["prompt"] + g["new"]) + 8, num_layers=cfg.num_layers,
                                num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim),
    )
    prompts = [common.ids_as_text(row) for row in inputs["gen_prompt"]]
    sample = args.workload == "gen_sample"
    state = {"seed": 0}

    def run():
        state["seed"] += 1
        out = sampler(
            prompts, max_generation_steps=g["new"], max_prompt_length=g["prompt"],
            temperature=1.0 if sample else 0.0, top_p=1.0 if sample else None,
            eos_tokens=[hf["vocab_size"] + 7], seed=state["seed"], pad_output=True,
        )
        jax.block_until_ready(out.tokens if hasattr(out, "tokens") else out.text)

    first, times = common.time_steps(run, args.steps)
    peak = common.jax_matmul_peak()
    new_tokens = g["batch"] * g["new"]
    common.emit(LIB, args.workload, first, times, peak_gflops=peak, new_tokens=new_tokens)


if __name__ == "__main__":
    main()
