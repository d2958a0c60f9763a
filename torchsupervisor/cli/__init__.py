"""The ``torchsupervisor`` command: the demo, and looking inside a log directory without code.

Commands (one module each):
    demo     train a model under a Supervisor: digits CNN or charlm (``demo.py``)
    ls       the checkpoints of a logdir, checked byte by byte (``ls.py``)
    inspect  a checkpoint's tensors and values (``inspect_checkpoint.py``)
    verify   exit status 0 only if the checkpoint a restart would use is valid (``verify.py``)
    events   the summaries of a logdir as TensorBoard shows them; CSV, plots (``events.py``)
    export   a checkpoint's tensors as a .safetensors file (``export.py``)
    preempted  exit status 0 if the last session stopped for a preemption without losing
             anything: what a requeue script asks (``preempted.py``)
    goodput  goodput and badput by cause over the run, from its ledger (``goodput.py``)

``python -m torchsupervisor`` and the ``torchsupervisor`` console script both call ``main``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from types import ModuleType

__all__ = ["build_parser", "main"]

_COMMANDS = ("ls", "inspect", "verify", "events", "export", "import-dcp", "preempted", "goodput")


def _module(command: str) -> ModuleType:
    from torchsupervisor.cli import (
        events,
        export,
        goodput,
        import_dcp,
        inspect_checkpoint,
        ls,
        preempted,
        verify,
    )

    return {
        "ls": ls,
        "inspect": inspect_checkpoint,
        "verify": verify,
        "events": events,
        "export": export,
        "import-dcp": import_dcp,
        "preempted": preempted,
        "goodput": goodput,
    }[command]


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of the ``torchsupervisor`` command."""
    from torchsupervisor.cli import demo

    parser = argparse.ArgumentParser(
        prog="torchsupervisor",
        description="TensorFlow 1's training Supervisor for PyTorch: run the demo, or look "
        "inside a log directory (checkpoints and summaries) without writing code.",
        epilog="Run 'torchsupervisor COMMAND --help' for the options of a command.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.add_parser("demo", help=demo.HELP, add_help=False)
    for name in _COMMANDS:
        module = _module(name)
        sub = commands.add_parser(
            name,
            help=module.HELP,
            description=(module.__doc__ or "").replace("``", ""),
            epilog=getattr(module, "EPILOG", None),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); return the exit status.

    Exit status: 0 on success, 1 when the command fails (a missing or damaged file, or
    ``verify`` finding the checkpoint a restart would use damaged), 2 for a usage error, 130
    when the demo was aborted by a second Ctrl-C.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "demo":
        from torchsupervisor.cli import demo

        try:
            return demo.main(argv[1:])
        except KeyboardInterrupt:  # A second Ctrl-C: the handler already said so.
            return 130
        except ImportError as e:  # An extra that is not installed: say which.
            print(f"torchsupervisor demo: error: {e}", file=sys.stderr)
            return 1
        except (OSError, ConnectionError) as e:  # A missing bucket, an unreachable store.
            print(f"torchsupervisor demo: error: {e}", file=sys.stderr)
            return 1
    parser = build_parser()
    if not argv:
        parser.print_help()
        return 2
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from torchsupervisor import errors

    try:
        status = _module(args.command).run(args)
        sys.stdout.flush()  # Here, so that a closed pipe is handled below, not at exit.
        return status
    except BrokenPipeError:  # e.g. `torchsupervisor events --csv ... | head`: not an error.
        _discard_stdout()
        return 0
    except (errors.OpError, OSError, ValueError, ImportError) as e:
        message = getattr(e, "message", None) or str(e)
        print(f"torchsupervisor {args.command}: error: {message}", file=sys.stderr)
        return 1


def _discard_stdout() -> None:
    """Point stdout at /dev/null: the reader went away, and the interpreter's last flush at
    exit must not fail again ("Exception ignored ... BrokenPipeError")."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
