"""`<stage>.lora.use_dora`: a pipeline stage trains DoRA adapters, exports them as PEFT
does (`use_dora: true`, `lora_magnitude_vector`) and resumes them from a checkpoint."""

import json

import numpy as np
import pytest
from helpers import quiet_settings
from safetensors.numpy import load_file

from rlhf_eqx.__main__ import main

_MODULE = """
import rlhf_eqx.pipelines as pl


class StopOnce(pl.Callback):
    armed = True

    def on_step(self, run, step, metrics):
        if StopOnce.armed:
            StopOnce.armed = False
            run.request_stop("one step")
"""


def _adapter(out):
    directory = out / "sft" / "adapter"
    config = json.loads((directory / "adapter_config.json").read_text())
    return config, load_file(directory / "adapter_model.safetensors")


@pytest.mark.slow
def test_sft_with_use_dora_trains_exports_and_resumes_dora_adapters(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "dora_callbacks.py").write_text(_MODULE)
    settings = quiet_settings(
        "sft.steps=2", "sft.batch_size=4", "sft.lora.rank=2", "sft.lora.use_dora=true"
    )
    assert main(["sft", "--out", str(tmp_path / "full"), *settings]) == 0
    config, tensors = _adapter(tmp_path / "full")
    assert config["use_dora"] is True and config["r"] == 2
    magnitudes = [n for n in tensors if n.endswith(".lora_magnitude_vector")]
    b = [n for n in tensors if n.endswith(".lora_B.weight")]
    assert magnitudes and len(magnitudes) == len(b)
    assert all(np.any(tensors[n]) for n in b)  # B starts at zero: trained
    # stopped after one step, resumed from its checkpoint: the same adapters
    cut = ["sft", "--out", str(tmp_path / "cut"), *settings]
    cut += ["--callback", "dora_callbacks:StopOnce"]
    assert main(cut) == 0
    _, stopped = _adapter(tmp_path / "cut")  # exported after one step: not the full run's
    assert not all(np.allclose(stopped[n], tensors[n], atol=1e-6) for n in tensors)
    assert main([*cut, "--resume"]) == 0
    again_config, again = _adapter(tmp_path / "cut")
    assert again_config == config and sorted(again) == sorted(tensors)
    for name, value in tensors.items():
        np.testing.assert_allclose(again[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
