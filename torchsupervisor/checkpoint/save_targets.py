"""Where a save goes: the checkpoint prefix of a ``save_path`` and a step, TF's way.

``save_path`` names the family (``logdir/model.ckpt``); a save at step 300 writes the
checkpoint ``logdir/model.ckpt-300`` (``-00000300`` with ``pad_step_number``), and one without a
step writes ``save_path`` itself. Pure functions over their arguments.

TF name: the prefix rule of ``tf.compat.v1.train.Saver.save``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from torchsupervisor.checkpoint.writer import SaveTarget
from torchsupervisor.core.global_step import read_checkpoint_step

if TYPE_CHECKING:
    from torchsupervisor.core.global_step import GlobalStepLike

__all__ = ["checkpoint_prefix", "save_target"]


def checkpoint_prefix(
    save_path: str,
    global_step: GlobalStepLike,
    latest_filename: str | None,
    *,
    pad_step_number: bool = False,
    split_files: bool = False,
) -> tuple[str, int | None]:
    """Return the prefix a save writes, and its step (None: ``global_step`` was None).

    Args:
        save_path: The prefix family.
        global_step: The step (an int, a tensor, a ``GlobalStep``), or None.
        latest_filename: The state file's name; None: ``"checkpoint"``.
        pad_step_number: Write the step with 8 digits.
        split_files: The Saver writes several data files per save (TF's ``sharded``), so
            a prefix named like the state file does not collide with it.

    Raises:
        ValueError: ``latest_filename`` has a directory part, or is ``save_path``'s own name
            when there is no step; a negative step (``read_checkpoint_step``).
    """
    latest_filename = latest_filename or "checkpoint"
    if os.path.split(latest_filename)[0]:
        raise ValueError("'latest_filename' must not contain path components")
    step = read_checkpoint_step(global_step)
    if step is None:
        if os.path.basename(save_path) == latest_filename and not split_files:
            raise ValueError(
                f"'latest_filename' collides with 'save_path': '{latest_filename}' and "
                f"'{save_path}'"
            )
        return save_path, None
    pattern = "%s-%08d" if pad_step_number else "%s-%d"
    return pattern % (save_path, step), step


def save_target(
    save_path: str,
    global_step: GlobalStepLike,
    latest_filename: str | None,
    write_state: bool,
    metrics: dict[str, float] | None,
    *,
    collective: bool,
    pad_step_number: bool = False,
    split_files: bool = False,
) -> tuple[SaveTarget, Exception | None]:
    """Return where a save goes, and what is wrong with it for a ``collective`` writer.

    A collective writer's error is returned, not raised: that rank still joins the
    collective, which raises it on every rank (a rank that raised alone would leave the
    others waiting in it). Its target is then ``save_path`` itself, never written.

    Raises:
        ValueError: As ``checkpoint_prefix`` (not for a ``collective`` writer).
    """
    options = {"pad_step_number": pad_step_number, "split_files": split_files}
    if not collective:
        prefix, _ = checkpoint_prefix(save_path, global_step, latest_filename, **options)
        return SaveTarget(prefix, save_path, latest_filename, write_state, metrics), None
    try:
        if metrics is not None:
            raise ValueError("metrics are not supported yet for a state of DTensors (FSDP2)")
        prefix, _ = checkpoint_prefix(save_path, global_step, latest_filename, **options)
        return SaveTarget(prefix, save_path, latest_filename, write_state), None
    except Exception as e:  # No prefix: the save fails before anything is written.
        return SaveTarget(save_path, save_path, latest_filename, write_state=False), e
