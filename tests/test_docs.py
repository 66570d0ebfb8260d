"""The docs set: the configuration reference is generated from the settings object and current,
and every relative link in the user docs points at a file (and heading) that exists."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
USER_DOCS = ["index", "quickstart", "how-it-works", "configuration", "privacy", "operating",
             "troubleshooting", "terraform", "openclaw", "design", "methods", "learning", "agents",
             "measurements"]
# Pages other engineers own, linked from the index; checked once they exist.
OTHERS = {"backends.md", "local-gpu.md", "learning.md"}


def test_configuration_reference_is_generated_from_settings():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_config_docs.py"), "--check"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    from clawbridge.config import FLAT

    text = (DOCS / "configuration.md").read_text()
    for name in FLAT:
        assert f"`CLAWBRIDGE_{name.upper()}`" in text, name


def test_the_readme_starts_with_the_product():
    """A newcomer reads what clawbridge is in the first 5 lines, and the two set-up commands in
    the first 15."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert any("clawbridge makes" in line for line in lines[:5])
    top = "\n".join(lines[:15])
    assert "make demo" in top and "make test" in top


def _slug(heading: str) -> str:  # GitHub's anchor for a heading
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return s.replace(" ", "-")


@pytest.mark.parametrize("page", USER_DOCS)
def test_relative_links_resolve(page: str):
    src = DOCS / f"{page}.md"
    text = re.sub(r"```.*?```", "", src.read_text(), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (src.parent / path).resolve() if path else src
        if not dest.exists() and dest.name in OTHERS:
            continue
        assert dest.exists(), f"{page}.md links to missing {target}"
        if anchor and dest.suffix == ".md":
            headings = {_slug(h) for h in re.findall(r"^#+ (.+)$", dest.read_text(), re.M)}
            assert anchor in headings, f"{page}.md links to missing heading {target}"


# Flags of other tools that the docs quote (alembic, SGLang, torchrun, checkov/terraform, OpenClaw,
# and the scripts under bench/, which document their own flags in --help).
OTHER_TOOLS_FLAGS = {
    "--autogenerate", "--max-loras-per-batch", "--mem-fraction-static", "--nproc-per-node",
    "--enable-priority-scheduling",  # SGLang's (docs/engine.md#the-user-first)
    "--framework", "--target", "--local", "--chunk", "--compute-dtype", "--profile", "--repeats",
    "--tokens", "--quick", "--turns", "--methods", "--seeds", "--mixed", "--samples",
    "--message", "--session-id", "--prefix",  # openclaw agent, npm install (docs/openclaw.md)
}


def _cli_flags() -> set[str]:
    from clawbridge.cli.main import app
    from typer.main import get_command

    flags: set[str] = set()

    def walk(cmd) -> None:  # type: ignore[no-untyped-def]
        for p in getattr(cmd, "params", []):
            flags.update(p.opts, p.secondary_opts)
        for sub in getattr(cmd, "commands", {}).values():
            walk(sub)

    walk(get_command(app))
    return flags


def _script_flags() -> set[str]:
    """Every flag the scripts under bench/ and scripts/ define (argparse `add_argument`)."""
    sources = [*ROOT.glob("bench/**/*.py"), *ROOT.glob("scripts/*.py")]
    pattern = re.compile(r"add_argument\(\s*(?:\"-\w\",\s*)?\"(--[a-z][a-z0-9-]*)\"")
    return {flag for src in sources for flag in pattern.findall(src.read_text())}


def test_every_flag_the_docs_name_exists():
    """A flag in the docs that the CLI lacks sends a user to an error; settings without a flag
    are named by their setting (configuration.md lists them all)."""
    known = _cli_flags() | _script_flags() | OTHER_TOOLS_FLAGS
    pages = [*DOCS.glob("*.md"), ROOT / "README.md"]
    missing = sorted(
        {f"{page.name}: {flag}" for page in pages
         for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]+)", page.read_text()) if flag not in known}
    )
    assert not missing, missing


ROOMS = ("bridge", "backends", "judges", "local_gpu")


def _code_map() -> dict[str, set[str]]:
    """docs/how-it-works.md's "The code, room by room": folder -> the Python files its row names."""
    text = (DOCS / "how-it-works.md").read_text().split("## The code, room by room", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, set[str]] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not (m := re.fullmatch(r"`([\w/]+/)`", cells[0])):
            continue
        rows[m.group(1).rstrip("/")] = set(re.findall(r"`([\w]+\.py)`", cells[1]))
    return rows


def test_the_code_map_names_every_file_of_every_room():
    """The map a newcomer reads first is the tree: every folder of the package has its row, and
    each row names exactly the folder's modules (a file added, moved or removed changes the map)."""
    rows = _code_map()
    tree = {str(d.relative_to(ROOT)): {f.name for f in d.glob("*.py") if f.name != "__init__.py"}
            for room in ROOMS for d in [ROOT / room, *(ROOT / room).rglob("*")]
            if d.is_dir() and "__pycache__" not in d.parts and "versions" not in d.parts and list(d.glob("*.py"))}
    tree = {k: v for k, v in tree.items() if v}
    assert set(rows) == set(tree), (sorted(set(tree) - set(rows)), sorted(set(rows) - set(tree)))
    for folder, files in tree.items():
        assert rows[folder] == files, (folder, sorted(files - rows[folder]), sorted(rows[folder] - files))


# Files by these names are made at run time (a benchmark's output, an agent's workspace file in a
# test), not kept in the repository.
MADE_AT_RUN_TIME = {"NOTES.md", "AGENTS.md"}


def test_every_notes_file_the_code_and_docs_cite_is_in_the_repository():
    """The repository stands alone: a page name in capitals (`README.md`) cited in a source file, test or page is one of
    its own files, never notes kept somewhere else."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    own = {Path(f).name for f in tracked}
    cited: dict[str, str] = {}
    for f in tracked:
        if f.endswith((".py", ".md", ".yaml", ".toml", ".sh")) and (ROOT / f).is_file():
            for name in re.findall(r"\b([A-Z][A-Z0-9_-]*\.md)\b", (ROOT / f).read_text(errors="replace")):
                cited.setdefault(name, f)
    missing = {n: f for n, f in cited.items() if n not in own and n not in MADE_AT_RUN_TIME}
    assert not missing, f"cited but not in the repository (name: first file citing it): {missing}"
