"""The Supervisor's arguments, checked and resolved once: ``Settings``.

TF's Supervisor resolves every argument left to ``USE_DEFAULT`` from the graph's collections,
else makes TF's default (``resolve_default``); here the state is a mapping given by the user,
so some defaults come from it (the global step, a ``Saver`` when the state is not empty, the
RNG state added to it). Non-chiefs keep TF's view (no logdir, no summary writer, no save
path), and every rank keeps the ``replica_*`` values a sharded state needs.

TF name: the constructor of ``tf.compat.v1.train.Supervisor``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from torchsupervisor.checkpoint.saver import Saver
from torchsupervisor.core import checks
from torchsupervisor.core.clock import REAL_CLOCK, Clock
from torchsupervisor.core.global_step import GlobalStep
from torchsupervisor.core.registry import (
    USE_DEFAULT,
    Graph,
    GraphKeys,
    first_from_collection,
    get_default_graph,
    resolve_default,
)
from torchsupervisor.core.rng import RNGState
from torchsupervisor.core.training_state import TrainingState
from torchsupervisor.core.variables import (
    global_variables_initializer,
    local_variables_initializer,
    report_uninitialized_variables,
)
from torchsupervisor.distributed import env as distributed
from torchsupervisor.driver.preemption_sources import PreemptionSource, check_sources
from torchsupervisor.driver.requeue import SlurmRequeue, check_requeue
from torchsupervisor.summary.ops import merge_all
from torchsupervisor.summary.writer import SummaryWriter
from torchsupervisor.supervisor.session_manager import SessionManager
from torchsupervisor.tiers.memory import MemoryTierConfig

if TYPE_CHECKING:
    from collections.abc import Callable

    from torchsupervisor.core.global_step import GlobalStepLike
    from torchsupervisor.core.session import Op
    from torchsupervisor.driver.checkpoint_driver import EventSink, SaverLike

__all__ = ["Settings", "resolve_settings"]

logger = logging.getLogger("torchsupervisor")


@dataclasses.dataclass
class Settings:
    """What a ``Supervisor`` was built with, every ``USE_DEFAULT`` resolved.

    The attributes are the Supervisor's arguments of the same names (see its docstring);
    ``logdir``, ``save_summaries_secs``, ``save_model_secs``, ``save_path`` and
    ``summary_writer`` are None on non-chiefs, as in TF; ``replica_logdir``,
    ``replica_save_path`` and ``replica_save_model_secs`` are kept on every rank.
    """

    graph: Graph
    state: dict[str, Any]
    is_chief: bool
    ready_op: Op
    ready_for_local_init_op: Op
    init_op: Op
    init_feed_dict: Mapping[str, Any] | None
    local_init_op: Op
    global_step: GlobalStepLike
    saver: SaverLike
    summary_op: Op
    summary_writer: EventSink
    session_manager: SessionManager
    init_fn: Callable[..., object] | None
    logdir: str | None
    save_summaries_secs: float | None
    save_model_secs: float | None
    save_path: str | None
    replica_logdir: str | None
    replica_save_path: str | None
    replica_save_model_secs: float | None
    recovery_wait_secs: float
    stop_grace_secs: float
    stop_on_checkpoint_error: bool
    preemption_signals: tuple[int, ...]
    preemption_grace_secs: float
    preemption_exit_code: int | None
    preemption_sources: tuple[PreemptionSource, ...]
    preemption_requeue: SlurmRequeue | None
    system_metrics_secs: float | None
    goodput_ledger: bool
    memory_tier: MemoryTierConfig | None
    clock: Clock


def resolve_settings(
    *,
    graph: Graph | None,
    ready_op: Op,
    ready_for_local_init_op: Op,
    is_chief: bool | None,
    init_op: Op,
    init_feed_dict: Mapping[str, Any] | None,
    local_init_op: Op,
    logdir: str | None,
    summary_op: Op,
    saver: SaverLike,
    global_step: GlobalStepLike,
    save_summaries_secs: float,
    save_model_secs: float,
    recovery_wait_secs: float,
    stop_grace_secs: float,
    checkpoint_basename: str,
    session_manager: SessionManager | None,
    summary_writer: EventSink,
    init_fn: Callable[..., object] | None,
    local_init_run_options: object,
    state: Mapping[str, Any] | None,
    device: torch.device | str | None,
    stop_on_checkpoint_error: bool,
    preemption_signals: Iterable[int] | None,
    preemption_grace_secs: float,
    preemption_exit_code: int | None,
    preemption_sources: Iterable[PreemptionSource] | str | None,
    preemption_requeue: SlurmRequeue | str | None,
    system_metrics_secs: float | None,
    goodput_ledger: bool,
    save_rng_state: bool,
    memory_tier: MemoryTierConfig | None,
    clock: Clock | None,
) -> Settings:
    """Check the Supervisor's arguments and resolve them (see the module docstring).

    Raises:
        TypeError: For an argument of the wrong type, naming it and the value.
        ValueError: For a value out of range, naming it and the value; if
            ``state['global_step']`` is not the global step given.
    """
    if is_chief is not None:
        is_chief = checks.check_bool("is_chief", is_chief)
    logdir = checks.check_path("logdir", logdir)
    save_summaries_secs = checks.check_number(
        "save_summaries_secs", save_summaries_secs, allow_none=True
    )
    save_model_secs = checks.check_number("save_model_secs", save_model_secs, allow_none=True)
    recovery_wait_secs = checks.check_number(
        "recovery_wait_secs", recovery_wait_secs, positive=True, allow_inf=False
    )
    stop_grace_secs = checks.check_number("stop_grace_secs", stop_grace_secs)
    checks.check_str("checkpoint_basename", checkpoint_basename, allow_empty=False)
    checks.check_state("state", state)
    _check_init(init_feed_dict, init_fn)
    stop_on_checkpoint_error = checks.check_bool(
        "stop_on_checkpoint_error", stop_on_checkpoint_error
    )
    preemption_signals = checks.check_signals("preemption_signals", preemption_signals)
    preemption_grace_secs = checks.check_number("preemption_grace_secs", preemption_grace_secs)
    preemption_exit_code = checks.check_int(
        "preemption_exit_code", preemption_exit_code, allow_none=True
    )
    save_rng_state = checks.check_bool("save_rng_state", save_rng_state)
    if memory_tier is not None and not isinstance(memory_tier, MemoryTierConfig):
        raise TypeError(
            f"memory_tier must be a MemoryTierConfig or None, got {memory_tier!r} "
            f"({type(memory_tier).__name__})"
        )
    if logdir and not state and saver is USE_DEFAULT:
        _warn_without_state(logdir)
    graph = checks.check_duck("graph", graph, ("get_collection",), "a Graph") or get_default_graph()
    clock = clock or REAL_CLOCK
    state = TrainingState.of(state)  # The user's mapping itself: what the loop sets is saved.
    add_rng = save_rng_state and bool(state) and "rng" not in state
    if add_rng:
        state.add("rng", RNGState())
    ready_op, ready_for_local_init_op, init_op, local_init_op = _default_ops(
        graph, ready_op, ready_for_local_init_op, init_op, local_init_op
    )
    global_step = _global_step(graph, global_step, state)
    make_saver = (lambda: Saver(clock=clock)) if state else None
    saver = resolve_default(graph, saver, GraphKeys.SAVERS, make_saver)
    if add_rng and hasattr(saver, "allow_missing"):
        saver.allow_missing("rng")
    summary_op = resolve_default(graph, summary_op, GraphKeys.SUMMARY_OP, merge_all)
    if is_chief is None:
        is_chief = distributed.rank() == 0
    if session_manager is None:
        # TF's arguments in TF's order, then ours.
        ops = (local_init_op, ready_op, ready_for_local_init_op, graph, recovery_wait_secs)
        session_manager = SessionManager(
            *ops, local_init_run_options, state=state, device=device, clock=clock
        )
    save_path = os.path.join(logdir, checkpoint_basename) if logdir else None
    writer = _chief_writer(summary_writer, logdir, clock) if is_chief else None
    return Settings(
        graph=graph,
        state=state,
        is_chief=bool(is_chief),
        ready_op=ready_op,
        ready_for_local_init_op=ready_for_local_init_op,
        init_op=init_op,
        init_feed_dict=init_feed_dict,
        local_init_op=local_init_op,
        global_step=global_step,
        saver=saver,
        summary_op=summary_op,
        summary_writer=writer,
        session_manager=session_manager,
        init_fn=init_fn,
        logdir=(logdir or None) if is_chief else None,
        save_summaries_secs=save_summaries_secs if is_chief else None,
        save_model_secs=save_model_secs if is_chief else None,
        save_path=save_path if is_chief else None,
        replica_logdir=logdir or None,
        replica_save_path=save_path,
        replica_save_model_secs=save_model_secs,
        recovery_wait_secs=recovery_wait_secs,
        stop_grace_secs=stop_grace_secs,
        stop_on_checkpoint_error=stop_on_checkpoint_error,
        preemption_signals=tuple(preemption_signals or ()),
        preemption_grace_secs=preemption_grace_secs,
        preemption_exit_code=preemption_exit_code,
        preemption_sources=check_sources("preemption_sources", preemption_sources),
        preemption_requeue=check_requeue("preemption_requeue", preemption_requeue),
        system_metrics_secs=checks.check_number(
            "system_metrics_secs", system_metrics_secs, positive=True, allow_none=True
        ),
        goodput_ledger=checks.check_bool("goodput_ledger", goodput_ledger),
        memory_tier=memory_tier,
        clock=clock,
    )


def _check_init(init_feed_dict: Any, init_fn: Callable[..., object] | None) -> None:
    if init_feed_dict is not None and not isinstance(init_feed_dict, Mapping):
        raise TypeError(f"init_feed_dict must be a mapping or None, got {init_feed_dict!r}")
    if init_fn is not None and not callable(init_fn):
        raise TypeError(f"init_fn must be callable or None, got {init_fn!r}")


def _warn_without_state(logdir: str) -> None:
    logger.warning(
        "Supervisor(logdir=%r) has no state=: its checkpoints hold only the global "
        "step, if any. TF saved every variable implicitly; pass the training state, e.g. "
        "state={'model': model, 'optimizer': optimizer, 'global_step': step}",
        logdir,
    )


def _default_ops(
    graph: Graph, ready_op: Op, ready_for_local_init_op: Op, init_op: Op, local_init_op: Op
) -> tuple[Any, Any, Any, Any]:
    """The ops given as USE_DEFAULT, from the graph's collections, else TF's defaults."""
    return (
        resolve_default(graph, ready_op, GraphKeys.READY_OP, report_uninitialized_variables),
        resolve_default(graph, ready_for_local_init_op, GraphKeys.READY_FOR_LOCAL_INIT_OP),
        resolve_default(graph, init_op, GraphKeys.INIT_OP, global_variables_initializer),
        resolve_default(graph, local_init_op, GraphKeys.LOCAL_INIT_OP, local_variables_initializer),
    )


def _chief_writer(summary_writer: EventSink, logdir: str | None, clock: Clock) -> Any:
    """The chief's summary writer: the one given, else one of the logdir (else None)."""
    if summary_writer is not USE_DEFAULT:
        return summary_writer
    return SummaryWriter(logdir, clock=clock) if logdir else None


def _global_step(graph: Graph, global_step: GlobalStepLike, state: dict[str, Any]) -> Any:
    """The global step: ``state["global_step"]`` first, then the ``GLOBAL_STEP`` collection.

    A global step missing from the state is added to it, so it is checkpointed.
    """
    if global_step is USE_DEFAULT:
        global_step = state.get("global_step")
        if global_step is not None and not _is_int_step(global_step):
            logger.warning("Found 'global_step' is not an int type: %s", global_step)
            global_step = None
        if global_step is None:
            global_step = first_from_collection(graph, GraphKeys.GLOBAL_STEP)
        elif not any(v is global_step for v in graph.get_collection(GraphKeys.GLOBAL_STEP)):
            graph.add_to_collection(GraphKeys.GLOBAL_STEP, global_step)
    if global_step is not None and not any(v is global_step for v in state.values()):
        if "global_step" in state:
            raise ValueError(
                "state['global_step'] is not the Supervisor's global_step; pass the same "
                "object or rename the state entry"
            )
        state["global_step"] = global_step
    return global_step


def _is_int_step(value: object) -> bool:
    if isinstance(value, GlobalStep):
        return True
    return isinstance(value, torch.Tensor) and not (
        value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool
    )
