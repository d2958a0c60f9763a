"""How the multi-process test workers end: the program's exit without the interpreter's teardown.

``run_and_exit(main)`` runs ``main``, prints an exception's traceback as Python would, runs the
``atexit`` hooks (the library's own: waiting for a save in flight, destroying the process
group), flushes the output and leaves with ``os._exit``. What it skips is the finalization of
the interpreter, where gloo's worker threads may still release tensors of finished
collectives: taking the GIL then aborts the process ("terminate called without an active
exception", a PyTorch issue: pytorch/pytorch#179291) at random, after a run that succeeded.
"""

from __future__ import annotations

import atexit
import os
import sys
import traceback
from collections.abc import Callable


def run_and_exit(main: Callable[[], int | None]) -> None:
    try:
        status = main() or 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            status = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            status = 1
    except BaseException:
        traceback.print_exc()
        status = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
