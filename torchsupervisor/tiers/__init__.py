"""The tiers a snapshot goes to besides the checkpoint directory: host memory that outlives the
training process (``memory``), a peer host's memory (``peer``, ``replication``, ``ring``), and
this node's disk at an interval of its own (``local_disk``).

* ``selection``: which step a restart restores, and from which tier each rank reads it (pure
  policy over what every tier holds);
* ``memory_root``: where the memory tier lives (a tmpfs such as ``/dev/shm``); its files go
  through ``storage.private.MemoryTierStorage`` (directories 0700, files 0600, a room check).
"""

from torchsupervisor.tiers.selection import Part, RestoreChoice, choose_restore, restore_newest

__all__ = ["Part", "RestoreChoice", "choose_restore", "restore_newest"]
