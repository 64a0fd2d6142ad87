"""rlhf_eqx side of the side-by-side benchmark: one workload per process.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/side_by_side/run_rlhf_eqx.py dpo --inputs DIR

Prints one `RESULT {...}` JSON line (see `common.emit`). The persistent compilation
cache is on (`RLHF_EQX_BENCH_CACHE`, default `/tmp/rlhf_eqx_jax_cache`), as a user would
run. Preference workloads (`dpo`, `dpo_cached`, `curve_*`, `rm`, `hh_dpo`) run on
shared-prompt batches (`data.pack_preferences`: each prompt once, both completions
after it), in the layout that suits the data: `aligned` for the fixed-length workloads
(fixed prompt / chosen / rejected regions, each completion scored against the prompt
and itself only) and `packed` for the HH-RLHF length mix (one pair per row,
`[prompt | chosen | rejected]` back to back: least padding when lengths vary). The
GRPO update runs each group's prompt once (`GRPOBatch(prompt_length=,
samples_per_prompt=)`). `RLHF_EQX_BENCH_LAYOUT=aligned|packed|plain` forces one
(`plain`: the unpacked `PreferenceBatch` / one GRPO row per completion, prompts computed
once per row), for A/B runs.

The SmolLM2-135M-Instruct workloads (`common.WORKLOADS_135`, inputs from
`make_inputs.py --smollm2`) load the shipped Q4_1 GGUF file dequantised to float32
(`rlhf_eqx.load_gguf`); see `run_135`. `dpo135 --profile` also times the pieces of the
step (reference forward, policy forward, forward + backward, optimiser update) after
the timed steps and writes them into the result's `profile`.
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import rlhf_eqx as rx  # noqa: E402
from rlhf_eqx import data, train  # noqa: E402

LIB = "rlhf_eqx"


def enable_cache():
    path = os.environ.get("RLHF_EQX_BENCH_CACHE", "/tmp/rlhf_eqx_jax_cache")
    if path:
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def preference_batch(prompt, chosen, rejected):
    """Full rows `prompt + completion` (no padding) as a `PreferenceBatch`."""
    P = prompt.shape[1]
    c = np.concatenate([prompt, chosen], axis=1)
    r = np.concatenate([prompt, rejected], axis=1)
    T = c.shape[1]
    mask = np.ones(c.shape, bool)
    cm = np.broadcast_to(np.arange(T)[None, :] >= P, c.shape)
    return rx.PreferenceBatch(
        chosen_tokens=jnp.asarray(c),
        chosen_mask=jnp.asarray(mask),
        chosen_completion_mask=jnp.asarray(cm),
        rejected_tokens=jnp.asarray(r),
        rejected_mask=jnp.asarray(mask),
        rejected_completion_mask=jnp.asarray(cm),
    )


LAYOUT = os.environ.get("RLHF_EQX_BENCH_LAYOUT", "auto")
if LAYOUT not in ("auto", "aligned", "packed", "plain"):
    raise SystemExit(f"RLHF_EQX_BENCH_LAYOUT must be aligned, packed or plain, got {LAYOUT!r}")
if LAYOUT == "auto":
    LAYOUT = "packed" if len(sys.argv) > 1 and sys.argv[1] == "hh_dpo" else "aligned"
PACKED = LAYOUT != "plain"


def pairs_of(prompt, chosen, rejected, rejected_prompt=None):
    """`TokenizedPair`s from the rows of token arrays (or lists of tuples)."""
    rejected_prompt = prompt if rejected_prompt is None else rejected_prompt
    t = lambda row: tuple(int(x) for x in row)
    return [
        data.TokenizedPair(
            data.TokenizedSequence(t(prompt[i]), t(chosen[i])),
            data.TokenizedSequence(t(rejected_prompt[i]), t(rejected[i])),
        )
        for i in range(len(prompt))
    ]


def pair_batch(prompt, chosen, rejected):
    """The workload's batch: packed with the prompt shared, or the unpacked rows."""
    if PACKED:
        return data.pack_preferences(
            pairs_of(prompt, chosen, rejected), pad_id=0, aligned=LAYOUT == "aligned"
        )
    return preference_batch(prompt, chosen, rejected)


def optimizer():
    return train.make_optimizer(learning_rate=1e-5, total_steps=1000, max_grad_norm=1.0)


def dpo_runner(policy, batch, *, cached: bool, reference=None, lora: bool = False):
    """A DPO step of `policy` on `batch`; with `cached` the reference log-probabilities
    (of `reference`, default the policy itself: a full fine-tune's starting point) are
    computed beforehand. With `lora` only the adapters train."""
    opt = optimizer()
    step = train.make_dpo_step(opt, reference="cached" if cached else "model")
    if cached:
        batch = train.compute_reference_logps(policy if reference is None else reference, batch)
    # `TrainState.apply`, as a user runs a step: the state's parameters and optimiser
    # state are donated to the update (updated in place, as torch's optimisers do)
    trainable = rx.lora_filter(policy) if lora else None
    state = {"s": train.init_train_state(policy, opt, filter_spec=trainable)}
    kwargs = {} if cached else {"reference": policy}

    def run():
        state["s"], m = state["s"].apply(step, batch, **kwargs)
        jax.block_until_ready(m["loss"])

    return run


def grpo_runner(
    policy,
    prompts,
    rewards,
    *,
    group: int,
    new: int,
    shared: bool = True,
    budgets=None,
    slots: int | None = None,
):
    """One GRPO iteration per call: `group` completions of `new` tokens sampled for each
    prompt (each prompt prefilled once), then one update (each group's prompt run once
    when `shared`). With `budgets` (`[prompts · group]` ints, at most `new`) the
    completions are sampled by continuous batching (`generate_continuous`, `slots` rows
    in flight), row `i` stopping after `budgets[i]` tokens; the update then runs on rows
    of width `new` with each completion masked to its length. Returns `(run, split)`,
    `split` the generation and update seconds of every call."""
    pmask = jnp.ones(prompts.shape, bool)
    opt = optimizer()
    step = train.make_grpo_step(opt, group_size=group)
    state = {"s": train.init_train_state(policy, opt), "k": jax.random.key(0)}
    split = {"gen": [], "update": []}

    def run():
        state["k"], sub = jax.random.split(state["k"])
        t0 = time.perf_counter()
        if budgets is None:
            out = rx.generate_batch(
                state["s"].params,
                prompts,
                pmask,
                sub,
                max_new_tokens=new,
                temperature=1.0,
                num_samples=group,
            )
        else:
            out = rx.generate_continuous(
                state["s"].params,
                prompts,
                pmask,
                jax.random.split(sub, prompts.shape[0]),
                slots=slots,
                max_new_tokens=new,
                budgets=budgets,
                temperature=1.0,
                num_samples=group,
            )
        jax.block_until_ready(out.tokens)
        t1 = time.perf_counter()
        layout = dict(prompt_length=prompts.shape[1], samples_per_prompt=group) if shared else {}
        batch = train.GRPOBatch(
            tokens=out.tokens,
            mask=out.mask,
            completion_mask=out.completion_mask,
            rewards=rewards,
            old_logp=None,
            **layout,
        )
        state["s"], m = state["s"].apply(step, batch)
        jax.block_until_ready(m["loss"])
        split["gen"].append(t1 - t0)
        split["update"].append(time.perf_counter() - t1)

    return run, split


# HH-RLHF batching. "budget" (default, packed layout): token-budget steps
# (`data.pack_preference_steps`), rows of HH_ROW tokens holding up to 4 pairs each, about
# as many pairs a step as TRL's batches (as many steps), one compiled shape. "sorted": batches
# of 8 pairs, windows of HH_GROUP batches sorted by length, rows padded to multiples of
# HH_BUCKET (the previous scheme; see RESULTS.md).
HH_BATCHING = os.environ.get("RLHF_EQX_BENCH_HH_BATCHING", "budget")
HH_ROW = int(os.environ.get("RLHF_EQX_BENCH_HH_ROW", "768"))
HH_GROUP = int(os.environ.get("RLHF_EQX_BENCH_HH_GROUP", "12"))
HH_BUCKET = int(os.environ.get("RLHF_EQX_BENCH_HH_BUCKET", "192"))


def hh_batches(inputs, pairs: int, *, group: int, bucket: int):
    """The HH-RLHF pairs in batches (see `HH_BATCHING`): token-budget steps, or batches of
    `pairs` in windows of `group` batches sorted by length (rlhf_eqx.data's
    `group_by_length`), each padded to its longest row rounded up to `bucket`
    (`bucket_size`); packed with the prompt shared unless the layout is `plain`.
    Returns `[(batch, real tokens of its chosen + rejected rows)]`."""

    def rows(name):
        return [tuple(r) for r in common.ragged_rows(inputs, name)]

    items = pairs_of(
        rows("hh_prompt"), rows("hh_chosen"), rows("hh_rejected"), rows("hh_rejected_prompt")
    )
    n = len(items) // pairs * pairs
    items = items[:n]
    if PACKED and LAYOUT == "packed" and HH_BATCHING == "budget":
        row = max(HH_ROW, max(data.packed_length(it) for it in items))
        batches = data.pack_preference_steps(items, pad_id=0, row_length=row, pairs_per_step=pairs)
        # real tokens of the unpacked chosen + rejected rows: the shared prompt counts twice
        unpacked = lambda b: int(jnp.sum(b.mask) + jnp.sum(b.mask & (b.branch_ids == 0)))
        return [(b, unpacked(b)) for b in batches]
    if HH_BATCHING not in ("budget", "sorted"):
        raise SystemExit(
            f"RLHF_EQX_BENCH_HH_BATCHING must be budget or sorted, got {HH_BATCHING!r}"
        )
    size = data.packed_length if PACKED else (lambda it: max(len(it.chosen), len(it.rejected)))
    out = []
    win = pairs * group
    for s in range(0, n, win):
        w = sorted(items[s : s + win], key=lambda it: -size(it))
        for b in range(0, len(w), pairs):
            chunk = w[b : b + pairs]
            real = sum(len(it.chosen) + len(it.rejected) for it in chunk)
            if PACKED:
                batch = data.pack_preferences(
                    chunk, pad_id=0, bucket_size=bucket, aligned=LAYOUT == "aligned"
                )
            else:
                batch = data.collate_preferences(
                    chunk, pad_id=0, max_length=common.HH_MAX_LEN, bucket_size=bucket
                )
            out.append((batch, real))
    return out


def computed_tokens(batch) -> int:
    """Token positions the model runs on (padding included)."""
    if isinstance(batch, rx.PackedPreferenceBatch):
        return int(batch.tokens.size)
    return int(2 * batch.chosen_tokens.size)


def weight_bytes(model) -> int:
    """Bytes of the model's arrays (packed quantised blocks at their packed size): what a
    decode step reads once."""
    return int(sum(x.nbytes for x in jax.tree.leaves(eqx.filter(model, eqx.is_array))))


def check_logits(policy, inputs) -> float:
    """Largest |difference| between `policy`'s logits of the check text and the float32
    reference logits `make_inputs.py` stored."""
    ids = jnp.asarray(inputs["s135_check_ids"])
    logits = policy(ids, jnp.ones(ids.shape, bool))
    return float(np.max(np.abs(np.asarray(logits, np.float32) - inputs["s135_check_logits"])))


def profile_dpo(policy, batch, repeats: int = 3) -> dict:
    """Seconds (medians of `repeats` after a compile) of the pieces of a DPO step on
    `batch`, each jitted alone: the reference forward (`compute_reference_logps`), the
    policy's loss forward against cached reference log-probabilities, its forward +
    backward (`eqx.filter_value_and_grad` of the step's own loss, `train.dpo_loss_fn`) and
    the optimiser update (`optimizer().update` + `eqx.apply_updates`)."""
    opt = optimizer()
    params, frozen = eqx.partition(policy, eqx.is_inexact_array)
    ref_fn = eqx.filter_jit(train.compute_reference_logps)
    cached = ref_fn(policy, batch)
    loss_fn = train.dpo_loss_fn(reference="cached")

    def loss(p):
        nums, dens, _ = loss_fn(p, (frozen, None), cached, None)
        return nums["dpo"] / dens["dpo"]

    fwd = eqx.filter_jit(loss)
    fwd_bwd = eqx.filter_jit(eqx.filter_value_and_grad(loss))
    opt_state = opt.init(params)

    @eqx.filter_jit
    def update(grads, opt_state, params):
        updates, opt_state = opt.update(grads, opt_state, params)
        return eqx.apply_updates(params, updates), opt_state

    grads = fwd_bwd(params)[1]
    pieces = {
        "reference_forward": lambda: ref_fn(policy, batch),
        "policy_forward": lambda: fwd(params),
        "policy_forward_backward": lambda: fwd_bwd(params),
        "optimizer_update": lambda: update(grads, opt_state, params),
    }
    out = {}
    for name, f in pieces.items():
        jax.block_until_ready(f())
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(f())
            times.append(time.perf_counter() - t0)
        out[name] = common.median(times)
    out["policy_backward"] = out["policy_forward_backward"] - out["policy_forward"]
    return out


def lora_config():
    c = common.LORA135
    return rx.LoRAConfig(rank=c["rank"], alpha=c["alpha"], dropout=0.0, targets=c["targets"])


def run_135(args, inputs):
    """One SmolLM2-135M-Instruct workload; returns `(first, times, extra)`.

    - `dpo135`: `make_dpo_step(reference="model")`, full fine-tune, unpacked rows
      (`PreferenceBatch`: each prompt computed for both completions, as TRL does).
    - `dpo135_saving`: the library's own savings: the packed layout of `hh_dpo` (one
      pair per row, `[prompt | chosen | rejected]`, the prompt once) and the reference
      log-probabilities cached beforehand
      (`reference="cached"`, `compute_reference_logps` outside the timed step).
    - `dpo135_dots`, `dpo135_remat`: as `dpo135` with the layers rematerialised in the
      backward pass (`rx.with_remat(policy, "dots")`: the products' outputs kept, the
      rest recomputed; `"full"`: only each layer's input kept).
    - `dpo135_saving_dots`: as `dpo135_saving` with the layers rematerialised (`"dots"`).
    - `dpo135_lora`: as `dpo135` with LoRA adapters (`common.LORA135`, no dropout) on
      every projection; the reference is the model without its adapters.
    - `dpo135_lora_saving`: as `dpo135_lora` with the savings of `dpo135_saving` (packed
      rows, the reference log-probabilities of the model without its adapters cached
      beforehand).
    - `gen135`, `gen135_q8`, `gen135_q4`: greedy `generate_batch` on float32 weights, on
      the Q8_0 file (`quantized=True`) and on the shipped Q4_1 file (`quantized=True`).
    - `grpo135`: `grpo_runner` (sampling at T = 1, then one update, shared-prompt layout).
    """
    w = args.workload
    smol = common.smollm2_dir(args.inputs)
    extra = {}
    if w == "gen135_q8":
        policy, _ = rx.load_gguf(os.path.join(smol, "q8_0.gguf"), quantized=True)
    elif w == "gen135_q4":
        policy, _ = rx.load_gguf(common.smollm2_gguf(), quantized=True)
    else:
        policy, _ = rx.load_gguf(common.smollm2_gguf())
    remat = {"dpo135_dots": "dots", "dpo135_remat": "full", "dpo135_saving_dots": "dots"}.get(w)
    if remat is not None:
        policy = rx.with_remat(policy, remat)
        extra["remat"] = remat
    extra["load_peak_rss_mb"] = common.peak_rss_mb()  # loading alone, before any step
    extra["logits_max_abs_diff"] = check_logits(policy, inputs)
    if w.startswith("dpo135"):
        P, C, R = (inputs[f"s135_dpo_{k}"] for k in ("prompt", "chosen", "rejected"))
        T = P.shape[1] + C.shape[1]
        if w in ("dpo135_saving", "dpo135_saving_dots"):
            batch = data.pack_preferences(pairs_of(P, C, R), pad_id=0, aligned=False)
            run = dpo_runner(policy, batch, cached=True)
            extra["layout"] = "packed"
        elif w == "dpo135_lora_saving":
            batch = data.pack_preferences(pairs_of(P, C, R), pad_id=0, aligned=False)
            model = rx.apply_lora(policy, lora_config(), key=jax.random.key(0))
            run = dpo_runner(model, batch, cached=True, reference=rx.without_lora(model), lora=True)
            extra["layout"] = "packed"
            extra["trainable_params"] = rx.count_params(eqx.filter(model, rx.lora_filter(model)))
        else:
            batch = preference_batch(P, C, R)
            extra["layout"] = "plain"
            if w in ("dpo135", "dpo135_dots", "dpo135_remat"):
                run = dpo_runner(policy, batch, cached=False)
            else:
                opt = optimizer()
                model = rx.apply_lora(policy, lora_config(), key=jax.random.key(0))
                reference = rx.without_lora(model)
                st = {"s": train.init_train_state(model, opt, filter_spec=rx.lora_filter(model))}
                step = train.make_dpo_step(opt, reference="model")
                extra["trainable_params"] = rx.count_params(st["s"].params)

                def run():
                    st["s"], m = st["s"].apply(step, batch, reference=reference)
                    jax.block_until_ready(m["loss"])

        first, times = common.time_steps(run, args.steps)
        extra["tokens"] = int(2 * P.shape[0] * T)
        extra["computed_tokens"] = computed_tokens(batch)
        extra["flops"] = common.dpo_flops(
            P.shape[0],
            T,
            with_reference="saving" not in w,
            cfg=common.SMOL_CONFIG,
            lora=w.startswith("dpo135_lora"),
        )
        if args.profile and w == "dpo135":
            extra["rss_mb"] = common.peak_rss_mb()  # before the profile's own buffers
            prof = profile_dpo(policy, batch)
            prof["step"] = common.median(times)
            prof["rest_of_step"] = prof["step"] - (
                prof["reference_forward"]
                + prof["policy_forward_backward"]
                + prof["optimizer_update"]
            )
            extra["profile"] = prof
            common.log(
                "profile (s): "
                + ", ".join(f"{k} {v:.3f} ({v / prof['step']:.0%})" for k, v in prof.items())
            )
    elif w.startswith("gen135"):
        prompts = jnp.asarray(inputs["s135_gen_prompt"])
        masks = jnp.ones(prompts.shape, bool)
        new = int(inputs["s135_gen_new"])

        def run(key):
            out = rx.generate_batch(
                policy, prompts, masks, key, max_new_tokens=new, temperature=0.0
            )
            jax.block_until_ready(out.tokens)

        first, times = common.time_keyed_steps(run, args.steps)
        extra["new_tokens"] = int(prompts.shape[0] * new)
        extra["weight_bytes"] = weight_bytes(policy)
        extra["decode_steps"] = new
        extra["weights"] = {"gen135": "float32", "gen135_q8": "Q8_0", "gen135_q4": "Q4_1"}[w]
    elif w == "grpo135":
        prompts = jnp.asarray(inputs["s135_grpo_prompt"])
        rewards = jnp.asarray(inputs["s135_grpo_rewards"])
        run, split = grpo_runner(
            policy,
            prompts,
            rewards,
            group=int(inputs["s135_grpo_group"]),
            new=int(inputs["s135_grpo_new"]),
            shared=True,
        )
        first, times = common.time_steps(run, args.steps)
        extra["gen_s"] = common.median(split["gen"][1:] or split["gen"])
        extra["update_s"] = common.median(split["update"][1:] or split["update"])
        extra["layout"] = "shared-prompt"
        extra["fine_tune"] = "full"
    return first, times, extra


def main():
    args, inputs = common.start(LIB)
    enable_cache()
    w = args.workload
    extra = {}
    if w in common.WORKLOADS_135:
        first, times, extra = run_135(args, inputs)
        rss = extra.pop("rss_mb", None)
        peak = common.jax_matmul_peak()
        common.emit(LIB, w, first, times, peak_gflops=peak, rss_mb=rss, **extra)
        return
    if w == "hh_dpo":
        policy = rx.load_hf(os.path.join(args.inputs, "model_hh"))
    else:
        policy = rx.load_hf(os.path.join(args.inputs, "model"))

    if w in ("dpo", "dpo_cached"):
        P, C = inputs["dpo_prompt"], inputs["dpo_chosen"]
        batch = pair_batch(P, C, inputs["dpo_rejected"])
        run = dpo_runner(policy, batch, cached=w == "dpo_cached")
        first, times = common.time_steps(run, args.steps)
        T = P.shape[1] + C.shape[1]
        extra["tokens"] = int(2 * P.shape[0] * T)
        extra["computed_tokens"] = computed_tokens(batch)
        extra["flops"] = common.dpo_flops(P.shape[0], T, with_reference=w == "dpo")
    elif w.startswith("curve_"):
        t = int(w.split("_")[1])
        P = inputs[f"{w}_prompt"]
        batch = pair_batch(P, inputs[f"{w}_chosen"], inputs[f"{w}_rejected"])
        run = dpo_runner(policy, batch, cached=False)
        first, times = common.time_steps(run, max(2, args.steps - 2))
        extra["tokens"] = int(2 * P.shape[0] * t)
        extra["computed_tokens"] = computed_tokens(batch)
        extra["flops"] = common.dpo_flops(P.shape[0], t, with_reference=True)
    elif w in ("gen_sample", "gen_greedy"):
        g = common.GEN
        prompts = jnp.asarray(inputs["gen_prompt"])
        masks = jnp.ones(prompts.shape, bool)
        temp = 1.0 if w == "gen_sample" else 0.0

        def run(key):
            out = rx.generate_batch(
                policy, prompts, masks, key, max_new_tokens=g["new"], temperature=temp
            )
            jax.block_until_ready(out.tokens)

        first, times = common.time_keyed_steps(run, args.steps)
        extra["new_tokens"] = g["batch"] * g["new"]
    elif w == "rm":
        model = rx.RewardModel.from_policy(policy, key=jax.random.key(1))
        batch = pair_batch(inputs["rm_prompt"], inputs["rm_chosen"], inputs["rm_rejected"])
        extra["computed_tokens"] = computed_tokens(batch)
        opt = optimizer()
        step = train.make_reward_step(opt)
        state = {"s": train.init_train_state(model, opt)}

        def run():
            state["s"], m = state["s"].apply(step, batch)
            jax.block_until_ready(m["loss"])

        first, times = common.time_steps(run, args.steps)
    elif w == "grpo":
        g = common.GRPO
        prompts = jnp.asarray(inputs["grpo_prompt"])  # each prompt prefilled once for its group
        rewards = jnp.asarray(inputs["grpo_rewards"])
        run, split = grpo_runner(
            policy, prompts, rewards, group=g["group"], new=g["new"], shared=PACKED
        )
        first, times = common.time_steps(run, args.steps)
        extra["gen_s"] = common.median(split["gen"][1:])
        extra["update_s"] = common.median(split["update"][1:])
    elif w == "grpo_mix":
        g = common.GRPO_MIX
        prompts = jnp.asarray(inputs["grpo_mix_prompt"])
        rewards = jnp.asarray(inputs["grpo_mix_rewards"])
        budgets = np.asarray(inputs["grpo_mix_budgets"])
        slots = int(os.environ.get("RLHF_EQX_BENCH_SLOTS", g["slots"]))
        run, split = grpo_runner(
            policy,
            prompts,
            rewards,
            group=g["group"],
            new=int(budgets.max()),
            shared=PACKED,
            budgets=jnp.asarray(budgets),
            slots=slots,
        )
        first, times = common.time_steps(run, args.steps)
        extra["gen_s"] = common.median(split["gen"][1:])
        extra["update_s"] = common.median(split["update"][1:])
        extra["completion_tokens"] = int(budgets.sum())
        extra["generated_width"] = int(budgets.max())
        extra["slots"] = slots
    elif w == "hh_dpo":
        batches = hh_batches(inputs, common.HH["pairs"], group=HH_GROUP, bucket=HH_BUCKET)
        opt = optimizer()
        step = train.make_dpo_step(opt, reference="model")
        state = {"s": train.init_train_state(policy, opt), "i": 0}
        shapes = set()
        seen = []  # (real tokens, seconds) of steps whose shape was compiled before

        def run():
            b, n_real = batches[state["i"] % len(batches)]
            state["i"] += 1
            shape = jax.tree.map(lambda x: x.shape, b)
            new_shape = str(shape) not in shapes
            shapes.add(str(shape))
            t0 = time.perf_counter()
            state["s"], m = state["s"].apply(step, b, reference=policy)
            jax.block_until_ready(m["loss"])
            if not new_shape:
                seen.append((n_real, time.perf_counter() - t0))

        # first step, then one pass over every batch (compiles of new shapes included)
        t_start = time.perf_counter()
        first, times = common.time_steps(run, len(batches) - 1)
        total = time.perf_counter() - t_start
        real = sum(n for _, n in batches)
        computed = sum(computed_tokens(b) for b, _ in batches)
        in_rows = sum(
            int(
                jnp.sum(b.mask if PACKED else b.chosen_mask)
                + (0 if PACKED else jnp.sum(b.rejected_mask))
            )
            for b, _ in batches
        )
        extra.update(
            real_tokens_per_s=real / total,
            padding_fraction=1.0 - in_rows / computed,
            computed_tokens=computed,
            real_tokens=real,
            compiled_shapes=len(shapes),
            steady_real_tokens_per_s=sum(n for n, _ in seen) / max(1e-9, sum(t for _, t in seen)),
            total_s=total,
            steps=len(batches),
            batching=HH_BATCHING if LAYOUT == "packed" else "sorted",
        )
    else:
        raise SystemExit(f"unknown workload {w}")
    if w in ("grpo", "grpo_mix"):
        extra["layout"] = "shared-prompt" if PACKED else "plain"
    elif not w.startswith("gen_"):
        extra["layout"] = LAYOUT
    common.emit(LIB, w, first, times, peak_gflops=common.jax_matmul_peak(), **extra)


if __name__ == "__main__":
    main()
