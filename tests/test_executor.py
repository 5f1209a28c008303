"""``toolpool.Executor``: the cases of CPython's own executor tests
(``Lib/test/test_concurrent_futures/``: executor.py, test_shutdown.py, test_wait.py,
test_as_completed.py, test_process_pool.py) on toolpool's code, then what is toolpool's own:
references refused, cancel and terminate, the result codecs, the default worker count.

Real worker processes throughout; a module-scoped executor serves the tests that do not
shut it down (each pool start costs a few hundred ms of a shared 2-core machine).
"""

from __future__ import annotations

import collections
import concurrent.futures as futures
import functools
import gc
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest

import executor_funcs as funcs
import toolpool
from toolpool import Outcome, Rung

TESTS = str(Path(__file__).parent)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def executor() -> Iterator[toolpool.Executor]:
    with toolpool.Executor(max_workers=2, cancel_grace=0.2, term_grace=1.0) as ex:
        yield ex


def _done_future(state: str) -> futures.Future[int]:
    """The standard tests' ready-made futures: finished, failed, cancelled (and notified)."""
    future: futures.Future[int] = futures.Future()
    if state == "successful":
        future.set_result(42)
    elif state == "exception":
        future.set_exception(OSError())
    elif state == "cancelled":
        future.cancel()
    elif state == "cancelled_and_notified":
        future.cancel()
        future.set_running_or_notify_cancel()
    return future


def _run(code: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([TESTS, *sys.path])}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


# ====================================================================== executor.py


def test_submit(executor: toolpool.Executor) -> None:
    assert executor.submit(pow, 2, 8).result(timeout=30) == 256


def test_submit_keyword(executor: toolpool.Executor) -> None:
    assert executor.submit(funcs.mul, 2, y=8).result(timeout=30) == 16
    future = executor.submit(funcs.capture, 1, self=2, fn=3)
    assert future.result(timeout=30) == ((1,), {"self": 2, "fn": 3})
    with pytest.raises(TypeError):
        executor.submit(fn=funcs.capture, arg=1)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        executor.submit(arg=1)  # type: ignore[call-arg]


def test_map(executor: toolpool.Executor) -> None:
    expected = list(map(pow, range(10), range(10)))
    assert list(executor.map(pow, range(10), range(10))) == expected
    assert list(executor.map(pow, range(10), range(10), chunksize=3)) == expected


def test_map_exception(executor: toolpool.Executor) -> None:
    results = executor.map(divmod, [1, 1, 1, 1], [2, 3, 0, 5])
    assert next(results) == (0, 1)
    assert next(results) == (0, 1)
    with pytest.raises(ZeroDivisionError):
        next(results)


def test_map_timeout(executor: toolpool.Executor) -> None:
    results: list[object] = []

    def consume() -> None:
        for value in executor.map(time.sleep, [0, 0, 6], timeout=3):
            results.append(value)

    with pytest.raises(TimeoutError):
        consume()
    assert results == [None, None]


def test_shutdown_race_issue12456() -> None:
    with toolpool.Executor(max_workers=1) as ex:
        ex.map(str, [2] * 2)
        ex.shutdown()


def test_no_stale_references(executor: toolpool.Executor) -> None:
    obj = funcs.MyObject()
    collected = threading.Event()
    ref = weakref.ref(obj, lambda _: collected.set())
    executor.submit(obj.my_method)  # the future deliberately dropped
    del obj
    gc.collect()
    assert collected.wait(timeout=30)
    assert ref() is None


@pytest.mark.parametrize("number", [0, -1])
def test_max_workers_negative(number: int) -> None:
    with pytest.raises(ValueError, match="max_workers must be greater than 0"):
        toolpool.Executor(max_workers=number)


def test_free_reference(executor: toolpool.Executor) -> None:
    for obj in executor.map(funcs.make_dummy_object, range(10)):
        ref = weakref.ref(obj)
        del obj
        gc.collect()
        assert ref() is None


# ====================================================================== test_shutdown.py


def test_run_after_shutdown() -> None:
    ex = toolpool.Executor(max_workers=1)
    ex.shutdown()
    with pytest.raises(RuntimeError, match="cannot schedule new futures after shutdown"):
        ex.submit(pow, 2, 5)


def test_interpreter_shutdown_runs_what_was_submitted() -> None:
    """Never shut down: the interpreter's exit waits for the call, then closes the pool."""
    done = _run(
        """
        import toolpool, executor_funcs
        if __name__ == "__main__":
            ex = toolpool.Executor(2)
            ex.submit(executor_funcs.sleep_and_print, 1.0, "apple")
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    # (the worker's output is discarded by default: the call's own print is not seen)
    done = _run(
        """
        import toolpool, executor_funcs
        if __name__ == "__main__":
            ex = toolpool.Executor(2)
            f = ex.submit(executor_funcs.sleep_deaf, 1.0)
            import atexit
            atexit.register(lambda: print("settled", f.done(), flush=True))
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "settled True"


def test_submit_after_interpreter_shutdown() -> None:
    done = _run(
        """
        import atexit
        @atexit.register
        def run_last():
            try:
                t.submit(id, None)
            except RuntimeError:
                print("runtime-error")
                raise
        import toolpool
        if __name__ == "__main__":
            t = toolpool.Executor(2)
            t.submit(id, 42).result()
        """
    )
    assert "RuntimeError: cannot schedule new futures" in done.stderr
    assert done.stdout.strip() == "runtime-error"


def test_hang_issue12364() -> None:
    with toolpool.Executor(max_workers=2) as ex:
        fs = [ex.submit(time.sleep, 0.01) for _ in range(50)]
        ex.shutdown()
        for f in fs:
            assert f.result(timeout=0) is None


def test_cancel_futures() -> None:
    ex = toolpool.Executor(max_workers=2)
    fs = [ex.submit(time.sleep, 0.1) for _ in range(50)]
    ex.shutdown(cancel_futures=True)
    cancelled = [f for f in fs if f.cancelled()]
    assert len(cancelled) > 20
    others = [f for f in fs if not f.cancelled()]
    assert others
    for f in others:
        assert f.done()
        assert f.exception() is None


def test_cancel_futures_wait_false() -> None:
    done = _run(
        """
        import time, toolpool
        if __name__ == "__main__":
            t = toolpool.Executor(1)
            running = t.submit(time.sleep, 0.5)
            while not running.running():
                time.sleep(0.01)
            queued = t.submit(time.sleep, 60)
            t.shutdown(wait=False, cancel_futures=True)
            print(queued.cancelled(), running.cancelled(), flush=True)
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True False"


def test_hang_gh83386_shutdown_without_waiting() -> None:
    done = _run(
        """
        import toolpool, executor_funcs
        if __name__ == "__main__":
            t = toolpool.Executor(max_workers=2)
            f = t.submit(executor_funcs.sleep_deaf, 1.0)
            t.shutdown(wait=False)
            print("returned", f.done(), flush=True)
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "returned False"  # (and the exit waited for the call)


def test_hang_gh94440_cancel_right_before_shutdown() -> None:
    ex = toolpool.Executor(max_workers=1)
    ex.submit(int).result(timeout=30)
    ex.submit(int).cancel()
    started = time.monotonic()
    ex.shutdown(wait=True)
    assert time.monotonic() - started < 30


def test_context_manager_shutdown() -> None:
    with toolpool.Executor(max_workers=2) as ex:
        assert list(ex.map(abs, range(-5, 5))) == [5, 4, 3, 2, 1, 0, 1, 2, 3, 4]
        pids = ex._sync._pool.worker_pids
    assert pids
    for pid in pids:  # every worker is gone (reaped) once the with block is left
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_del_shutdown() -> None:
    ex = toolpool.Executor(max_workers=1)
    ex.submit(pow, 2, 2).result(timeout=30)
    sync = ex._sync
    pids = sync._pool.worker_pids
    del ex
    gc.collect()
    deadline = time.monotonic() + 60
    while sync._portal is not None and time.monotonic() < deadline:
        time.sleep(0.05)  # (closed in a thread of its own: nothing here to await)
    assert sync._portal is None
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


# ====================================================================== test_wait.py


def test_wait_20369(executor: toolpool.Executor) -> None:
    future = executor.submit(time.sleep, 0.5)
    done, not_done = futures.wait([future, future], return_when=futures.ALL_COMPLETED)
    assert (done, not_done) == ({future}, set())


def test_first_completed(executor: toolpool.Executor) -> None:
    cancelled = _done_future("cancelled")
    future1 = executor.submit(funcs.mul, 21, 2)
    future2 = executor.submit(time.sleep, 3)
    done, not_done = futures.wait(
        [cancelled, future1, future2], return_when=futures.FIRST_COMPLETED, timeout=30
    )
    assert done == {future1}
    assert not_done == {cancelled, future2}
    toolpool.terminate(future2, force=True)


def test_first_exception(executor: toolpool.Executor) -> None:
    future1 = executor.submit(funcs.mul, 2, 21)
    future2 = executor.submit(funcs.sleep_and_raise, 1.0)
    future1.result(timeout=30)  # (two workers: the third call waits for the first)
    future3 = executor.submit(time.sleep, 10)
    finished, pending = futures.wait(
        [future1, future2, future3], return_when=futures.FIRST_EXCEPTION, timeout=30
    )
    assert finished == {future1, future2}
    assert pending == {future3}
    toolpool.terminate(future3, force=True)


def test_first_exception_some_already_complete(executor: toolpool.Executor) -> None:
    successful = _done_future("successful")
    cancelled = _done_future("cancelled")
    notified = _done_future("cancelled_and_notified")
    future1 = executor.submit(divmod, 21, 0)
    future2 = executor.submit(time.sleep, 3)
    finished, pending = futures.wait(
        [successful, cancelled, notified, future1, future2],
        return_when=futures.FIRST_EXCEPTION,
        timeout=30,
    )
    assert finished == {successful, notified, future1}
    assert pending == {cancelled, future2}
    toolpool.terminate(future2, force=True)


def test_all_completed(executor: toolpool.Executor) -> None:
    ready = [_done_future(s) for s in ("successful", "cancelled_and_notified", "exception")]
    future1 = executor.submit(divmod, 2, 0)
    future2 = executor.submit(funcs.mul, 2, 21)
    finished, pending = futures.wait(
        [*ready, future1, future2], return_when=futures.ALL_COMPLETED, timeout=30
    )
    assert finished == {*ready, future1, future2}
    assert pending == set()


def test_wait_timeout(executor: toolpool.Executor) -> None:
    ready = [_done_future(s) for s in ("successful", "cancelled_and_notified", "exception")]
    future = executor.submit(time.sleep, 5)
    finished, pending = futures.wait([*ready, future], timeout=0.05)
    assert finished == set(ready)
    assert pending == {future}
    toolpool.terminate(future, force=True)


# ====================================================================== test_as_completed.py


def test_as_completed_no_timeout(executor: toolpool.Executor) -> None:
    ready = [_done_future(s) for s in ("successful", "cancelled_and_notified", "exception")]
    future1 = executor.submit(funcs.mul, 2, 21)
    future2 = executor.submit(funcs.mul, 7, 6)
    completed = set(futures.as_completed([*ready, future1, future2], timeout=30))
    assert completed == {*ready, future1, future2}


@pytest.mark.parametrize("timeout", [0, 0.1])
def test_as_completed_future_times_out(executor: toolpool.Executor, timeout: float) -> None:
    ready = {_done_future(s) for s in ("successful", "cancelled_and_notified", "exception")}
    future = executor.submit(time.sleep, 5)
    seen = set()

    def consume() -> None:
        for f in futures.as_completed(ready | {future}, timeout):
            seen.add(f)

    with pytest.raises(TimeoutError):
        consume()
    assert seen == ready
    toolpool.terminate(future, force=True)


def test_as_completed_duplicate_futures(executor: toolpool.Executor) -> None:
    future = executor.submit(time.sleep, 0.2)
    assert list(futures.as_completed([future] * 3, timeout=30)) == [future]


# ====================================================================== test_process_pool.py


def test_killed_worker_fails_its_call_only(executor: toolpool.Executor) -> None:
    """ProcessPoolExecutor's pool breaks (BrokenProcessPool); here the call that lost its
    worker fails, says why, and the executor goes on."""
    future = executor.submit(funcs.exit_worker)
    with pytest.raises(toolpool.CallFailed, match="worker_lost") as caught:
        future.result(timeout=30)
    assert caught.value.result.outcome is Outcome.WORKER_LOST
    assert caught.value.result.exit_code == 7
    assert future.call_result() is caught.value.result
    assert executor.submit(pow, 2, 8).result(timeout=30) == 256


def test_map_chunksize(executor: toolpool.Executor) -> None:
    expected = list(map(pow, range(40), range(40)))
    for chunksize in (6, 50, 40):
        assert list(executor.map(pow, range(40), range(40), chunksize=chunksize)) == expected
    for bad in (0, -1):
        with pytest.raises(ValueError, match="chunksize"):
            list(executor.map(pow, range(40), range(40), chunksize=bad))


def test_traceback(executor: toolpool.Executor) -> None:
    future = executor.submit(funcs.raise_runtime_error)
    with pytest.raises(RuntimeError) as caught:
        future.result(timeout=30)
    exc = caught.value
    assert type(exc) is RuntimeError
    assert exc.args == (123,)
    cause = exc.__cause__
    assert type(cause) is toolpool.RemoteTraceback
    assert "raise RuntimeError(123)  # some comment" in cause.tb
    assert future.call_result().outcome is Outcome.ERROR  # the Result says what happened


def test_idle_worker_reuse() -> None:
    with toolpool.Executor(max_workers=2) as ex:
        pids = {ex.submit(os.getpid).result(timeout=30) for _ in range(3)}
        assert len(pids) <= 2
        assert pids <= set(ex._sync._pool.worker_pids)


# ====================================================================== toolpool's own


def test_references_that_cannot_be_imported_are_refused(executor: toolpool.Executor) -> None:
    def nested() -> int:
        return 1

    factor = 3
    with pytest.raises(TypeError, match="a lambda"):
        executor.submit(lambda: factor)
    with pytest.raises(TypeError, match="defined inside a function"):
        executor.submit(nested)
    with pytest.raises(TypeError, match="cannot be pickled"):
        executor.submit(funcs.LockHolder().method)
    with pytest.raises(TypeError, match="does not name this object"):
        executor.submit(funcs.shadowed)
    with pytest.raises(TypeError, match="not callable"):
        executor.submit(42)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"arguments of .* cannot be pickled"):
        executor.submit(funcs.mul, threading.Lock(), 1)
    with pytest.raises(TypeError, match="a lambda"):
        executor.map(lambda x: x, [1])


def test_what_a_function_may_be(executor: toolpool.Executor) -> None:
    assert executor.submit(functools.partial(funcs.mul, 6), 7).result(timeout=30) == 42
    assert executor.submit(funcs.MyObject.make, 1).result(timeout=30) == 2  # a classmethod
    assert executor.submit(str.upper, "a").result(timeout=30) == "A"  # a method descriptor
    assert executor.submit(funcs.async_mul, 6, 7).result(timeout=30) == 42  # run to its end
    point = funcs.Point(1, 2)
    assert executor.submit(funcs.swap, point).result(timeout=30) == funcs.Point(2, 1)


def test_exceptions_that_do_not_pickle_back(executor: toolpool.Executor) -> None:
    with pytest.raises(toolpool.RemoteError) as caught:
        executor.submit(funcs.raise_odd).result(timeout=30)
    assert caught.value.type_name == "executor_funcs.OddError"
    assert caught.value.message == "1 and 2"
    assert "raise OddError(1, 2)" in caught.value.traceback
    with pytest.raises(toolpool.RemoteError, match="SystemExit: 3"):
        executor.submit(funcs.raise_system_exit).result(timeout=30)
    # A value that does not pickle is the function's failure, raised as pickle raised it.
    with pytest.raises(TypeError, match="pickle"):
        executor.submit(funcs.unpicklable_result).result(timeout=30)


def _until_started(path: Path) -> None:
    """Until the function created ``path`` (no event says a plain function started)."""
    deadline = time.monotonic() + 30
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert path.exists()


def test_cancel_is_true_only_for_a_call_that_never_started(tmp_path: Path) -> None:
    with toolpool.Executor(max_workers=1, cancel_grace=0.2, term_grace=0.5) as ex:
        running = ex.submit(funcs.started_then_sleep, str(tmp_path / "a"), 60)
        queued = ex.submit(funcs.mul, 1, 2)
        _until_started(tmp_path / "a")
        assert running.running()
        assert not queued.running()
        assert queued.cancel() is True
        assert queued.cancelled()
        assert queued.cancel() is True  # (again: still cancelled, as a Future says)
        with pytest.raises(futures.CancelledError):
            queued.result(timeout=0)
        assert queued.call_result().outcome is Outcome.ABORTED_BEFORE_DISPATCH
        assert running.cancel() is False  # it runs: cancel() leaves it alone
        assert not running.done()

        # The ladder: the cancel message (a plain function never sees it), SIGTERM.
        assert toolpool.terminate(running) is True
        with pytest.raises(toolpool.CallFailed, match="killed") as caught:
            running.result(timeout=30)
        assert caught.value.result.rung is Rung.SIGTERM
        assert running.call_result().outcome is Outcome.KILLED
        assert toolpool.terminate(running) is False  # settled: nothing to stop

        forced = ex.submit(funcs.started_then_sleep, str(tmp_path / "b"), 60)
        _until_started(tmp_path / "b")
        assert toolpool.terminate(forced, force=True) is True
        assert forced.call_result(timeout=30).rung is Rung.SIGKILL
        assert ex.submit(funcs.mul, 6, 7).result(timeout=30) == 42  # a new worker serves

    with pytest.raises(TypeError, match="terminate"):
        toolpool.terminate(futures.Future())


def test_terminate_takes_a_sync_pool_call_too() -> None:
    with toolpool.SyncPool("map_tools:registry", workers=1, cancel_grace=0.2) as pool:
        call = pool.submit("varied", {"kind": "hang"})
        assert toolpool.terminate(call, force=True) is True
        result = call.result(timeout=30)
        # (killed, or withdrawn if the cancel reached the worker before the body started)
        assert result.outcome in (Outcome.KILLED, Outcome.ABORTED_BEFORE_DISPATCH)
        assert result.cause == {"kind": "user"}
        assert toolpool.terminate(call) is False


def test_results_codec_follows_trust() -> None:
    with pytest.raises(toolpool.ConfigurationError, match="unpickling"):
        toolpool.Executor(1, profile="untrusted", results="pickle")
    with pytest.raises(ValueError, match="results"):
        toolpool.Executor(1, results="json")  # type: ignore[arg-type]
    with toolpool.Executor(max_workers=1, results="values") as ex:
        assert ex.results == "values"
        assert ex.submit(funcs.capture, 1, a=[2]).result(timeout=30) == [[1], {"a": [2]}]
        with pytest.raises(toolpool.RemoteError) as caught:
            ex.submit(divmod, 1, 0).result(timeout=30)
        assert caught.value.type_name == "builtins.ZeroDivisionError"
        assert isinstance(caught.value.__cause__, toolpool.RemoteTraceback)
        with pytest.raises(toolpool.CallFailed, match="error") as failed:
            ex.submit(funcs.make_dummy_object, 1).result(timeout=30)  # not a msgpack value
        assert failed.value.result.error_name == "UnserializableResult"


def test_an_untrusted_executor_takes_values_back_never_pickles() -> None:
    """Under the untrusted profile results come back as msgpack values: the supervisor
    unpickles nothing a sandboxed worker sends."""
    with toolpool.Executor(1, profile="untrusted") as ex:
        assert ex.results == "values"
        assert ex.submit(funcs.capture, 1, a=(2,)).result(timeout=60) == [[1], {"a": [2]}]
        with pytest.raises(toolpool.RemoteError) as caught:
            ex.submit(divmod, 1, 0).result(timeout=60)
        assert caught.value.type_name == "builtins.ZeroDivisionError"
        assert "exception" not in caught.value.result.context["toolpool.function"]


def test_functions_of_a_main_script(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(
        textwrap.dedent(
            """
            import toolpool

            class Box:
                def __init__(self, v):
                    self.v = v

            def unbox(box):
                return Box(box.v * 2)

            if __name__ == "__main__":
                with toolpool.Executor(1) as ex:
                    print(ex.submit(unbox, Box(21)).result(timeout=30).v, flush=True)
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=90,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "42"


def test_the_default_worker_count_follows_the_cpus_this_process_may_use() -> None:
    done = _run(
        """
        import os, toolpool
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
        print(toolpool.Pool("map_tools:registry").size,
              toolpool.SyncPool("map_tools:registry")._pool.size, flush=True)
        with toolpool.Executor() as ex:
            print(ex.max_workers, len(ex._sync._pool.worker_pids), flush=True)
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "1", "1", "1"]
    assert toolpool.Pool("map_tools:registry").size == len(os.sched_getaffinity(0))


# ====================================================================== max_calls_per_worker


def test_max_calls_per_worker_recycles_a_worker(caplog: pytest.LogCaptureFixture) -> None:
    """CPython's test_max_tasks_per_child, on ``max_calls_per_worker``."""
    caplog.set_level(logging.DEBUG, logger="toolpool.supervisor")
    with toolpool.Executor(1, max_calls_per_worker=3) as ex:
        first = ex.submit(os.getpid).result(timeout=30)
        assert ex.submit(os.getpid).result(timeout=30) == first
        assert ex.submit(os.getpid).result(timeout=30) == first
        new = ex.submit(os.getpid).result(timeout=30)  # a new worker, the first one gone
        assert new != first
        # The first one retired; its process may still be exiting (listed until its tree is
        # reported gone: the new one can serve a call before that): no third worker.
        pids = ex._sync._pool.worker_pids
        assert new in pids
        assert set(pids) <= {first, new}
        stats = ex._sync.statistics()
    with pytest.raises(ProcessLookupError):
        os.kill(first, 0)
    assert stats.workers_started == 2
    assert "retired (it served 3 calls (max_calls_per_worker=3))" in caplog.text
    with pytest.raises(ValueError, match="max_calls_per_worker"):
        toolpool.Pool("map_tools:registry", max_calls_per_worker=0)


def test_max_calls_per_worker_early_shutdown() -> None:
    with toolpool.Executor(3, max_calls_per_worker=1) as ex:
        fs = [ex.submit(funcs.mul, i, i) for i in range(6)]
        ex.shutdown()
    assert [f.result(timeout=0) for f in fs] == [i * i for i in range(6)]


def test_max_calls_per_worker_bounds_what_a_worker_takes_ahead() -> None:
    """With prefetch, a worker is sent no more calls than it has left to serve."""
    with toolpool.Executor(2, max_calls_per_worker=3, prefetch=16) as ex:
        pids = list(ex.map(funcs.pid_of, range(30)))
    assert len(pids) == 30
    per_worker = collections.Counter(pids)
    assert max(per_worker.values()) <= 3
    assert len(per_worker) >= 10
