"""`GET /v1/models` as OpenAI's clients read it."""

import json
import time
import urllib.request

from rlhf_eqx import load_llama2c, serving
from rlhf_eqx.assets import asset_path


def test_models_list_the_served_model_with_its_creation_time():
    """OpenAI's `created` is a Unix time; `0` (1 January 1970) is what a client that
    sorts or shows models by date would show."""
    policy, tok = load_llama2c(asset_path("stories260K.bin"), asset_path("tok512.bin"))
    before = int(time.time())
    with serving.Server(policy, tok, model_name="stories") as server:
        after = int(time.time())
        for path in ("/models", "/models/stories"):
            with urllib.request.urlopen(server.url + path, timeout=60) as r:
                assert r.status == 200
                body = json.loads(r.read())
            entry = body["data"][0] if path == "/models" else body
            if path == "/models":
                assert body["object"] == "list" and len(body["data"]) == 1
            assert entry["id"] == "stories" and entry["object"] == "model"
            assert isinstance(entry["owned_by"], str)
            assert before <= entry["created"] <= after
