"""Requeue: after a preemption stop that saved everything, ask the scheduler to run the job again.

A SLURM job that stops because its time runs out (the ``--signal=B:USR1@N`` warning, or the
time limit itself: ``preemption_sources.SlurmTimeLimit``) ends for good unless it requeues
itself; ``scontrol requeue $SLURM_JOB_ID`` puts it back in the queue under the same job id
(``$SLURM_RESTART_COUNT`` counts the requeues), and the run resumes from its final checkpoint in
the same log directory, with the same run id. ``SlurmRequeue`` does that, once, on rank 0, after
the session closed with its final checkpoint committed (``Preemption.exit``).

Which stops requeue: SIGUSR1 and SIGUSR2 (what ``--signal`` sends, by convention) and a notice
of SLURM's time limit. Not SIGTERM: ``scancel`` sends it to cancel a job (a job that requeued
itself then would never end), and SLURM's own preemption with ``PreemptMode=REQUEUE`` sends it
and requeues the job by itself. Not SIGINT (Ctrl-C). Not a cloud's notice (the machine goes
away; the scheduler that placed the job there decides).

Under torchrun, the documented recipe is a ``preemption_exit_code`` that torchrun's
``--max-restarts`` restarts on (``docs/distributed.md``); elsewhere ``torchsupervisor
preempted LOGDIR`` tells a clean preemption from a failure for a requeue script.
"""

from __future__ import annotations

import logging
import shutil
import signal
import subprocess
from collections.abc import Iterable

from torchsupervisor.core.checks import check_signals
from torchsupervisor.driver.preemption_sources import PreemptionNotice, SlurmTimeLimit

__all__ = ["REQUEUE_SIGNALS", "SlurmRequeue", "check_requeue"]

logger = logging.getLogger("torchsupervisor")

REQUEUE_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGUSR1, signal.SIGUSR2)
"""The signals after which a SLURM job requeues itself: those ``--signal`` sends by convention."""

_SCONTROL_TIMEOUT_SECS = 30.0


class SlurmRequeue:
    """``scontrol requeue JOB`` after a stop by one of ``signals`` or by SLURM's time limit.

    Args:
        job_id: The job (``launcher.slurm_job_id()``).
        signals: The signals whose stop requeues (default ``REQUEUE_SIGNALS``).
        scontrol: The ``scontrol`` command.

    TF name: none.
    """

    def __init__(
        self,
        job_id: str,
        signals: Iterable[int] = REQUEUE_SIGNALS,
        scontrol: str = "scontrol",
    ) -> None:
        self.job_id = str(job_id)
        self.signals = check_signals("signals", signals)
        self.scontrol = scontrol

    def wants(self, received: int | None, notice: PreemptionNotice | None) -> bool:
        """Whether a stop by signal ``received`` (or by ``notice``, when no signal) requeues."""
        if received is not None:
            return received in self.signals
        return notice is not None and notice.source == SlurmTimeLimit.name

    def requeue(self) -> bool:
        """Run ``scontrol requeue JOB``; log the outcome; return whether SLURM took it.

        Never raises: a failure (a job submitted with ``--no-requeue``, ``scontrol`` missing)
        is logged as an error naming the job and SLURM's message.
        """
        command = [self.scontrol, "requeue", self.job_id]
        try:
            done = subprocess.run(
                command, capture_output=True, text=True, timeout=_SCONTROL_TIMEOUT_SECS
            )
        except (OSError, subprocess.TimeoutExpired) as error:
            logger.error("Could not requeue SLURM job %s (%s): %s", self.job_id, command, error)
            return False
        if done.returncode != 0:
            logger.error(
                "Could not requeue SLURM job %s: %s (submit it with --requeue)",
                self.job_id,
                (done.stderr or done.stdout).strip() or f"scontrol exited {done.returncode}",
            )
            return False
        logger.warning("Requeued SLURM job %s: it resumes from its final checkpoint", self.job_id)
        return True


def check_requeue(name: str, value: object) -> SlurmRequeue | None:
    """``value`` (``"auto"``, None, or a ``SlurmRequeue``) resolved.

    ``"auto"``: a ``SlurmRequeue`` of the job inside a SLURM job with ``scontrol`` on the
    ``PATH``; None elsewhere.

    Raises:
        TypeError: Anything else (naming ``name``).
    """
    from torchsupervisor.distributed.launcher import slurm_job_id

    if value == "auto":
        job = slurm_job_id()
        return SlurmRequeue(job) if job and shutil.which("scontrol") else None
    if value is None or isinstance(value, SlurmRequeue):
        return value
    raise TypeError(f"{name} must be 'auto', None or a SlurmRequeue, got {value!r}")
