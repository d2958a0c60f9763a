"""Replicas of one run: the process group, the cluster, agreements between ranks.

``env`` joins the process group named by a master string and gives this process's rank and the
world size (the one copy of those helpers); ``cluster`` is TF's ``ClusterSpec``/``Server``;
``replicas`` holds the chief's broadcast and ``stop_agreement`` the step every rank stops at
(the driver's ``sharded_checkpoints`` builds on them).

``torchsupervisor.distributed`` itself offers what ``env`` exports: ``connect``, ``rank``,
``world_size``, ``default_backend``, ``is_distributed_master``, ``IN_PROCESS_MASTERS``.
"""

from torchsupervisor.distributed import env
from torchsupervisor.distributed.env import *  # noqa: F403

__all__ = list(env.__all__)
