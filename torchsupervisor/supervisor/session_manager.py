"""``SessionManager``: create a session whose state is restored, or initialized, and ready.

The chief calls ``prepare_session``: restore the newest valid checkpoint of ``checkpoint_dir``
or, when there is none, run ``init_op`` and ``init_fn``; then run ``local_init_op`` and check
``ready_op``. Other replicas call ``wait_for_session``: poll until the state is ready.

One deliberate difference from TF: a checkpoint that fails verification (missing shard, bad
checksum, damaged manifest) is reported with a warning naming the file, and the next older
checkpoint is tried; only when every checkpoint is bad does the restore fail.

TF name: ``tf.compat.v1.train.SessionManager``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from torchsupervisor.checkpoint.files import checkpoint_step
from torchsupervisor.checkpoint.recovery import plan_restore
from torchsupervisor.core.clock import REAL_CLOCK, Clock
from torchsupervisor.core.session import Session, call_op
from torchsupervisor.errors import (
    CorruptCheckpointError,
    DataLossError,
    DeadlineExceededError,
    FailedPreconditionError,
)
from torchsupervisor.storage import is_url
from torchsupervisor.tiers.selection import restore_order

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from torchsupervisor.core.session import Op
    from torchsupervisor.driver.checkpoint_driver import SaverLike
    from torchsupervisor.tiers.tier import Snapshot, SnapshotTier

__all__ = ["DIRECTORY_TIERS", "SessionManager"]

DIRECTORY_TIERS = ("disk", "bucket")
"""The names of the checkpoint directory's tier (``Session.restored_tier`` of a checkpoint
restored from it); the other tiers (``"memory"``, ``"local"``) keep snapshots elsewhere."""

logger = logging.getLogger("torchsupervisor")


def _op_name(op: Op) -> str:
    if op is None:
        return "None"
    return getattr(op, "name", None) or getattr(op, "__name__", None) or repr(op)


class SessionManager:
    """Creates sessions and makes sure their state is initialized or restored.

    Args:
        local_init_op: Run on every new session after restore or init (a callable taking the
            session or nothing).
        ready_op: Returns the names of what is not initialized (empty or None: ready).
        ready_for_local_init_op: Like ``ready_op``, checked before ``local_init_op`` runs.
        graph: The collections registry (unused here; kept for TF's signature).
        recovery_wait_secs: Seconds between two readiness or checkpoint checks.
        local_init_run_options: Accepted for TF compatibility; RunOptions have no counterpart.
        local_init_feed_dict: Keyword arguments for ``local_init_op``.
        state: The state of the sessions this manager creates.
        device: Where uninitialized state is materialized.
        clock: Time source for waits.

    Raises:
        ValueError: If ``ready_for_local_init_op`` is given without ``local_init_op``.

    TF name: ``tf.compat.v1.train.SessionManager``.
    """

    def __init__(
        self,
        local_init_op: Op | None = None,
        ready_op: Op | None = None,
        ready_for_local_init_op: Op | None = None,
        graph: Any = None,
        recovery_wait_secs: float = 30,
        local_init_run_options: object = None,
        local_init_feed_dict: Mapping[str, Any] | None = None,
        *,
        state: Mapping[str, Any] | None = None,
        device: torch.device | str | None = None,
        clock: Clock | None = None,
    ) -> None:
        if ready_for_local_init_op is not None and local_init_op is None:
            raise ValueError(
                "If you pass a ready_for_local_init_op you must also pass a local_init_op "
                f", ready_for_local_init_op [{ready_for_local_init_op}]"
            )
        del graph, local_init_run_options
        self._local_init_op = local_init_op
        self._ready_op = ready_op
        self._ready_for_local_init_op = ready_for_local_init_op
        self._recovery_wait_secs = recovery_wait_secs
        self._local_init_feed_dict = local_init_feed_dict
        self._state = state
        self._device = device
        self._clock = clock or REAL_CLOCK

    def _new_session(self, master: str, config: object) -> Session:
        return Session(self._state, master=master, config=config, device=self._device)

    def _restore_checkpoint(
        self,
        master: str,
        saver: SaverLike | None = None,
        checkpoint_dir: str | None = None,
        checkpoint_filename_with_path: str | None = None,
        wait_for_checkpoint: bool = False,
        max_wait_secs: float = 7200,
        config: object = None,
        tiers: Sequence[SnapshotTier] = (),
    ) -> tuple[Session, bool]:
        sess = self._new_session(master, config)
        if checkpoint_dir and checkpoint_filename_with_path:
            raise ValueError(
                "Can not provide both checkpoint_dir and checkpoint_filename_with_path."
            )
        if not saver or not (checkpoint_dir or checkpoint_filename_with_path):
            return sess, False
        if checkpoint_filename_with_path:
            saver.restore(sess, checkpoint_filename_with_path)
            sess.restored_checkpoint = checkpoint_filename_with_path
            sess.restored_tier = _tier_of(checkpoint_filename_with_path)
            return sess, True
        assert checkpoint_dir is not None
        waited_secs = 0.0
        plan = plan_restore(checkpoint_dir)
        held = _held_snapshots(tiers)
        while not plan.candidates and not held:
            if not wait_for_checkpoint or waited_secs >= max_wait_secs:
                return sess, False
            logger.info("Waiting for checkpoint to be available.")
            self._clock.sleep(self._recovery_wait_secs)
            waited_secs += self._recovery_wait_secs
            plan = plan_restore(checkpoint_dir)
        attempts = _attempts(saver, plan.candidates, held, _tier_of(checkpoint_dir))
        tier, prefix = _restore_newest_valid(sess, attempts, checkpoint_dir)
        sess.restored_checkpoint = prefix
        sess.restored_tier = tier
        if tier != _tier_of(checkpoint_dir):
            newest = checkpoint_step(plan.candidates[0]) if plan.candidates else None
            logger.info(
                "Restored step %s from the %s tier (%s); the newest checkpoint in %s is %s",
                checkpoint_step(prefix),
                tier,
                prefix,
                checkpoint_dir,
                "none" if not plan.candidates else f"of step {newest}",
            )
        saver.recover_last_checkpoints(plan.tracked)
        return sess, True

    def prepare_session(
        self,
        master: str = "",
        init_op: Op | None = None,
        saver: SaverLike | None = None,
        checkpoint_dir: str | None = None,
        checkpoint_filename_with_path: str | None = None,
        wait_for_checkpoint: bool = False,
        max_wait_secs: float = 7200,
        config: object = None,
        init_feed_dict: Mapping[str, Any] | None = None,
        init_fn: Callable[..., object] | None = None,
        *,
        tiers: Sequence[SnapshotTier] = (),
    ) -> Session:
        """Create a session, restoring or initializing its state, and check it is ready.

        Args:
            master: The master string (``""`` for in-process).
            init_op: Run when nothing was restored (before ``init_fn``).
            saver: Restores checkpoints; None: never restore.
            checkpoint_dir: Directory to restore the newest valid checkpoint from.
            checkpoint_filename_with_path: A specific checkpoint prefix to restore instead.
            wait_for_checkpoint: Wait until a checkpoint appears in ``checkpoint_dir``.
            max_wait_secs: Longest wait for a checkpoint, in seconds.
            config: Passed to the new session.
            init_feed_dict: Keyword arguments for ``init_op``.
            init_fn: Called as ``init_fn(sess)`` when nothing was restored, after ``init_op``.
            tiers: Other tiers to restore from besides ``checkpoint_dir`` (the memory tier):
                their snapshots at least as new as its newest checkpoint are tried first,
                the faster tier first at the same step; one that fails its checks is
                reported and the next one tried.

        Returns:
            The session. ``sess.restored_checkpoint`` is the prefix restored, or None;
            ``sess.restored_tier`` its tier.

        Raises:
            RuntimeError: With TF's texts, when nothing initializes the model or the model is
                not ready after initialization.
            ValueError: If both checkpoint locations are given.
            DataLossError: If ``checkpoint_dir`` (or a tier) holds checkpoints but none is
                valid.

        TF name: ``SessionManager.prepare_session``.
        """
        where = (checkpoint_dir, checkpoint_filename_with_path, wait_for_checkpoint, max_wait_secs)
        sess, restored = self._restore_checkpoint(master, saver, *where, config=config, tiers=tiers)
        if not restored:
            if init_op is None and not init_fn and self._local_init_op is None:
                raise RuntimeError(
                    "Model is not initialized and no init_op or init_fn or local_init_op was given"
                )
            if init_op is not None:
                call_op(init_op, sess, init_feed_dict)
            if init_fn:
                init_fn(sess)
        ok, msg = self._try_run_local_init_op(sess)
        if not ok:
            raise RuntimeError(
                "Init operations did not make model ready for local_init.  "
                f"Init op: {_op_name(init_op)}, init fn: {init_fn}, error: {msg}"
            )
        ready, msg = self._model_ready(sess)
        if not ready:
            raise RuntimeError(
                "Init operations did not make model ready.  "
                f"Init op: {_op_name(init_op)}, init fn: {init_fn}, "
                f"local_init_op: {self._local_init_op}, error: {msg}"
            )
        return sess

    def recover_session(
        self,
        master: str = "",
        saver: SaverLike | None = None,
        checkpoint_dir: str | None = None,
        checkpoint_filename_with_path: str | None = None,
        wait_for_checkpoint: bool = False,
        max_wait_secs: float = 7200,
        config: object = None,
    ) -> tuple[Session, bool]:
        """Create a session and restore it if possible; never initializes.

        Returns:
            ``(sess, initialized)``: initialized is True only if a checkpoint was restored and
            the model is then ready (local init is attempted exactly once either way).

        Raises:
            ValueError: If both checkpoint locations are given.
            DataLossError: If checkpoints exist but none is valid.

        TF name: ``SessionManager.recover_session``.
        """
        where = (checkpoint_dir, checkpoint_filename_with_path, wait_for_checkpoint, max_wait_secs)
        sess, restored = self._restore_checkpoint(master, saver, *where, config=config)
        ok, local_msg = self._try_run_local_init_op(sess)
        if not restored:
            return sess, False
        source = sess.restored_checkpoint or checkpoint_dir
        if not ok:
            logger.info(
                "Restoring model from %s did not make model ready for local init: %s",
                source,
                local_msg,
            )
            return sess, False
        ready, msg = self._model_ready(sess)
        if not ready:
            logger.info("Restoring model from %s did not make model ready: %s", source, msg)
            return sess, False
        logger.info("Restored model from %s", source)
        return sess, True

    def wait_for_session(
        self, master: str = "", config: object = None, max_wait_secs: float | None = float("inf")
    ) -> Session:
        """Create sessions until one is ready (the state was initialized by the chief).

        Args:
            master: The master string.
            config: Passed to each new session.
            max_wait_secs: Longest wait in seconds (None: forever).

        Returns:
            A ready session.

        Raises:
            DeadlineExceededError: ``"Session was not ready after waiting %d secs."``.

        TF name: ``SessionManager.wait_for_session``.
        """
        if max_wait_secs is None:
            max_wait_secs = math.inf
        start = self._clock.monotonic()
        while True:
            sess = self._new_session(master, config)
            not_ready_msg = None
            ok, not_ready_local_msg = self._try_run_local_init_op(sess)
            if ok:
                ready, not_ready_msg = self._model_ready(sess)
                if ready:
                    return sess
            _safe_close(sess)
            remaining = max(0.0, max_wait_secs - (self._clock.monotonic() - start))
            if remaining < self._recovery_wait_secs:
                raise DeadlineExceededError(
                    None, None, f"Session was not ready after waiting {int(max_wait_secs)} secs."
                )
            logger.info(
                "Waiting for model to be ready.  Ready_for_local_init_op:  %s, ready: %s",
                not_ready_local_msg,
                not_ready_msg,
            )
            self._clock.sleep(self._recovery_wait_secs)

    def _model_ready(self, sess: Session) -> tuple[bool, str | None]:
        return _ready(self._ready_op, sess, "Model not ready")

    def _model_ready_for_local_init(self, sess: Session) -> tuple[bool, str | None]:
        return _ready(self._ready_for_local_init_op, sess, "Model not ready for local init")

    def _try_run_local_init_op(self, sess: Session) -> tuple[bool, str | None]:
        if self._local_init_op is None:
            return True, None
        ready, msg = self._model_ready_for_local_init(sess)
        if not ready:
            return False, msg
        call_op(self._local_init_op, sess, self._local_init_feed_dict)
        return True, None


def _ready(op: Op, sess: Session, msg: str) -> tuple[bool, str | None]:
    if op is None:
        return True, None
    try:
        names = _not_ready_names(call_op(op, sess))
    except FailedPreconditionError as e:
        if "uninitialized" not in str(e):
            logger.warning("%s : error [%s]", msg, e)
            raise
        return False, str(e)
    if not names:
        return True, None
    return False, "Variables not initialized: " + ", ".join(names)


def _not_ready_names(result: object) -> list[str]:
    if result is None:
        return []
    if isinstance(result, (str, bytes)):
        result = [result] if result else []
    elif hasattr(result, "tolist"):
        result = result.tolist()
    if not isinstance(result, (list, tuple, set, frozenset)):
        raise TypeError(
            f"ready_op must return a list of names of what is not ready, got {result!r}"
        )
    return [n.decode("utf-8") if isinstance(n, bytes) else str(n) for n in result]


_Attempt = tuple[str, str, "Callable[[Session, str], None]"]
"""One snapshot a restart may restore: its tier, its prefix, and what restores it."""


def _tier_of(path: str) -> str:
    """The name of the tier of a checkpoint directory or prefix: ``"bucket"`` or ``"disk"``."""
    return DIRECTORY_TIERS[1] if is_url(path) else DIRECTORY_TIERS[0]


def _held_snapshots(tiers: Sequence[SnapshotTier]) -> list[tuple[SnapshotTier, Snapshot]]:
    """Every tier's committed snapshots, the damaged ones reported (never tried)."""
    held = []
    for tier in tiers:
        snapshots = tier.snapshots()
        for damaged in tier.damaged:
            logger.warning("The %s tier's snapshot %s: not restoring it", tier.name, damaged)
        held.extend((tier, snap) for snap in snapshots)
    return held


def _attempts(
    saver: SaverLike,
    candidates: list[str],
    held: list[tuple[SnapshotTier, Snapshot]],
    directory_tier: str,
) -> list[_Attempt]:
    """What a restart tries, in order (``tiers.selection.restore_order``)."""
    newest = checkpoint_step(candidates[0]) if candidates else None
    restorers = {snap.prefix: tier.restore for tier, snap in held}
    order = restore_order(
        directory_tier, candidates, newest, [(t.name, s.step, s.prefix) for t, s in held]
    )
    return [
        (tier, prefix, saver.restore if tier == directory_tier else restorers[prefix])
        for tier, prefix in order
    ]


def _restore_newest_valid(
    sess: Session, attempts: list[_Attempt], directory: str
) -> tuple[str, str]:
    """Restore the first snapshot of ``attempts`` that passes its checks; each is tried once.

    Returns:
        ``(tier, prefix)`` restored.

    Raises:
        DataLossError: None passed (each failure named).
    """
    failures = []
    directory_tier = _tier_of(directory)
    for tier, prefix, restore in attempts:
        try:
            restore(sess, prefix)
        except CorruptCheckpointError as e:
            if tier == directory_tier:
                logger.warning("Checkpoint %s is not usable, trying an older one: %s", prefix, e)
            else:
                logger.warning(
                    "The %s tier's snapshot %s is not usable, trying the next tier: %s",
                    tier,
                    prefix,
                    e,
                )
            failures.append(f"{prefix}: {e}")
            continue
        if failures and tier == directory_tier:
            logger.warning("Restored %s, the newest valid checkpoint in %s", prefix, directory)
        elif failures:
            logger.warning("Restored %s of the %s tier, the newest valid snapshot", prefix, tier)
        return tier, prefix
    raise DataLossError(
        None,
        None,
        f"No valid checkpoint in {directory}: "
        + "; ".join(failures)
        + ". Repair or remove these checkpoints to start again from scratch.",
    )


def _safe_close(sess: Session) -> None:
    try:
        sess.close()
    except Exception:
        pass
