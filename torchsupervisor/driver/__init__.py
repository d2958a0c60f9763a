"""Drivers: what decides *when* to checkpoint and how a stop is handled.

``checkpoint_driver`` is the one place that decides whether a checkpoint is due, defers one
while a save is in flight, skips an unchanged step, writes the final checkpoint within a grace
budget, reports failures and writes the CHECKPOINT event. ``sharded_checkpoints`` makes every rank
of a sharded (DTensor/FSDP2) state save at one agreed step. ``preemption`` turns signals, and the
notices ``preemption_sources`` polls (SLURM's time limit, a cloud's spot notice), into a clean
stop. The Supervisor and the MonitoredSession hold these; neither writes files itself.
"""
