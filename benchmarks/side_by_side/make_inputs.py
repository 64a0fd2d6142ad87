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
- With `--smollm2`, the inputs of the 135M workloads (`common.WORKLOADS_135`):
  `DIR/smollm2/hf/`, SmolLM2-135M-Instruct's shipped Q4_1 GGUF file dequantised to
  float32 by `rlhf_eqx.load_gguf` and written by `rlhf_eqx.save_hf` with its tokenizer
  (`tokenizer.json`, `tokenizer_config.json`), which TRL and the floor load;
  `DIR/smollm2/q8_0.gguf`, the same float32 weights written as Q8_0 blocks by
  `rlhf_eqx.save_gguf`; and in `batches.npz` the `s135_*` arrays, tokenised with the
  model's own tokenizer: DPO pairs cut from HH-RLHF (harmless-base test) to exactly
  `common.DPO135`'s lengths (a prompt's last tokens, a response's first; a text too
  short is continued with the next records' text), GSM8K questions as prompts of exactly
  the prompt length (questions joined by a newline where one is too short; only prompts
  whose decode → encode round trip gives the same ids, so that TRL, which takes text,
  sees the same tokens), the GRPO rewards, and the reference logits of a short text
  (`s135_check_ids`, `s135_check_logits`: every runner compares its model's logits
  with them). Random ids when `../shared` is absent. `BENCH_SMOKE=1` shrinks every
  length (smoke tests only).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/side_by_side/make_inputs.py \
        --out /tmp/rlhf_bench_inputs        # default: $BENCH_INPUTS or /tmp/rlhf_bench_inputs
    PYTHONPATH=$PWD .venv/bin/python benchmarks/side_by_side/make_inputs.py \
        --out /tmp/rlhf_bench_inputs --smollm2   # also the 135M model and its inputs
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
CHECK_TEXT = "The quick brown fox jumps over the lazy dog. How many legs do three dogs have?"


def fixed_length(tok, texts, i: int, n: int, *, keep: str):
    """Exactly `n` token ids of `texts[i]`: its last `n` (`keep="last"`, a prompt) or first
    `n` (`keep="first"`, a response); a text too short is continued with the texts after
    it (before it, for a prompt)."""
    ids, j = list(tok.encode(texts[i])), i
    while len(ids) < n:
        j = (j + 1) % len(texts)
        more = list(tok.encode("\n" + texts[j]))
        ids = more + ids if keep == "last" else ids + more
    return ids[-n:] if keep == "last" else ids[:n]


def gsm8k_prompts(tok, questions, count: int, length: int):
    """`count` prompts of exactly `length` ids from the questions in order (joined by a
    newline where one is too short), keeping only those whose decode → encode round trip
    gives the same ids."""
    out, i = [], 0
    while len(out) < count and i < len(questions):
        text, j = questions[i], i
        while len(tok.encode(text)) < length and j + 1 < len(questions):
            j += 1
            text += "\n" + questions[j]
        ids = list(tok.encode(text))[:length]
        if len(ids) == length and list(tok.encode(tok.decode(ids))) == ids:
            out.append(ids)
        i = j + 1
    if len(out) < count:
        raise SystemExit(f"gsm8k: only {len(out)} of {count} prompts round-trip")
    return np.asarray(out, np.int32)


def smollm2_inputs(out_dir: str, out: dict) -> None:
    """The 135M model files under `out_dir/smollm2/` and the `s135_*` arrays into `out`."""
    import jax.numpy as jnp

    policy, tok = rx.load_gguf(common.smollm2_gguf())
    mdir = os.path.join(out_dir, "smollm2")
    rx.save_hf(policy, os.path.join(mdir, "hf"))
    tok.save(os.path.join(mdir, "hf"))
    rx.save_gguf(policy, os.path.join(mdir, "q8_0.gguf"), tokenizer=tok, dtype="q8_0")
    ids = np.asarray(tok.encode(CHECK_TEXT), np.int32)
    out["s135_check_ids"] = ids
    out["s135_check_logits"] = np.asarray(policy(jnp.asarray(ids), jnp.ones(ids.shape, bool)))

    rng = np.random.default_rng(2)
    V = common.SMOL_CONFIG["vocab_size"]
    d, g, gr = common.DPO135, common.GEN135, common.GRPO135
    hh = os.path.join(SHARED, "data", "hh-rlhf", "harmless-base", "test.jsonl.gz")
    gsm = os.path.join(SHARED, "data", "gsm8k", "test.jsonl")
    if os.path.isfile(hh) and os.path.isfile(gsm):
        recs = data.load_preferences(hh, "hh")
        recs = [recs[int(i)] for i in rng.permutation(len(recs))[:64]]
        texts = {k: [getattr(r, k) for r in recs] for k in ("prompt", "chosen", "rejected")}
        for name, n, keep in (
            ("prompt", d["prompt"], "last"),
            ("chosen", d["completion"], "first"),
            ("rejected", d["completion"], "first"),
        ):
            out[f"s135_dpo_{name}"] = np.asarray(
                [fixed_length(tok, texts[name], i, n, keep=keep) for i in range(d["pairs"])],
                np.int32,
            )
        questions = [r.prompt for r in data.load_prompts(gsm, "gsm8k")]
        out["s135_gen_prompt"] = gsm8k_prompts(tok, questions, g["batch"], g["prompt"])
        out["s135_grpo_prompt"] = gsm8k_prompts(tok, questions[100:], gr["prompts"], gr["prompt"])
        source = "HH-RLHF pairs and GSM8K questions"
    else:  # no shared data: random ids above the special tokens
        out["s135_dpo_prompt"] = rng.integers(3, V, (d["pairs"], d["prompt"]), dtype=np.int32)
        for name in ("chosen", "rejected"):
            out[f"s135_dpo_{name}"] = rng.integers(
                3, V, (d["pairs"], d["completion"]), dtype=np.int32
            )
        out["s135_gen_prompt"] = rng.integers(3, V, (g["batch"], g["prompt"]), dtype=np.int32)
        out["s135_grpo_prompt"] = rng.integers(3, V, (gr["prompts"], gr["prompt"]), dtype=np.int32)
        source = "random ids (../shared not found)"
    out["s135_gen_new"] = np.int32(g["new"])
    out["s135_grpo_new"] = np.int32(gr["new"])
    out["s135_grpo_group"] = np.int32(gr["group"])
    out["s135_grpo_rewards"] = rng.standard_normal(gr["prompts"] * gr["group"]).astype(np.float32)
    print(f"wrote {mdir}: SmolLM2-135M-Instruct float32 (hf/) and Q8_0; tokens from {source}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("BENCH_INPUTS", "/tmp/rlhf_bench_inputs"))
    p.add_argument("--hh-pairs", type=int, default=common.HH["pairs"] * common.HH["steps"])
    p.add_argument(
        "--smollm2",
        action="store_true",
        help="also write the SmolLM2-135M-Instruct model and the inputs of its workloads",
    )
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
    if args.smollm2:
        smollm2_inputs(args.out, out)
    np.savez(os.path.join(args.out, "batches.npz"), **out)
    lens = [len(pr.chosen) for pr in pairs] + [len(pr.rejected) for pr in pairs]
    print(
        f"wrote {args.out}: {len(pairs)} HH pairs, "
        f"row lengths mean {np.mean(lens):.0f}, max {max(lens)}"
    )


if __name__ == "__main__":
    main()
