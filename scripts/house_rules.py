"""The house rules that ruff and import-linter do not check, run by `make lint`:

- no package module over 500 lines (bridge/, backends/, judges/, local_gpu/; alembic's
  migrations under bridge/migrations/ are generated, and left out);
- no history marker (`session 12`, `sessions 3-4`: the pattern `sessions? [0-9]`, any case) in
  package files or README.md: a change's history belongs in git and the measurement log under
  docs/, not in the code a newcomer reads.

    .venv/bin/python scripts/house_rules.py          # the checkout this script is in
    .venv/bin/python scripts/house_rules.py ROOT     # another tree (the tests use a temporary one)

Exit 1, naming each offending file (and line), when a rule is broken.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path

PACKAGE_DIRS = ("bridge", "backends", "judges", "local_gpu")
GENERATED = ("bridge/migrations",)
MAX_LINES = 500
MARKER = re.compile(r"sessions? [0-9]", re.IGNORECASE)


def _files(root: Path) -> Iterator[Path]:
    """Every file of the package folders, in a stable order (caches left out)."""
    for top in PACKAGE_DIRS:
        folder = root / top
        if folder.is_dir():
            yield from sorted(
                p for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts
            )


def _text(path: Path) -> str | None:
    """The file's text, None for a file that is not UTF-8 text (an image, a binary)."""
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def oversized(root: Path) -> list[str]:
    """A line for each package module over MAX_LINES lines (generated migrations excepted)."""
    found = []
    for path in _files(root):
        rel = path.relative_to(root).as_posix()
        if path.suffix != ".py" or rel.startswith(tuple(f"{g}/" for g in GENERATED)):
            continue
        text = _text(path)
        n = 0 if text is None else len(text.splitlines())
        if n > MAX_LINES:
            found.append(f"{rel}: {n} lines (at most {MAX_LINES}): split it where its ideas part")
    return found


def history_markers(root: Path) -> list[str]:
    """A line for each line of a package file or README.md that names a work session."""
    found = []
    for path in [*_files(root), root / "README.md"]:
        text = _text(path) if path.is_file() else None
        for i, line in enumerate((text or "").splitlines(), 1):
            if MARKER.search(line):
                rel = path.relative_to(root).as_posix()
                found.append(f"{rel}:{i}: history marker: {line.strip()}")
    return found


def main(argv: list[str]) -> int:
    root = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parents[1]
    problems = oversized(root) + history_markers(root)
    for problem in problems:
        print(problem)
    if problems:
        print(f"house rules: {len(problems)} problem(s) (scripts/house_rules.py)", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
