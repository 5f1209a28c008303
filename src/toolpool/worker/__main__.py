"""Entry point of a worker process: ``python -m toolpool.worker``."""

from ._main import main

if __name__ == "__main__":
    main()
