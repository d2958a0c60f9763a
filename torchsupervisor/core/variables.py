"""Initialization ops for the state: what is not initialized, and how to initialize it.

TF's ``report_uninitialized_variables`` lists variables that have no value yet. In PyTorch the
equivalent is a tensor with no data: on the ``meta`` device (a model built under
``torch.device("meta")`` to be materialized later) or a lazy module's
``UninitializedParameter``. ``global_variables_initializer`` materializes meta modules on the
session's device and resets their parameters; for a model built normally it does nothing.

TF names: ``tf.compat.v1.report_uninitialized_variables``,
``tf.compat.v1.global_variables_initializer``, ``tf.compat.v1.local_variables_initializer``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from torchsupervisor.core.session import session_op
from torchsupervisor.core.state import is_materialized, iter_state_tensors
from torchsupervisor.core.state_names import select_state

if TYPE_CHECKING:
    from torchsupervisor.core.session import SessionLike

__all__ = [
    "global_variables_initializer",
    "local_variables_initializer",
    "report_uninitialized_variables",
]


def report_uninitialized_variables(var_list: Any = None) -> Callable[[Any], list[str]]:
    """Return a ready op: called with a session, it lists the uninitialized tensors' names.

    Args:
        var_list: None (the session's whole state), a mapping of names to stateful objects,
            or a list of state names.

    Returns:
        ``op(sess) -> list[str]`` of ``/``-joined names (``["model/fc.weight"]``), empty when
        everything is initialized; ``sess.run(op)`` works too.

    TF name: ``tf.compat.v1.report_uninitialized_variables``.
    """

    @session_op
    def report_uninitialized(sess: SessionLike) -> list[str]:
        state = _state(sess, var_list)
        return [name for name, t in iter_state_tensors(state) if not is_materialized(t)]

    return report_uninitialized


def global_variables_initializer() -> Callable[[Any], None]:
    """Return an init op that materializes the session's meta-device modules.

    For each ``nn.Module`` in the state with tensors on the ``meta`` device: allocate them on
    the session's device (keeping the same ``Parameter`` objects, so optimizers built on the
    meta model stay valid) and call ``reset_parameters()`` of every sub-module that has one.
    Lazy modules (``UninitializedParameter``) need a forward pass and are left as they are.
    Run it as in TF, ``sess.run(global_variables_initializer())``, or call it: ``op(sess)``.

    TF name: ``tf.compat.v1.global_variables_initializer``.
    """

    @session_op
    def initialize(sess: SessionLike) -> None:
        for obj in _state(sess, None).values():
            if isinstance(obj, torch.nn.Module):
                _materialize(obj, sess.device)

    return initialize


def local_variables_initializer() -> Callable[[], None]:
    """Return a no-op: eager state has no local variables or tables to initialize.

    TF name: ``tf.compat.v1.local_variables_initializer`` (grouped with
    ``tables_initializer`` as the Supervisor's default ``local_init_op``).
    """

    def local_init() -> None:
        return None

    return local_init


def _state(sess: SessionLike, var_list: Any) -> Mapping[str, Any]:
    state = getattr(sess, "state", None) or {}
    return select_state(state, var_list)


def _materialize(module: torch.nn.Module, device: torch.device) -> None:
    on_meta = [
        m
        for m in module.modules()
        if any(t.is_meta for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)))
    ]
    if not on_meta:
        return
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        for m in on_meta:
            m.to_empty(device=device, recurse=False)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)
    with torch.no_grad():
        for m in on_meta:
            reset = getattr(m, "reset_parameters", None)
            if callable(reset):
                reset()
