"""Audio summaries: clips encoded as 16-bit PCM WAV with TF's rounding rule.

TF's ``audio`` op takes batches ``[N, frames]`` or ``[N, frames, channels]``;
``SummaryWriter.add_audio`` takes one mono clip ``[L]`` or ``[1, L]``.
"""

from __future__ import annotations

import io
import wave
from typing import Any

import numpy as np
from tensorboard.compat.proto import summary_pb2

from torchsupervisor import errors
from torchsupervisor.summary.encoders.scalar import scalar_value
from torchsupervisor.summary.encoders.values import (
    check_max_outputs,
    output_tag,
    shape_str,
    to_numpy,
)

__all__ = ["audio_pb", "sample_rate_value", "torch_audio_pb"]


def _pcm16(samples: np.ndarray) -> np.ndarray:
    """Convert float samples to int16 with TF's rule: clamp(roundf(x * 32768))."""
    x = samples.astype(np.float32) * np.float32(32768.0)
    x = x.astype(np.float64)
    whole = np.trunc(x)
    with np.errstate(invalid="ignore"):
        frac = x - whole
        whole += np.where(np.abs(frac) >= 0.5, np.sign(x), 0.0)  # half away from zero
    whole[np.isnan(whole)] = 0.0
    np.clip(whole, -32768.0, 32767.0, out=whole)
    return whole.astype("<i2")


def _encode_wav(frames: np.ndarray, sample_rate: float) -> bytes:
    """Encode ``[frames, channels]`` float samples as 16-bit PCM WAV (44-byte header)."""
    rate = max(1, int(np.rint(np.float32(sample_rate))))
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(frames.shape[1])
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(_pcm16(frames).tobytes())
    return buf.getvalue()


def _audio_proto(frames: np.ndarray, sample_rate: float) -> summary_pb2.Summary.Audio:
    return summary_pb2.Summary.Audio(
        sample_rate=sample_rate,
        num_channels=frames.shape[1],
        length_frames=frames.shape[0],
        encoded_audio_string=_encode_wav(frames, sample_rate),
        content_type="audio/wav",
    )


def sample_rate_value(sample_rate: Any) -> float:
    """Return ``sample_rate`` (a number or a one-element tensor) as a float.

    Raises:
        InvalidArgumentError: ``sample_rate <= 0`` (TF's text ``"sample_rate must be > 0"``), or
            it is not one real number.
    """
    rate = scalar_value("sample_rate", sample_rate)
    if not rate > 0:
        raise errors.InvalidArgumentError("sample_rate must be > 0")
    return rate


def _audio_samples(tag: str, arr: np.ndarray) -> np.ndarray:
    if arr.dtype.kind != "f":
        raise errors.InvalidArgumentError(
            f"audio summary '{tag}' expects float samples in [-1, 1], got dtype {arr.dtype}"
        )
    return arr


def audio_pb(tag: str, audio: Any, sample_rate: Any, max_outputs: int = 3) -> summary_pb2.Summary:
    """Encode a batch of clips as 16-bit PCM WAV audio summaries with TF's rules.

    Samples are ``clamp(round_half_away_from_zero(x * 32768), -32768, 32767)``; the WAV header
    holds ``round(sample_rate)`` (at least 1) and the proto the exact ``sample_rate``.

    Args:
        tag: The base tag. Values are tagged ``"<tag>/audio"`` if ``max_outputs == 1``, else
            ``"<tag>/audio/<i>"``.
        audio: Float samples in [-1, 1], ``[N, frames]`` (mono) or ``[N, frames, channels]``.
        sample_rate: Samples per second (a number or a one-element tensor), > 0.
        max_outputs: At most this many clips (the first ones) are encoded; >= 1.

    Returns:
        A ``Summary`` with ``min(max_outputs, N)`` audio values (content type ``audio/wav``).

    Raises:
        InvalidArgumentError: The shape is not 2-D or 3-D (TF's text
            ``"Tensor must be 3-D or 2-D, got: [...]"``), ``sample_rate <= 0`` (TF's text
            ``"sample_rate must be > 0"``), the samples are not floats, or ``max_outputs < 1``.

    TF name: the ``AudioSummaryV2`` kernel.
    """
    check_max_outputs(max_outputs)
    arr = to_numpy(audio)
    if arr.ndim not in (2, 3):
        raise errors.InvalidArgumentError(f"Tensor must be 3-D or 2-D, got: {shape_str(arr.shape)}")
    rate = sample_rate_value(sample_rate)
    arr = _audio_samples(tag, arr)
    if arr.ndim == 2:
        arr = arr[:, :, None]
    summary = summary_pb2.Summary()
    for i in range(min(max_outputs, arr.shape[0])):
        summary.value.add(
            tag=output_tag(tag, "audio", max_outputs, i), audio=_audio_proto(arr[i], rate)
        )
    return summary


def torch_audio_pb(tag: str, snd: object, sample_rate: Any = 44100) -> summary_pb2.Summary:
    """Encode one mono clip given as ``add_audio`` takes it: ``[L]`` or ``[1, L]``.

    Args:
        tag: The summary tag (used as is).
        snd: Float samples in [-1, 1].
        sample_rate: Samples per second, > 0.

    Returns:
        A ``Summary`` with one audio value (samples encoded as ``audio_pb`` does).

    Raises:
        InvalidArgumentError: The shape is not ``[L]`` or ``[1, L]``, ``sample_rate <= 0``, or
            the samples are not floats.

    TF name: none (``torch.utils.tensorboard.SummaryWriter.add_audio``'s encoding).
    """
    arr = to_numpy(snd)
    if arr.ndim == 2 and arr.shape[0] == 1:
        arr = arr[0]
    if arr.ndim != 1:
        raise errors.InvalidArgumentError(
            f"snd_tensor must have shape [L] or [1, L], got {shape_str(arr.shape)}"
        )
    rate = sample_rate_value(sample_rate)
    arr = _audio_samples(tag, arr)
    summary = summary_pb2.Summary()
    summary.value.add(tag=tag, audio=_audio_proto(arr[:, None], rate))
    return summary
