"""Regenerate the state diagram in README.md from the transition table.

    python scripts/gen_diagram.py          # rewrite README.md in place
    python scripts/gen_diagram.py --check  # exit 1 if README.md is out of date
"""

import sys
from pathlib import Path

from lifecycle import mermaid

START, END = "<!-- diagram:start -->", "<!-- diagram:end -->"
README = Path(__file__).resolve().parents[1] / "README.md"


def render(text: str) -> str:
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n```mermaid\n{mermaid()}```\n{END}{tail}"


if __name__ == "__main__":
    current = README.read_text()
    wanted = render(current)
    if "--check" in sys.argv[1:]:
        sys.exit(0 if current == wanted else 1)
    README.write_text(wanted)
