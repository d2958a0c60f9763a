from __future__ import annotations

import io
import struct
import tracemalloc

import crc32c
import pytest

from torchsupervisor import errors
from torchsupervisor.summary import records


def test_crc32c_check_value():
    assert crc32c.crc32c(b"123456789") == 0xE3069283


def test_masked_crc_against_hand_computed_values():
    # rotr15(0xE3069283) = 0x2507C60D; + 0xA282EAD8 = 0xC78AB0E5 (mod 2**32).
    assert records.masked_crc32c(b"123456789") == 0xC78AB0E5
    # crc32c(b"") == 0, so the mask is the delta itself.
    assert records.masked_crc32c(b"") == 0xA282EAD8


@pytest.mark.parametrize("crc", [0, 1, 0xE3069283, 0xFFFFFFFF, 0x80000000, 0x12345678])
def test_unmask_inverts_mask(crc):
    masked = (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF
    assert records.unmask_crc32c(masked) == crc


def test_encode_record_layout():
    data = b"hello"
    rec = records.encode_record(data)
    assert len(rec) == len(data) + 16
    (length,) = struct.unpack("<Q", rec[:8])
    assert length == 5
    (length_crc,) = struct.unpack("<I", rec[8:12])
    assert records.unmask_crc32c(length_crc) == crc32c.crc32c(rec[:8])
    assert rec[12:17] == data
    (data_crc,) = struct.unpack("<I", rec[17:])
    assert records.unmask_crc32c(data_crc) == crc32c.crc32c(data)


def test_empty_record_layout():
    rec = records.encode_record(b"")
    assert rec[:8] == b"\x00" * 8
    assert struct.unpack("<I", rec[12:16])[0] == 0xA282EAD8


def test_round_trip_through_a_file(tmp_path):
    payloads = [b"", b"a", bytes(range(256)) * 100, b"last"]
    path = tmp_path / "records"
    path.write_bytes(records.encode_records(payloads))
    assert list(records.read_records(path)) == payloads
    with open(path, "rb") as f:
        assert list(records.iter_records(f)) == payloads


def test_empty_file_yields_nothing(tmp_path):
    path = tmp_path / "empty"
    path.write_bytes(b"")
    assert list(records.read_records(path)) == []


def _two_records(tmp_path):
    path = tmp_path / "data.tfrecord"
    first = records.encode_record(b"first payload")
    path.write_bytes(first + records.encode_record(b"second payload"))
    return path, len(first)


def test_corrupt_payload_is_data_loss_naming_file_and_offset(tmp_path):
    path, second_offset = _two_records(tmp_path)
    raw = bytearray(path.read_bytes())
    raw[second_offset + 12 + 3] ^= 0x01
    path.write_bytes(bytes(raw))
    it = records.read_records(path)
    assert next(it) == b"first payload"
    with pytest.raises(errors.DataLossError) as info:
        next(it)
    assert str(path) in str(info.value)
    assert f"byte offset {second_offset}" in str(info.value)
    assert "payload" in str(info.value)


def test_corrupt_length_is_data_loss(tmp_path):
    path, _ = _two_records(tmp_path)
    raw = bytearray(path.read_bytes())
    raw[0] ^= 0x40
    path.write_bytes(bytes(raw))
    with pytest.raises(errors.DataLossError, match=r"byte offset 0 .*length"):
        list(records.read_records(path))


def test_corrupt_footer_is_data_loss(tmp_path):
    path, second_offset = _two_records(tmp_path)
    raw = bytearray(path.read_bytes())
    raw[second_offset - 1] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(errors.DataLossError, match="byte offset 0 "):
        list(records.read_records(path))


@pytest.mark.parametrize("cut", [1, 5, 11, 12, 13, 20])
def test_truncated_tail_is_data_loss(tmp_path, cut):
    path, second_offset = _two_records(tmp_path)
    raw = path.read_bytes()
    path.write_bytes(raw[: second_offset + cut])
    it = records.read_records(path)
    assert next(it) == b"first payload"
    with pytest.raises(
        errors.DataLossError, match=f"truncated record at byte offset {second_offset}"
    ):
        next(it)


def test_stream_without_name_is_named_in_errors():
    stream = io.BytesIO(records.encode_record(b"x")[:-1])
    with pytest.raises(errors.DataLossError, match="<stream>"):
        list(records.iter_records(stream))
    stream = io.BytesIO(records.encode_record(b"x")[:-1])
    with pytest.raises(errors.DataLossError, match="mine"):
        list(records.iter_records(stream, name="mine"))


def test_huge_declared_length_does_not_allocate(tmp_path):
    header = struct.pack("<Q", 1 << 40)
    data = header + struct.pack("<I", records.masked_crc32c(header)) + b"short"
    path = tmp_path / "huge"
    path.write_bytes(data)
    with pytest.raises(errors.DataLossError, match="more than the 268435456 bytes a record"):
        list(records.read_records(path))


def test_a_length_beyond_the_rest_of_the_file_is_damage_found_before_reading(tmp_path):
    # A crafted length with a valid length checksum: a 1 GiB (sparse) file claiming 200 MiB
    # past its end allocated what it claimed before finding the file too short.
    header = struct.pack("<Q", 200 << 20)
    path = tmp_path / "crafted"
    with open(path, "wb") as f:
        f.write(header + struct.pack("<I", records.masked_crc32c(header)) + b"x" * 100)
    tracemalloc.start()
    try:
        with pytest.raises(errors.DataLossError, match="claims 209715200 bytes of payload"):
            list(records.read_records(path))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20  # A chunk of the read, whatever the claim.
