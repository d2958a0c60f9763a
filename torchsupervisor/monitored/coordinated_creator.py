"""``CoordinatedSessionCreator``: the creator ``MonitoredSession`` wraps around the user's.

It creates a session with the user's creator (after the checkpoint still being written, so a
re-created session restores the newest), then its coordinator and queue-runner threads, and
informs the hooks (``after_create_session``); at the end it closes the user's creator, telling
the library's creators the hooks' newest checkpoint step (which frees a memory tier).

TF name: none (TF's ``_CoordinatedSessionCreator`` is private).
"""

from __future__ import annotations

from torchsupervisor.core.coordinator import Coordinator
from torchsupervisor.core.registry import Graph, GraphKeys
from torchsupervisor.core.session import Session
from torchsupervisor.hooks.session_run_hook import SessionRunHook, checkpoint_drivers
from torchsupervisor.monitored.creators import SessionCreator, _ScaffoldedCreator
from torchsupervisor.monitored.wrappers import HookedSession, _CoordinatedSession

__all__ = ["CoordinatedSessionCreator"]


class CoordinatedSessionCreator:
    """Creates a session, its coordinator and queue-runner threads, and informs the hooks
    (``MonitoredSession``'s creator, wrapped around the user's ``session_creator``)."""

    def __init__(
        self,
        session_creator: SessionCreator,
        hooks: list[SessionRunHook],
        stop_grace_period_secs: float,
        graph: Graph,
    ) -> None:
        self._session_creator = session_creator
        self._hooks = hooks
        self._stop_grace_period_secs = stop_grace_period_secs
        self._graph = graph
        self.tf_sess: Session | None = None
        self.coord: Coordinator | None = None

    def close(self) -> None:
        """Release what the session creator holds (the chief's writer lock, the memory tier:
        freed when the hooks' newest checkpoint holds the last step)."""
        creator = self._session_creator
        if isinstance(creator, _ScaffoldedCreator):
            steps = [d.last_step for d in checkpoint_drivers(self._hooks)]
            creator.close(max((s for s in steps if s is not None), default=None))
            return
        close = getattr(creator, "close", None)
        if close is not None:
            close()

    def create_session(self) -> _CoordinatedSession:
        # A checkpoint still being written (a recovery) is committed before the new session
        # looks for the newest checkpoint to restore.
        for driver in checkpoint_drivers(self._hooks):
            driver.wait()
        sess = self._session_creator.create_session()
        coord = Coordinator(clean_stop_exception_types=[])
        try:
            for runner in self._graph.get_collection(GraphKeys.QUEUE_RUNNERS):
                runner.create_threads(sess, coord=coord, daemon=True, start=True)
            for hook in self._hooks:
                hook.after_create_session(sess, coord)
        except BaseException:
            coord.request_stop()
            try:
                coord.join(
                    stop_grace_period_secs=self._stop_grace_period_secs, ignore_live_threads=True
                )
            except Exception:
                pass
            sess.close()
            raise
        self.tf_sess, self.coord = sess, coord
        lock = getattr(self._session_creator, "writer_lock", None)
        if lock is not None:  # Lost to another writer: the session stops with its error.
            lock.on_lost(lambda e: coord.request_stop((type(e), e, e.__traceback__)))
        return _CoordinatedSession(
            HookedSession(sess, self._hooks), coord, self._stop_grace_period_secs
        )
