"""scripts/house_rules.py (run by `make lint`) on a temporary tree: a package module over 500
lines and a history marker in package code or the README fail it, by name; the rest passes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "house_rules.py"


def house_rules(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(root)], capture_output=True, text=True, timeout=60
    )


def write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def module(lines: int) -> str:
    return "".join(f"x{i} = {i}\n" for i in range(lines))


def clean_tree(root: Path) -> None:
    write(root, "README.md", "# clawbridge\n\nSessions hold turns; a session's id is a string.\n")
    write(root, "bridge/__init__.py", "")
    write(root, "local_gpu/engine.py", module(500))  # at the limit: allowed
    write(root, "bridge/migrations/versions/0001_initial.py", module(900))  # generated: allowed
    write(root, "judges/prompts/judge.txt", "Judge the session below.\n")
    (root / "bridge/ui/static").mkdir(parents=True)
    (root / "bridge/ui/static/logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")  # not text


def test_a_tree_that_keeps_the_rules_passes(tmp_path: Path) -> None:
    clean_tree(tmp_path)
    result = house_rules(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout == ""


def test_a_package_module_over_500_lines_fails_by_name(tmp_path: Path) -> None:
    clean_tree(tmp_path)
    write(tmp_path, "backends/big.py", module(501))
    write(tmp_path, "scripts/long_tool.py", module(900))  # not package code
    result = house_rules(tmp_path)
    assert result.returncode == 1
    assert result.stdout.splitlines() == [
        "backends/big.py: 501 lines (at most 500): split it where its ideas part"
    ]


def test_a_history_marker_in_package_code_or_the_readme_fails_by_line(tmp_path: Path) -> None:
    clean_tree(tmp_path)
    write(tmp_path, "judges/rules.py", "X = 1\n# tuned in Session 12\n")
    write(tmp_path, "bridge/demo/scenario.yaml", "rounds: 4  # sessions 3-4 measured\n")
    with (tmp_path / "README.md").open("a", encoding="utf-8") as f:
        f.write("Seeds 5 and 6 (session 9) scored higher.\n")
    write(tmp_path, "docs/measurements.md", "session 9: +25\n")  # the log's place: allowed
    result = house_rules(tmp_path)
    assert result.returncode == 1
    assert sorted(result.stdout.splitlines()) == sorted([
        "judges/rules.py:2: history marker: # tuned in Session 12",
        "bridge/demo/scenario.yaml:1: history marker: rounds: 4  # sessions 3-4 measured",
        "README.md:4: history marker: Seeds 5 and 6 (session 9) scored higher.",
    ])
