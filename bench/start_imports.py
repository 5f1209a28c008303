"""What the supervisor process imports to start its first pool (issue 26, step 4).

Each figure is taken in a fresh interpreter (``sys.executable``), so nothing is cached:

- ``import toolpool``: modules loaded (``sys.modules`` before/after) and the CPU time of the
  import (``time.process_time``), the largest cumulative imports from ``-X importtime``;
- the first pool: ``async with toolpool.Pool(...)`` + one no-op call, the modules it adds
  after ``import toolpool`` and its wall time, create -> first result;
- the CLI: ``python -m toolpool --help``, modules loaded and wall time of the process.

Run: ``python bench/start_imports.py [--rounds N] [--top K] [--json]``. With ``--rounds`` the
first-pool figures are medians [min-max] over N fresh interpreters. Figures are never
asserted in tests (``tests/test_imports.py`` checks only which modules stay out).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time

EXAMPLES = "toolpool.testing.examples:registry"

# One child script, two modes (import, pool): what it loads, printed as JSON on its last line.
CHILD = r"""
import sys, time, json
mode = sys.argv[1]
base = set(sys.modules)
t0 = time.process_time()
w0 = time.perf_counter()
import toolpool
import_cpu = time.process_time() - t0
import_wall = time.perf_counter() - w0
after_import = set(sys.modules)
out = {"import_cpu_s": import_cpu, "import_wall_s": import_wall,
       "import_new": sorted(after_import - base)}
if mode == "pool":
    t0 = time.process_time()
    w0 = time.perf_counter()
    pool_cls = toolpool.Pool
    out["class_cpu_s"] = time.process_time() - t0
    class_wall = time.perf_counter() - w0
    after_class = set(sys.modules)
    out["class_new"] = sorted(after_class - after_import)
    import anyio

    async def first() -> float:
        c0 = time.perf_counter()
        async with pool_cls(TOOLS, workers=1) as pool:
            await pool.call("noop")
            first_s = time.perf_counter() - c0
        return first_s

    # create -> first result counts the class's import too (the first pool pays it)
    out["first_s"] = anyio.run(first) + class_wall
    out["pool_new"] = sorted(set(sys.modules) - after_class)
print(json.dumps(out))
""".replace("TOOLS", repr(EXAMPLES))

THIRD_PARTY = (
    "rich",
    "prometheus_client",
    "mcp",
    "starlette",
    "uvicorn",
    "pydantic",
    "psutil",
    "httpx",
    "anyio",
    "zmq",
    "msgpack",
    "asyncio",
    "ssl",
    "yaml",
    "jsonschema",
)


def _child(mode: str, importtime: bool = False) -> tuple[dict, str]:
    cmd = [sys.executable, *(["-X", "importtime"] if importtime else []), "-c", CHILD, mode]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def _families(mods: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for m in mods:
        top = m.split(".")[0]
        out[top] = out.get(top, 0) + 1
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _top_imports(stderr: str, k: int) -> list[tuple[int, str]]:
    rows = []
    for line in stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|(\s*)(\S+)", line)
        if m and len(m.group(3)) <= 3:  # imported directly by the toolpool import chain
            rows.append((int(m.group(2)), m.group(4)))
    return sorted(rows, reverse=True)[:k]


def _cli() -> dict:
    code = (
        "import sys, runpy, json\n"
        "base = set(sys.modules)\n"
        "sys.argv = ['toolpool', '--help']\n"
        "try:\n"
        "    runpy.run_module('toolpool', run_name='__main__', alter_sys=True)\n"
        "except SystemExit:\n"
        "    pass\n"
        "sys.stderr.write(json.dumps(sorted(set(sys.modules) - base)) + '\\n')\n"
    )
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    wall = time.perf_counter() - t0
    mods = json.loads(proc.stderr.strip().splitlines()[-1])
    return {"wall_s": wall, "new": mods}


def _agg(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:.1f} ms [{min(xs) * 1e3:.1f}-{max(xs) * 1e3:.1f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="fresh interpreters per figure")
    ap.add_argument("--top", type=int, default=12, help="largest imports shown")
    ap.add_argument("--json", action="store_true", help="print the raw figures as JSON")
    args = ap.parse_args()

    imp_cpu, imp_wall, cls_cpu, first, cli_wall = [], [], [], [], []
    last: dict = {}
    cli: dict = {}
    for _ in range(args.rounds):
        last, _err = _child("pool")
        imp_cpu.append(last["import_cpu_s"])
        imp_wall.append(last["import_wall_s"])
        cls_cpu.append(last["class_cpu_s"])
        first.append(last["first_s"])
        cli = _cli()
        cli_wall.append(cli["wall_s"])
    _res, err = _child("pool", importtime=True)

    report = {
        "import_modules": len(last["import_new"]),
        "import_cpu": _agg(imp_cpu),
        "import_wall": _agg(imp_wall),
        "pool_class_modules": len(last["class_new"]),
        "pool_class_cpu": _agg(cls_cpu),
        "first_pool_modules": len(last["pool_new"]),
        "first_result": _agg(first),
        "cli_help_modules": len(cli["new"]),
        "cli_help_wall": _agg(cli_wall),
        "third_party_on_import": sorted(
            {m.split(".")[0] for m in last["import_new"] + last["class_new"]} & set(THIRD_PARTY)
        ),
        "third_party_on_cli_help": sorted({m.split(".")[0] for m in cli["new"]} & set(THIRD_PARTY)),
        "import_families": _families(last["import_new"]),
        "pool_class_families": _families(last["class_new"]),
        "first_pool_families": _families(last["pool_new"]),
        "cli_families": _families(cli["new"]),
        "top_imports_us": _top_imports(err, args.top),
    }
    if args.json:
        report["import_new"] = last["import_new"]
        report["class_new"] = last["class_new"]
        report["pool_new"] = last["pool_new"]
        report["cli_new"] = cli["new"]
        print(json.dumps(report, indent=1))
        return
    for key, value in report.items():
        print(f"{key}: {value}")


if __name__ == "__main__":
    main()
