"""Test-only: stands in for ``python -m toolpool.worker``. It reads the worker's secret like
the worker, then lets *another* process (its child) connect and say hello with it, claiming
the real worker's pid; the real worker process itself only waits. The supervisor must refuse
the impostor: the secret alone does not prove who is at the other end of the socket."""

from __future__ import annotations

import os
import signal
import sys

from toolpool.protocol import PROTOCOL_VERSION, Hello, encode


def main() -> None:
    argv = sys.argv[1:]
    endpoint = argv[argv.index("--endpoint") + 1]
    secret = sys.stdin.buffer.readline().strip()
    worker_pid = os.getpid()
    if os.fork() == 0:
        import zmq

        ctx = zmq.Context()
        sock = ctx.socket(zmq.PAIR)
        sock.connect(endpoint)
        sock.send(encode(Hello(PROTOCOL_VERSION, worker_pid, secret, [], {})))
        signal.pause()  # until the pool kills the tree
    signal.pause()


if __name__ == "__main__":
    main()
