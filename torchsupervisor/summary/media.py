"""The ``torch.utils.tensorboard``-style methods of ``SummaryWriter`` for tensors and text.

``add_histogram``, ``add_image``, ``add_audio`` and ``add_text`` check their arguments at the
call (so a bad one raises on the caller's thread), take a snapshot of the value (a copy that
stays on its device: ``snapshot.py``) and enqueue one item; the writer thread encodes it later
(``encoders/``). ``SummaryWriter`` mixes them in; its own module holds the TF ``FileWriter``
API and ``add_scalar`` (the hot path).

TF names: none (``torch.utils.tensorboard.SummaryWriter``'s methods).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from torchsupervisor.summary.encoders.audio import sample_rate_value
from torchsupervisor.summary.encoders.histogram import check_bins
from torchsupervisor.summary.encoders.image import image_layout
from torchsupervisor.summary.encoders.text import string_array
from torchsupervisor.summary.queue_items import AUDIO, HISTOGRAM, IMAGE, TEXT, Item
from torchsupervisor.summary.snapshot import snapshot_array, snapshot_bins, snapshot_step

if TYPE_CHECKING:
    from torchsupervisor.core.global_step import GlobalStepLike

__all__ = ["MediaMethods", "check_tag"]


def _shape_of(value: object) -> tuple[int, ...]:
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return tuple(value.shape)
    return np.shape(value)


def check_tag(tag: object) -> None:
    """Raise ``TypeError`` unless ``tag`` is a ``str``."""
    if type(tag) is not str:
        raise TypeError(f"tag must be a str, got {type(tag).__name__}")


class MediaMethods:
    """``add_histogram``, ``add_image``, ``add_audio``, ``add_text`` (see the module docstring).

    The class mixing them in provides ``_put(item)`` and ``_wall_time(walltime)``.
    """

    def _put(self, item: object) -> None:
        raise NotImplementedError

    def _wall_time(self, walltime: float | None) -> float:
        raise NotImplementedError

    def _enqueue(
        self,
        kind: int,
        tag: str,
        value: object,
        extra: Any,
        global_step: GlobalStepLike,
        walltime: object,
    ) -> None:
        """Queue one item: its kind, wall time, step (checked here), tag, value, extra."""
        step = snapshot_step(global_step)
        self._put(Item((kind, self._wall_time(walltime), step, tag, value, extra)))

    def add_histogram(
        self,
        tag: str,
        values: object,
        global_step: GlobalStepLike | None = None,
        bins: Any = "tensorflow",
        walltime: float | None = None,
    ) -> None:
        """Enqueue a histogram of ``values`` (a copy is kept; encoding happens later).

        Args:
            tag: The tag (used as is).
            values: Real numbers of any shape: a tensor (any device), an array or a list.
            global_step: The step; ``None`` leaves it unset.
            bins: ``"tensorflow"`` for TF's default buckets (see ``histogram_pb``); an
                int (number of equal bins), a sequence of bin edges, or a numpy rule name
                (``"auto"``, ``"fd"``, ...) for ``numpy.histogram`` bins (values outside given
                edges are not counted).
            walltime: The event's wall time; ``None`` means now.

        Raises:
            TypeError: ``tag`` is not a str; ``global_step`` is not an integer.
            ValueError: ``bins`` is invalid; ``global_step`` is outside the int64 range.
            InvalidArgumentError: ``values`` are not real numbers (a string, None, complex).

        NaN or infinite values are found on the writer thread: the event is dropped and the
        error (``"Nan in summary histogram for: <tag>"``) is logged.

        Thread safety: may be called from any thread.

        TF name: none (``torch.utils.tensorboard.SummaryWriter.add_histogram``).
        """
        check_tag(tag)
        check_bins(bins)
        self._enqueue(
            HISTOGRAM,
            tag,
            snapshot_array(values, f"histogram summary '{tag}'"),
            snapshot_bins(bins),
            global_step,
            walltime,
        )

    def add_image(
        self,
        tag: str,
        img_tensor: Any,
        global_step: GlobalStepLike | None = None,
        walltime: float | None = None,
        dataformats: str = "CHW",
    ) -> None:
        """Enqueue one image (``torch.utils.tensorboard`` semantics; encoded as PNG later).

        Pixels: uint8 is used as is; any other dtype is taken as intensities in [0, 1],
        multiplied by 255, clipped to [0, 255] and truncated (NaN -> 0).

        Args:
            tag: The tag (used as is).
            img_tensor: The image, laid out as ``dataformats`` says.
            global_step: The step; ``None`` leaves it unset.
            walltime: The event's wall time; ``None`` means now.
            dataformats: A permutation of ``"CHW"`` (C in 1, 3, 4) or of ``"HW"``.

        Raises:
            TypeError: ``tag`` is not a str.
            ValueError: ``dataformats`` is unknown or does not fit the shape.

        Thread safety: may be called from any thread.

        TF name: none (``torch.utils.tensorboard.SummaryWriter.add_image``).
        """
        check_tag(tag)
        image_layout(_shape_of(img_tensor), dataformats)
        self._enqueue(
            IMAGE,
            tag,
            snapshot_array(img_tensor, f"image summary '{tag}'"),
            dataformats,
            global_step,
            walltime,
        )

    def add_audio(
        self,
        tag: str,
        snd_tensor: object,
        global_step: GlobalStepLike | None = None,
        sample_rate: float = 44100,
        walltime: float | None = None,
    ) -> None:
        """Enqueue one mono clip (encoded later as 16-bit WAV with TF's rounding rule).

        Args:
            tag: The tag (used as is).
            snd_tensor: Float samples in [-1, 1], shape ``[L]`` or ``[1, L]``.
            global_step: The step; ``None`` leaves it unset.
            sample_rate: Samples per second (> 0).
            walltime: The event's wall time; ``None`` means now.

        Raises:
            TypeError: ``tag`` is not a str.
            ValueError: The shape is not ``[L]`` or ``[1, L]``.
            InvalidArgumentError: ``sample_rate <= 0`` (``"sample_rate must be > 0"``).

        Thread safety: may be called from any thread.

        TF name: none (``torch.utils.tensorboard.SummaryWriter.add_audio``).
        """
        check_tag(tag)
        shape = _shape_of(snd_tensor)
        if not (len(shape) == 1 or (len(shape) == 2 and shape[0] == 1)):
            raise ValueError(f"snd_tensor must have shape [L] or [1, L], got {list(shape)}")
        rate = sample_rate_value(sample_rate)
        self._enqueue(
            AUDIO,
            tag,
            snapshot_array(snd_tensor, f"audio summary '{tag}'"),
            rate,
            global_step,
            walltime,
        )

    def add_text(
        self,
        tag: str,
        text_string: str | Sequence[str],
        global_step: GlobalStepLike | None = None,
        walltime: float | None = None,
    ) -> None:
        """Enqueue text for TensorBoard's text plugin (Markdown).

        Args:
            tag: The tag (used as is).
            text_string: A string, or a (nested) list or array of strings.
            global_step: The step; ``None`` leaves it unset.
            walltime: The event's wall time; ``None`` means now.

        Raises:
            TypeError: ``tag`` is not a str.
            InvalidArgumentError: ``text_string`` is not a string or an array of strings.

        Thread safety: may be called from any thread.

        TF name: none (``torch.utils.tensorboard.SummaryWriter.add_text``).
        """
        check_tag(tag)
        text = string_array(tag, text_string)
        if text is text_string:
            text = text.copy()
        self._enqueue(TEXT, tag, text, None, global_step, walltime)
