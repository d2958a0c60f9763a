"""One save cache: what a writer keeps from one save to the next, behind one switch.

A save runs at every checkpoint interval over a state that is mostly the very same objects as
at the last save. What a writer derived from them then (the walk's skeleton and tensor table,
a module's state dict, the manifest's tree texts, a sharded save's plan and its shard layout)
is kept here and taken again, and nowhere else:

* ``walk`` (``core.walk.WalkMemo``, with ``core.module_memo.ModuleStateMemo``): the last
  walk's mappings of leaves and modules' state dicts (both writers, training thread);
* ``trees`` (``tree_memo.TreeMemo``): the skeleton's encoding and JSON texts (one process's
  writer; the sharded coordinator keeps its own under ``plans``);
* ``plans`` (``sharded.replay.PlanCache``): a sharded save's plan, replayed while no rank's
  layout changed, with its shard, table and tree memos (sharded writer);
* ``staged`` (``sharded.staging.StageMemo``): what the last sharded stage made over the host
  buffers (sharded writer, training thread).

The one invalidation rule: a memo is taken again only where the save meets the very same
objects (compared by identity, in passes in C) with the same structure that it was made from,
and a save that fails drops what it made. Nothing is kept past the next save.

The switch: ``TORCHSUPERVISOR_SAVE_CACHE=0`` (or ``off``), read when a writer is made, turns
every memo off: each save derives everything again. The files are byte-identical either way
(``tests/checkpoint/test_save_cache.py`` saves random states, optimizers and DTensors both
ways and compares every byte); the switch is for ruling the cache out when hunting a bug.
Value caches that are pure functions of their keys (``tensor_table``'s texts of an entry) are
not memos of objects and stay on.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from torchsupervisor.checkpoint.sharded.replay import PlanCache
from torchsupervisor.checkpoint.sharded.staging import StageMemo
from torchsupervisor.checkpoint.tree_memo import TreeMemo
from torchsupervisor.core.walk import WalkMemo

__all__ = ["SAVE_CACHE_ENV", "SaveCache", "save_cache_enabled"]

SAVE_CACHE_ENV = "TORCHSUPERVISOR_SAVE_CACHE"
"""The environment variable whose value ``0``/``off``/``false``/``no`` turns the cache off."""


def save_cache_enabled() -> bool:
    """Whether the save cache is on (``$TORCHSUPERVISOR_SAVE_CACHE`` is not 0/off/false/no)."""
    return os.environ.get(SAVE_CACHE_ENV, "1").strip().lower() not in ("0", "off", "false", "no")


@dataclass
class SaveCache:
    """The memos of one writer (each None when the cache is off; see the module docstring).

    Thread safety: ``walk`` and ``staged`` on the training thread; ``trees`` and ``plans`` on
    the thread that persists (one save at a time).
    """

    walk: WalkMemo | None
    trees: TreeMemo | None
    plans: PlanCache | None
    staged: StageMemo | None

    @classmethod
    def create(cls, enabled: bool | None = None) -> SaveCache:
        """Empty memos, or none at all when off (None: ``save_cache_enabled()``)."""
        if enabled is None:
            enabled = save_cache_enabled()
        if not enabled:
            return cls(None, None, None, None)
        return cls(WalkMemo(), TreeMemo(), PlanCache(), StageMemo())

    @property
    def enabled(self) -> bool:
        """Whether this cache keeps anything."""
        return self.walk is not None
