#!/usr/bin/env bash
# Run a supervised training under torchrun so that a scheduler's preemption requeues it.
#
#   examples/preemptible_torchrun.sh LOGDIR TORCHRUN_ARGS...
#   e.g. examples/preemptible_torchrun.sh runs/ddp --nproc_per_node=2 \
#            examples/ddp_digits.py --logdir runs/ddp
#
# Signal this script (SIGTERM, SIGUSR1 or SIGINT; SLURM: "#SBATCH --signal=B:TERM@120", which
# signals the batch shell only). It forwards the signal to torchrun, whose agent forwards it
# to every worker: each stops at the step the ranks agree on, and the chief writes the final
# checkpoint. torchrun itself then exits 1 (its agent was signalled, and says so with a
# traceback), so its status cannot tell a clean preemption from a crash: the script asks the
# log directory (torchsupervisor preempted), which the chief told how the session ended.
#
# Exit status: $REQUEUE_STATUS (default 0) after a clean preemption: requeue the job here
# (SLURM: scontrol requeue "$SLURM_JOB_ID"); torchrun's own status otherwise (0 when the
# training ended by itself, non-zero after a failure or a preemption that lost work).
set -u
if [ $# -lt 2 ]; then
    echo "usage: $0 LOGDIR TORCHRUN_ARGS..." >&2
    exit 2
fi
logdir=$1
shift
python=${PYTHON:-python3}

"$python" -m torch.distributed.run "$@" &
pid=$!
trap 'kill -TERM "$pid" 2>/dev/null' TERM USR1 INT
wait "$pid"
status=$?
while kill -0 "$pid" 2>/dev/null; do  # A trapped signal ended the wait, not torchrun.
    wait "$pid"
    status=$?
done
if "$python" -m torchsupervisor preempted "$logdir"; then
    exit "${REQUEUE_STATUS:-0}"
fi
exit "$status"
