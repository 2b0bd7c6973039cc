"""Structured-output tasks for NeMo Gym's released `structeval` resources server: the
rows the rollout collection reads and the document the scripted policy answers with.

structeval's /verify parses the answer's YAML with PyYAML's pure-Python loader, in its
event loop, and checks that every path the row names exists: a verifier whose CPU grows
with the answer (about 2 ms a kilobyte here), so one process of it is the stack's
bottleneck once answers reach tens of kilobytes, as long structured answers do.
"""

from __future__ import annotations

import re
from typing import Any

PROMPT = re.compile(r"^Please output YAML code\b.*?catalog of (\d+) items, seed (\d+)", re.S)


def prompt(items: int, seed: int) -> str:
    return (
        "Please output YAML code:\n\nTask:\nWrite a product catalog of "
        f"{items} items, seed {seed}. Each item has an id, a name, a price, three tags and "
        "an owner with a name and an active flag."
    )


def catalog(items: int, seed: int) -> str:
    """The document a policy that follows the prompt writes, fenced as models fence it."""
    lines = ["```yaml", "catalog:", f"  title: Catalog {seed}", "  items:"]
    for i in range(items):
        lines += [
            f"    - id: {i}",
            f"      name: item-{seed}-{i}",
            f"      price: {(i * 37 + seed) % 1000 / 10}",
            f"      tags: [a{i % 7}, b{i % 5}, c{i % 3}]",
            "      owner:",
            f"        name: owner-{(i + seed) % 13}",
            "        active: true",
        ]
    return "\n".join([*lines, "```"])


def answer(text: str) -> str | None:
    """The scripted policy's answer to a structured-output prompt, or None for another."""
    match = PROMPT.match(text)
    return None if match is None else catalog(int(match[1]), int(match[2]))


def rows(count: int, items: int, seed: int = 0) -> list[dict[str, Any]]:
    """Rows in structeval's dataset shape (`data/example.jsonl`), YAML answers of `items`
    items; the paths name the first and the last item, so a truncated answer scores less
    than 1.0."""
    out = []
    for i in range(count):
        last = f"catalog.items[{items - 1}]"
        out.append(
            {
                "responses_create_params": {
                    "input": [{"role": "user", "content": prompt(items, seed + i)}]
                },
                "task_id": f"{seed + i:06d}",
                "task_name": "Text to YAML",
                "input_type": "Text",
                "output_type": "YAML",
                "raw_output_metric": [
                    "catalog.title",
                    "catalog.items[0].name",
                    "catalog.items[0].tags",
                    "catalog.items[0].owner.active",
                    f"{last}.name",
                    f"{last}.owner.name",
                ],
                "rendering": False,
                "row": i,
            }
        )
    return out
