"""The code-evaluation example (``examples/codeeval``, issue 18): truthful verdicts.

Real worker processes, real child processes, real signals and a real socket. Every sample of
``examples/codeeval/completions.py`` goes through a pool and must get the verdict it is
expected to get: the correct ones pass, the wrong ones fail, the hostile ones never pass. No
process of the evaluation may outlive its call: the tool reaps its own tree (the worker counts
no leftover), and a scan of the machine finds no process running the tool's child program.
A naive harness (the completion and an ``assert`` in one process, passed when it exits 0) is
run beside it on the same completions, to show that the attacks are real.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import pytest

import toolpool
from toolpool import CancelController, Outcome, Rung
from toolpool.sandbox import Profile

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the workers see this process's sys.path
    sys.path.insert(0, str(ROOT))

from examples.codeeval import completions as samples  # noqa: E402
from examples.codeeval import tools  # noqa: E402
from examples.codeeval.problems import PROBLEMS, same  # noqa: E402

TOOLS = "examples.codeeval.tools:registry"
#: Text of the child's program: every process of an evaluation carries it in its command line.
CHILD_MARK = "The child side of the code-evaluation tool"
PROBLEMS_FILE = ROOT / "examples" / "codeeval" / "problems.py"
ESCAPE_FILE = Path("/tmp/codeeval-hostile-was-here")
IS_ROOT = os.geteuid() == 0
PROFILES = {
    "untrusted": Profile.untrusted(),
    # The weakest set-up: no cgroups, the network on; only the tool's own jail holds.
    "weakest": Profile.default().with_limits(disable=frozenset({"cgroups"})),
}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _strays() -> list[psutil.Process]:
    """Every process on the machine running the tool's child program (or forked from one),
    but another test run's: a suite running beside this one has children of its own."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info.get("cmdline") or []
        if any(CHILD_MARK in part for part in cmdline) and not _another_runs(proc):
            found.append(proc)
    return found


def _another_runs(proc: psutil.Process) -> bool:
    """Whether proc descends from another pytest process than this one. An orphan (its
    ancestry reaches pid 1 through no pytest) counts as this run's: it may have escaped."""
    me = os.getpid()
    try:
        for parent in proc.parents():
            if parent.pid == me:
                return False
            if any("pytest" in part for part in parent.cmdline()):
                return True
    except psutil.Error:
        return False  # (gone meanwhile: count what is still seen)
    return False


def _descendants(pool: toolpool.Pool) -> list[psutil.Process]:
    out = []
    for pid in pool.worker_pids:
        try:
            out.extend(psutil.Process(pid).children(recursive=True))
        except psutil.NoSuchProcess:
            pass
    return out


@contextmanager
def _answer_key_guarded() -> Iterator[None]:
    """The hostile samples try to rewrite the tests on disk: prove they could not, and put the
    file back should one ever manage it (so that a failure does not poison the checkout)."""
    text = PROBLEMS_FILE.read_bytes()
    ESCAPE_FILE.unlink(missing_ok=True)
    try:
        yield
    finally:
        changed = PROBLEMS_FILE.read_bytes() != text
        if changed:
            PROBLEMS_FILE.write_bytes(text)
        escaped = ESCAPE_FILE.exists()
        ESCAPE_FILE.unlink(missing_ok=True)
        assert not changed, "a completion rewrote the tests on disk"
        assert not escaped, "a completion wrote a file outside its directory"


#: The tool's time limit for samples that do not set their own (the default is 5 s): a margin
#: for a loaded machine. The samples that must time out set 1 s.
TIME_LIMIT = 30.0


def _args(sample: samples.Completion) -> dict[str, Any]:
    limit = sample.time_limit if sample.time_limit is not None else TIME_LIMIT
    return {"problem_id": sample.problem_id, "completion": sample.source, "time_limit": limit}


# -- the samples, the input file, the problems ------------------------------------------------


def test_the_batch_input_is_what_the_samples_make() -> None:
    path = ROOT / "examples" / "codeeval" / "completions.jsonl"
    assert path.read_text(encoding="utf-8").splitlines() == samples.lines(), (
        "run: python examples/codeeval/completions.py"
    )
    records = [json.loads(line) for line in samples.lines()]
    assert len({r["id"] for r in records}) == len(records)
    for record in records:
        assert set(record) == {"id", "tool", "args", "timeout"}
        assert record["tool"] == "evaluate"
        assert record["args"]["problem_id"] in PROBLEMS
    kinds = {s.kind for s in samples.COMPLETIONS}
    assert kinds == {"correct", "wrong", "hostile", "limit"}
    assert {s.problem_id for s in samples.COMPLETIONS if s.kind == "correct"} == set(PROBLEMS)
    assert all("passed" not in s.expect for s in samples.COMPLETIONS if s.kind == "hostile")
    for sample in samples.COMPLETIONS:
        if sample.id != "fizzbuzz/wrong/syntax-error":
            compile(sample.source, sample.id, "exec")  # each fails for its own reason


def test_a_dozen_problems_each_with_several_tests() -> None:
    assert len(PROBLEMS) == 12
    for problem in PROBLEMS.values():
        assert len(problem.tests) >= 3, problem.id
        assert f"def {problem.entry}(" in problem.prompt
        json.dumps([list(args) for args, _ in problem.tests])  # plain data, every one
        json.dumps([expected for _, expected in problem.tests])


def test_comparison_is_strict_about_kinds() -> None:
    assert same(6, 6)
    assert same(6.0, 6)
    assert not same(True, 1)
    assert not same(1, True)
    assert same(True, True)
    assert not same(0, False)
    assert not same(None, 0)
    assert not same("6", 6)
    assert not same([6], 6)
    assert not same(6, [6])
    assert same([[1, 6], [8, 10]], [[1, 6], [8, 10]])
    assert not same([[1, 6]], [[1, 6], [8, 10]])
    assert not same(["a"], "a")
    assert not same("ab", ["a", "b"])
    assert same({"a": [1]}, {"a": [1]})
    assert not same({"a": 1, "b": 2}, {"a": 1})
    assert same(0.30000000000000004, 0.3, "close")
    assert not same(0.31, 0.3, "close")
    assert not same(float("nan"), float("nan"), "close")
    with pytest.raises(TypeError):
        same(1, object())


# -- an answer served on the network ----------------------------------------------------------


@contextmanager
def _answer_server() -> Iterator[int]:
    """A TCP server on loopback that answers sum_even correctly: the port."""
    import socket

    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn:
                numbers = json.loads(conn.recv(4096))
                conn.sendall(str(sum(n for n in numbers if n % 2 == 0)).encode())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        thread.join(5)
        server.close()


NETWORK_CHEAT_ID = "sum_even/hostile/asks-a-server-on-loopback"
NETWORK_EXPECT = frozenset({"failed"})


def _network_cheat(port: int) -> str:
    """A completion that gets its answers from the server on ``port`` (and has no other)."""
    return textwrap.dedent(f"""
        import json, socket

        def sum_even(numbers):
            with socket.create_connection(("127.0.0.1", {port}), timeout=5) as s:
                s.sendall(json.dumps(numbers).encode())
                return int(s.recv(64))
        """)


def test_the_answer_server_works_and_would_fool_a_naive_harness() -> None:
    with _answer_server() as port:
        assert _naive_passes("sum_even", _network_cheat(port))


# -- every sample, through a pool -------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.timeout(120)
@pytest.mark.parametrize("profile", sorted(PROFILES))
async def test_every_sample_gets_its_verdict_and_leaves_nothing(profile: str) -> None:
    if profile == "untrusted" and not IS_ROOT:
        pytest.skip("the untrusted profile's uid layer needs root here")
    # Under the weakest set-up, only what attacks: the others do not depend on the profile.
    chosen = [
        s for s in samples.COMPLETIONS if profile == "untrusted" or s.kind in ("hostile", "limit")
    ]
    with _answer_key_guarded(), _answer_server() as port:
        # One more: it asks a real server on loopback, which would give it the right answer.
        chosen.append(samples.Completion(NETWORK_CHEAT_ID, _network_cheat(port), NETWORK_EXPECT))
        async with toolpool.Pool(
            TOOLS, workers=3, profile=PROFILES[profile], cancel_grace=2.0, term_grace=1.0
        ) as pool:
            calls = {
                s.id: pool.submit("evaluate", _args(s), timeout=samples.CALL_TIMEOUT)
                for s in chosen
            }
            results = {cid: await call for cid, call in calls.items()}
            assert _descendants(pool) == []
            assert _strays() == []
            workers = set(pool.worker_pids)
    wrong: list[str] = []
    for sample in chosen:
        result = results[sample.id]
        assert result.outcome == Outcome.OK, (sample.id, result.error)
        verdict = result.value
        if verdict["verdict"] not in sample.expect:
            wrong.append(f"{sample.id}: {verdict['verdict']} ({verdict['detail']})")
        assert result.leftovers_killed == 0, sample.id  # the tool reaped its own tree
        assert verdict["directory_removed"], sample.id
        assert verdict["tests"] == len(PROBLEMS[sample.problem_id].tests)
        assert result.worker_pid in workers, sample.id  # no worker died or was replaced
        if verdict["verdict"] == "failed":
            assert verdict["failed_test"] is not None, sample.id
            assert verdict["call"], sample.id
        if verdict["verdict"] != "error" or "sandbox" not in verdict["detail"]:
            assert any(j.startswith("landlock") for j in verdict["jail"]), verdict
    assert wrong == []
    assert _strays() == []
    # What the verdicts say, for a few that matter.
    v = {cid: r.value for cid, r in results.items()}
    if profile == "untrusted":
        assert v["sum_even/wrong/odds"]["failed_test"] == 0
        assert v["sum_even/wrong/odds"]["got"] == "4"
        assert v["sum_even/wrong/odds"]["expected"] == "6"
        assert v["sum_even/wrong/odds"]["call"] == "sum_even([1, 2, 3, 4])"
        assert v["balanced/wrong/counts-only"]["failed_test"] == 5  # "}{"
        assert "SyntaxError" in v["fizzbuzz/wrong/syntax-error"]["detail"]
    assert "status 0" in v["sum_even/hostile/os-exit-0"]["detail"]
    assert "SystemExit" in v["sum_even/hostile/system-exit-in-the-function"]["detail"]
    assert "MemoryError" in v["sum_even/hostile/eats-memory"]["detail"]
    assert "1,048,576 bytes" in v["sum_even/hostile/huge-reply"]["detail"]
    assert "readiness" in v["sum_even/hostile/forges-replies"]["detail"]
    assert v["sum_even/hostile/always-equal"]["got"] == "-1"
    assert "not data" in v["reverse_words/hostile/always-equal-object"]["detail"]
    assert v["sum_even/limit/special-cases-the-inputs"]["verdict"] == "passed"  # a limit
    assert "raised" in v[NETWORK_CHEAT_ID]["detail"]  # connect() was refused


# -- the naive harness these attacks are aimed at ---------------------------------------------

NAIVE_CHECK = """
def check(candidate):
{asserts}

check({entry})
"""
#: Hostile samples that fool the naive harness (each defines a wrong function).
FOOLS_THE_NAIVE_HARNESS = (
    "sum_even/hostile/always-equal",
    "sum_even/hostile/patches-assert-machinery",
    "sum_even/hostile/reads-the-answers",
    "sum_even/hostile/system-exit-in-the-function",
    "sum_even/hostile/system-exit-at-load",
    "sum_even/hostile/os-exit-0",
    "sum_even/hostile/os-exit-0-at-load",
)


def _naive_passes(problem_id: str, source: str) -> bool:
    """HumanEval's way, without its guard: completion + asserts in one process; exit 0 passes."""
    problem = PROBLEMS[problem_id]
    asserts = "\n".join(
        f"    assert candidate(*{list(args)!r}) == {expected!r}" for args, expected in problem.tests
    )
    program = source + NAIVE_CHECK.format(asserts=asserts, entry=problem.entry)
    done = subprocess.run(
        [sys.executable, "-c", program],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=30,
        check=False,
    )
    return done.returncode == 0


@pytest.mark.timeout(60)
def test_the_attacks_are_real_a_naive_harness_passes_them() -> None:
    by_id = {s.id: s for s in samples.COMPLETIONS}
    for sample_id in FOOLS_THE_NAIVE_HARNESS:
        sample = by_id[sample_id]
        assert "passed" not in sample.expect  # the tool must not pass it (checked above)
        assert _naive_passes(sample.problem_id, sample.source), sample_id
    # The harness itself tells right from wrong when nobody attacks it.
    assert _naive_passes("sum_even", by_id["sum_even/correct/ref"].source)
    assert not _naive_passes("sum_even", by_id["sum_even/wrong/odds"].source)


# -- the call's own signal: its timeout and a cancel -------------------------------------------

SLEEPER = "import time\n\ndef sum_even(numbers):\n    time.sleep(10 ** 6)\n"


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_the_calls_timeout_and_a_cancel_stop_the_evaluation_cooperatively() -> None:
    args = {"problem_id": "sum_even", "completion": SLEEPER, "time_limit": 120}
    async with toolpool.Pool(TOOLS, workers=1, cancel_grace=30.0, profile="untrusted") as pool:
        worker = pool.worker_pids[0]
        timed = await pool.call("evaluate", args, timeout=1.0)
        call = pool.submit("evaluate", args)
        await call.wait_started()
        call.cancel()
        cancelled = await call
        assert _descendants(pool) == []
        assert pool.worker_pids == [worker]  # the same worker serves on: nothing was killed
        after = await pool.call(
            "evaluate",
            {
                "problem_id": "sum_even",
                "completion": samples.CORRECT[0].source,
                "time_limit": TIME_LIMIT,
            },
            timeout=60,
        )
    assert timed.outcome == Outcome.TIMEOUT
    assert timed.body_started
    assert cancelled.outcome == Outcome.ABORTED
    assert cancelled.body_started
    for result in (timed, cancelled):
        assert result.rung == Rung.CANCEL  # the tool stopped on its signal: no SIGTERM needed
        assert result.leftovers_killed == 0
        assert result.exit_signal is None
    assert after.outcome == Outcome.OK
    assert after.value["verdict"] == "passed"
    assert _strays() == []


# -- in-process checks (the registry used directly) --------------------------------------------


@pytest.mark.anyio
async def test_bad_input_is_a_clear_error() -> None:
    controller = CancelController()
    result = await tools.registry.execute(
        "evaluate", {"problem_id": "nope", "completion": ""}, signal=controller.signal
    )
    assert result.outcome == Outcome.ERROR
    assert "unknown problem 'nope'" in (result.error or "")
    assert "sum_even" in (result.error or "")
    for bad in (0, -1, 1000, float("nan")):
        result = await tools.registry.execute(
            "evaluate",
            {"problem_id": "sum_even", "completion": "", "time_limit": bad},
            signal=controller.signal,
        )
        assert result.outcome == Outcome.ERROR, bad
        assert "time_limit" in (result.error or ""), bad
    listed = await tools.registry.execute("problems", {}, signal=controller.signal)
    assert [p["id"] for p in listed.value] == list(PROBLEMS)


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_without_its_jail_the_completion_does_not_run_unless_allowed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A kernel without Landlock, as the child sees it.
    no_landlock = tools.RUNNER.replace("abi = int(_libc.syscall(create, None, 0, 1))", "abi = 0")
    assert no_landlock != tools.RUNNER
    monkeypatch.setattr(tools, "RUNNER", no_landlock)
    controller = CancelController()
    args = {
        "problem_id": "sum_even",
        "completion": samples.CORRECT[0].source,
        "time_limit": TIME_LIMIT,
    }
    refused = await tools.registry.execute("evaluate", args, signal=controller.signal)
    allowed = await tools.registry.execute(
        "evaluate", {**args, "allow_weak_jail": True}, signal=controller.signal
    )
    assert refused.outcome == Outcome.OK
    assert refused.value["verdict"] == "error"
    assert "Landlock is not available" in refused.value["detail"]
    assert allowed.outcome == Outcome.OK
    assert allowed.value["verdict"] == "passed"
    assert any(j.startswith("incomplete: landlock") for j in allowed.value["jail"])
    assert _strays() == []


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_landlock_is_what_keeps_the_tests_from_the_completion(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The answer-reading sample, pointed at this checkout's tests wherever it is.
    sample = next(s for s in samples.HOSTILE if s.id == "sum_even/hostile/reads-the-answers")
    source = sample.source.replace("/work/*/examples/codeeval/problems.py", str(PROBLEMS_FILE))
    assert source != sample.source
    args = {"problem_id": "sum_even", "completion": source, "time_limit": TIME_LIMIT}
    controller = CancelController()
    jailed = await tools.registry.execute("evaluate", args, signal=controller.signal)
    no_landlock = tools.RUNNER.replace("abi = int(_libc.syscall(create, None, 0, 1))", "abi = 0")
    monkeypatch.setattr(tools, "RUNNER", no_landlock)
    unjailed = await tools.registry.execute(
        "evaluate", {**args, "allow_weak_jail": True}, signal=controller.signal
    )
    assert jailed.value["verdict"] == "failed"
    assert unjailed.value["verdict"] == "passed"  # it read the tests: the layer matters
    assert _strays() == []


def test_the_child_program_uses_the_standard_library_only() -> None:
    # It runs as `python -I -S -c`, before any site-packages: nothing of toolpool's.
    imported: set[str] = set()
    for node in ast.walk(ast.parse(tools.RUNNER)):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.module is not None
            assert node.level == 0
            imported.add(node.module.split(".")[0])
    assert imported, "the parse found no import at all"
    assert imported <= sys.stdlib_module_names, imported


@pytest.mark.timeout(120)
def test_the_documented_command_line_scores_a_mix_truthfully(tmp_path: Path) -> None:
    """``toolpool batch ... --profile untrusted`` as docs/codeeval.md gives it, on a mix of
    every kind of sample: the records say what the tool decided; no hostile one passes."""
    chosen = [s for s in samples.COMPLETIONS if s.kind in ("correct", "hostile")][::4]
    chosen += [s for s in samples.COMPLETIONS if s.kind == "wrong"][:2]
    wanted = {s.id for s in chosen}
    lines = [line for line in samples.lines() if json.loads(line)["id"] in wanted]
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "verdicts.jsonl"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src")])}
    done = subprocess.run(
        [sys.executable, "-m", "toolpool", "batch", "examples.codeeval.tools:registry",
         str(inp), "-o", str(out), "--workers", "2", "--profile", "untrusted",
         "--no-progress", "--json"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=110,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)
    assert summary["recorded"] == {"ok": len(chosen)}
    verdicts = {}
    for line in out.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        verdicts[record["id"]] = record["value"]["verdict"]
    assert set(verdicts) == wanted
    for sample in chosen:
        assert verdicts[sample.id] in sample.expect, (sample.id, verdicts[sample.id])
        if sample.kind == "hostile":
            assert verdicts[sample.id] != "passed", sample.id
    assert {verdicts[s.id] for s in chosen if s.kind == "correct"} == {"passed"}
    assert not _strays()
