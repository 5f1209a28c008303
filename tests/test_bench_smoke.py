"""The benchmark harness keeps working: a tiny run of bench/run.py, never timed.

Runs toolpool and one cheap peer (multiprocessing.Pool, in the standard library) through every
part at smoke sizes, in subprocesses, and checks the run exits 0 and writes the JSON and the
markdown it promises. It asserts nothing about the numbers: this machine is shared and noisy.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUN = ROOT / "bench" / "run.py"
PEERS = ("toolpool", "mp_pool")
PARTS = ("throughput", "latency", "stop", "leaks", "cold", "scale", "map")


@pytest.mark.timeout(120)
def test_bench_smoke_run_writes_its_results(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(RUN),
            "--smoke",
            "--peers",
            ",".join(PEERS),
            "--parts",
            "1,2,3,4,5,6,7",
            "--out-dir",
            str(tmp_path),
            "--no-charts",
        ],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    doc = json.loads((tmp_path / "latest.json").read_text())
    assert set(doc) >= {"meta", "summary", "results"}
    meta = doc["meta"]
    assert set(meta) >= {"command", "date", "machine", "load_before", "load_after", "size"}
    assert meta["size"] == "smoke"
    assert set(meta["machine"]) >= {"nproc", "cpu_model", "python"}

    ran = {(r["peer"], r["part"]) for r in doc["results"]}
    assert ran == {(peer, part) for peer in PEERS for part in PARTS}
    for r in doc["results"]:
        assert r["ok"], (r["peer"], r["part"], r.get("error"))
        assert isinstance(r["metrics"], dict)
        assert isinstance(r["leftover_after_part"], list)

    peers = doc["summary"]["peers"]
    assert set(peers) == set(PEERS)
    for peer in PEERS:
        assert set(peers[peer]) >= {"noop_rate", "p50_us", "cold_ms", "stop", "leaks", "queued"}
    assert set(peers["toolpool"]["stop"]) == {"cancel", "force"}
    assert "scale" in peers["toolpool"]
    tp_map = peers["toolpool"]["map"]["noop"]
    assert set(tp_map) >= {"sync_map", "async_submit", "sync_map_vs_async_submit"}
    assert peers["mp_pool"]["map"]["noop"]["map"]["n"] == 1
    assert isinstance(doc["summary"]["targets"], list)
    for target in doc["summary"]["targets"]:
        assert set(target) >= {"target", "value", "goal", "met"}

    markdown = (tmp_path / "latest.md").read_text()
    assert "| toolpool |" in markdown
    assert "## Targets" in markdown
    assert "## map over an iterable (part 7)" in markdown


@pytest.mark.timeout(120)
def test_the_executor_bench_runs() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "executor.py"), "--smoke", "--workers", "1"],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    rows = proc.stdout.strip().splitlines()
    assert rows[0].startswith("| executor (1 workers) | submit, one by one |")
    assert [row.split(" |")[0] for row in rows[2:]] == [
        "| ProcessPoolExecutor",
        "| toolpool.Executor",
        "| toolpool.Executor, prefetch=16",
    ]
