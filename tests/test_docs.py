"""The documentation shows what the code does: the README's example prints what its comments
say, and the pages it links exist in the repository."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.S)


def _claims(block: str) -> list[str]:
    """What the example's ``print(...)  # comment`` lines say they print."""
    return [
        " ".join(line.split("#", 1)[1].split())
        for line in block.splitlines()
        if line.strip().startswith("print(") and "#" in line
    ]


@pytest.mark.timeout(120)
def test_the_readme_example_prints_what_its_comments_say(tmp_path: Path) -> None:
    tools, script = _python_blocks(README)[:2]
    assert tools.startswith("# mytools.py\n")
    (tmp_path / "mytools.py").write_text(tools)
    (tmp_path / "example.py").write_text(script)
    claims = _claims(script)
    assert claims[:2] == ["ok slept 0.5s", "aborted cancel"]
    for _ in range(3):  # it printed "aborted_before_dispatch" 7 runs in 10 without the wait
        done = subprocess.run(
            [sys.executable, "example.py"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=90,
            stdin=subprocess.DEVNULL,
        )
        assert done.returncode == 0, done.stderr
        printed = done.stdout.splitlines()
        assert [" ".join(line.split()) for line in printed[:2]] == claims[:2]
        assert printed[2].startswith("[('submitted', 0.0), ('dispatched', ")


@pytest.mark.timeout(120)
def test_the_readme_map_example_prints_one_line_per_item(tmp_path: Path) -> None:
    tools, _, example = _python_blocks(README)[:3]
    assert "pool.map(" in example
    (tmp_path / "mytools.py").write_text(tools)
    (tmp_path / "example.py").write_text(example)
    done = subprocess.run(
        [sys.executable, "example.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=90,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr
    lines = [line.split() for line in done.stdout.splitlines()]
    assert sorted(int(line[0]) for line in lines) == list(range(8))
    assert all(line[1] == "ok" for line in lines)


def test_the_pages_the_readme_links_are_in_the_repository() -> None:
    pages = re.findall(r"`((?:\.\./)?[\w./-]+\.md)`", README)
    assert "docs/contract.md" in pages
    for page in pages:
        assert (ROOT / page).resolve().is_relative_to(ROOT), page
        assert (ROOT / page).is_file(), page


def test_the_contract_has_every_clause_the_code_and_tests_cite() -> None:
    contract = (ROOT / "docs" / "contract.md").read_text()
    defined = set(re.findall(r"^- (C\d+\.\d+)\b", contract, re.M))
    defined |= set(re.findall(r"^## (C\d+)\b", contract, re.M))
    cited: set[str] = set()
    for path in [*ROOT.glob("src/**/*.py"), *ROOT.glob("tests/*.py"), *ROOT.glob("docs/*.md")]:
        if path.name in ("contract.md", "changelog.md"):
            continue
        cited |= set(re.findall(r"\b(C\d+(?:\.\d+)?)\b", path.read_text()))
    assert cited, "the search found no citation at all"
    assert cited <= defined, sorted(cited - defined)


@pytest.mark.timeout(120)
def test_the_readme_executor_example_prints_what_its_comments_say(tmp_path: Path) -> None:
    (example,) = [b for b in _python_blocks(README) if "toolpool.Executor(" in b]
    (tmp_path / "example.py").write_text(example)
    done = subprocess.run(
        [sys.executable, "example.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=90,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr
    claims = _claims(example)
    assert claims == ["1024", "[1, 1, 2, 6, 24, 120]", "RemoteTraceback", "error"]
    assert [" ".join(line.split()) for line in done.stdout.splitlines()] == claims
