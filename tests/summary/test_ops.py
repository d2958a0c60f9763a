from __future__ import annotations

import bisect
import io
import logging
import struct
import sys

import numpy as np
import pytest
import torch
from PIL import Image
from tensorboard.compat.proto import summary_pb2, types_pb2
from tensorboard.util import tensor_util

from torchsupervisor import errors
from torchsupervisor.core import registry
from torchsupervisor.core.registry import GraphKeys
from torchsupervisor.summary import ops
from torchsupervisor.summary.encoders import audio as audio_encoder
from torchsupervisor.summary.encoders import histogram as histogram_encoder
from torchsupervisor.summary.encoders import image as image_encoder

DBL_MAX = sys.float_info.max


# --------------------------------------------------------------------------- helpers


def _reference_limits():
    positive = []
    v = 1e-12
    while v < 1e20:
        positive.append(v)
        v *= 1.1
    positive.append(DBL_MAX)
    return [-x for x in reversed(positive)] + [0.0] + positive


def _reference_buckets(values):
    """Independent (slow) implementation of TF's bucket counting and empty-run encoding."""
    limits = _reference_limits()
    counts = [0] * len(limits)
    for x in values:
        counts[min(bisect.bisect_right(limits, x), len(limits) - 1)] += 1
    out = []
    i = 0
    while i < len(limits):
        if counts[i]:
            out.append((limits[i], counts[i]))
            i += 1
        else:
            j = i
            while j + 1 < len(limits) and counts[j + 1] == 0:
                j += 1
            out.append((limits[j], 0))
            i = j + 1
    return out


def _pairs(histo):
    return list(zip(histo.bucket_limit, histo.bucket))


def _decode_png(value):
    img = Image.open(io.BytesIO(value.image.encoded_image_string))
    assert img.format == "PNG"
    return np.asarray(img)


def _parse_wav(data):
    header = struct.unpack("<4sI4s4sIHHIIHH4sI", data[:44])
    samples = np.frombuffer(data[44:], dtype="<i2")
    return header, samples


# --------------------------------------------------------------------------- scalar


@pytest.mark.parametrize(
    "value", [3, 2.5, np.float64(2.5), np.array([2.5]), torch.tensor(2.5), torch.tensor([[2.5]])]
)
def test_scalar_pb_accepts_one_element(value):
    summary = ops.scalar_pb("loss", value)
    assert len(summary.value) == 1
    assert summary.value[0].tag == "loss"
    assert summary.value[0].simple_value == pytest.approx(float(np.asarray(value).ravel()[0]))


def test_scalar_pb_is_float32():
    value = ops.scalar_pb("x", 0.1).value[0].simple_value
    assert value == float(np.float32(0.1))


def test_scalar_pb_rejects_several_elements():
    with pytest.raises(
        errors.InvalidArgumentError,
        match=r"tags and values not the same shape: \[\] != \[2\] \(tag 'x'\)",
    ):
        ops.scalar_pb("x", torch.tensor([1.0, 2.0]))


def test_scalar_pb_rejects_strings():
    with pytest.raises(errors.InvalidArgumentError, match="real number"):
        ops.scalar_pb("x", np.array("abc"))


def test_scalar_pb_bfloat16_tensor():
    assert ops.scalar_pb("x", torch.tensor(1.5, dtype=torch.bfloat16)).value[0].simple_value == 1.5


# --------------------------------------------------------------------------- histogram


def test_default_bucket_limits():
    limits = histogram_encoder.default_bucket_limits()
    assert limits.size == 1551
    assert limits[775] == 0.0
    assert limits[-1] == DBL_MAX and limits[0] == -DBL_MAX
    positive_finite = limits[776:-1]
    assert positive_finite.size == 774
    assert positive_finite[0] == 1e-12 and positive_finite[-1] < 1e20
    np.testing.assert_array_equal(limits, -limits[::-1])
    assert np.all(np.diff(limits) > 0)
    assert limits.tolist() == _reference_limits()


def test_histogram_of_one_zero_by_hand():
    histo = ops.histogram_pb("h", [0.0]).value[0].histo
    # buckets 0..775 empty (one entry at limit 0.0), bucket 776 = [0, 1e-12) holds the zero,
    # buckets 777..1550 empty (one entry at DBL_MAX).
    assert _pairs(histo) == [(0.0, 0.0), (1e-12, 1.0), (DBL_MAX, 0.0)]
    assert (histo.min, histo.max, histo.num, histo.sum, histo.sum_squares) == (0, 0, 1, 0, 0)


@pytest.mark.parametrize(
    "values",
    [
        [1.0, 2.0, 2.0],
        [-1.0, -1e-13, 0.0, 1e-13, 5.5],
        [1e-12, 1.1e-12, -1e-12],
        [1e30, -1e30, DBL_MAX],
        list(np.random.default_rng(0).normal(size=500)),
    ],
)
def test_histogram_matches_reference_rule(values):
    histo = ops.histogram_pb("h", np.array(values)).value[0].histo
    assert _pairs(histo) == [(lim, float(c)) for lim, c in _reference_buckets(values)]
    x = np.array(values, dtype=np.float64)
    with np.errstate(over="ignore"):
        sum_squares = float((x * x).sum())
    assert histo.min == x.min() and histo.max == x.max() and histo.num == len(values)
    assert histo.sum == pytest.approx(x.sum())
    assert histo.sum_squares == pytest.approx(sum_squares)


def test_histogram_of_torch_tensor_any_shape():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    histo = ops.histogram_pb("h", t).value[0].histo
    assert histo.num == 12
    assert _pairs(histo) == [(lim, float(c)) for lim, c in _reference_buckets(range(12))]


def test_empty_histogram_encoding():
    histo = ops.histogram_pb("h", []).value[0].histo
    assert _pairs(histo) == [(DBL_MAX, 0.0)]
    assert histo.min == DBL_MAX and histo.max == -DBL_MAX
    assert histo.num == 0 and histo.sum == 0 and histo.sum_squares == 0


def test_histogram_nan_error():
    with pytest.raises(errors.InvalidArgumentError, match=r"^Nan in summary histogram for: w$"):
        ops.histogram_pb("w", [1.0, float("nan")])


@pytest.mark.parametrize("bad", [float("inf"), float("-inf")])
def test_histogram_infinity_error(bad):
    with pytest.raises(
        errors.InvalidArgumentError, match=r"^Infinity in summary histogram for: w$"
    ):
        ops.histogram_pb("w", torch.tensor([0.0, bad, float("nan")]))


def test_histogram_numpy_bins():
    x = np.arange(10, dtype=np.float64)
    histo = histogram_encoder.torch_histogram_pb("h", x, 5).value[0].histo
    counts, edges = np.histogram(x, bins=5)
    assert list(histo.bucket) == counts.tolist()
    assert list(histo.bucket_limit) == edges[1:].tolist()
    assert histo.min == 0 and histo.max == 9


# --------------------------------------------------------------------------- image


def test_image_uint8_is_used_as_is():
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, size=(2, 5, 7, 3), dtype=np.uint8)
    summary = ops.image_pb("img", images)
    assert [v.tag for v in summary.value] == ["img/image/0", "img/image/1"]
    for i, value in enumerate(summary.value):
        assert (value.image.height, value.image.width, value.image.colorspace) == (5, 7, 3)
        np.testing.assert_array_equal(_decode_png(value), images[i])


def test_image_tags_depend_on_max_outputs_not_batch():
    images = np.zeros((4, 2, 2, 1), dtype=np.uint8)
    assert [v.tag for v in ops.image_pb("a", images, max_outputs=1).value] == ["a/image"]
    assert [v.tag for v in ops.image_pb("a", images[:1], max_outputs=3).value] == ["a/image/0"]
    assert len(ops.image_pb("a", images, max_outputs=3).value) == 3


def test_image_float_nonnegative_scaling():
    img = np.array([0.0, 0.5, 1.0, 2.0], dtype=np.float32).reshape(1, 1, 4, 1)
    pixels = _decode_png(ops.image_pb("a", img).value[0])
    # scale = 255 / max = 127.5: 0, 63.75, 127.5, 255 truncated toward zero.
    assert pixels.tolist() == [[0, 63, 127, 255]]


def test_image_float_negative_scaling():
    img = np.array([-2.0, 0.0, 1.0, 2.0], dtype=np.float64).reshape(1, 1, 4, 1)
    pixels = _decode_png(ops.image_pb("a", img).value[0])
    # scale = 127 / max(|-2|, |2|) = 63.5, offset 128: 1, 128, 191.5 -> 191, 255.
    assert pixels.tolist() == [[1, 128, 191, 255]]


def test_image_tiny_range_scales_to_zero():
    img = np.full((1, 2, 2, 1), 1e-7, dtype=np.float32)
    assert _decode_png(ops.image_pb("a", img).value[0]).tolist() == [[0, 0], [0, 0]]
    img = np.full((1, 2, 2, 1), -1e-7, dtype=np.float32)
    assert _decode_png(ops.image_pb("a", img).value[0]).tolist() == [[128, 128], [128, 128]]


def test_image_non_finite_pixels_get_bad_color():
    img = np.zeros((1, 1, 3, 3), dtype=np.float32)
    img[0, 0, 0] = [1.0, 1.0, 1.0]
    img[0, 0, 1] = [0.5, np.nan, 0.5]  # excluded from min/max, painted red
    img[0, 0, 2] = [np.inf, 100.0, 0.0]
    pixels = _decode_png(ops.image_pb("a", img).value[0])
    assert pixels.tolist() == [[[255, 255, 255], [255, 0, 0], [255, 0, 0]]]
    pixels = _decode_png(ops.image_pb("a", img, bad_color=[0, 9, 0, 255]).value[0])
    assert pixels[0, 1].tolist() == [0, 9, 0]


def test_image_rgba_and_grayscale_png_modes():
    rgba = np.full((1, 2, 3, 4), 7, dtype=np.uint8)
    value = ops.image_pb("a", rgba).value[0]
    assert value.image.colorspace == 4
    assert Image.open(io.BytesIO(value.image.encoded_image_string)).mode == "RGBA"
    gray = torch.full((1, 2, 3, 1), 9, dtype=torch.uint8)
    value = ops.image_pb("a", gray).value[0]
    assert value.image.colorspace == 1
    assert Image.open(io.BytesIO(value.image.encoded_image_string)).mode == "L"
    assert _decode_png(value).shape == (2, 3)


@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (3, 4, 3), (1, 2, 2, 2)])
def test_image_bad_shape_error_text(shape):
    expected = "[" + ",".join(map(str, shape)) + "]"
    with pytest.raises(errors.InvalidArgumentError) as info:
        ops.image_pb("a", np.zeros(shape, dtype=np.uint8))
    assert str(info.value) == f"Tensor must be 4-D with last dim 1, 3, or 4, not {expected}"


def test_image_other_errors():
    with pytest.raises(errors.InvalidArgumentError, match="dtype int64"):
        ops.image_pb("a", np.zeros((1, 2, 2, 3), dtype=np.int64))
    with pytest.raises(errors.InvalidArgumentError, match="max_outputs"):
        ops.image_pb("a", np.zeros((1, 2, 2, 3), dtype=np.uint8), max_outputs=0)
    with pytest.raises(errors.InvalidArgumentError, match=r"bad_color\.size = 2"):
        ops.image_pb("a", np.zeros((1, 2, 2, 3), dtype=np.float32), bad_color=[1, 2])


def test_image_torch_semantics_for_add_image():
    chw = torch.tensor([[[0.0, 0.5], [1.0, 2.0]]])  # C=1, H=2, W=2
    pixels = _decode_png(image_encoder.torch_image_pb("t", chw, "CHW").value[0])
    assert pixels.tolist() == [[0, 127], [255, 255]]
    hwc = np.zeros((2, 3, 3), dtype=np.uint8)
    hwc[1, 2] = [1, 2, 3]
    value = image_encoder.torch_image_pb("t", hwc, "HWC").value[0]
    assert value.tag == "t"
    np.testing.assert_array_equal(_decode_png(value), hwc)
    chw3 = torch.from_numpy(hwc).permute(2, 0, 1)
    np.testing.assert_array_equal(
        _decode_png(image_encoder.torch_image_pb("t", chw3).value[0]), hwc
    )
    with pytest.raises(ValueError, match="dataformats"):
        image_encoder.image_layout((2, 2, 2), "NCHW")
    with pytest.raises(ValueError, match="channels"):
        image_encoder.image_layout((2, 4, 4), "CHW")


# --------------------------------------------------------------------------- audio


def test_audio_wav_header_and_samples():
    samples = [0.0, 0.5, -0.5, 1.0, -1.0, 1 / 65536, -1 / 65536, 2.0, -3.0, 0.49 / 32768]
    clip = np.array([samples], dtype=np.float32)
    summary = ops.audio_pb("snd", clip, sample_rate=16000.4, max_outputs=1)
    (value,) = summary.value
    assert value.tag == "snd/audio"
    audio = value.audio
    assert audio.content_type == "audio/wav"
    assert audio.num_channels == 1 and audio.length_frames == len(samples)
    assert audio.sample_rate == pytest.approx(16000.4)
    header, pcm = _parse_wav(audio.encoded_audio_string)
    riff, riff_size, wave_tag, fmt, fmt_size, pcm_format, channels, rate, byte_rate, align, bits = (
        header[:11]
    )
    data_tag, data_size = header[11:]
    assert (riff, wave_tag, fmt, data_tag) == (b"RIFF", b"WAVE", b"fmt ", b"data")
    assert (fmt_size, pcm_format, channels, rate, bits) == (16, 1, 1, 16000, 16)
    assert (byte_rate, align) == (32000, 2)
    assert data_size == 2 * len(samples) and riff_size == 36 + data_size
    assert len(audio.encoded_audio_string) == 44 + data_size
    assert pcm.tolist() == [0, 16384, -16384, 32767, -32768, 1, -1, 32767, -32768, 0]


def test_audio_multichannel_batch_tags_and_interleaving():
    clips = torch.zeros(3, 2, 2)
    clips[0, :, 0] = 0.25
    clips[0, :, 1] = -0.25
    summary = ops.audio_pb("snd", clips, torch.tensor(8000.0), max_outputs=2)
    assert [v.tag for v in summary.value] == ["snd/audio/0", "snd/audio/1"]
    header, pcm = _parse_wav(summary.value[0].audio.encoded_audio_string)
    assert header[6] == 2 and summary.value[0].audio.num_channels == 2
    assert pcm.tolist() == [8192, -8192, 8192, -8192]


def test_audio_errors():
    with pytest.raises(errors.InvalidArgumentError) as info:
        ops.audio_pb("a", np.zeros(5, dtype=np.float32), 100)
    assert str(info.value) == "Tensor must be 3-D or 2-D, got: [5]"
    with pytest.raises(errors.InvalidArgumentError) as info:
        ops.audio_pb("a", np.zeros((1, 5), dtype=np.float32), 0)
    assert str(info.value) == "sample_rate must be > 0"
    with pytest.raises(errors.InvalidArgumentError, match="float samples"):
        ops.audio_pb("a", np.zeros((1, 5), dtype=np.int16), 10)


def test_audio_torch_shape_for_add_audio():
    value = audio_encoder.torch_audio_pb("a", torch.tensor([[0.5, -0.5]]), 100).value[0]
    assert value.tag == "a" and value.audio.length_frames == 2
    assert _parse_wav(value.audio.encoded_audio_string)[1].tolist() == [16384, -16384]
    with pytest.raises(errors.InvalidArgumentError, match=r"\[L\] or \[1, L\]"):
        audio_encoder.torch_audio_pb("a", torch.zeros(2, 3), 100)


# --------------------------------------------------------------------------- text


def test_text_pb_is_a_string_tensor_for_the_text_plugin():
    summary = ops.text_pb("notes", "hello *world*")
    (value,) = summary.value
    assert value.tag == "notes"
    assert value.metadata.plugin_data.plugin_name == "text"
    assert value.tensor.dtype == types_pb2.DT_STRING
    assert tensor_util.make_ndarray(value.tensor).item() == b"hello *world*"


def test_text_pb_arrays_keep_shape_and_utf8():
    value = ops.text_pb("t", [["a", "é"], ["c", b"d"]]).value[0]
    arr = tensor_util.make_ndarray(value.tensor)
    assert arr.shape == (2, 2)
    assert arr.tolist() == [[b"a", "é".encode()], [b"c", b"d"]]


@pytest.mark.parametrize("bad", [torch.zeros(2), np.zeros(3), [1, 2]])
def test_text_pb_rejects_non_strings(bad):
    with pytest.raises(errors.InvalidArgumentError, match="expects"):
        ops.text_pb("t", bad)


# --------------------------------------------------------------------------- summary ops


def test_scalar_op_reads_tensor_at_call_time(graph):
    t = torch.tensor(1.0)
    op = ops.scalar("loss", t)
    t.fill_(2.0)
    assert op().value[0].simple_value == 2.0
    t.add_(1.0)
    assert op().value[0].simple_value == 3.0


def test_ops_read_callables_and_constants(graph):
    calls = []

    def source():
        calls.append(1)
        return float(len(calls))

    op = ops.scalar("count", source)
    assert calls == []
    assert op().value[0].simple_value == 1.0
    assert op().value[0].simple_value == 2.0
    assert ops.scalar("const", 4)().value[0].simple_value == 4.0
    assert ops.histogram("h", lambda: [1.0, 2.0])().value[0].histo.num == 2
    assert ops.image("i", np.zeros((1, 2, 2, 3), np.uint8))().value[0].tag == "i/image/0"
    snd = ops.audio("s", torch.zeros(1, 4), lambda: 100.0, max_outputs=1)()
    assert snd.value[0].tag == "s/audio" and snd.value[0].audio.sample_rate == 100.0
    assert ops.text("t", lambda: "x")().value[0].tensor.string_val == [b"x"]


def test_ops_are_registered_in_collections(graph):
    a = ops.scalar("a", 1.0)
    b = ops.histogram("b", [1.0], collections=["mine"])
    c = ops.text("c", "x", collections=[])
    d = ops.image("d", np.zeros((1, 1, 1, 1), np.uint8), collections=[GraphKeys.SUMMARIES, "k"])
    assert registry.get_collection(GraphKeys.SUMMARIES) == [a, d]
    assert registry.get_collection("mine") == [b]
    assert registry.get_collection("k") == [d]
    assert c not in registry.get_collection(GraphKeys.SUMMARIES)


def test_scope_filters_on_op_name(graph):
    ops.scalar("train/loss", 1.0)
    ops.scalar("eval/loss", 1.0)
    ops.scalar("acc", 1.0, family="train")
    names = [op.name for op in registry.get_collection(GraphKeys.SUMMARIES, scope="train/")]
    assert names == ["train/loss", "train/acc"]


def test_tag_cleaning(graph, caplog):
    with caplog.at_level(logging.INFO, logger="torchsupervisor"):
        op = ops.scalar("/my loss:0 (avg)", 1.0)
    assert op.name == "my_loss_0__avg_"
    assert op().value[0].tag == "my_loss_0__avg_"
    assert "Summary name /my loss:0 (avg) is illegal; using my_loss_0__avg_ instead." in (
        caplog.text
    )
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="torchsupervisor"):
        assert ops.scalar("ok-name_1.2/x", 1.0).name == "ok-name_1.2/x"
    assert "illegal" not in caplog.text
    with pytest.raises(TypeError):
        ops.scalar(3, 1.0)


def test_family_prefixes_the_tag(graph):
    op = ops.histogram("weights", [1.0], family="layer 1")
    assert op.name == "layer_1/weights"
    assert op().value[0].tag == "layer_1/weights"


def test_merge_concatenates_ops_protos_and_bytes(graph):
    proto = ops.scalar_pb("p", 1.0)
    merged = ops.merge([ops.scalar("a", 2.0), proto, ops.scalar_pb("b", 3.0).SerializeToString()])
    assert [v.tag for v in merged().value] == ["a", "p", "b"]
    assert [v.simple_value for v in merged().value] == [2.0, 1.0, 3.0]
    # merge adds itself to no collection by default, as TF.
    assert merged not in registry.get_collection(GraphKeys.SUMMARIES)
    assert merged.name == "Merge"
    named = ops.merge([proto], collections=["merged"], name="all")
    assert registry.get_collection("merged") == [named] and named.name == "all"


def test_merge_duplicate_tag_error(graph):
    merged = ops.merge([ops.scalar("x", 1.0), ops.scalar("x", 2.0)])
    with pytest.raises(errors.InvalidArgumentError) as info:
        merged()
    assert str(info.value) == "Duplicate tag x found in summary inputs"


def test_merge_bad_inputs():
    with pytest.raises(errors.InvalidArgumentError, match="Could not parse one of the summary"):
        ops.merge([b"\xff\xff\xff"], collections=[])()
    with pytest.raises(TypeError, match="got int"):
        ops.merge([1])


def test_merge_all(graph):
    assert ops.merge_all() is None
    t = torch.tensor(1.0)
    ops.scalar("train/a", t)
    ops.histogram("train/h", lambda: t.repeat(3))
    ops.scalar("eval/b", 5.0)
    merged = ops.merge_all()
    t.fill_(7.0)
    summary = merged()
    assert isinstance(summary, summary_pb2.Summary)
    assert [v.tag for v in summary.value] == ["train/a", "train/h", "eval/b"]
    assert summary.value[0].simple_value == 7.0 and summary.value[1].histo.sum == 21.0
    scoped = ops.merge_all(scope="train/")
    assert [v.tag for v in scoped().value] == ["train/a", "train/h"]
    assert ops.merge_all(key="nothing") is None


def test_zero_fraction():
    z = ops.zero_fraction(torch.tensor([0.0, 1.0, 0.0, 2.0]))
    assert z.dtype == torch.float32 and z.dim() == 0 and z.item() == 0.5
    assert ops.zero_fraction([[0, 0], [0, 3]]).item() == 0.75
    assert ops.zero_fraction(np.ones(3)).item() == 0.0
    assert torch.isnan(ops.zero_fraction(torch.zeros(0)))
