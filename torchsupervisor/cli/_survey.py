"""What a log directory holds: its checkpoints, their integrity, and which one a restart uses.

``survey`` composes the library's own parts, so that the answers are those of a real restart:
``recovery.restore_candidates`` gives the order in which ``SessionManager`` tries checkpoints,
and ``CheckpointReader.verify`` checks every byte of each; the first valid candidate is the
one a restart restores. Why a checkpoint is still on disk follows the ``Saver``'s retention:
the state file lists the checkpoints ``max_to_keep`` tracks. A committed checkpoint it does not
list is either newer than its newest entry (committed after the last state-file update: a crash
in between; a restart tries it first) or older, and then "unlisted": the ``Saver`` will never
delete it. The directory alone cannot tell why: ``keep_checkpoint_every_n_hours`` preserved it,
or the ``Saver`` keeps every checkpoint (``max_to_keep`` 0 or None: TF's rule, the state file
lists only the newest), or another saver, a copy by hand or a crash before its deletion left
it. The manifest does not record the ``Saver``'s retention settings, so ``ls`` does not guess.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Iterator

from torchsupervisor.checkpoint.files import checkpoint_step, find_incomplete_checkpoints
from torchsupervisor.checkpoint.format import Manifest
from torchsupervisor.checkpoint.reader import CheckpointReader, NewCheckpointReader
from torchsupervisor.checkpoint.recovery import restore_candidates, scan_checkpoints
from torchsupervisor.checkpoint.references import referenced_data_files
from torchsupervisor.checkpoint.run_id import read_run_id
from torchsupervisor.checkpoint.state_file import get_checkpoint_state, state_file_path
from torchsupervisor.errors import CorruptCheckpointError, NotFoundError, UnimplementedError
from torchsupervisor.storage import is_url, storage_for
from torchsupervisor.tiers.local_disk import LOCAL_TIER
from torchsupervisor.tiers.memory import MEMORY_TIER, held_in_memory
from torchsupervisor.tiers.selection import restore_order

__all__ = ["CheckpointInfo", "Survey", "check", "restart_order", "survey"]

VALID = "valid"
CORRUPT = "corrupt"
UNCHECKED = "unchecked"

KEPT_MAX_TO_KEEP = "max_to_keep"
KEPT_NEWEST_OR_BEST = "max_to_keep/best"
KEPT_UNLISTED = "unlisted"
KEPT_NEWER_THAN_STATE = "not yet in state file"
KEPT_NO_STATE_FILE = "no state file"
KEPT_MEMORY_SLOT = "memory slot"
KEPT_OTHER_RUN = "another run's (deleted at start)"
KEPT_PEER_COPY = "peer copy"
KEPT_LOCAL_COPY = "local copy"
PEER_TIER = "peer"


@dataclasses.dataclass
class CheckpointInfo:
    """One committed checkpoint (a ``<prefix>.index`` file) of a log directory.

    Attributes:
        prefix: The checkpoint prefix.
        step: The global step in its manifest (None if unreadable or not recorded).
        wall_time: When it was saved, in seconds since the epoch (None if unreadable).
        size_bytes: Bytes of its index and of every data file it reads (shards shared with
            other checkpoints included).
        own_bytes: Bytes of the files named after it (what deleting it frees, at most).
        status: ``"valid"``, ``"corrupt"`` or ``"unchecked"`` (verification skipped).
        error: What is wrong, for a corrupt checkpoint.
        kept_by: Why it is still on disk (see the module docstring).
        candidate: Its position in the order a restart tries checkpoints (0 first).
        elsewhere: It is in another directory (named by the state file with an absolute path,
            or a snapshot of the memory tier).
        metrics: The metrics saved with it (``Saver.save(metrics=)``); None: none.
        tier: ``"disk"``, ``"bucket"``, ``"memory"``, ``"peer"`` or ``"local"``.
        rank: The rank whose snapshot it is (the memory and local tiers), else None.
        format: ``"torchsupervisor"``, or ``"tf1"`` for a TF 1 checkpoint (a tensor bundle:
            read and checked, never restored by a restart).
    """

    prefix: str
    step: int | None = None
    wall_time: float | None = None
    size_bytes: int = 0
    own_bytes: int = 0
    status: str = UNCHECKED
    error: str | None = None
    kept_by: str = ""
    candidate: int | None = None
    elsewhere: bool = False
    metrics: dict[str, float] | None = None
    tier: str = "disk"
    rank: int | None = None
    format: str = "torchsupervisor"

    @property
    def name(self) -> str:
        """The prefix's base name (its full path when it is in another directory)."""
        return self.prefix if self.elsewhere else os.path.basename(self.prefix)


@dataclasses.dataclass
class Survey:
    """The checkpoints of a log directory and what a restart would do with them.

    Attributes:
        logdir: The directory.
        checkpoints: Committed checkpoints, newest first (by step, then time), then the
            memory tier's snapshots (by rank, newest first).
        restore: The checkpoint a restart restores (the first valid candidate), or None.
        first_candidate: The checkpoint a restart tries first, or None if there is none.
        state_file: The state file's path if it exists and could be read, else None.
        state_file_error: Why the state file was ignored, if it was.
        incomplete: Prefixes with data files but no index (an interrupted save), ignored by a
            restart and removed at the next start (unless a checkpoint uses their data).
        shared_data: Prefixes without index whose data files newer checkpoints still read.
        temporaries: Left-over temporary files of an interrupted write.
    """

    logdir: str
    checkpoints: list[CheckpointInfo]
    restore: CheckpointInfo | None
    first_candidate: CheckpointInfo | None
    state_file: str | None
    state_file_error: str | None
    incomplete: list[str]
    shared_data: list[str]
    temporaries: list[str]


@contextlib.contextmanager
def _quiet_library() -> Iterator[None]:
    library = logging.getLogger("torchsupervisor")
    previous = library.level
    library.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        library.setLevel(previous)


def _file_size(path: str) -> int:
    try:
        return storage_for(path).size(path)
    except OSError:
        return 0


def _sizes(prefix: str, manifest: Manifest | None, files: list[str] | None) -> tuple[int, int]:
    directory = os.path.dirname(prefix)
    base = os.path.basename(prefix)
    index = _file_size(prefix + ".index")
    own = index
    total = index
    if manifest is None:
        data = sum(_file_size(path) for path in files or [])
        return total + data, own + data
    for shard in manifest.shards:
        size = _file_size(os.path.join(directory, shard.file))
        total += size
        if shard.file.startswith(base + ".data-"):
            own += size
    return total, own


def _check(info: CheckpointInfo, verify: bool) -> tuple[Manifest | None, list[str] | None]:
    """Read (and verify) ``info``'s checkpoint; return its manifest, or a TF 1 checkpoint's
    data files."""
    try:
        reader = NewCheckpointReader(info.prefix)
        if isinstance(reader, CheckpointReader):
            manifest, files = reader.manifest, None
            info.step = manifest.global_step
            info.wall_time = manifest.wall_time
            info.metrics = manifest.metrics
        else:  # A TF 1 checkpoint: its step is its global_step variable's (read, checked).
            manifest, files = None, reader.data_files()
            info.format = "tf1"
            info.step = reader.global_step
    except (NotFoundError, CorruptCheckpointError, UnimplementedError) as e:
        info.status, info.error = CORRUPT, str(e)
        return None, None
    if verify:
        try:
            reader.verify()
        except CorruptCheckpointError as e:
            info.status, info.error = CORRUPT, str(e)
        except OSError as e:
            info.status, info.error = CORRUPT, f"cannot be read: {e}"
        else:
            info.status = VALID
    return manifest, files


def check(prefix: str, *, verify: bool = True) -> CheckpointInfo:
    """Read one checkpoint's manifest and (with ``verify``) check every byte of it.

    Returns:
        Its ``CheckpointInfo`` (``kept_by`` and ``candidate`` are not filled in).
    """
    info = CheckpointInfo(prefix)
    manifest, files = _check(info, verify)
    info.size_bytes, info.own_bytes = _sizes(prefix, manifest, files)
    return info


def restart_order(logdir: str) -> list[str]:
    """Return the prefixes a restart tries, in order (``recovery.restore_candidates``)."""
    with _quiet_library():
        return restore_candidates(logdir)


def _memory_infos(
    logdir: str, verify: bool, root: str | None, tier: str = MEMORY_TIER
) -> list[CheckpointInfo]:
    """The memory tier's snapshots of the run of ``logdir`` (or, with ``tier`` ``"local"``,
    the local-disk tier's copies under ``root``), checked as checkpoints are.

    A snapshot whose manifest names another step than its file is corrupt (an older
    generation in its place), as a restart finds it.
    """
    infos = []
    run_id = read_run_id(logdir)
    for held in held_in_memory(logdir, root):
        for prefix in held.prefixes:
            where = PEER_TIER if held.copy else tier
            info = CheckpointInfo(prefix, elsewhere=True, tier=where, rank=held.rank)
            manifest, files = _check(info, verify)
            info.size_bytes, info.own_bytes = _sizes(prefix, manifest, files)
            if held.copy:
                info.kept_by = KEPT_PEER_COPY
            elif held.same_run:
                info.kept_by = KEPT_MEMORY_SLOT if tier == MEMORY_TIER else KEPT_LOCAL_COPY
            else:
                info.kept_by = KEPT_OTHER_RUN
            origin = {} if manifest is None else manifest.origin or {}
            if manifest is not None and manifest.global_step != checkpoint_step(prefix):
                info.status = CORRUPT
                info.error = (
                    f"its manifest is of step {manifest.global_step}: an older generation in "
                    "its place"
                )
            elif manifest is not None and (
                origin.get("run_id") != run_id or origin.get("rank") != held.rank
            ):
                info.status = CORRUPT
                info.error = f"written by {manifest.origin}: another's snapshot in its place"
            infos.append(info)
    return infos


def survey(
    logdir: str,
    *,
    verify: bool = True,
    memory_root: str | None = None,
    local_dir: str | None = None,
) -> Survey:
    """Describe the checkpoints of ``logdir``, and the memory (and local-disk) tier's snapshots
    of its run.

    Args:
        logdir: A log directory (as given to the Supervisor or ``Saver.save``).
        verify: Check every byte of every checkpoint (else only the manifests are read and
            ``restore`` is the first candidate whose manifest reads).
        memory_root: The memory tier's file system (``MemoryTierConfig.root``); None: the
            default (``$TORCHSUPERVISOR_MEMORY_ROOT`` or ``/dev/shm``).
        local_dir: The local-disk tier's directory (``LocalDiskConfig.directory``); None:
            not listed.

    Returns:
        A ``Survey``.

    Raises:
        NotFoundError: ``logdir`` is not a directory.
    """
    storage = storage_for(logdir)
    if not storage.is_dir(logdir):
        if storage.exists(logdir):
            raise NotFoundError(f"{logdir} is not a directory")
        raise NotFoundError(f"no such file or directory: {logdir}")
    state_file_error = None
    state = None
    with _quiet_library():  # the survey reports what the library would log
        try:
            state = get_checkpoint_state(logdir)
        except ValueError as e:
            state_file_error = str(e)
        candidates = restore_candidates(logdir)
    path = state_file_path(logdir)
    if state is None and state_file_error is None and storage.exists(path):
        state_file_error = "it cannot be read or parsed"
    listed: set[str] = set()
    head = None
    if state is not None:
        listed = {_key(p) for p in state.all_model_checkpoint_paths}
        listed.add(_key(state.model_checkpoint_path))
        head = _key(state.model_checkpoint_path)

    infos = [CheckpointInfo(prefix) for prefix in scan_checkpoints(logdir)]
    by_path = {_key(i.prefix): i for i in infos}
    for prefix in candidates:  # a state file may name checkpoints in another directory
        if _key(prefix) not in by_path:
            info = CheckpointInfo(prefix, elsewhere=True)
            infos.append(info)
            by_path[_key(prefix)] = info
    for info in infos:
        manifest, files = _check(info, verify)
        info.size_bytes, info.own_bytes = _sizes(info.prefix, manifest, files)
    head_info = by_path.get(head) if head else None
    for info in infos:
        if state is None:
            info.kept_by = KEPT_NO_STATE_FILE
        elif _key(info.prefix) in listed:
            # With metrics, it may be listed as one of the best (``Saver(keep_best=)``).
            info.kept_by = KEPT_MAX_TO_KEEP if info.metrics is None else KEPT_NEWEST_OR_BEST
        elif head_info is not None and _newer(info, head_info):
            info.kept_by = KEPT_NEWER_THAN_STATE
        else:
            info.kept_by = KEPT_UNLISTED
    directory_tier = "bucket" if is_url(logdir) else "disk"
    for info in infos:
        info.tier = directory_tier
    memory = _memory_infos(logdir, verify, memory_root)
    if local_dir is not None:
        memory += _memory_infos(logdir, verify, local_dir, LOCAL_TIER)
    infos.extend(memory)
    by_path.update({_key(i.prefix): i for i in memory})
    held = [  # What a restart of rank 0 (one process, a replicated run's chief) considers:
        # its memory, and a peer copy kept on this node (taken when newer).
        (i.tier, i.step, i.prefix)
        for i in memory
        if i.rank == 0
        and i.kept_by in (KEPT_MEMORY_SLOT, KEPT_PEER_COPY, KEPT_LOCAL_COPY)
        and i.step is not None
        and i.status != CORRUPT
    ]
    newest = checkpoint_step(candidates[0]) if candidates else None
    order = [
        by_path.get(_key(p)) for _, p in restore_order(directory_tier, candidates, newest, held)
    ]
    for position, info in enumerate(i for i in order if i is not None):
        info.candidate = position
    tried = sorted((i for i in infos if i.candidate is not None), key=lambda i: i.candidate)
    usable = (VALID,) if verify else (UNCHECKED,)
    # A TF 1 checkpoint is read and checked, but a restart never restores it (no name map).
    restore = next((i for i in tried if i.status in usable and i.format != "tf1"), None)

    needed = referenced_data_files(logdir)
    incomplete, shared = [], []
    for prefix in find_incomplete_checkpoints(logdir):
        base = os.path.basename(prefix) + ".data-"
        (shared if any(n.startswith(base) for n in needed) else incomplete).append(prefix)
    temporaries = storage.leftovers(logdir)
    return Survey(
        logdir=logdir,
        checkpoints=infos,
        restore=restore,
        first_candidate=tried[0] if tried else None,
        state_file=path if state is not None else None,
        state_file_error=state_file_error,
        incomplete=incomplete,
        shared_data=shared,
        temporaries=temporaries,
    )


def _key(prefix: str) -> str:
    return storage_for(prefix).canonical(prefix)


def _newer(info: CheckpointInfo, head: CheckpointInfo) -> bool:
    step = -1 if info.step is None else info.step
    head_step = -1 if head.step is None else head.step
    return (step, info.wall_time or 0.0) > (head_step, head.wall_time or 0.0)
