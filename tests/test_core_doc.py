"""docs/core.md's table of where things are names the machines' files as they are (the
supervisor's, the worker's): none that is gone, none missing."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SUPERVISOR = ROOT / "src" / "toolpool" / "supervisor"


def _table_files() -> list[str]:
    text = (ROOT / "docs" / "core.md").read_text()
    section = text.split("## Where things are", 1)[1].split("\n## ", 1)[0]
    named: list[str] = []
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        first = line.split("|")[1]
        folder = ""
        for token in re.findall(r"`([^`]+)`", first):
            if "/" in token:
                folder = token.rsplit("/", 1)[0]
            elif folder:
                token = f"{folder}/{token}"  # (`supervisor/_pool.py`, `_channels.py`)
            named.append(token)
    return named


@pytest.mark.timeout(10)
def test_every_file_the_table_names_exists() -> None:
    named = _table_files()
    assert len(named) >= 10, named
    for path in named:
        assert (ROOT / "src" / "toolpool" / path.rstrip("/")).exists(), path


@pytest.mark.timeout(10)
def test_the_table_names_every_file_of_the_machine() -> None:
    named = set(_table_files())
    files = {f"supervisor/machine/{p.name}" for p in (SUPERVISOR / "machine").glob("*.py")}
    files.discard("supervisor/machine/__init__.py")
    files.add("worker/_machine.py")  # the worker's machine, and its shell
    files.add("worker/_server.py")
    assert files - named == set(), "docs/core.md does not name these"
