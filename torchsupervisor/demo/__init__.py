"""Demos: real training runs on data that ships with the machine (no download).

``torchsupervisor demo [digits]`` trains a small CNN on scikit-learn's handwritten digits in
seconds; ``torchsupervisor demo charlm`` trains a character-level transformer on the Python
standard library's source in about ten minutes on two CPU cores. Both are resumable and
deterministic.
"""

from __future__ import annotations

__all__ = ["DEMOS", "main"]

DEMOS = ("digits", "charlm")


def main(argv: list[str] | None = None) -> int:
    """Run a demo: ``[digits|charlm] [options]`` (digits when no name is given)."""
    argv = list(argv or [])
    name = argv.pop(0) if argv and argv[0] in DEMOS else "digits"
    if name == "charlm":
        from torchsupervisor.demo.charlm import main as demo_main
    else:
        from torchsupervisor.demo.digits import main as demo_main
    return demo_main(argv)
