"""One-step off-policy GRPO with the next rollout overlapping the update, against the
synchronous run and the same off-policy run without overlap, side by side in one run.

Three GRPO runs of the built-in task's settings (`animal_task_config().grpo`: 8 prompts
x 8 samples per rollout, LoRA rank 8, one step per rollout) on the training prompts of
the built-in task, with the run's own loop (`rlhf_eqx.pipelines.runs.run_grpo`):

- `sync`: `staleness=0`, every rollout sampled by the current policy;
- `stale`: `staleness=1, overlap=False`, sampled by the policy one update old, in turn;
- `overlap`: `staleness=1, overlap=True`, rollout `r + 1`'s sampling dispatched before
  rollout `r`'s update, and decoded and scored while that update runs.

`stale` and `overlap` train the same numbers (checked here: equal final parameters). With
one step per rollout and no importance correction, the off-policy runs take the trained
policy's log-probs from the step's own forward pass: no extra pass, as in the synchronous
run.

Rewards (`--rewards`):

- `task`: a rule on the text (cheap): the built-in task's animal rule for stories260K,
  the parity of the word count for the randomly initialised model (which names no
  animal; its groups need a signal for the update to move);
- `remote`: the same rule behind a host call that waits `--latency` seconds per
  rollout, as a reward served by another process does (a sandbox running code, a judge
  model behind an API, a math verifier service): the host waits while the device could
  work.

The time of a run is the sum of its iterations' `iteration_time_s` after the first
(which compiles). Rounds alternate the order of the three runs; medians are printed with
the ratios `sync / overlap` and `stale / overlap`. Models (`--models`): the shipped
stories260K checkpoint, and the benchmark model of `side_by_side/common.py` (`CONFIG`:
vocab 4096, d_model 256, 4 layers, random weights, the stories tokenizer's ids) whose
update is heavier.

Usage: `python benchmarks/bench_async_rollouts.py [--rollouts 6] [--rounds 3]
[--rewards task,remote] [--latency 0.25] [--models stories,config] [--json FILE]`
(`--quick` for a smoke run).
"""

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time

import jax
import numpy as np

import rlhf_eqx as rx
from rlhf_eqx import pipelines as pl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "side_by_side"))
from common import CONFIG  # noqa: E402

VARIANTS = {
    "sync": dict(staleness=0),
    "stale": dict(staleness=1, overlap=False),
    "overlap": dict(staleness=1, overlap=True),
}


def rule(name: str):
    """The cheap rule on the text: the task's animal rule for stories260K; for the
    randomly initialised model (which never names an animal) the parity of the number
    of words, so that its groups carry a signal and the update moves."""
    if name == "stories":
        return lambda t: pl.task.animal_score(t)
    return lambda t: float(len(t.split()) % 2)


def rewards(kind: str, latency: float, score):
    """The run's reward: the rule, or the rule behind a waiting host call."""
    if kind == "task":
        return [pl.runs.RewardFunction("rule", lambda p, t: score(t))]

    class Remote(pl.runs.RewardSource):
        def score(self, roll):
            time.sleep(latency)  # the round trip to the service
            s = np.asarray([score(t) for t in roll.texts], np.float32)
            return pl.runs.Scored(s, {"reward/rule": float(s.mean())})

    return Remote()


def model(name: str):
    policy, tok = pl.tools.load_model("builtin")
    if name == "stories":
        return policy, tok
    cfg = rx.TransformerConfig(**{**CONFIG, "vocab_size": tok.vocab_size})
    return rx.Policy(cfg, key=jax.random.key(0)), tok


def run(policy, tok, variant: str, reward, rollouts: int, out: str):
    cfg = dataclasses.replace(
        pl.animal_task_config().grpo, rollouts=rollouts, kl_target=1e9, **VARIANTS[variant]
    )
    log = pl.tools.MetricsLog(out, f"grpo-{variant}", quiet=True)
    ops = pl.OpsConfig(monitor=False, quiet=True, rollback=False)
    ctx = pl.RunContext(ops=ops, log=log, key=jax.random.key(0))
    res = pl.runs.run_grpo(policy, tok, pl.task.TRAIN_PROMPTS, reward=reward, cfg=cfg, ctx=ctx)
    times = [h["iteration_time_s"] for h in res.history if "iteration_time_s" in h]
    overlapped = [h.get("rollout/overlapped", 0.0) for h in res.history]
    return float(sum(times[1:])), res.state.params, float(np.mean(overlapped[1:]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rollouts", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rewards", default="task,remote")
    ap.add_argument("--latency", type=float, default=0.25)
    ap.add_argument("--models", default="stories,config")
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    if a.quick:
        a.rollouts, a.rounds, a.models = 3, 1, "stories"
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; load {os.getloadavg()}")
    print(f"matmul peak {pl.tools.measure_matmul_peak() / 1e9:.0f} GFLOP/s (float32)")
    rows = []
    with tempfile.TemporaryDirectory() as out:
        for name in a.models.split(","):
            policy, tok = model(name)
            for kind in a.rewards.split(","):
                reward = rewards(kind, a.latency, rule(name))
                times = {v: [] for v in VARIANTS}
                for rnd in range(a.rounds):
                    order = list(VARIANTS) if rnd % 2 == 0 else list(VARIANTS)[::-1]
                    params = {}
                    for v in order:
                        t, params[v], used = run(policy, tok, v, reward, a.rollouts, out)
                        times[v].append(t)
                        if v == "overlap" and used < 1.0:
                            raise SystemExit(f"overlap run used a prepared rollout {used:.0%}")
                    same = all(
                        np.array_equal(x, y)
                        for x, y in zip(
                            jax.tree.leaves(params["stale"]), jax.tree.leaves(params["overlap"])
                        )
                    )
                    if not same:
                        raise SystemExit("stale and overlap runs trained different parameters")
                    print(f"  {name}/{kind} round {rnd}: " + ", ".join(
                        f"{v} {times[v][-1]:.2f}s" for v in VARIANTS
                    ))  # fmt: skip
                med = {v: statistics.median(ts) for v, ts in times.items()}
                row = dict(
                    model=name,
                    reward=kind,
                    latency=a.latency if kind == "remote" else 0.0,
                    iterations=a.rollouts - 1,
                    rounds=a.rounds,
                    **{f"{v}_s": med[v] for v in VARIANTS},
                    sync_over_overlap=med["sync"] / med["overlap"],
                    stale_over_overlap=med["stale"] / med["overlap"],
                    rounds_sync_over_overlap=[
                        s / o for s, o in zip(times["sync"], times["overlap"])
                    ],
                )
                rows.append(row)
    print()
    print("| model | reward | sync s | stale s | overlap s | sync / overlap | stale / overlap |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        reward = r["reward"] + (f" ({r['latency']:.2f} s)" if r["reward"] == "remote" else "")
        print(
            f"| {r['model']} | {reward} | {r['sync_s']:.2f} | {r['stale_s']:.2f} | "
            f"{r['overlap_s']:.2f} | {r['sync_over_overlap']:.2f}x | "
            f"{r['stale_over_overlap']:.2f}x |"
        )
    if a.json:
        with open(a.json, "x") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
