"""The API reference covers the package: every layer has a page in the mkdocs nav, and
every top-level name is documented or linked on the top-level or sampling page.

Read from the sources (no import, no mkdocs); CI builds the pages themselves with
`mkdocs build --strict`, which also checks every cross-reference written here. The
formulas (`$...$`, `$$...$$`) of every docstring and page go through mkdocs.yml's
Markdown extensions and must reach MathJax whole (`pymdownx.arithmatex`).
"""

import ast
import inspect
import os
import re
import subprocess
import sys
from html import unescape

import pytest
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


# --- formulas ------------------------------------------------------------------------------

# Code (fenced blocks, code spans) holds no maths: `$XDG_CACHE_HOME` stays a literal.
_CODE = re.compile(r"```.*?```|``.+?``|`[^`]*`", re.S)
# `$$ display $$` and `$inline$` (no space inside the dollars, no escaped dollar).
_SOURCE_MATH = re.compile(r"\$\$(.+?)\$\$|(?<![\\$])\$(?![\s$])(.+?)(?<![\s\\])\$", re.S)
# What `pymdownx.arithmatex` (generic) hands MathJax: \( inline \) and \[ display \].
_HTML_MATH = re.compile(
    r'<span class="arithmatex">\\\((.*?)\\\)</span>|<div class="arithmatex">\\\[(.*?)\\\]</div>',
    re.S,
)
_HTML_CODE = re.compile(r"<pre\b.*?</pre>|<code\b.*?</code>", re.S)


def _markdown():
    """A Markdown converter with mkdocs.yml's extensions and their settings: what mkdocs
    renders the pages with and mkdocstrings the docstrings."""
    import markdown

    names, settings = [], {}
    for entry in _config()["markdown_extensions"]:
        name = next(iter(entry)) if isinstance(entry, dict) else entry
        names.append(name)
        if isinstance(entry, dict):
            settings[name] = entry[name] or {}
    return markdown.Markdown(extensions=names, extension_configs=settings)


def _docstrings():
    """`(where, docstring)` of every module, class, function and attribute docstring of
    the package (cleaned as mkdocstrings cleans them), read from the sources."""
    for folder, _, files in os.walk(PACKAGE):
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read())
            where = os.path.relpath(path, ROOT)
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)):
                    doc = ast.get_docstring(node)
                    if doc:
                        yield f"{where}:{getattr(node, 'name', '')}", doc
                if not isinstance(node, (ast.Module, ast.ClassDef)):
                    continue
                for before, stmt in zip(node.body, node.body[1:]):  # attribute docstrings
                    is_text = isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)
                    text = stmt.value.value if is_text else None
                    if isinstance(before, (ast.Assign, ast.AnnAssign)) and isinstance(text, str):
                        yield f"{where}:{stmt.lineno}", inspect.cleandoc(text)


def _pages():
    for folder, _, files in os.walk(os.path.join(ROOT, "docs")):
        for name in sorted(files):
            if name.endswith(".md"):
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    yield os.path.relpath(os.path.join(folder, name), ROOT), f.read()


def _squash(formulas) -> list[str]:
    return ["".join(f.split()) for f in formulas]


def formula_problems(text: str, md) -> list[str]:
    """What goes wrong with the formulas of the markdown `text` once rendered: a formula
    that does not reach MathJax whole (an operator that began a line and became a list
    bullet, a formula split across blocks) or a `$` left in the page as text."""
    source = [a or b for a, b in _SOURCE_MATH.findall(_CODE.sub("", text))]
    html = md.reset().convert(text)
    rendered = [unescape(a or b) for a, b in _HTML_MATH.findall(html)]
    problems = []
    if _squash(source) != _squash(rendered):
        lost = [f for f, s in zip(source, _squash(source)) if s not in _squash(rendered)]
        problems.append(f"formulas not rendered whole: {lost or source}")
    left = _HTML_MATH.sub("", _HTML_CODE.sub("", html))
    if "$" in left:
        i = left.index("$")
        problems.append(f"unrendered $ in {left[max(0, i - 60) : i + 60]!r}")
    return problems


def test_formula_problems_are_found():
    md = _markdown()
    good = "With $u = h_w - h_l$:\n\n- `a`: $-\\log\\sigma(u) -\n  \\log\\sigma(-u)$.\n"
    assert formula_problems(good, md) == []
    # An operator that starts a continuation line inside a list item becomes a bullet.
    bullet = "- `a`: $-\\log\\sigma(u)\n  - \\log\\sigma(-u)$.\n"
    assert formula_problems(bullet, md)
    assert formula_problems("Cost: 5$ a month and $x$.", md)  # a stray dollar
    assert formula_problems("`$HOME` and\n\n$$a\n+ b$$\n", md) == []
    assert formula_problems("A display formula inside a paragraph, $$a\n+ b$$.", md)


def test_every_formula_renders_whole():
    config = _config()
    assert "javascripts/mathjax.js" in config.get("extra_javascript", [])
    assert os.path.isfile(os.path.join(ROOT, "docs", "javascripts", "mathjax.js"))
    md, problems, formulas = _markdown(), [], 0
    for where, text in [*_docstrings(), *_pages()]:
        if "$" in text:
            formulas += len(_SOURCE_MATH.findall(_CODE.sub("", text)))
            problems += [f"{where}: {p}" for p in formula_problems(text, md)]
    assert formulas > 500  # the losses alone have hundreds
    assert not problems, "\n".join(problems)


@pytest.mark.slow
def test_the_built_reference_hands_every_formula_to_mathjax(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    site = tmp_path / "site"
    build = [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-d", str(site)]
    done = subprocess.run(build, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    counts = {}
    for page in sorted(site.glob("**/index.html")):
        html = page.read_text(encoding="utf-8")
        counts[page.parent.name] = len(_HTML_MATH.findall(html))
        text = _HTML_MATH.sub("", re.sub(r"<script\b.*?</script>", "", _HTML_CODE.sub("", html)))
        assert "$" not in text, f"{page}: unrendered $"
        bullets = re.findall(r"<li>\s*(?:<p>)?\s*([-+=]|\\[A-Za-z]+)", text)
        assert not bullets, f"{page}: a formula's continuation became a list item: {bullets}"
        if counts[page.parent.name]:
            assert "javascripts/mathjax.js" in html and "mathjax@3" in html
    assert counts["losses"] > 300 and counts["train"] > 100 and counts["objectives"] > 20
    losses = (site / "api" / "losses" / "index.html").read_text(encoding="utf-8")
    exo = r"\sigma(\beta u)[\log\sigma(\beta u) - \log(1-\varepsilon)]"
    assert f'<div class="arithmatex">\\[{exo}\n+ \\sigma(-\\beta u)' in losses
