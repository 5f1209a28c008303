"""The documentation shows what the code does: the README's example prints what its comments
say, every Python snippet a user can run runs, and the pages it links exist in the
repository."""

from __future__ import annotations

import ast
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
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


def _run_example(tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """Run ``example.py`` of ``tmp_path`` there, as a reader would."""
    return subprocess.run(
        [sys.executable, "example.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=90,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.timeout(120)
def test_the_readme_example_prints_what_its_comments_say(tmp_path: Path) -> None:
    tools, script = _python_blocks(README)[:2]
    assert tools.startswith("# mytools.py\n")
    (tmp_path / "mytools.py").write_text(tools)
    (tmp_path / "example.py").write_text(script)
    claims = _claims(script)
    assert claims[:2] == ["ok slept 0.5s", "aborted cancel"]
    for _ in range(3):  # it printed "aborted_before_dispatch" 7 runs in 10 without the wait
        done = _run_example(tmp_path)
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
    done = _run_example(tmp_path)
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
    done = _run_example(tmp_path)
    assert done.returncode == 0, done.stderr
    claims = _claims(example)
    assert claims == ["1024", "[1, 1, 2, 6, 24, 120]", "RemoteTraceback", "error"]
    assert [" ".join(line.split()) for line in done.stdout.splitlines()] == claims


# ------------------------------------------------------------------ every snippet runs

#: The Python blocks a reader cannot run as they stand (page, index of the block on the page):
#: they name what the reader brings. Every other block of README.md and docs/*.md is run.
SKETCHES = {
    ("pool.md", 1): "a map over the reader's 'fetch' tool and 'urls'",
    ("providers.md", 0): "the reader's 'listener' and 'ops_tools' module",
    ("eval.md", 0): "the reader's 'HumanEval' problems and 'samples'",
    ("mcp.md", 1): "serves its client until it goes away; the reader's 'ops_tools' module",
    ("service.md", 0): "a service the reader runs, and its 'token'",
}

#: Runs files as one reader's session, in order, in one namespace: a page's later blocks use
#: what its earlier ones defined. Top-level ``await`` and ``async with`` are allowed, as in
#: ``python -m asyncio``.
SESSION = """
import ast, asyncio, sys

namespace = {"__name__": "__main__"}
for path in sys.argv[1:]:
    with open(path) as f:
        code = compile(f.read(), path, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    ran = eval(code, namespace)
    if asyncio.iscoroutine(ran):
        asyncio.run(ran)
"""

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "page",
    [  # (a page whose every block is a sketch has nothing to run)
        p
        for p in PAGES
        if any((p.name, n) not in SKETCHES for n in range(len(_python_blocks(p.read_text()))))
    ],
    ids=lambda p: p.name,
)
def test_every_python_snippet_a_user_can_run_runs(page: Path) -> None:
    """The page's blocks run as a reader would run them, in order, with the README's
    ``mytools.py`` beside them (the module the pages' examples name) and this checkout on
    the path (``examples.codeeval``). In a directory every user may read: a snippet with
    the ``untrusted`` profile runs its workers as a uid of their own."""
    work = Path(tempfile.mkdtemp(prefix="toolpool-docs-"))
    try:
        work.chmod(0o755)
        (work / "mytools.py").write_text(_python_blocks(README)[0])
        (work / "session.py").write_text(SESSION)
        files = []
        for n, block in enumerate(_python_blocks(page.read_text())):
            if (page.name, n) in SKETCHES:
                continue
            # (The metrics page's server: on a free port, not 9100, which may be taken.)
            block = block.replace("start_http_server(9100,", f"start_http_server({_free_port()},")
            (work / f"block{n}.py").write_text(block)
            files.append(f"block{n}.py")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        done = subprocess.run(
            [sys.executable, "session.py", *files],
            cwd=work,
            capture_output=True,
            text=True,
            timeout=280,
            stdin=subprocess.DEVNULL,
            env=env,
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_sketches_that_are_not_run_are_still_there_and_do_not_run() -> None:
    """A sketch is listed because it cannot run alone: once fixed (or moved), it must be run."""
    for (name, n), why in SKETCHES.items():
        page = ROOT / ("README.md" if name == "README.md" else f"docs/{name}")
        blocks = _python_blocks(page.read_text())
        assert n < len(blocks), (name, n)
        compile(blocks[n], f"{name}[{n}]", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        names = re.findall(r"'(\w+)'", why)
        assert names, why
        assert all(word in blocks[n] for word in names), (name, n, why)


def test_the_metrics_snippet_binds_the_loopback_address_and_says_why() -> None:
    text = (ROOT / "docs" / "metrics.md").read_text()
    (block,) = _python_blocks(text)
    assert 'addr="127.0.0.1"' in block
    assert "0.0.0.0" in text.partition("```\n\n")[2]  # (what it would bind otherwise)


def test_the_readme_says_how_the_command_gets_on_the_path() -> None:
    assert ".venv/bin/toolpool" in README
    assert "pip install" in README
