"""The built-in registry behind :class:`toolpool.Executor`: plain Python functions as calls.

Its one tool, ``toolpool.function``, imports a function by module and qualified name and
calls it with pickled arguments, once per item of a chunk (``docs/executor.md``). The
supervisor names this registry by its spec, :data:`SPEC`; it never imports this module.

What travels (all inside the tool's msgpack arguments and result):

- arguments: ``target`` (``"module:qualname"``), ``calls`` (a pickle of ``(bound, items)``:
  ``bound`` is None, or a bound method to call instead of ``target``, pickled with its
  object; ``items`` a list of ``(args, kwargs)`` pairs), ``results`` (``"pickle"`` or
  ``"values"``), and ``main_path`` (the supervisor's ``__main__`` script, when the
  function is defined there);
- the value: the list of the function's return values, pickled (``"pickle"``) or as they are
  (``"values"``: msgpack's values only, checked by the registry as for any tool);
- when the function (or the import of ``target``) raises: the call's outcome is ``error``,
  and its context ``"toolpool.function"`` says what was raised (:func:`_describe`).

Unpickling the arguments here is safe for the supervisor: they come from it. The other way
is the supervisor's choice (``results``): it unpickles only what workers it trusts send.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import pickle
import sys
import traceback
from typing import Any, Final

from ..core import AbortError
from ._registry import Registry, ToolExecution

__all__ = ("CONTEXT_KEY", "SPEC", "TOOL", "registry")

#: The spec the supervisor's Executor starts its pool with.
SPEC: Final = "toolpool.worker._functions:registry"
#: The tool's name.
TOOL: Final = "toolpool.function"
#: The context key of what a function raised.
CONTEXT_KEY: Final = "toolpool.function"
#: The name the supervisor's ``__main__`` script is imported under (as multiprocessing does).
_MAIN_ALIAS: Final = "__mp_main__"

registry = Registry()


class FunctionExited(Exception):
    """The function raised a BaseException that is not an Exception (``SystemExit``...)."""


@registry.tool(name=TOOL, description="Call a module-level Python function (toolpool.Executor).")
def function(
    target: str, calls: bytes, results: str, execution: ToolExecution, main_path: str = ""
) -> object:
    """Import ``target`` and call it once per ``(args, kwargs)`` pair of ``calls``; between
    two items, stop (outcome ``aborted``) if the call was cancelled."""
    try:
        if main_path:
            _main_module(main_path)  # (before unpickling: the arguments may name its classes)
        bound, items = pickle.loads(calls)
        fn = bound if bound is not None else _resolve(target, main_path)
        values: list[Any] = []
        for args, kwargs in items:
            if values:
                execution.signal.raise_if_cancelled()
            value = fn(*args, **kwargs)
            if inspect.iscoroutine(value):  # an async function: run it to its end here
                value = asyncio.run(value)
            values.append(value)
        return pickle.dumps(values, pickle.HIGHEST_PROTOCOL) if results == "pickle" else values
    except (KeyboardInterrupt, GeneratorExit, AbortError):
        raise
    except BaseException as exc:
        execution.attach(CONTEXT_KEY, _describe(exc, pickled=results == "pickle"))
        if isinstance(exc, Exception):
            raise
        raise FunctionExited(f"{type(exc).__name__}: {exc}") from exc


def _describe(exc: BaseException, *, pickled: bool) -> dict[str, Any]:
    """What the supervisor needs to raise it again: its type, text and traceback, and (when
    results are pickled) the exception itself, or None if it does not pickle."""
    kind = type(exc)
    described: dict[str, Any] = {
        "type": f"{kind.__module__}.{kind.__qualname__}",
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(exc)),
    }
    if pickled:
        try:
            blob = pickle.dumps(exc, pickle.HIGHEST_PROTOCOL)
            pickle.loads(blob)  # (an exception whose __init__ takes other arguments fails here)
        except Exception:
            blob = None
        described["exception"] = blob
    return described


def _resolve(target: str, main_path: str) -> Any:
    module_name, _, qualname = target.partition(":")
    if module_name == "__main__" and main_path:
        module = _main_module(main_path)
    else:
        module = importlib.import_module(module_name)
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _main_module(path: str) -> Any:
    """The supervisor's ``__main__`` script, imported here once as ``__mp_main__`` (so its
    ``if __name__ == "__main__":`` block does not run) and made this process's
    ``__main__`` too, so that pickles of its classes resolve (as multiprocessing's spawn
    does)."""
    module = sys.modules.get(_MAIN_ALIAS)
    if module is None or getattr(module, "__file__", None) != path:
        spec = importlib.util.spec_from_file_location(_MAIN_ALIAS, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot import the main script {path!r}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[_MAIN_ALIAS] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[_MAIN_ALIAS]
            raise
    sys.modules["__main__"] = module
    return module
