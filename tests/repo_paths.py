"""Where things are, for tests that start scripts: the repository, the examples, the workers."""

import os

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
WORKERS = os.path.join(TESTS, "workers")


def worker(name: str) -> str:
    """The path of ``tests/workers/<name>``."""
    return os.path.join(WORKERS, name)


def repo(*parts: str) -> str:
    """The path of ``<repository>/<parts...>``."""
    return os.path.join(ROOT, *parts)
