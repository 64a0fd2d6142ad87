"""The DPO-step, generation and GRPO-iteration benchmarks on an accelerator, as one
bounded run (bfloat16 by default).

The workloads and the model are those of the side-by-side benchmark
(`side_by_side/common.py`: Llama architecture, vocab 4096, d_model 256, 4 layers, 8/4
heads, d_ff 688), built here from random weights and seeded token batches so that
nothing else has to travel to the machine:

- `dpo`: one DPO step, 8 pairs × (64 prompt + 192 completion), reference on the fly
  (shared-prompt aligned batch), with MFU against a matrix-product peak measured in
  the same process in the same dtype (8192² on an accelerator);
- `gen_sample`, `gen_greedy`: 8 prompts × 64 tokens, 128 new tokens;
- `grpo`: 8 prompts × 4 completions × 128 new tokens sampled, then one update;
- with `--hf`, the same generation with Hugging Face `generate` on the same weights
  (torch, in a subprocess, so that JAX's and torch's allocators do not share a process).

Every workload prints one JSON line (`first_s` compile included, `times`, `median_s`)
and appends it to `--out`. Workloads are started only while the elapsed time is under
`--budget-s`, so the run ends within that budget plus one workload.

    python benchmarks/bench_gpu.py --out results-gpu.jsonl --hf      # on the GPU machine
    python benchmarks/bench_gpu.py --small --dtype float32 --steps 1 # a CPU dry run

On a machine where rlhf_eqx's dependencies are present but the package is not
installed, run it with `PYTHONPATH=$PWD`.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "side_by_side"))
import common  # noqa: E402

HF_SCRIPT = r"""
import json, sys, time, torch
from transformers import AutoModelForCausalLM
model_dir, dtype, steps, new = (
    sys.argv[1], getattr(torch, sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
)
prompts = torch.tensor(json.loads(sys.argv[5]))
device = "cuda" if torch.cuda.is_available() else "cpu"
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
prompts = prompts.to(device)
for mode in ("gen_sample", "gen_greedy"):
    sample = mode == "gen_sample"
    def run():
        with torch.no_grad():
            model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts),
                           max_new_tokens=new, min_new_tokens=new, do_sample=sample,
                           temperature=1.0 if sample else None, top_k=0 if sample else None,
                           top_p=1.0 if sample else None, pad_token_id=0, eos_token_id=None)
        if device == "cuda":
            torch.cuda.synchronize()
    t0 = time.perf_counter(); run(); first = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t0 = time.perf_counter(); run(); times.append(time.perf_counter() - t0)
    print("RESULT " + json.dumps(dict(library="hf", workload=mode, first_s=first, times=times,
                                      device=device)), flush=True)
"""


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="results-gpu.jsonl", help="JSONL file the rows are appended to")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--steps", type=int, default=5, help="timed steps after the first")
    p.add_argument(
        "--budget-s", type=float, default=420.0, help="start no workload after this many seconds"
    )
    p.add_argument("--workloads", default="dpo,gen_sample,gen_greedy,grpo")
    p.add_argument(
        "--hf",
        action="store_true",
        help="also time Hugging Face generate (needs torch, transformers)",
    )
    p.add_argument(
        "--hf-python", default=sys.executable, help="the Python that runs Hugging Face generate"
    )
    p.add_argument(
        "--small", action="store_true", help="a tiny model and short rows (a dry run on CPU)"
    )
    args = p.parse_args()
    if args.steps < 1:
        p.error(f"--steps must be at least 1, got {args.steps}")
    t_start = time.perf_counter()

    import jax
    import jax.numpy as jnp
    import numpy as np
    import run_rlhf_eqx as R  # the side-by-side runner's DPO and GRPO iterations

    import rlhf_eqx as rx
    from rlhf_eqx import data

    cfg_kw = dict(common.CONFIG)
    dpo_shape, gen, grpo = dict(common.DPO), dict(common.GEN), dict(common.GRPO)
    if args.small:
        cfg_kw.update(vocab_size=256, d_model=64, n_layers=2, d_ff=128, max_seq_len=512)
        dpo_shape.update(pairs=2, prompt=8, completion=16)
        gen.update(batch=2, prompt=8, new=8)
        grpo.update(prompts=2, group=2, prompt=8, new=8)
    cfg = rx.TransformerConfig(**cfg_kw, dtype=args.dtype)
    policy = rx.Policy(cfg, key=jax.random.key(0))
    device = jax.devices()[0]
    rng = np.random.default_rng(0)
    V = cfg.vocab_size

    n = 1024 if device.platform == "cpu" or args.small else 8192
    a = jax.random.normal(jax.random.key(1), (n, n), cfg.param_dtype)
    b = jax.random.normal(jax.random.key(2), (n, n), cfg.param_dtype)
    mm = jax.jit(jnp.dot)
    peak = common.matmul_gflops(lambda: mm(a, b).block_until_ready(), n)
    base = dict(
        dtype=args.dtype,
        device=str(device.device_kind),
        platform=device.platform,
        matmul_gflops=peak,
    )
    print(f"{device.device_kind}: {args.dtype} {n}² matmul {peak:,.0f} GFLOP/s", flush=True)

    def emit(row):
        row = {**base, **row, "median_s": common.median(row["times"])}
        print("RESULT " + json.dumps(row), flush=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")

    def dpo():
        P, C, N = dpo_shape["prompt"], dpo_shape["completion"], dpo_shape["pairs"]
        prompt = rng.integers(3, V, (N, P))
        pairs = R.pairs_of(prompt, rng.integers(3, V, (N, C)), rng.integers(3, V, (N, C)))
        run = R.dpo_runner(
            policy, data.pack_preferences(pairs, pad_id=0, aligned=True), cached=False
        )
        first, times = common.time_steps(run, args.steps)
        flops = common.dpo_flops(N, P + C, with_reference=True, cfg=cfg_kw)
        emit(
            dict(
                library="rlhf_eqx",
                workload="dpo",
                first_s=first,
                times=times,
                flops=flops,
                mfu=flops / common.median(times) / (peak * 1e9),
                tokens=2 * N * (P + C),
            )
        )

    gen_prompts = rng.integers(3, V, (gen["batch"], gen["prompt"]))

    def generation(temperature, name):
        prompts = jnp.asarray(gen_prompts, jnp.int32)
        masks = jnp.ones(prompts.shape, bool)

        def run(key):
            out = rx.generate_batch(
                policy, prompts, masks, key, max_new_tokens=gen["new"], temperature=temperature
            )
            jax.block_until_ready(out.tokens)

        first, times = common.time_keyed_steps(run, args.steps)
        new = gen["batch"] * gen["new"]
        emit(
            dict(
                library="rlhf_eqx",
                workload=name,
                first_s=first,
                times=times,
                new_tokens=new,
                new_tokens_per_s=new / common.median(times),
            )
        )

    def grpo_iteration():
        G = grpo["group"]
        prompts = jnp.asarray(rng.integers(3, V, (grpo["prompts"], grpo["prompt"])), jnp.int32)
        rewards = jnp.asarray(rng.normal(size=grpo["prompts"] * G), jnp.float32)
        run, split = R.grpo_runner(policy, prompts, rewards, group=G, new=grpo["new"])
        first, times = common.time_steps(run, args.steps)
        emit(
            dict(
                library="rlhf_eqx",
                workload="grpo",
                first_s=first,
                times=times,
                gen_s=common.median(split["gen"][1:]),
                update_s=common.median(split["update"][1:]),
            )
        )

    def hf():
        with tempfile.TemporaryDirectory() as d:
            rx.save_hf(policy, d)
            cmd = [
                args.hf_python,
                "-c",
                HF_SCRIPT,
                d,
                args.dtype,
                str(args.steps),
                str(gen["new"]),
                json.dumps(gen_prompts.tolist()),
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        rows = [
            json.loads(x[len("RESULT ") :])
            for x in proc.stdout.splitlines()
            if x.startswith("RESULT ")
        ]
        if proc.returncode != 0 or not rows:
            print(
                f"Hugging Face generate failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}",
                flush=True,
            )
        for row in rows:
            new = gen["batch"] * gen["new"]
            emit({**row, "new_tokens": new, "new_tokens_per_s": new / common.median(row["times"])})

    jobs = {
        "dpo": dpo,
        "gen_sample": lambda: generation(1.0, "gen_sample"),
        "gen_greedy": lambda: generation(0.0, "gen_greedy"),
        "grpo": grpo_iteration,
    }
    wanted = [w for w in args.workloads.split(",") if w]
    unknown = [w for w in wanted if w not in jobs]
    if unknown:
        p.error(f"unknown workloads {unknown}; choose from {sorted(jobs)}")
    todo = [jobs[w] for w in wanted] + ([hf] if args.hf else [])
    for job in todo:
        if time.perf_counter() - t_start > args.budget_s:
            print(
                f"budget of {args.budget_s:.0f} s spent: {job.__name__} "
                "and later workloads skipped",
                flush=True,
            )
            break
        job()
    print(f"done in {time.perf_counter() - t_start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
