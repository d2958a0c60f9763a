"""Where things are, for tests that start scripts: the repository, the examples, the workers;
and the benchmark scripts loaded as modules."""

import importlib.util
import os
import sys
from types import ModuleType

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
WORKERS = os.path.join(TESTS, "workers")


def worker(name: str) -> str:
    """The path of ``tests/workers/<name>``."""
    return os.path.join(WORKERS, name)


def repo(*parts: str) -> str:
    """The path of ``<repository>/<parts...>``."""
    return os.path.join(ROOT, *parts)


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a module named ``bench_<name>`` (by path, under a name of
    its own: ``checkpoint`` or ``distributed`` may name another module in a test run)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", repo("benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
