"""Write the times-table task of the GRPO recipe as a GSM8K-style JSONL file: one record
per product `a × b` for `a, b` in 2..12 (121 questions, "What is 7 times 8?"), each with
its reference answer after `####`, the format `rlhf_eqx grpo --data` reads and scores by
exact match of the completion's last number.

    python examples/recipes/times_tables.py runs/times_tables.jsonl

SmolLM2-135M-Instruct answers about one in eight of these correctly at temperature 1
(it often talks around the question instead of answering it), so the task is one the
model can partly do at the start and GRPO has signal from the first rollout.
"""

import json
import os
import sys


def records(lo: int = 2, hi: int = 12) -> list[dict]:
    """The `(hi - lo + 1)²` questions `What is a times b?` with GSM8K-style answers."""
    return [
        {
            "question": f"What is {a} times {b}?",
            "answer": f"{a} times {b} is {a * b}.\n#### {a * b}",
        }
        for a in range(lo, hi + 1)
        for b in range(lo, hi + 1)
    ]


def main(path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for r in records():
            f.write(json.dumps(r) + "\n")
    os.replace(tmp, path)
    print(f"{path}: {len(records())} questions")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python examples/recipes/times_tables.py OUT.jsonl")
    main(sys.argv[1])
