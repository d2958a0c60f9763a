"""Exponential moving averages of parameters, saved in checkpoints, restorable in their place.

Training keeps a shadow copy of each parameter and moves it towards the parameter after every
step; evaluating with the shadows often beats evaluating with the last weights::

    ema = ExponentialMovingAverage(0.999, num_updates=step, name="ema")
    ema.apply(model)                      # creates the shadows (copies of the weights)
    state = {"model": model, "optimizer": opt, "global_step": step, ema.name: ema}
    ...
    optimizer.step()
    ema.apply(model)                      # after every step: shadow -= (1 - d) * (shadow - w)

The EMA is a stateful object of the state: put it under the key ``ema.name`` and its shadows
are checkpointed as ``<ema.name>/<parameter name>`` (``ema/fc.weight``), restored with the
rest, and ``average_name(param)`` is exactly that checkpoint name.

To evaluate with the averages, build the model as usual and restore it with a ``Saver`` whose
``var_list`` maps the shadows' checkpoint names to the model's tensors
(``variables_to_restore``)::

    eval_model = build_model()
    Saver(ema.variables_to_restore(eval_model, prefix="model")).restore(None, checkpoint)
    # eval_model's parameters now hold the moving averages; its buffers (BatchNorm
    # statistics) come from "model/<buffer>" as saved.

The shadows can also be used directly: ``ema.average(param)`` is the shadow tensor.

TF name: ``tf.compat.v1.train.ExponentialMovingAverage``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from torchsupervisor.core.global_step import read_step
from torchsupervisor.core.state_load import copy_tensor
from torchsupervisor.errors import InvalidArgumentError

__all__ = ["ExponentialMovingAverage"]


def _default_name(place: int) -> str:
    """TF's name for the unnamed variable at ``place`` (0: ``"Variable"``, 1: ``"Variable_1"``)."""
    return "Variable" if place == 0 else f"Variable_{place}"


logger = logging.getLogger("torchsupervisor")

_FLOAT_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


class ExponentialMovingAverage:
    """Maintain exponential moving averages (shadows) of tensors, TF 1's way.

    Each ``apply()`` moves every shadow towards its tensor:
    ``shadow -= (1 - decay) * (shadow - tensor)``. A new shadow starts as a copy of its tensor
    (or as the value restored from a checkpoint, see ``load_state_dict``). With
    ``num_updates``, the decay used is ``min(decay, (1 + num_updates) / (10 + num_updates))``:
    lower at the start of training, so the averages move faster then.

    Args:
        decay: The decay, typically close to 1 (0.999, 0.9999).
        num_updates: The count of updates (usually the ``GlobalStep``, read at every
            ``apply()``), an int, or an integer scalar tensor. None: always ``decay``.
        zero_debias: Accepted for TF's signature. TF debiases only averages of non-variable
            tensors (its shadows start at 0); here every averaged tensor is a variable whose
            shadow starts at its value, so, as for TF variables, it has no effect.
        name: The state name under which the EMA is checkpointed (``state={name: ema}``) and
            the prefix of ``average_name()``; must not contain ``/``.

    Raises:
        TypeError: If ``decay`` is not a real number or ``num_updates`` not an integer,
            ``GlobalStep`` or integer scalar tensor.
        ValueError: If ``name`` is empty or contains ``/``.

    Thread safety: ``apply()`` and ``load_state_dict()`` are meant for the training thread (at
    step boundaries, like the optimizer); the checkpoint snapshot is taken there too.

    TF name: ``tf.compat.v1.train.ExponentialMovingAverage``.
    """

    def __init__(
        self,
        decay: float,
        num_updates: Any = None,
        zero_debias: bool = False,
        name: str = "ExponentialMovingAverage",
    ) -> None:
        if isinstance(decay, bool) or not isinstance(decay, int | float):
            raise TypeError(f"decay must be a float, got {type(decay).__name__}: {decay!r}")
        if num_updates is not None:
            read_step(num_updates)  # TypeError for anything but an integer count.
        if not isinstance(name, str) or not name or "/" in name:
            raise ValueError(f"name must be a non-empty str without '/', got {name!r}")
        self._decay = float(decay)
        self._num_updates = num_updates
        self._zero_debias = bool(zero_debias)
        self._name = name
        self._tensors: dict[str, torch.Tensor] = {}  # name -> averaged tensor
        self._shadows: dict[str, torch.Tensor] = {}  # name -> its moving average
        self._names: dict[int, str] = {}  # id(averaged tensor) -> name
        self._restored: dict[str, torch.Tensor] = {}  # loaded before apply() named them
        # id(tensor) -> (name, tensor): names average_name() gave tensors apply() had not seen.
        self._given: dict[int, tuple[str, torch.Tensor]] = {}

    def __repr__(self) -> str:
        return (
            f"ExponentialMovingAverage(decay={self._decay}, name={self._name!r}, "
            f"averages={len(self._shadows)})"
        )

    @property
    def name(self) -> str:
        """The state name of the EMA and the prefix of the shadows' checkpoint names.

        TF name: ``tf.compat.v1.train.ExponentialMovingAverage.name``.
        """
        return self._name

    @property
    def decay(self) -> float:
        """The decay given to the constructor (a float).

        TF name: none (TF keeps it private, ``ExponentialMovingAverage._decay``).
        """
        return self._decay

    @property
    def num_updates(self) -> Any:
        """The ``num_updates`` given to the constructor (None if none), not its value.

        TF name: none (TF keeps it private, ``ExponentialMovingAverage._num_updates``).
        """
        return self._num_updates

    def current_decay(self) -> float:
        """Return the decay the next ``apply()`` uses (with the ``num_updates`` rule).

        Returns:
            ``decay``, or ``min(decay, (1 + n) / (10 + n))`` with ``n`` the value of
            ``num_updates`` now.

        TF name: none (TF computes it inside ``apply``).
        """
        if self._num_updates is None:
            return self._decay
        n = float(read_step(self._num_updates))
        return min(self._decay, (1.0 + n) / (10.0 + n))

    # -------------------------------------------------------------------------- naming

    def _named(self, var_list: Any) -> list[tuple[str, torch.Tensor]]:
        """Return ``(name, tensor)`` pairs for a module, a mapping, or an iterable."""
        if isinstance(var_list, nn.Module):
            return list(var_list.named_parameters())
        if isinstance(var_list, Mapping):
            items = list(var_list.items())
        elif isinstance(var_list, torch.Tensor):
            items = [var_list]
        elif isinstance(var_list, Iterable) and not isinstance(var_list, str | bytes):
            items = list(var_list)
        else:
            raise TypeError(
                "var_list must be an nn.Module, a mapping of names to tensors, or an iterable of "
                f"(name, tensor) pairs or averaged tensors; got {type(var_list).__name__}"
            )
        pairs = []
        unnamed = 0  # The place of a bare tensor among the list's bare tensors.
        for item in items:
            if isinstance(item, torch.Tensor):
                pairs.append((self._bare_name(item, unnamed), item))
                unnamed += 1
            elif isinstance(item, tuple) and len(item) == 2:
                pairs.append(item)
            else:
                raise TypeError(
                    f"var_list items must be (name, tensor) pairs or tensors, got {item!r}"
                )
        for name, tensor in pairs:
            if not isinstance(name, str):
                raise TypeError(f"Names must be str, got {type(name).__name__}: {name!r}")
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"{name!r} is not a tensor: {type(tensor).__name__}")
        return pairs

    def _bare_name(self, tensor: torch.Tensor, place: int) -> str:
        """The name of a tensor given without one, at ``place`` among a list's bare tensors.

        Its name if it is averaged or was named by ``average_name()``; else TF's default
        name for the variable at that place (``_default_name``), so that the same list
        names its tensors alike at every call, new tensors included (a loss each step).
        """
        known = self._names.get(id(tensor))
        if known is not None and self._tensors.get(known) is tensor:
            return known
        given = self._given.get(id(tensor))
        if given is not None and given[1] is tensor:
            return given[0]
        name = _default_name(place)
        other = next((t for n, t in self._given.values() if n == name), None)
        if other is not None:
            raise ValueError(
                f"average_name() named another tensor {name!r}, the name of the tensor at "
                f"place {place} of apply()'s list: call average_name() in the order of that "
                "list, or give the tensors names (a module, a mapping, (name, tensor) pairs)"
            )
        current = self._tensors.get(name)
        if current is not None and current.is_leaf and current.requires_grad:
            # A new value at a place is the next value of a computed tensor (a loss); a
            # trainable variable's average is never handed to another tensor.
            raise ValueError(
                f"Place {place} of apply()'s list is {name!r}, the average of a trainable "
                "tensor, but another tensor is there now: give the tensors names (a module, "
                "a mapping, (name, tensor) pairs) when lists differ from call to call"
            )
        return name

    def _track(self, name: str, tensor: torch.Tensor) -> None:
        """Start averaging ``tensor`` under ``name`` (a no-op if it already is)."""
        known = self._names.get(id(tensor))
        if known == name and self._tensors.get(name) is tensor:
            return
        if known is not None:
            raise ValueError(
                f"Moving average already computed for: {known} (the same tensor cannot also "
                f"be averaged as {name!r})"
            )
        if tensor.dtype not in _FLOAT_DTYPES:
            raise TypeError(
                f"The variables must be half, float, or double: {name} (got {tensor.dtype})"
            )
        if name in self._tensors:
            # A new tensor under a name already averaged: the next value of the same quantity
            # (an eager loss is a new tensor at every step, where TF re-ran one op). It takes
            # the old one's place and its average goes on.
            shadow = self._shadows[name]
            if tuple(shadow.shape) != tuple(tensor.shape):
                raise InvalidArgumentError(
                    f"Moving average of {name!r} has shape {tuple(shadow.shape)}; the new "
                    f"tensor under that name has shape {tuple(tensor.shape)}"
                )
            del self._names[id(self._tensors[name])]
            self._tensors[name] = tensor
            self._names[id(tensor)] = name
            return
        if tensor.dtype not in _FLOAT_DTYPES:
            raise TypeError(
                f"The variables must be half, float, or double: {name} (got {tensor.dtype})"
            )
        if not name:
            raise ValueError("Averaged tensors need a non-empty name")
        restored = self._restored.pop(name, None)
        with torch.no_grad():
            if restored is None:
                shadow = tensor.detach().clone()
            else:
                if tuple(restored.shape) != tuple(tensor.shape):
                    self._restored[name] = restored
                    raise InvalidArgumentError(
                        f"The restored moving average {name!r} has shape "
                        f"{tuple(restored.shape)}, the tensor {tuple(tensor.shape)}"
                    )
                shadow = restored.to(device=tensor.device, dtype=tensor.dtype, copy=True)
        self._tensors[name] = tensor
        self._shadows[name] = shadow
        self._names[id(tensor)] = name
        self._given.pop(id(tensor), None)

    def _name_of(self, var: Any) -> str | None:
        if isinstance(var, str):
            return var
        if isinstance(var, torch.Tensor):
            name = self._names.get(id(var))
            if name is not None and self._tensors.get(name) is var:
                return name
            given = self._given.get(id(var))
            return given[0] if given is not None and given[1] is var else None
        raise TypeError(f"Expected a tensor or its name, got {type(var).__name__}: {var!r}")

    def _give_name(self, var: torch.Tensor) -> str:
        """Name a tensor ``apply()`` has not seen: the first of TF's default names that no
        other tensor has, remembered (with the tensor) for ``apply()`` and later calls."""
        taken = set(self._tensors) | {name for name, _ in self._given.values()}
        name = next(
            _default_name(i) for i in range(len(taken) + 1) if _default_name(i) not in taken
        )
        self._given[id(var)] = (name, var)
        return name

    # ------------------------------------------------------------------------ averaging

    def apply(self, var_list: Any = None) -> None:
        """Average the tensors of ``var_list`` (creating their shadows) and update the shadows.

        Call it after every optimizer step. The first call for a tensor creates its shadow as
        a copy of the tensor (or from a value restored earlier), so that first update leaves
        the shadow unchanged.

        Args:
            var_list: An ``nn.Module`` (all its ``named_parameters()``), a mapping of names to
                tensors, an iterable of ``(name, tensor)`` pairs and tensors (TF's
                ``apply([var0, var1])``), or None: every tensor averaged so far. A tensor
                given without a name keeps the name it has (from an earlier ``apply()`` or
                ``average_name()``); a new one gets TF's name for an unnamed variable by its
                place among the list's tensors without a name: ``"Variable"``,
                ``"Variable_1"``, ... So one list names its tensors alike at every call,
                and a new tensor at a place (a loss, new at every step) goes on with the
                average of that place. Tensors must be float16, bfloat16, float32 or float64
                (any device); a name may be scoped as TF's (``"local3/weight_loss"``).

        Raises:
            TypeError: ``"The variables must be half, float, or double: <name>"`` for another
                dtype; for a ``var_list`` of another kind.
            ValueError: ``"Moving average already computed for: <name>"`` if a tensor is
                already averaged under another name; if ``var_list`` is None before anything
                is averaged; if ``average_name()`` gave another tensor the default name of
                a place in the list.
            InvalidArgumentError: If a value restored for a name, or the average of a name
                given a new tensor, has another shape.

        A new tensor under a name already averaged (a loss, a new tensor at every step, as
        TF's CIFAR-10 trainer averages its losses) takes the old one's place: its average
        goes on from the current shadow.

        TF name: ``tf.compat.v1.train.ExponentialMovingAverage.apply``.
        """
        if var_list is None:
            if not self._tensors:
                raise ValueError(
                    "apply() needs var_list the first time (a module, a mapping of names to "
                    "tensors, or (name, tensor) pairs)"
                )
            names = list(self._tensors)
        else:
            pairs = self._named(var_list)
            for name, tensor in pairs:
                self._track(name, tensor)
            names = list(dict.fromkeys(name for name, _ in pairs))
        if not names:
            return
        decay = self.current_decay()
        shadows, tensors = [], []
        for name in names:
            tensor = self._tensors[name]
            shadow = self._shadows[name]
            if shadow.device != tensor.device or shadow.dtype != tensor.dtype:
                # The module moved (model.to(...)): the shadow follows it.
                shadow = self._shadows[name] = shadow.to(tensor.device, tensor.dtype)
            shadows.append(shadow)
            tensors.append(tensor.detach())
        with torch.no_grad():
            deltas = torch._foreach_sub(shadows, tensors)
            torch._foreach_mul_(deltas, 1.0 - decay)
            torch._foreach_sub_(shadows, deltas)

    def average(self, var: Any) -> torch.Tensor | None:
        """Return the shadow of ``var`` (a tensor or its name), or None if it is not averaged.

        TF name: ``tf.compat.v1.train.ExponentialMovingAverage.average``.
        """
        name = self._name_of(var)
        return None if name is None else self._shadows.get(name)

    def average_name(self, var: Any) -> str:
        """Return the checkpoint name of the shadow of ``var``: ``"<ema.name>/<var name>"``.

        It is the name under which the shadow is saved when the EMA is in the state under
        ``ema.name``, so ``Saver({ema.average_name(w): w})`` restores the average into ``w``.
        The order differs from TF's ``"<var name>/ExponentialMovingAverage"``: here the shadows
        are entries of the EMA's own state (checkpoint paths are state paths, SPEC section 5),
        so code that built TF's names by hand must call this method instead.

        As in TF, it can be called before ``apply()`` (an evaluation program that restores
        the averages never applies): a tensor ``apply()`` has not seen gets the first of TF's
        default names no other tensor has (``"Variable"``, ``"Variable_1"``, ...), which
        ``apply()`` then keeps. Called in the order of the list the training program gives
        ``apply()``, it returns the names that program saved; a restore checks the shapes.

        Args:
            var: A tensor (averaged by ``apply()`` or not), or a name (a str; it need not be
                averaged).

        Raises:
            TypeError: For a ``var`` that is neither a tensor nor a str.

        TF name: ``tf.compat.v1.train.ExponentialMovingAverage.average_name``.
        """
        name = self._name_of(var)
        if name is None:
            name = self._give_name(var)
        return f"{self._name}/{name}"

    def variables_to_restore(
        self, moving_avg_variables: Any = None, *, prefix: str | None = None
    ) -> dict[str, torch.Tensor]:
        """Return a ``Saver`` var_list that restores the averages into the given tensors.

        The mapping goes from checkpoint names to live tensors: ``average_name(p) -> p`` for
        the averaged tensors, and, with ``prefix``, ``"<prefix>/<key>" -> tensor`` for the
        rest of the module's state dict (buffers such as BatchNorm statistics, which are
        restored as saved), like TF's map that uses "the moving average variable name" where
        there is one and "the variable name" otherwise. ``Saver(mapping).restore(None, path)``
        then copies the shadows of checkpoint ``path`` into the tensors, in place.

        Args:
            moving_avg_variables: What receives the averages: an ``nn.Module`` (every
                parameter, named as ``apply(module)`` names them, e.g. a freshly built
                evaluation copy of the model), a mapping of names to tensors, an iterable of
                ``(name, tensor)`` pairs or of averaged tensors, or None: the tensors
                ``apply()`` averages.
            prefix: The state name of the module in the checkpoint (``"model"``), to also
                restore its non-averaged entries; only with a module.

        Returns:
            ``{checkpoint name: tensor}``, usable as ``Saver(var_list=...)``.

        Raises:
            TypeError: If ``prefix`` is given without a module, or for a ``moving_avg_variables``
                of another kind.

        TF name: ``tf.compat.v1.train.ExponentialMovingAverage.variables_to_restore``.
        """
        if prefix is not None and not isinstance(moving_avg_variables, nn.Module):
            raise TypeError(
                "prefix restores a module's other entries; moving_avg_variables must then be an "
                f"nn.Module, got {type(moving_avg_variables).__name__}"
            )
        if moving_avg_variables is None:
            pairs = list(self._tensors.items())
        else:
            pairs = self._named(moving_avg_variables)
        mapping = {self.average_name(name): tensor for name, tensor in pairs}
        if prefix is not None:
            averaged = {name for name, _ in pairs}
            for key, tensor in moving_avg_variables.state_dict().items():
                if key not in averaged and isinstance(tensor, torch.Tensor):
                    mapping[f"{prefix}/{key}"] = tensor
        return mapping

    # ----------------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Return ``{name: shadow}`` for the checkpoint (the shadows themselves, not copies).

        Values restored by ``load_state_dict`` for names that ``apply()`` has not seen yet are
        included, so a checkpoint written before the next ``apply()`` does not lose them.

        TF name: none (PyTorch's ``state_dict`` protocol; TF saves the shadow variables).
        """
        return {**self._restored, **self._shadows}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load shadows saved by ``state_dict()``.

        Existing shadows are overwritten in place. Values for names not averaged yet are kept
        and become the starting shadow when ``apply()`` first sees a tensor of that name (so
        the EMA can be restored before or after its first ``apply()``).

        Raises:
            TypeError: If ``state_dict`` is not a mapping of names to tensors.
            KeyError: If a shadow that exists is missing from ``state_dict``.
            ValueError: If a shadow and its saved value differ in shape.

        The entries are loaded one by one: after an error, those before it stay loaded.

        TF name: none (PyTorch's ``load_state_dict`` protocol; TF restores the shadow
        variables).
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a mapping, got {type(state_dict).__name__}")
        missing = [name for name in self._shadows if name not in state_dict]
        if missing:
            raise KeyError(f"{self._name}: moving averages missing from the state dict: {missing}")
        for name, value in state_dict.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"{self._name}: the value of {name!r} is a {type(value).__name__}, not a tensor"
                )
            shadow = self._shadows.get(name)
            if shadow is None:
                self._restored[name] = value.detach().clone()
                continue
            copy_tensor(
                shadow,
                value,
                (
                    f"{self._name}: the moving average {name!r} has shape "
                    f"{tuple(shadow.shape)}, the saved value {tuple(value.shape)}"
                ),
            )
