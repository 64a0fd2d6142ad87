"""The API reference covers the package: every layer has a page in the mkdocs nav, and
every top-level name is documented or linked on the top-level or sampling page.

Read from the sources (no import, no mkdocs); CI builds the pages themselves with
`mkdocs build --strict`, which also checks every cross-reference written here.
"""

import ast
import os
import re

import yaml

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
PACKAGE = os.path.join(ROOT, "rlhf_eqx")
API = os.path.join(ROOT, "docs", "api")


def _nav_files(entries):
    for entry in entries:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        if isinstance(value, list):
            yield from _nav_files(value)
        else:
            yield value


def _config():
    with open(os.path.join(ROOT, "mkdocs.yml"), encoding="utf-8") as f:
        return yaml.safe_load(f)


def _top_level_exports():
    """Names `rlhf_eqx/__init__.py` re-exports as `from .x import name as name`."""
    with open(os.path.join(PACKAGE, "__init__.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names |= {a.name for a in node.names if a.asname == a.name}
    return names


def test_every_api_page_is_in_the_nav_and_exists():
    nav = set(_nav_files(_config()["nav"]))
    pages = {f"api/{name}" for name in os.listdir(API) if name.endswith(".md")}
    assert pages <= nav, f"API pages missing from the mkdocs nav: {sorted(pages - nav)}"
    for path in nav:
        assert os.path.isfile(os.path.join(ROOT, "docs", path)), f"nav names a missing {path}"


def test_every_public_layer_has_a_page():
    layers = {
        name
        for name in os.listdir(PACKAGE)
        if not name.startswith("_")
        and name != "assets"
        and (os.path.isfile(os.path.join(PACKAGE, name, "__init__.py")) or name.endswith(".py"))
    }
    layers = {name.removesuffix(".py") for name in layers}
    for layer in sorted(layers):
        page = os.path.join(API, f"{layer}.md")
        assert os.path.isfile(page), f"no API page docs/api/{layer}.md for rlhf_eqx.{layer}"
        with open(page, encoding="utf-8") as f:
            assert f"::: rlhf_eqx.{layer}\n" in f.read(), f"docs/api/{layer}.md renders nothing"


def test_every_top_level_name_is_documented_or_linked():
    text = ""
    for page in ("rlhf_eqx.md", "sampling.md"):
        with open(os.path.join(API, page), encoding="utf-8") as f:
            text += f.read()
    documented = set(re.findall(r"^\s*- (\w+)$", text, re.M))  # `members:` of `::: rlhf_eqx`
    documented |= set(re.findall(r"^::: rlhf_eqx\.(\w+)$", text, re.M))
    linked = set(re.findall(r"`rx\.(\w+)`", text))
    exports = _top_level_exports()
    assert {"Policy", "generate", "load_hf", "PreferenceBatch"} <= exports
    missing = sorted(exports - documented - linked)
    assert not missing, f"top-level names on no API page: {missing}"
