"""Scale-out on one machine: three ``toolpool serve`` on loopback behind a real load balancer
(haproxy, from Debian's packages, standing in for the Kubernetes Service), and
``toolpool batch --server`` sending 2,000 calls through it while one node is SIGKILLed (its
whole process group) and another is SIGTERMed (it drains).

The tools note every start and end with the call's id and the worker's pid
(``serve_tools.work``), so the test knows which node ran what, and how often.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest

from serve_support import HAPROXY, ServeProcess, haproxy, serve_env

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        HAPROXY is None,
        reason="haproxy is not installed (Debian: apt-get install haproxy; .ci/run installs "
        "it): the scale-out test needs a real load balancer in front of the nodes",
    ),
]

CALLS = 2000
# Each call's work; every tenth call's is LONG, so that calls are running on the nodes when
# one is killed and one drained. The sleeps bound the test's length (the last thousand calls
# run on one node's four workers): 0.05 and 1.0 s made each variant take about a minute.
SECONDS = 0.02
LONG = 0.5
KILL_AT = 500  # calls started when node 1 is SIGKILLed
TERM_AT = 1000  # ... and node 2 SIGTERMed


def ledger_lines(path: Path) -> list[list[str]]:
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


def wait_started(path: Path, count: int, batch: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 120
    while sum(1 for line in ledger_lines(path) if line[0] == "start") < count:
        assert batch.poll() is None, "the batch ended early"
        assert time.monotonic() < deadline, f"fewer than {count} calls started"
        time.sleep(0.02)  # (other processes' file: polled)


def wait_running_on(path: Path, pids: set[str], batch: subprocess.Popen[str]) -> None:
    """Until a call is in its body on a worker of ``pids`` (started, not ended)."""
    deadline = time.monotonic() + 120
    while True:
        lines = ledger_lines(path)
        ended = {(line[1], line[2]) for line in lines if line[0] == "end"}
        if any(
            line[0] == "start" and line[2] in pids and (line[1], line[2]) not in ended
            for line in lines
        ):
            return
        assert batch.poll() is None, "the batch ended early"
        assert time.monotonic() < deadline, "no call ran on the node"
        time.sleep(0.01)  # (other processes' file: polled)


@pytest.mark.parametrize("idempotent", [False, True], ids=["plain", "idempotent"])
def test_three_nodes_behind_haproxy_one_killed_one_drained(
    tmp_path: Path, idempotent: bool
) -> None:
    ledger = tmp_path / "ledger"
    env = serve_env(TOOLPOOL_TEST_LEDGER=str(ledger))
    nodes: list[ServeProcess] = []
    try:
        for i in range(3):
            nodes.append(
                ServeProcess(
                    [
                        "serve_tools:registry",
                        "--workers",
                        "4",
                        "--http",
                        "127.0.0.1:0",
                        "--drain-grace",
                        "30",
                        "--cancel-grace",
                        "2",
                        "--term-grace",
                        "2",
                    ],
                    control=str(tmp_path / f"ctl{i}" / "control.sock"),
                    env=env,
                )
            )
        ports = [n.wait_serving() for n in nodes]
        workers = [{str(p) for p in n.note_descendants()} for n in nodes]
        lines = [
            {
                "id": f"c{i}",
                "tool": "work",
                "args": {"id": f"c{i}", "seconds": LONG if i % 10 == 0 else SECONDS},
            }
            for i in range(CALLS)
        ]
        (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        with haproxy(tmp_path, ports) as lb:
            retry = ["--retries", "1"] + (["--idempotent"] if idempotent else [])
            batch = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "toolpool",
                    "batch",
                    "--server",
                    f"http://127.0.0.1:{lb}/mcp",
                    "--workers",
                    "24",
                    *retry,
                    "--no-progress",
                    "--json",
                    str(tmp_path / "in.jsonl"),
                    "-o",
                    str(tmp_path / "out.jsonl"),
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            try:
                wait_started(ledger, KILL_AT, batch)
                wait_running_on(ledger, workers[0], batch)
                killed = nodes[0]
                os.killpg(killed.proc.pid, signal.SIGKILL)  # the node's whole process group
                wait_started(ledger, TERM_AT, batch)
                nodes[1].signal(signal.SIGTERM)
                out, err = batch.communicate(timeout=240)
            finally:
                if batch.poll() is None:
                    batch.kill()
                    batch.communicate()
        summary = json.loads(out)
        assert nodes[1].wait(60) == 0, "the drained node exits 0"
        assert killed.wait(30) == -signal.SIGKILL
    finally:
        for n in nodes:
            n.close()

    # Every input line has exactly one record.
    records: dict[str, dict[str, object]] = {}
    for line in (tmp_path / "out.jsonl").read_text().splitlines():
        record = json.loads(line)
        assert record["id"] not in records, f"two records for {record['id']}"
        records[str(record["id"])] = record
    assert set(records) == {f"c{i}" for i in range(CALLS)}, err
    assert summary["lines"] == CALLS

    starts = [line for line in ledger_lines(ledger) if line[0] == "start"]
    ends = {(line[1], line[2]) for line in ledger_lines(ledger) if line[0] == "end"}
    runs = Counter(line[1] for line in starts)
    node_of = {}
    for line in starts:
        for n, pids in enumerate(workers):
            if line[2] in pids:
                node_of.setdefault(line[1], set()).add(n)
    assert all(line[2] in set().union(*workers) for line in starts), "a call ran elsewhere"

    # The killed node's calls: those it had started and not finished were lost with it.
    cut_short = {
        line[1] for line in starts if line[2] in workers[0] and (line[1], line[2]) not in ends
    }
    assert cut_short, "node 1 had calls running when it was killed"
    lost = {i for i, r in records.items() if r["outcome"] == "worker_lost"}
    if idempotent:
        assert not lost, (
            {i: (records[i], runs[i], sorted(node_of.get(i, set()))) for i in lost},
            err,
        )
        for i in cut_short:
            assert records[i]["outcome"] == "ok"
            assert records[i]["attempts"] == 2  # retried once: it may have run twice
            assert runs[i] == 2
    else:
        assert cut_short <= lost
        for i in lost:  # node 1's: running, or sent to it and not begun (never elsewhere)
            assert node_of.get(i, set()) <= {0}
            assert records[i]["body_started"] is None  # the node said nothing more
            assert records[i]["attempts"] == 1  # not retried without --idempotent
    # Nothing else failed: the drained node finished its calls (well within its grace).
    others = {i: r for i, r in records.items() if i not in lost}
    assert {r["outcome"] for r in others.values()} == {"ok"}
    assert any(1 in where for where in node_of.values()), "node 2 served before its drain"
    # No tool ran twice unless its record says it may have.
    for i, count in runs.items():
        assert count == 1 or records[i]["attempts"] == count, (i, count, records[i])
    # No process of any node is left.
    alive = []
    for n in nodes:
        alive += n.alive_descendants()
    deadline = time.monotonic() + 30
    while alive and time.monotonic() < deadline:  # (the killed node's reaper cleans up)
        time.sleep(0.05)
        alive = [p for p in alive if psutil.pid_exists(p)]
    assert alive == []
