"""Every ```python block of README.md (and docs/*.md) runs as written, as a user would.

Each block runs verbatim in a fresh interpreter with the repository root as working
directory, without the test suite's configuration (no conftest, Hypothesis' default
profile: `CI` is removed from the environment so the "ci" profile is not loaded). Test
functions a block defines (`def test_...`) are then called, as pytest would.
"""

import glob
import os
import re
import subprocess
import sys

import pytest
from conftest import FAST_COMPILE_FLAGS, SHARED

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
_DEVICE_FLAG = "--xla_force_host_platform_device_count"
_BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
_PACKAGE_FILE = re.compile(r"# [\w.]+/[\w./]+\.py\n")

# Runs a block, then calls the test functions it defines (hypothesis tests included).
_RUNNER = """
import sys
path = sys.argv[1]
with open(path) as f:
    source = f.read()
namespace = {"__name__": "__main__", "__file__": path}
exec(compile(source, path, "exec"), namespace)
for name, obj in list(namespace.items()):
    if name.startswith("test_") and callable(obj):
        obj()
        print("passed", name)
"""


def _blocks():
    files = [os.path.join(ROOT, "README.md")] + sorted(
        glob.glob(os.path.join(ROOT, "docs", "*.md"))
    )
    out = []
    for path in files:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        for match in _BLOCK.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            out.append(pytest.param(match.group(1), id=f"{os.path.relpath(path, ROOT)}:{line}"))
    return out


def test_blocks_are_found():
    assert len(_blocks()) >= 3


@pytest.mark.parametrize("source", _blocks())
def test_block_runs(source, tmp_path):
    if "../shared/" in source and not os.path.isdir(SHARED):
        pytest.skip("the block reads ../shared, which is not present")
    if _PACKAGE_FILE.match(source):
        # one file of a package (relative imports): tests/test_adding_an_algorithm.py
        # writes the blocks of docs/pipelines.md's worked example to a package and runs it
        pytest.skip("a file of a package, run with its package elsewhere")
    block = tmp_path / "block.py"
    block.write_text(source)
    env = {
        k: v for k, v in os.environ.items() if k not in ("CI", "HYPOTHESIS_PROFILE", "XLA_FLAGS")
    }
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    # The suite's compile-time flags (see conftest; numerics unaffected), and the devices
    # a block asks for with `os.environ.setdefault("XLA_FLAGS", ...)`.
    flags = FAST_COMPILE_FLAGS
    if _DEVICE_FLAG in source:
        flags += " " + re.search(_DEVICE_FLAG + r"=\d+", source).group(0)
    env["XLA_FLAGS"] = flags
    out = subprocess.run(
        [sys.executable, "-c", _RUNNER, str(block)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, f"block failed:\n{source}\n--- stderr ---\n{out.stderr[-4000:]}"
