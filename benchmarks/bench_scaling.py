"""Scaling of one DPO step over devices, and the memory plan of large models.

Two reports:

1. **Step time on 1, 2 and 8 devices** (default). Each device count runs in a fresh
   subprocess with `--xla_force_host_platform_device_count=N` (simulated CPU devices
   unless real ones are present), on a `(N, 1)` mesh: parameters replicated, the global
   batch split over `"data"`, XLA's all-reduce of the gradients. The collective share
   is measured by timing the same step with the all-reduce removed: the step runs per
   device on its own rows as one `vmap`ped copy of the state per device, the copy axis
   sharded over the mesh (same FLOPs, no cross-device reduction), and
   `share = 1 - t_no_collective / t_mesh`. Simulated CPU devices share the host's
   cores, so on them the step time does not fall with N; the table shows the overhead
   of the distribution itself.
2. **Memory table** (`--memory-table`): `rlhf_eqx.estimate_memory` for Llama-7B/13B/70B
   on 8-device meshes (v5e-8: 8 × 16 GB; 8×H100: 8 × 80 GB), full fine-tuning with
   FSDP, LoRA and int8-base LoRA, bfloat16; the markdown table in `docs/scaling.md`.

Usage:

```bash
python benchmarks/bench_scaling.py [--quick] [--devices 1 2 8]
python benchmarks/bench_scaling.py --memory-table
```
"""

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _worker(n_devices: int, quick: bool) -> dict:
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    import rlhf_eqx as rx
    from rlhf_eqx import distributed as dist
    from rlhf_eqx.train import init_train_state, make_dpo_step, make_optimizer

    assert jax.device_count() >= n_devices, jax.devices()
    if quick:
        cfg = rx.TransformerConfig(
            vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=172
        )
        pairs, T, repeats = 8, 32, 3
    else:
        cfg = rx.TransformerConfig(
            vocab_size=1024, d_model=128, n_layers=4, n_heads=8, n_kv_heads=4, d_ff=344
        )
        pairs, T, repeats = 16, 128, 5
    policy = rx.Policy(cfg, key=jax.random.key(0))
    lengths = T - (jnp.arange(pairs) % 5) * (T // 8)  # uneven rows
    mask = jnp.arange(T)[None, :] < lengths[:, None]
    tokens = jax.random.randint(jax.random.key(1), (pairs, T), 3, cfg.vocab_size)
    batch = rx.PreferenceBatch(
        chosen_tokens=tokens,
        chosen_mask=mask,
        chosen_completion_mask=mask.at[:, : T // 4].set(False),
        rejected_tokens=jnp.flip(tokens, 1),
        rejected_mask=mask,
        rejected_completion_mask=mask.at[:, : T // 4].set(False),
    )
    opt = make_optimizer(learning_rate=1e-4, total_steps=100)
    step = make_dpo_step(opt, reference="cached", donate=False)
    batch = rx.train.compute_reference_logps(policy, batch)
    state = init_train_state(policy, opt)
    mesh = dist.make_mesh(n_devices, 1, devices=jax.devices()[:n_devices])
    params = dist.shard_model(state.params, mesh)
    opt_state = dist.shard_opt_state(state.opt_state, state.params, mesh)
    sharded = dist.shard_batch(batch, mesh)

    def run(p, o, b):
        return step(p, o, b)

    mesh_step = jax.jit(run)
    # The same step on each device's own rows, nothing reduced across devices: one
    # independent copy of the state per device, `vmap`ped over a leading copy axis that
    # the mesh shards over "data" (a step built without `axis_name` refuses to run
    # inside `shard_map` / `pmap`, where the copies would silently drift apart).
    copy_axis = NamedSharding(mesh, P("data"))

    def copies(tree):
        return jax.tree.map(
            lambda x: jax.device_put(jnp.broadcast_to(x, (n_devices,) + x.shape), copy_axis),
            eqx.filter(tree, eqx.is_array),
        )

    def per_device(b):
        return jax.device_put(
            b.reshape((n_devices, b.shape[0] // n_devices) + b.shape[1:]), copy_axis
        )

    local_args = (
        eqx.combine(copies(params), eqx.filter(params, eqx.is_array, inverse=True)),
        eqx.combine(copies(opt_state), eqx.filter(opt_state, eqx.is_array, inverse=True)),
        jax.tree.map(per_device, sharded),
    )
    local_step = eqx.filter_jit(eqx.filter_vmap(run))

    def best(fn, args):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        compile_s = time.perf_counter() - start
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times.append(time.perf_counter() - start)
        return min(times), compile_s

    t_mesh, c_mesh = best(mesh_step, (params, opt_state, sharded))
    t_local, _ = best(local_step, local_args) if n_devices > 1 else (t_mesh, 0.0)
    return {
        "devices": n_devices,
        "pairs": pairs,
        "seq_len": T,
        "step_s": t_mesh,
        "compile_s": c_mesh,
        "no_collective_s": t_local,
        "collective_share": max(0.0, 1.0 - t_local / t_mesh),
    }


def scaling_table(device_counts, quick: bool) -> list[dict]:
    rows = []
    for n in device_counts:
        env = dict(os.environ)
        env["XLA_FLAGS"] = (
            env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}"
        ).strip()
        env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
        args = [sys.executable, os.path.abspath(__file__), "--worker", str(n)] + (
            ["--quick"] if quick else []
        )
        out = subprocess.run(args, env=env, capture_output=True, text=True, check=False)
        if out.returncode != 0:
            raise RuntimeError(f"the {n}-device run failed:\n{out.stderr[-4000:]}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return rows


def print_scaling(rows) -> None:
    r0 = rows[0]
    print(
        f"DPO step, {r0['pairs']} pairs × {r0['seq_len']} tokens (global batch), "
        "(N, 1) mesh, data parallel\n"
    )
    header = ["devices", "step (ms)", "speed-up", "no-collective step (ms)", "collective share"]
    print(_row(header + ["compile (s)"]))
    print(_row(["---"] * 6))
    for r in rows:
        cells = [
            r["devices"],
            f"{1e3 * r['step_s']:.1f}",
            f"{r0['step_s'] / r['step_s']:.2f}×",
            f"{1e3 * r['no_collective_s']:.1f}",
            f"{100 * r['collective_share']:.0f}%",
            f"{r['compile_s']:.1f}",
        ]
        print(_row(cells))


def _row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


LLAMA = {
    "Llama-2-7B": dict(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, d_ff=11008),
    "Llama-2-13B": dict(vocab_size=32000, d_model=5120, n_layers=40, n_heads=40, d_ff=13824),
    "Llama-2-70B": dict(
        vocab_size=32000, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, d_ff=28672
    ),
}


def memory_table(*, pairs: int = 8, seq_len: int = 1024) -> str:
    import rlhf_eqx as rx
    from rlhf_eqx import estimate_memory

    gib = 2**30
    modes = [
        ("full, FSDP", (8, 1), {}),
        ("full, FSDP + TP", (2, 4), {}),
        (
            "LoRA r=16 (all projections)",
            (8, 1),
            {"lora": rx.LoRAConfig(rank=16, targets=rx.models.LORA_TARGETS)},
        ),
        (
            "LoRA r=16, int8 base",
            (8, 1),
            {"lora": rx.LoRAConfig(rank=16, targets=rx.models.LORA_TARGETS), "int8_base": True},
        ),
    ]
    lines = [
        f"DPO, {pairs} pairs × {seq_len} tokens per step ({2 * pairs} sequences), "
        "bfloat16 weights and AdamW moments, reference model held (full) or shared base "
        "(LoRA); GiB per device.",
        "",
        _row(
            ["model", "mode", "mesh (data, model)", "weights", "grads + optimiser", "reference"]
            + ["activations", "activations (dots)", "activations (remat)"]
            + ["total", "total (dots)", "total (remat)"]
            + ["v5e-8 (16 GB)", "8×H100 (80 GB)"]
        ),
        _row(["---"] * 14),
    ]

    def verdict(est, device_bytes):
        if est.fits(device_bytes):
            return "fits"
        if est.fits(device_bytes, remat="dots"):
            return "with remat dots"
        if est.fits(device_bytes, remat=True):
            return "with remat"
        return "no"

    for name, sizes in LLAMA.items():
        cfg = rx.TransformerConfig(**sizes, max_seq_len=4096, dtype="bfloat16")
        for mode, mesh, kw in modes:
            est = estimate_memory(cfg, mesh, (2 * pairs, seq_len), **kw)
            sizes_gib = [
                est.params,
                est.grads + est.optimizer,
                est.reference,
                est.activations,
                est.activations_dots,
                est.activations_remat,
                est.total,
                est.total_dots,
                est.total_remat,
            ]
            cells = [name, mode, mesh] + [f"{b / gib:.1f}" for b in sizes_gib]
            lines.append(_row(cells + [verdict(est, 16 * 10**9), verdict(est, 80 * 10**9)]))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2, 8])
    parser.add_argument(
        "--quick", action="store_true", help="a smaller model and batch (smoke run)"
    )
    parser.add_argument("--memory-table", action="store_true", help="print the docs memory table")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        print(json.dumps(_worker(args.worker, args.quick)))
    elif args.memory_table:
        print(memory_table())
    else:
        print_scaling(scaling_table(args.devices, args.quick))


if __name__ == "__main__":
    main()
