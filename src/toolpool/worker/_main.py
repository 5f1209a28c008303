"""The worker process: ``python -m toolpool.worker --endpoint ... --tools module:attr``.

Set-up happens first, single-threaded, before zmq starts its threads and before the tools
module is imported: die with the parent (PR_SET_PDEATHSIG), check the parent did not already
die, become a child subreaper (so daemons a tool starts stay in this tree), read the per-worker
secret from stdin. Then connect, import the tools, say hello, and serve its calls one at a
time, in the order they came, on the main thread (``_server.py``).

The supervisor may send a call while another runs (``Pool(prefetch=...)``): it waits in the
worker's queue. The worker writes to its *ledger* (protocol/_ledger.py), memory it shares
with the supervisor, which reaches the supervisor even if the worker is killed the next
instant: the id of a call before taking it up, again before invoking its body, and a copy of
each result before sending it. So after any death the supervisor knows which calls were
never taken up (it runs them elsewhere), whether the body of the one that was had started,
and every result sent, even one still in the dying worker's zmq queue. A result too large
for the ledger must be acknowledged before the worker takes up its next call.
"""

from __future__ import annotations

import importlib
import json
import mmap
import os
import signal
import sys
import traceback
from typing import TYPE_CHECKING, Any, TypedDict

# Stdlib and msgpack only (no threads): safe before set-up. zmq is imported after it.
from ..protocol import PROTOCOL_VERSION, Fatal, Hello, encode
from ..protocol._ledger import LEDGER_SIZE
from ..sandbox import Profile
from ..sandbox._apply import apply_profile
from ..sandbox._linux import PR_SET_CHILD_SUBREAPER, PR_SET_PDEATHSIG, prctl
from ._server import _Server as _Server  # (tests find the worker's server by this name)

if TYPE_CHECKING:
    from ._registry import Registry

EXIT_SETUP_FAILED = 70
EXIT_TOOLS_FAILED = 71


class Options(TypedDict):
    """What a worker is told: its command line's options, by name (``--parent-pid`` is
    ``parent_pid``)."""

    endpoint: str  # the zmq endpoint to connect to
    tools: str  # module:attribute naming a Registry
    parent_pid: int  # the reaper: the worker exits at once if it is not its parent
    max_frame: int  # the largest message either way
    profile: str  # the containment profile (JSON; "": none)
    capture: int  # bytes of output kept per call (0: none)
    cgroup_procs: str  # comma-separated cgroup.procs files to join
    ledger: str  # the ledger file shared with the supervisor
    members: str  # the cgroup v2 cgroup.procs listing the worker's tree
    heartbeat: float  # seconds between heartbeats to the supervisor (0: none)
    allow_background: bool  # processes a call leaves behind are allowed: never wait for them


#: Each option's type and default (None: required); ``allow_background`` is a flag.
_OPTIONS: dict[str, tuple[type, object]] = {
    "endpoint": (str, None),
    "tools": (str, None),
    "parent_pid": (int, None),
    "max_frame": (int, None),
    "profile": (str, ""),
    "capture": (int, 0),
    "cgroup_procs": (str, ""),
    "ledger": (str, ""),
    "members": (str, ""),
    "heartbeat": (float, 0.0),
}
USAGE = "usage: python -m toolpool.worker --endpoint E --tools MODULE:ATTR --parent-pid PID "
USAGE += "--max-frame BYTES [--profile JSON] [--capture BYTES] [--cgroup-procs FILES] "
USAGE += "[--ledger FILE] [--members FILE] [--heartbeat SECONDS] [--allow-background]"


def parse_options(argv: list[str]) -> Options:
    """The worker's options from its command line (``--name value`` pairs and the flag
    ``--allow-background``, as the supervisor writes them). Plain, for a quick start: a
    worker forked from the template parses its command line with this, not with argparse.
    Raises ValueError naming what is wrong."""
    values: dict[str, object] = {"allow_background": False}
    args = iter(argv)
    for arg in args:
        name = arg.removeprefix("--").replace("-", "_")
        if not arg.startswith("--") or (name not in _OPTIONS and name != "allow_background"):
            raise ValueError(f"unknown argument {arg!r}")
        if name == "allow_background":
            values[name] = True
            continue
        text = next(args, None)
        if text is None:
            raise ValueError(f"{arg} needs a value")
        kind = _OPTIONS[name][0]
        try:
            values[name] = kind(text)
        except ValueError:
            raise ValueError(f"{arg}: not a valid {kind.__name__}: {text!r}") from None
    for name, (_kind, default) in _OPTIONS.items():
        if name not in values:
            if default is None:
                raise ValueError(f"--{name.replace('_', '-')} is required")
            values[name] = default
    return values  # type: ignore[return-value]


def open_ledger(path: str) -> mmap.mmap | None:
    """Map the ledger file read-write (before set-up: the mapping outlives a uid change and
    Landlock, which would forbid opening it later)."""
    if not path:
        return None
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        # The whole file: the marks and slots (LEDGER_SIZE), then the spill (its size is the
        # supervisor's to choose).
        size = max(os.fstat(fd).st_size, LEDGER_SIZE)
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def open_members(path: str) -> int | None:
    """An fd on the worker's cgroup v2 ``cgroup.procs`` (pread re-reads it), or None."""
    if not path:
        return None
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


def setup(
    parent_pid: int,
    profile_json: str | None,
    procs_files: list[str],
    endpoint: str = "",
    tools_module: str | None = None,
) -> tuple[bytes, dict[str, list[Any]], str | None]:
    """Process set-up, in an order that does not undo itself.

    Returns the secret, what the containment set-up applied, and an error that must stop the
    worker (a required layer is missing), reported once connected.
    """

    error: str | None = None
    report: dict[str, list[Any]] = {}
    try:
        profile = Profile.from_wire(json.loads(profile_json)) if profile_json else None
        if profile is not None:
            path = endpoint.removeprefix("ipc://")
            own = [os.path.dirname(path), path] if endpoint.startswith("ipc:///") else []
            report = apply_profile(profile, procs_files, own, tools_module)
    except (RuntimeError, ValueError, TypeError) as exc:
        error = f"containment set-up failed: {exc}"
    if sys.platform.startswith("linux"):
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent_pid:  # the parent died before PDEATHSIG was armed
            os._exit(EXIT_SETUP_FAILED)
        prctl(PR_SET_CHILD_SUBREAPER, 1)
    secret = sys.stdin.buffer.readline().strip()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    if not secret:
        os._exit(EXIT_SETUP_FAILED)
    return secret, report, error


def load_registry(spec: str) -> Registry:
    """Import ``module:attribute`` and return the Registry it names."""
    from ._registry import Registry

    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"tools spec {spec!r} is not of the form 'module:attribute'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError:
        raise
    except Exception as exc:  # (a SyntaxError too): one line that says where, the cause chained
        raise ImportError(
            f"importing {module_name!r} (tools spec {spec!r}) raised {type(exc).__name__}: {exc}"
        ) from exc
    for n, part in enumerate(attr.split(".")):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            # As ``from module import name`` says it, and one line (the CLI prints it).
            where = ".".join([module_name, *attr.split(".")[:n]])
            raise ImportError(f"cannot find {part!r} in {where!r} (tools spec {spec!r})") from None
    if callable(obj) and not isinstance(obj, Registry):
        obj = obj()
    if not isinstance(obj, Registry):
        kind = type(obj).__name__
        article = "an" if kind[:1].lower() in "aeiou" else "a"
        raise TypeError(f"{spec!r} is {article} {kind}, not a toolpool.Registry")
    return obj


def main(argv: list[str] | None = None) -> None:
    """``python -m toolpool.worker ARGV``: a bad command line exits with status 2."""
    try:
        options = parse_options(sys.argv[1:] if argv is None else argv)
    except ValueError as exc:
        print(f"{USAGE}\npython -m toolpool.worker: error: {exc}", file=sys.stderr)
        sys.exit(2)
    run(options)


def run(args: Options) -> None:
    """Be the worker ``args`` describe: set up, connect, say hello, serve until told to stop."""
    procs = [p for p in args["cgroup_procs"].split(",") if p]
    try:
        ledger = open_ledger(args["ledger"])
    except (OSError, ValueError):
        os._exit(EXIT_SETUP_FAILED)
    members = open_members(args["members"])
    tools = args["tools"]
    secret, report, setup_error = setup(
        args["parent_pid"],
        args["profile"] or None,
        procs,
        args["endpoint"],
        tools.partition(":")[0],
    )

    capture = None
    if args["capture"] > 0:
        from ._capture import OutputCapture

        capture = OutputCapture(args["capture"])

    import zmq

    ctx = zmq.Context(io_threads=1)
    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.setsockopt(zmq.MAXMSGSIZE, args["max_frame"])
    sock.setsockopt(zmq.RECONNECT_IVL, -1)
    sock.connect(args["endpoint"])
    try:
        if setup_error is not None:
            raise RuntimeError(setup_error)
        registry = load_registry(tools)
        # Each entry also says whether the tool is sync (the supervisor queues calls only
        # behind such bodies: protocol.md 6.2). It is not part of the catalog.
        catalog = [
            {**spec.describe(), "runs_in_thread": not spec.is_async}
            for spec in registry.tools.values()
        ]
    except BaseException:
        sock.send(encode(Fatal(secret, traceback.format_exc(limit=20)[-8000:])))
        sock.close()
        ctx.term()
        os._exit(EXIT_TOOLS_FAILED)
    sock.send(encode(Hello(PROTOCOL_VERSION, os.getpid(), secret, catalog, report)))

    server = _Server(sock, registry, args["max_frame"], capture, ledger, members, args["heartbeat"])
    server.machine.allow_background = args["allow_background"]
    try:
        server.serve()
    finally:
        sock.close(linger=1000)
        ctx.term()
