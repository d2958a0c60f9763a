"""Restore a torch state from a TF 1 checkpoint through a name map, with layout transforms.

A TF 1 program's variables (``conv1/kernel``, ``dense/bias``, ``global_step``) are not a torch
model's (``model/conv1.weight``), and some are laid out differently: a TF convolution kernel
is ``[height, width, in, out]`` (HWIO) where torch's is ``[out, in, height, width]``; a dense
kernel is ``[in, out]`` where ``nn.Linear.weight`` is ``[out, in]``. ``restore_tf_checkpoint``
takes a map from TF names to state paths (the names ``Saver`` gives the state's tensors:
``model/conv1.weight``, ``optimizer/state/0/exp_avg``), each with an optional transform::

    from torchsupervisor.interop import conv2d_kernel, dense_kernel, restore_tf_checkpoint

    report = restore_tf_checkpoint(
        {"model": model},
        "tf_run/model.ckpt-3000",
        {
            "conv1/kernel": ("model/conv1.weight", conv2d_kernel),
            "conv1/bias": "model/conv1.bias",
            "dense/kernel": ("model/fc.weight", dense_kernel),
            "dense/bias": "model/fc.bias",
        },
    )
    report.unused    # TF names nothing was restored from: ["beta1_power", "conv1/bias/Adam", ...]

Every mapped tensor is read and checked (its CRC) and fitted (transform, shape, dtype kind)
before any is copied, so a failure leaves the state unchanged. TF's ``global_step`` variable
sets a ``GlobalStep`` given as ``global_step=``. An optimizer's TF slots (``kernel/Adam``) do
not map onto torch's lazily created optimizer state: map the weights, and training restarts
the optimizer's moments.

TF name: none (TF restored its own graphs' variables by name, with ``Saver(var_list={...})``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from torchsupervisor.checkpoint.reader import load_checkpoint
from torchsupervisor.core.state import iter_state_tensors
from torchsupervisor.core.state_load import copy_tensor
from torchsupervisor.errors import InvalidArgumentError, NotFoundError

__all__ = [
    "TFRestoreReport",
    "conv1d_kernel",
    "conv2d_kernel",
    "conv2d_transpose_kernel",
    "conv3d_kernel",
    "dense_kernel",
    "restore_tf_checkpoint",
]

logger = logging.getLogger("torchsupervisor")

Transform = Callable[[torch.Tensor], torch.Tensor]
Target = str | tuple[str, Transform] | None
NameMap = Mapping[str, str | tuple[str, Transform]] | Callable[[str], Target]


def dense_kernel(kernel: torch.Tensor) -> torch.Tensor:
    """A TF dense kernel ``[in, out]`` as ``nn.Linear.weight`` ``[out, in]``."""
    return kernel.t()


def conv1d_kernel(kernel: torch.Tensor) -> torch.Tensor:
    """A TF conv1d kernel ``[width, in, out]`` as ``nn.Conv1d.weight`` ``[out, in, width]``."""
    return kernel.permute(2, 1, 0)


def conv2d_kernel(kernel: torch.Tensor) -> torch.Tensor:
    """A TF conv2d kernel ``[h, w, in, out]`` (HWIO) as ``nn.Conv2d.weight`` ``[out, in, h, w]``."""
    return kernel.permute(3, 2, 0, 1)


def conv3d_kernel(kernel: torch.Tensor) -> torch.Tensor:
    """A TF conv3d kernel ``[d, h, w, in, out]`` as ``nn.Conv3d.weight`` ``[out, in, d, h, w]``."""
    return kernel.permute(4, 3, 0, 1, 2)


def conv2d_transpose_kernel(kernel: torch.Tensor) -> torch.Tensor:
    """A TF ``conv2d_transpose`` filter ``[h, w, out, in]`` as ``nn.ConvTranspose2d.weight``
    ``[in, out, h, w]``."""
    return kernel.permute(3, 2, 0, 1)


@dataclass
class TFRestoreReport:
    """What ``restore_tf_checkpoint`` did.

    Attributes:
        restored: ``(TF name, state path)`` of every tensor restored, in TF name order.
        unused: TF names in the checkpoint that nothing was restored from (an optimizer's
            slots, ``beta1_power``, ...).
        unmapped: State paths that received nothing (they keep their values).
        global_step: The step given to ``global_step`` (None: not set).
    """

    restored: list[tuple[str, str]] = field(default_factory=list)
    unused: list[str] = field(default_factory=list)
    unmapped: list[str] = field(default_factory=list)
    global_step: int | None = None


def _target(name_map: NameMap, tf_name: str) -> tuple[str, Transform | None] | None:
    found = name_map(tf_name) if callable(name_map) else name_map.get(tf_name)
    if found is None:
        return None
    if isinstance(found, str):
        return found, None
    if (
        isinstance(found, tuple)
        and len(found) == 2
        and isinstance(found[0], str)
        and callable(found[1])
    ):
        return found[0], found[1]
    raise TypeError(
        f"name_map gives {found!r} for {tf_name!r}: expected a state path, (path, transform) "
        "or None"
    )


def _same_kind(a: torch.dtype, b: torch.dtype) -> bool:
    def kind(d: torch.dtype) -> str:
        if d == torch.bool:
            return "bool"
        if d.is_complex:
            return "complex"
        return "float" if d.is_floating_point else "int"

    return kind(a) == kind(b)


def restore_tf_checkpoint(
    state: Mapping[str, Any],
    ckpt_dir_or_file: str,
    name_map: NameMap,
    *,
    global_step: Any = None,
    strict: bool = False,
) -> TFRestoreReport:
    """Copy the tensors of a TF 1 checkpoint into ``state``'s tensors through ``name_map``.

    Args:
        state: The state (as given to a ``Saver`` or ``Supervisor``: modules, optimizers,
            tensors). Its tensors are named by their paths (``model/conv1.weight``).
        ckpt_dir_or_file: A TF checkpoint prefix, or a directory (its ``checkpoint`` file's
            newest). One of ours is read too (its names are then state paths).
        name_map: TF name -> state path, or (state path, transform), for the tensors to
            restore; a mapping, or a callable returning one of those or None (not restored).
            A transform takes the TF tensor and returns the torch layout (``conv2d_kernel``,
            ``dense_kernel``, ...).
        global_step: A ``GlobalStep`` to set from the checkpoint's ``global_step``; None: not set.
        strict: Raise ``NotFoundError`` if a tensor of ``state`` receives nothing.

    Returns:
        The report (restored, unused and unmapped names); a warning is logged when some TF
        names were unused or some state tensors unmapped.

    Raises:
        NotFoundError: A mapping names a TF tensor or a state path that does not exist, or
            (``strict``) a state tensor received nothing; nothing is copied.
        InvalidArgumentError: A transformed tensor's shape differs from its state tensor's,
            or its dtype is of another kind (float into int, ...); nothing is copied.
        CorruptCheckpointError: The checkpoint is damaged (a CRC, a file); nothing is copied.
        UnimplementedError: As ``TFBundleReader`` (a big-endian bundle, ...).

    TF name: none.
    """
    reader = load_checkpoint(ckpt_dir_or_file)
    tensors = dict(iter_state_tensors(state))
    names = sorted(reader.get_variable_to_shape_map())
    report = TFRestoreReport()
    planned: list[tuple[str, str, torch.Tensor]] = []
    used: set[str] = set()
    if not callable(name_map):
        absent = sorted(set(name_map) - set(names))
        if absent:
            raise NotFoundError(
                f"name_map names tensors that {reader.prefix} does not hold: {absent}"
            )
    for tf_name in names:
        target = _target(name_map, tf_name)
        if target is None:
            if not (tf_name == "global_step" and global_step is not None):
                report.unused.append(tf_name)
            continue
        path, transform = target
        dest = tensors.get(path)
        if dest is None:
            raise NotFoundError(
                f"name_map sends {tf_name!r} to {path!r}, which is not a tensor of the state"
            )
        if path in used:
            raise InvalidArgumentError(f"name_map sends two TF tensors to {path!r}")
        used.add(path)
        value = reader.get_tensor(tf_name)  # Its CRC checked.
        if not isinstance(value, torch.Tensor):
            raise InvalidArgumentError(f"{tf_name!r} is a string tensor: it has no torch value")
        if transform is not None:
            value = transform(value)
        if tuple(value.shape) != tuple(dest.shape):
            raise InvalidArgumentError(
                f"{tf_name!r} of {reader.prefix} has shape {tuple(value.shape)}"
                f"{' after its transform' if transform else ''}; {path!r} has "
                f"{tuple(dest.shape)}"
            )
        if not _same_kind(value.dtype, dest.dtype):
            raise InvalidArgumentError(
                f"{tf_name!r} of {reader.prefix} is {value.dtype}; {path!r} is {dest.dtype}"
            )
        planned.append((tf_name, path, value))
    report.unmapped = sorted(set(tensors) - used)
    if strict and report.unmapped:
        raise NotFoundError(
            f"These tensors of the state receive nothing from {reader.prefix}: {report.unmapped}"
        )
    step = reader.global_step if global_step is not None else None
    if global_step is not None and step is None:
        raise NotFoundError(f"{reader.prefix} has no global_step to set global_step from")
    for tf_name, path, value in planned:  # Everything fits: now copy.
        copy_tensor(tensors[path], value, f"{path!r}: shape mismatch")
        report.restored.append((tf_name, path))
    if global_step is not None:
        global_step.assign(step)
        report.global_step = step
    if report.unused or report.unmapped:
        logger.warning(
            "Restored %d tensors from TF checkpoint %s; not restored from: %s; received "
            "nothing: %s",
            len(report.restored),
            reader.prefix,
            ", ".join(report.unused) or "none",
            ", ".join(report.unmapped) or "none",
        )
    return report
