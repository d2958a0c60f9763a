"""``torchsupervisor demo [digits|charlm]``: a real training run under a Supervisor, resumable.

``digits`` (the default) trains a small CNN on scikit-learn's handwritten digits in seconds;
``charlm`` trains a character-level transformer on the Python standard library's source for
about ten minutes on two CPU cores. The options are each demo's own (``torchsupervisor demo
charlm --help``); see ``torchsupervisor.demo``.
"""

from __future__ import annotations

__all__ = ["HELP", "main"]

HELP = (
    "train a model under a Supervisor, resumable: 'demo' or 'demo digits' (a CNN on "
    "scikit-learn's digits, seconds), 'demo charlm' (a transformer on Python's source, minutes)"
)


def main(argv: list[str]) -> int:
    """Run a demo with its own command line ``argv``; returns the exit status."""
    from torchsupervisor.demo import main as demo_main

    return demo_main(argv)
