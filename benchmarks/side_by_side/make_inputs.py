r"""Write the inputs every library's benchmark loads: the same random weights and the
same token batches.

- `DIR/model/`: the benchmark model (`common.CONFIG`, float32, seed 0) as a Hugging Face
  Llama checkpoint (`config.json` + `model.safetensors`, written by `rlhf_eqx.save_hf`);
  TRL loads it with `LlamaForCausalLM.from_pretrained`, Tunix and the hand-written JAX
  floor read the safetensors.
- `DIR/model_hh/`: the same architecture with the stories260K vocabulary (512) for
  the HH-RLHF length-mix workload.
- `DIR/batches.npz`: token batches (seeded numpy draws; for `grpo_mix` also each
  completion's token budget, drawn from `common.GRPO_MIX_LENGTHS`) and the HH-RLHF pairs,
  tokenised with the stories260K tokenizer (max length 512), stored ragged as flat
  arrays plus offsets.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/side_by_side/make_inputs.py \
        --out /tmp/rlhf_bench_inputs        # default: $BENCH_INPUTS or /tmp/rlhf_bench_inputs
"""

import argparse
import os
import sys

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import rlhf_eqx as rx  # noqa: E402
from rlhf_eqx import data  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SHARED = os.path.join(HERE, "..", "..", "..", "shared")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("BENCH_INPUTS", "/tmp/rlhf_bench_inputs"))
    p.add_argument("--hh-pairs", type=int, default=common.HH["pairs"] * common.HH["steps"])
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)

    cfg = rx.TransformerConfig(**common.CONFIG)
    rx.save_hf(rx.Policy(cfg, key=jax.random.key(0)), os.path.join(args.out, "model"))
    cfg_hh = rx.TransformerConfig(
        **{**common.CONFIG, "vocab_size": common.HH_VOCAB, "max_seq_len": 1024}
    )
    rx.save_hf(rx.Policy(cfg_hh, key=jax.random.key(1)), os.path.join(args.out, "model_hh"))

    rng = np.random.default_rng(0)
    V = common.CONFIG["vocab_size"]
    out = {}
    d = common.DPO
    # token ids drawn from [3, V): 0 is padding, 1 BOS, 2 EOS
    out["dpo_prompt"] = rng.integers(3, V, (d["pairs"], d["prompt"]), dtype=np.int32)
    out["dpo_chosen"] = rng.integers(3, V, (d["pairs"], d["completion"]), dtype=np.int32)
    out["dpo_rejected"] = rng.integers(3, V, (d["pairs"], d["completion"]), dtype=np.int32)
    g = common.GEN
    out["gen_prompt"] = rng.integers(3, V, (g["batch"], g["prompt"]), dtype=np.int32)
    r = common.RM
    out["rm_prompt"] = rng.integers(3, V, (r["pairs"], r["prompt"]), dtype=np.int32)
    out["rm_chosen"] = rng.integers(3, V, (r["pairs"], r["completion"]), dtype=np.int32)
    out["rm_rejected"] = rng.integers(3, V, (r["pairs"], r["completion"]), dtype=np.int32)
    gr = common.GRPO
    out["grpo_prompt"] = rng.integers(3, V, (gr["prompts"], gr["prompt"]), dtype=np.int32)
    out["grpo_rewards"] = rng.standard_normal(gr["prompts"] * gr["group"]).astype(np.float32)
    # the length mix from its own generator, so that the other draws stay as they were
    mix_rng = np.random.default_rng(1)
    gm = common.GRPO_MIX
    rows = gm["prompts"] * gm["group"]
    out["grpo_mix_prompt"] = mix_rng.integers(3, V, (gm["prompts"], gm["prompt"]), dtype=np.int32)
    out["grpo_mix_rewards"] = mix_rng.standard_normal(rows).astype(np.float32)
    out["grpo_mix_budgets"] = mix_rng.choice(common.GRPO_MIX_LENGTHS, size=rows).astype(np.int32)
    for t in common.CURVE_T:
        rows = max(1, common.CURVE_TOKENS // t)
        pairs = max(1, rows // 2)
        half = t // 4  # prompt a quarter of the row
        out[f"curve_{t}_prompt"] = rng.integers(3, V, (pairs, half), dtype=np.int32)
        out[f"curve_{t}_chosen"] = rng.integers(3, V, (pairs, t - half), dtype=np.int32)
        out[f"curve_{t}_rejected"] = rng.integers(3, V, (pairs, t - half), dtype=np.int32)

    tok = data.load_tokenizer(os.path.join(SHARED, "models", "stories260K", "tok512.bin"))
    ds = data.load_preferences(
        os.path.join(SHARED, "data", "hh-rlhf", "harmless-base", "test.jsonl.gz"), "hh"
    )
    order = rng.permutation(len(ds))[: args.hh_pairs * 2]
    pairs, _ = data.tokenize_preferences(
        [ds[int(i)] for i in order],
        tok,
        max_length=common.HH_MAX_LEN,
        max_prompt_length=common.HH_MAX_LEN // 2,
    )
    pairs = pairs[: args.hh_pairs]
    for name, seqs in (
        ("hh_prompt", [pr.chosen.prompt for pr in pairs]),
        ("hh_chosen", [pr.chosen.completion for pr in pairs]),
        ("hh_rejected_prompt", [pr.rejected.prompt for pr in pairs]),
        ("hh_rejected", [pr.rejected.completion for pr in pairs]),
    ):
        flat, offsets = common.to_ragged(seqs)
        out[name], out[name + "_offsets"] = flat, offsets
    np.savez(os.path.join(args.out, "batches.npz"), **out)
    lens = [len(pr.chosen) for pr in pairs] + [len(pr.rejected) for pr in pairs]
    print(
        f"wrote {args.out}: {len(pairs)} HH pairs, "
        f"row lengths mean {np.mean(lens):.0f}, max {max(lens)}"
    )


if __name__ == "__main__":
    main()
