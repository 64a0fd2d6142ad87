"""Options of `rlhf_eqx sample` and `rlhf_eqx serve` that are refused before a model
loads (one line naming the option, exit status 2), and a server stop cut short by a
second Ctrl-C."""

import concurrent.futures
import http.client
import json
import socket
import threading
import time

import pytest

import rlhf_eqx as rx
from rlhf_eqx import serving
from rlhf_eqx.__main__ import main
from rlhf_eqx.assets import asset_path
from rlhf_eqx.serving import serve_command


def test_sample_refuses_a_sample_count_below_one(capsys):
    """`rlhf_eqx sample -n 0`: one line naming `-n`, exit 2 (an invalid option, not a
    run error)."""
    assert main(["sample", "-n", "0"]) == 2
    err = capsys.readouterr().err
    assert err == "error: invalid configuration: -n/--num-samples=0: must be >= 1\n"


def test_serve_names_an_unknown_chat_template(capsys, tmp_path):
    """`--chat-template` that is neither a built-in name nor a file or directory is
    refused naming the option and what it takes; a file with no template names it."""
    assert serve_command(["--chat-template", "bogus", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "error: --chat-template 'bogus': not hh, chatml, nor an existing .jinja file, "
        "tokenizer_config.json or model directory\n"
    )
    path = tmp_path / "tokenizer_config.json"
    path.write_text("{}")
    assert serve_command(["--chat-template", str(path), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --chat-template: ") and str(path) in err, err


def test_a_stop_cut_short_still_closes_idle_connections_and_fails_waiting_requests():
    """A second Ctrl-C while `Server.stop` waits for the running batch: the idle
    keep-alive connections are closed anyway (their threads would keep the process
    alive) and a request still waiting for a batch gets 503, before the interrupt
    propagates; the running request is answered."""
    policy, tok = rx.load_llama2c(asset_path("stories260K.bin"), asset_path("tok512.bin"))
    server = serving.Server(policy, tok, slots=2, model_name="m", max_new_tokens=8).start()
    port = server.port
    idle = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    idle.request("GET", "/v1/models")
    assert idle.getresponse().read()  # the connection stays open (keep-alive)

    def post(max_tokens: int) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        body = {"model": "m", "prompt": "Once", "max_tokens": max_tokens, "temperature": 1.9}
        try:
            conn.request("POST", "/v1/completions", body=json.dumps(body))
            response = conn.getresponse()
            response.read()
            return response.status
        finally:
            conn.close()

    assert post(4) == 200  # compiled
    release, entered = threading.Event(), threading.Event()
    real_advance = server.scheduler._advance

    def slow_advance(run):  # holds the running batch until the stop is interrupted
        entered.set()
        release.wait(60)
        return real_advance(run)

    server.scheduler._advance = slow_advance
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        running = pool.submit(post, 8)
        assert entered.wait(60)
        waiting = pool.submit(post, 8)
        time.sleep(0.5)  # queued behind the running batch
        thread = server.scheduler._thread

        def interrupted_join(timeout=None):
            raise KeyboardInterrupt

        thread.join = interrupted_join
        try:
            with pytest.raises(KeyboardInterrupt):
                server.stop()
            assert waiting.result(timeout=30) == 503
            idle.sock.settimeout(10)
            assert idle.sock.recv(1) == b""  # closed by the server
        finally:
            idle.close()
            release.set()
        assert running.result(timeout=60) == 200
        threading.Thread.join(thread, 60)


def test_serve_command_stops_the_server_when_ready_fails():
    """An error raised by `ready` propagates, and the server is stopped first (its
    port no longer accepts connections)."""
    ports = []

    def ready(server):
        ports.append(server.port)
        raise RuntimeError("ready failed")

    with pytest.raises(RuntimeError, match="ready failed"):
        serve_command(["--port", "0"], ready=ready)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", ports[0]), timeout=10).close()
