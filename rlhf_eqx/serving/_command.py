"""`rlhf_eqx serve`: load a model by name or path and serve it until interrupted."""

import argparse
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence

from .._compilation_cache import command_line_cache
from ._server import Server


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rlhf_eqx serve",
        description=(
            "Serve a model over OpenAI's API (POST /v1/chat/completions, /v1/completions, "
            "GET /v1/models), sampled with continuous batching."
        ),
    )
    p.add_argument(
        "--model",
        default="builtin",
        help="builtin, smollm2-135m, a .gguf, a llama2.c .bin or HF dir",
    )
    p.add_argument("--tokenizer", help="tokenizer file for --model")
    p.add_argument(
        "--quantized",
        action="store_true",
        help="keep a .gguf model's packed blocks (model.quantized: less memory, and Q8_0 / "
        "Q4_0 / Q4_1 decode steps in the native CPU kernel)",
    )
    p.add_argument("--port", type=int, default=8000, help="port (0: a free one; default 8000)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument(
        "--allow-remote", action="store_true", help="allow a --host other than this machine"
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=256,
        help="completion budget of a request without max_tokens",
    )
    p.add_argument("--slots", type=int, default=8, help="decode slots of the continuous sampler")
    p.add_argument(
        "--chat-template",
        default=None,
        help="hh, chatml, a .jinja file or a model directory (default: the model's own "
        "template, else hh)",
    )
    p.add_argument("--served-model-name", help="the model name requests give (default: --model)")
    p.add_argument("--seed", type=int, default=0, help="seed of requests without one")
    p.add_argument(
        "--max-request-rows",
        type=int,
        default=64,
        help="most completions (prompts × n) one request may ask for (default 64)",
    )
    p.add_argument(
        "--max-request-tokens",
        type=int,
        default=65536,
        help="most completion tokens (completions × max_tokens) one request may ask for "
        "(default 65536)",
    )
    p.add_argument(
        "--concurrent-batches",
        type=int,
        default=1,
        help="batches decoding at once: more lets a request start while a long batch runs "
        "(each batch holds its own slots' caches; default 1)",
    )
    p.add_argument(
        "--batch-gather-ms",
        type=float,
        default=5.0,
        help="how long a new batch waits for more requests to join it (a burst of clients "
        "becomes one batch; 0: no wait; default 5)",
    )
    return p


def _chat_template(value: str | None):
    """`--chat-template`: a built-in name, else a template file or model directory
    (`rlhf_eqx.data.load_chat_template`); anything else is a `ValueError` naming the
    option and what it takes."""
    if value is None or value in ("hh", "chatml"):
        return value
    from rlhf_eqx import data

    if not os.path.exists(value):
        raise ValueError(
            f"--chat-template {value!r}: not hh, chatml, nor an existing .jinja file, "
            "tokenizer_config.json or model directory"
        )
    try:
        return data.load_chat_template(value)
    except data.DataError as e:
        raise ValueError(f"--chat-template: {e}") from None


def serve_command(
    argv: Sequence[str] | None = None,
    *,
    ready: Callable[[Server], None] | None = None,
    stop: threading.Event | None = None,
) -> int:
    """What `rlhf_eqx serve [options]` runs: load `--model` (as the other commands do,
    `rlhf_eqx.pipelines.tools.load_model`; `--quantized` keeps a GGUF file's packed
    blocks, as `model.quantized` does), start a `Server` and serve until Ctrl-C or
    SIGTERM (the running batch finishes, waiting requests fail, then it returns 0).
    Compiled programs are kept on disk as for the other commands
    (`rlhf_eqx.enable_compilation_cache`; `RLHF_EQX_COMPILATION_CACHE=0` switches it
    off), so a restarted server answers its first requests without compiling again.

    **Arguments:**

    - `argv`: the options after `serve` (`--help` lists them).
    - `ready`: called with the `Server` once it listens (for running it in a thread).
    - `stop`: serve until it is set (default: until Ctrl-C).

    **Returns:** the exit status: 0 once stopped, 2 for invalid options (one line),
    130 when a second Ctrl-C cuts the stop short (one line; the idle connections are
    closed, the running batch is still answered before the process ends).
    """
    args = _parser().parse_args(list(sys.argv[2:] if argv is None else argv))
    from rlhf_eqx import data
    from rlhf_eqx.pipelines import ConfigError, OpsConfig
    from rlhf_eqx.pipelines.tools import load_model

    ops = OpsConfig()  # compiled programs kept on disk, as for the other commands
    command_line_cache(ops.compilation_cache, ops.compilation_cache_max_mb)
    try:
        chat_template = _chat_template(args.chat_template)  # before the model loads
        policy, tok = load_model(args.model, args.tokenizer, quantized=args.quantized)
        server = Server(
            policy,
            tok,
            slots=args.slots,
            chat_template=chat_template,
            host=args.host,
            port=args.port,
            model_name=args.served_model_name or args.model,
            max_new_tokens=args.max_new_tokens,
            seed=args.seed,
            allow_remote=args.allow_remote,
            max_request_rows=args.max_request_rows,
            max_request_tokens=args.max_request_tokens,
            concurrent_batches=args.concurrent_batches,
            batch_gather_ms=args.batch_gather_ms,
        )
        server.start()
    except (ConfigError, data.DataError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    stopping = stop or threading.Event()
    previous = None
    if stop is None and threading.current_thread() is threading.main_thread():
        # SIGTERM (`kill`, a process manager) stops the server as Ctrl-C does
        previous = signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    print(f"rlhf_eqx serve: {server.model_name!r} at {server.url} (Ctrl-C stops)", flush=True)
    try:
        try:
            if ready is not None:
                ready(server)
            stopping.wait()
        except KeyboardInterrupt:
            pass
        finally:
            server.stop()
    except KeyboardInterrupt:  # a second Ctrl-C: no traceback; the batch still ends
        print("interrupted while stopping: the running batch ends, then exit", file=sys.stderr)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return 0
