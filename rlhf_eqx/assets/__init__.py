"""Files shipped with the package: the stories260K checkpoint and its tokenizer.

`stories260K.bin` and `tok512.bin` come from karpathy/tinyllamas (MIT licence; see
`NOTICE` in this directory).
"""

import os

__all__ = ["asset_path", "STORIES260K", "TOK512"]

_HERE = os.path.dirname(os.path.abspath(__file__))


def asset_path(name: str) -> str:
    """Absolute path of a shipped file (`"stories260K.bin"`, `"tok512.bin"`, `"NOTICE"`)."""
    path = os.path.join(_HERE, name)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"rlhf_eqx ships no asset named {name!r} (looked in {_HERE})")
    return path


STORIES260K = "stories260K.bin"
TOK512 = "tok512.bin"
