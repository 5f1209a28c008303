"""The worker's side of the pre-forked template (``Pool(start_method="fork")``).

The pool's reaper (``reaper/_main.py``) imports this module once, which imports what
every worker needs before it can serve (toolpool's worker, anyio and its asyncio backend,
msgpack, the zmq *module*), and then forks each new worker from itself: the reaper stays the
parent of every worker. Nothing here creates a zmq context, starts a thread or imports the
user's tools module: the forked child runs the unchanged worker :func:`~._main.main`, whose
set-up (cgroups, rlimits, namespaces, Landlock, PDEATHSIG, parent check, subreaper, secret)
comes first, single-threaded, exactly as in a worker started with ``python -m toolpool.worker``.

The reaper resets what belongs to the process (file descriptors, signal handlers and mask,
session, working directory, stdin/stdout/stderr) before calling :func:`run`; :func:`run` resets
what belongs to the interpreter (environment, ``sys.path``, ``sys.argv``, ``__main__``) and
never returns. See docs/pool.md, "Starting workers".
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
import types
from collections.abc import Mapping, Sequence
from typing import NoReturn

from .._exit import leave

#: What a worker imports before it serves a call, other than the tools module.
PRELOAD = (
    "toolpool",
    "toolpool.worker._main",
    "toolpool.worker._server",
    "toolpool.worker._registry",
    "toolpool.worker._capture",
    "toolpool._transport",
    "anyio._backends._asyncio",
    "msgpack",
    "zmq",
)

#: The argv prefix of a worker started by ``python -m``; what follows it is the worker's own.
WORKER_MODULE = "toolpool.worker"
#: The docstring of the worker's ``__main__.py``.
MAIN_DOC = "Entry point of a worker process: ``python -m toolpool.worker``."


def preload() -> None:
    """Import what every worker needs (no thread is started, no zmq context created)."""
    for name in PRELOAD:
        importlib.import_module(name)


def worker_path(cwd: str, env: Mapping[str, str], base: Sequence[str]) -> list[str]:
    """The ``sys.path`` of ``python -m toolpool.worker`` started in ``cwd`` with ``env``.

    ``base`` is the interpreter's own path (the standard library, site-packages and what
    their ``.pth`` files add). Duplicates are dropped, as ``site`` does.
    """
    paths = [cwd]
    paths.extend(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)
    paths.extend(base)
    seen: set[str] = set()
    out: list[str] = []
    for p in paths:
        key = os.path.normcase(os.path.abspath(p))
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


def run(argv: Sequence[str], env: Mapping[str, str], base_path: Sequence[str]) -> NoReturn:
    """Become the worker ``python -m toolpool.worker ARGV``; exit the process when it ends.

    Called in the freshly forked child, once the process-level state is reset.
    """
    code: int = 1
    try:
        code = _become(argv, env, base_path)
    finally:  # (whatever was raised, and wherever: the process ends here)
        # What the interpreter does at exit (non-daemon threads waited for, atexit), then out.
        leave(code)


def _become(argv: Sequence[str], env: Mapping[str, str], base_path: Sequence[str]) -> int:
    """:func:`run`'s work: the worker's exit status (1 where it failed, said on stderr)."""
    code = 1
    try:
        os.environ.clear()
        os.environ.update(env)
        if env.get("PYTHONUNBUFFERED"):  # as a fresh interpreter would read it
            for stream in (sys.stdout, sys.stderr):
                reconfigure = getattr(stream, "reconfigure", None)
                if reconfigure is not None:
                    reconfigure(write_through=True)
        sys.path[:] = worker_path(os.getcwd(), env, base_path)
        importlib.invalidate_caches()
        tempfile = sys.modules.get("tempfile")
        if tempfile is not None:  # its cached directory came from the reaper's environment
            tempfile.tempdir = None  # type: ignore[attr-defined]
        for name in [n for n in sys.modules if n.startswith("_toolpool_")]:
            del sys.modules[name]  # the reaper's helpers, loaded by path
        worker = sys.modules[f"{WORKER_MODULE}._main"]
        # What ``python -m toolpool.worker`` sees, without running it again through runpy:
        # its argv, its ``__main__`` (the worker's ``__main__.py``: nothing but ``main``),
        # not the reaper's script.
        main = sys.modules["__main__"] = types.ModuleType("__main__", MAIN_DOC)
        main.__file__ = os.path.join(os.path.dirname(worker.__file__ or ""), "__main__.py")
        main.__package__ = WORKER_MODULE
        main.main = worker.main  # type: ignore[attr-defined]
        sys.argv = [main.__file__, *argv]
        try:
            worker.main(list(argv))  # (its options parsed into a dict: no argparse)
            code = 0
        except SystemExit as exc:
            code = _exit_code(exc.code)
        except BaseException:
            traceback.print_exc()
            code = 1
    except BaseException:
        try:
            traceback.print_exc()
        except BaseException:
            pass
    return code


def _exit_code(value: object) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    try:
        print(value, file=sys.stderr)
    except BaseException:
        pass
    return 1
