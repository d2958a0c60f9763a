"""Tests of the ``checkpoint`` state file: exact TF text, tolerant reading, atomic writes."""

from __future__ import annotations

import errno
import logging
import os
import pathlib
import random
import threading

import pytest
from google.protobuf import descriptor_pb2

from torchsupervisor.checkpoint import state_file
from torchsupervisor.checkpoint.state_file import (
    CheckpointState,
    generate_checkpoint_state_proto,
    get_checkpoint_state,
    latest_checkpoint,
    parse_checkpoint_state,
    state_file_path,
    update_checkpoint_state,
    update_checkpoint_state_internal,
)
from torchsupervisor.storage import is_temporary_name
from torchsupervisor.testing import FaultyStorage

LOGGER = "torchsupervisor"


def _read(path) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _write(path, data: str | bytes) -> None:
    with open(path, "wb") as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)


def _touch_index(prefix) -> None:
    _write(f"{prefix}.index", b"{}")


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


# ----------------------------------------------------------------------------- writing


def test_written_text_is_tfs_absolute_example(tmp_path):
    paths = ["/data/run/model.ckpt-100", "/data/run/model.ckpt-200", "/data/run/model.ckpt-300"]
    update_checkpoint_state(str(tmp_path), "/data/run/model.ckpt-300", paths)
    assert _read(tmp_path / "checkpoint") == (
        'model_checkpoint_path: "/data/run/model.ckpt-300"\n'
        'all_model_checkpoint_paths: "/data/run/model.ckpt-100"\n'
        'all_model_checkpoint_paths: "/data/run/model.ckpt-200"\n'
        'all_model_checkpoint_paths: "/data/run/model.ckpt-300"\n'
    )


def test_written_text_with_timestamps_is_tf2_managers_format(tmp_path):
    d = str(tmp_path)
    update_checkpoint_state_internal(
        d,
        os.path.join(d, "ckpt-2"),
        all_model_checkpoint_paths=(os.path.join(d, "ckpt-1"), os.path.join(d, "ckpt-2")),
        save_relative_paths=True,
        all_model_checkpoint_timestamps=(10000.0, 10001.5),
        last_preserved_timestamp=2.0,
    )
    assert _read(tmp_path / "checkpoint") == (
        'model_checkpoint_path: "ckpt-2"\n'
        'all_model_checkpoint_paths: "ckpt-1"\n'
        'all_model_checkpoint_paths: "ckpt-2"\n'
        "all_model_checkpoint_timestamps: 10000.0\n"
        "all_model_checkpoint_timestamps: 10001.5\n"
        "last_preserved_timestamp: 2.0\n"
    )


def test_zero_and_empty_fields_are_omitted(tmp_path):
    update_checkpoint_state(
        str(tmp_path),
        "/r/m-1",
        ["/r/m-1"],
        all_model_checkpoint_timestamps=[],
        last_preserved_timestamp=0.0,
    )
    assert _read(tmp_path / "checkpoint") == (
        'model_checkpoint_path: "/r/m-1"\nall_model_checkpoint_paths: "/r/m-1"\n'
    )


def test_custom_latest_filename(tmp_path):
    update_checkpoint_state(str(tmp_path), "/r/m-1", latest_filename="my_state")
    assert not (tmp_path / "checkpoint").exists()
    assert get_checkpoint_state(str(tmp_path), "my_state").model_checkpoint_path == "/r/m-1"
    assert get_checkpoint_state(str(tmp_path)) is None
    assert state_file_path("/x", "my_state") == os.path.join("/x", "my_state")
    assert state_file_path("/x") == os.path.join("/x", "checkpoint")


def test_round_trip_absolute_paths_and_timestamps(tmp_path):
    d = str(tmp_path)
    paths = [os.path.join(d, f"model.ckpt-{i}") for i in (1, 2, 3)]
    update_checkpoint_state(
        d,
        paths[-1],
        list(paths),
        all_model_checkpoint_timestamps=[1.25, 2.5, 1e9 + 0.125],
        last_preserved_timestamp=0.5,
    )
    state = get_checkpoint_state(d)
    assert isinstance(state, CheckpointState)
    assert state.model_checkpoint_path == paths[-1]
    assert list(state.all_model_checkpoint_paths) == paths
    assert list(state.all_model_checkpoint_timestamps) == [1.25, 2.5, 1e9 + 0.125]
    assert state.last_preserved_timestamp == 0.5


def test_round_trip_non_ascii_and_quotes(tmp_path):
    d = tmp_path / 'ré"sumé\\'
    d.mkdir()
    prefix = os.path.join(str(d), "modèle.ckpt-7")
    update_checkpoint_state(str(d), prefix)
    assert get_checkpoint_state(str(d)).model_checkpoint_path == prefix


def test_path_like_arguments(tmp_path):
    update_checkpoint_state(tmp_path, tmp_path / "m-1", [tmp_path / "m-0"])
    state = get_checkpoint_state(tmp_path)
    assert state.model_checkpoint_path == str(tmp_path / "m-1")
    assert list(state.all_model_checkpoint_paths) == [str(tmp_path / "m-0"), str(tmp_path / "m-1")]


def test_model_path_is_appended_to_the_callers_list(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    paths = ["/r/m-1", "/r/m-2"]
    state = generate_checkpoint_state_proto(str(tmp_path), "/r/m-3", paths)
    assert paths == ["/r/m-1", "/r/m-2", "/r/m-3"]  # Mutated in place, as TF does.
    assert list(state.all_model_checkpoint_paths) == paths
    assert "/r/m-3 is not in all_model_checkpoint_paths. Manually adding it." in caplog.messages


def test_model_path_already_last_is_not_repeated(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    paths = ["/r/m-1", "/r/m-2"]
    state = generate_checkpoint_state_proto(str(tmp_path), "/r/m-2", paths)
    assert paths == ["/r/m-1", "/r/m-2"]
    assert list(state.all_model_checkpoint_paths) == ["/r/m-1", "/r/m-2"]
    assert not any("Manually adding it" in m for m in caplog.messages)


def test_model_path_elsewhere_in_list_is_appended_again(tmp_path):
    state = generate_checkpoint_state_proto(str(tmp_path), "/r/m-1", ["/r/m-1", "/r/m-2"])
    assert list(state.all_model_checkpoint_paths) == ["/r/m-1", "/r/m-2", "/r/m-1"]


def test_none_list_gives_the_model_path_only(tmp_path):
    state = generate_checkpoint_state_proto(str(tmp_path), "/r/m-9")
    assert state.model_checkpoint_path == "/r/m-9"
    assert list(state.all_model_checkpoint_paths) == ["/r/m-9"]
    assert not state.all_model_checkpoint_timestamps
    assert state.last_preserved_timestamp == 0.0


def test_tuple_list_is_copied_not_mutated(tmp_path):
    paths = ("/r/m-1",)
    state = generate_checkpoint_state_proto(str(tmp_path), "/r/m-2", paths)
    assert paths == ("/r/m-1",)
    assert list(state.all_model_checkpoint_paths) == ["/r/m-1", "/r/m-2"]


def test_string_instead_of_list_is_a_type_error(tmp_path):
    with pytest.raises(TypeError, match="all_model_checkpoint_paths must be a list"):
        generate_checkpoint_state_proto(str(tmp_path), "/r/m-2", "/r/m-2")


def test_mismatched_timestamps_raise_tfs_value_error(tmp_path):
    paths = ["/r/m-1", "/r/m-2"]
    expected = (
        "Checkpoint timestamps, if provided, must match checkpoint paths (got paths "
        "['/r/m-1', '/r/m-2', '/r/m-3'] and timestamps [1.0, 2.0])"
    )
    with pytest.raises(ValueError) as info:
        update_checkpoint_state(
            str(tmp_path), "/r/m-3", paths, all_model_checkpoint_timestamps=[1.0, 2.0]
        )
    assert str(info.value) == expected
    assert not (tmp_path / "checkpoint").exists()
    # The model path was appended before the check, as in TF.
    assert paths == ["/r/m-1", "/r/m-2", "/r/m-3"]


def test_empty_timestamps_are_not_checked(tmp_path):
    state = generate_checkpoint_state_proto(
        str(tmp_path), "/r/m-2", ["/r/m-1"], all_model_checkpoint_timestamps=[]
    )
    assert list(state.all_model_checkpoint_paths) == ["/r/m-1", "/r/m-2"]
    assert not state.all_model_checkpoint_timestamps


def test_relative_save_dir_rewrites_relative_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run").mkdir()
    paths = ["run/model.ckpt-1", "/abs/model.ckpt-0", "./run/model.ckpt-2"]
    state = generate_checkpoint_state_proto("run", "run/model.ckpt-3", paths)
    assert state.model_checkpoint_path == "model.ckpt-3"
    expected = ["model.ckpt-1", "/abs/model.ckpt-0", "model.ckpt-2", "model.ckpt-3"]
    assert list(state.all_model_checkpoint_paths) == expected
    assert paths == expected  # TF rewrites the caller's list in place too.


def test_relative_save_dir_round_trip_finds_the_same_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run").mkdir()
    _touch_index("run/model.ckpt-3")
    update_checkpoint_state("run", "run/model.ckpt-3", ["run/model.ckpt-2"])
    assert _read("run/checkpoint") == (
        'model_checkpoint_path: "model.ckpt-3"\n'
        'all_model_checkpoint_paths: "model.ckpt-2"\n'
        'all_model_checkpoint_paths: "model.ckpt-3"\n'
    )
    assert latest_checkpoint("run") == os.path.join("run", "model.ckpt-3")
    state = get_checkpoint_state("run")
    assert list(state.all_model_checkpoint_paths) == [
        os.path.join("run", "model.ckpt-2"),
        os.path.join("run", "model.ckpt-3"),
    ]


def test_empty_save_dir_means_current_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _touch_index("model.ckpt-5")
    update_checkpoint_state("", "model.ckpt-5")
    assert _read("checkpoint").startswith('model_checkpoint_path: "model.ckpt-5"\n')
    assert latest_checkpoint("") == "model.ckpt-5"


def test_absolute_save_dir_keeps_relative_paths_as_given(tmp_path):
    state = generate_checkpoint_state_proto(str(tmp_path), "sub/m-2", ["sub/m-1"])
    assert state.model_checkpoint_path == "sub/m-2"
    assert list(state.all_model_checkpoint_paths) == ["sub/m-1", "sub/m-2"]


def test_save_relative_paths_stores_names_relative_to_save_dir(tmp_path):
    d = str(tmp_path)
    paths = [os.path.join(d, "m-1"), "/elsewhere/m-0"]
    update_checkpoint_state_internal(
        d, os.path.join(d, "m-2"), all_model_checkpoint_paths=paths, save_relative_paths=True
    )
    other = os.path.relpath("/elsewhere/m-0", d)
    assert _read(tmp_path / "checkpoint") == (
        'model_checkpoint_path: "m-2"\n'
        'all_model_checkpoint_paths: "m-1"\n'
        f'all_model_checkpoint_paths: "{other}"\n'
        'all_model_checkpoint_paths: "m-2"\n'
    )
    assert paths == [os.path.join(d, "m-1"), "/elsewhere/m-0"]  # Caller's list left alone.
    state = get_checkpoint_state(d)
    assert state.model_checkpoint_path == os.path.join(d, "m-2")


def test_save_relative_paths_without_list(tmp_path):
    update_checkpoint_state_internal(str(tmp_path), str(tmp_path / "m-1"), save_relative_paths=True)
    assert _read(tmp_path / "checkpoint") == (
        'model_checkpoint_path: "m-1"\nall_model_checkpoint_paths: "m-1"\n'
    )


def test_moved_directory_with_relative_paths_still_resolves(tmp_path):
    a = tmp_path / "a"
    a.mkdir()
    update_checkpoint_state_internal(str(a), str(a / "m-1"), save_relative_paths=True)
    _touch_index(a / "m-1")
    b = tmp_path / "b"
    a.rename(b)
    assert latest_checkpoint(str(b)) == str(b / "m-1")


@pytest.mark.parametrize("relative", [False, True])
def test_model_path_equal_to_state_file_is_a_runtime_error(tmp_path, relative):
    model = str(tmp_path / "checkpoint")
    expected = (
        f"Save path '{model}' conflicts with path used for checkpoint state.  "
        "Please use a different save path."
    )
    with pytest.raises(RuntimeError) as info:
        update_checkpoint_state_internal(str(tmp_path), model, save_relative_paths=relative)
    assert str(info.value) == expected
    assert not (tmp_path / "checkpoint").exists()


def test_conflict_with_custom_latest_filename_and_relative_save_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run").mkdir()
    with pytest.raises(RuntimeError, match="Save path 'run/state' conflicts"):
        update_checkpoint_state("run", "run/state", latest_filename="state")
    # A different name is fine.
    update_checkpoint_state("run", "run/model", latest_filename="state")
    assert (tmp_path / "run" / "state").is_file()


def test_rewrite_replaces_the_previous_state(tmp_path):
    d = str(tmp_path)
    update_checkpoint_state(d, "/r/m-1")
    update_checkpoint_state(d, "/r/m-2", ["/r/m-1", "/r/m-2"])
    assert get_checkpoint_state(d).model_checkpoint_path == "/r/m-2"
    assert sorted(os.listdir(d)) == ["checkpoint"]


def test_missing_save_dir_raises_os_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        update_checkpoint_state(str(tmp_path / "nope"), "/r/m-1")


# ----------------------------------------------------------------------------- atomicity


@pytest.mark.parametrize(
    ("op", "error"),
    [
        ("rename", OSError(errno.EACCES, "rename denied")),
        ("write", OSError(errno.ENOSPC, "No space left on device")),
        ("fsync", OSError(errno.EIO, "Input/output error")),
    ],
)
def test_failed_write_keeps_old_file_and_leaves_no_temporary(tmp_path, op, error):
    d = str(tmp_path)
    update_checkpoint_state(d, "/r/m-1")
    before = _read(tmp_path / "checkpoint")
    storage = FaultyStorage()
    storage.fail(op, errno=error.errno)
    with pytest.raises(OSError) as info:
        update_checkpoint_state_internal(d, "/r/m-2", ["/r/m-1"], storage=storage)
    assert info.value.errno == error.errno
    assert storage.operations(op)
    assert _read(tmp_path / "checkpoint") == before
    assert os.listdir(d) == ["checkpoint"]
    assert get_checkpoint_state(d).model_checkpoint_path == "/r/m-1"


def test_write_goes_through_temp_rename_and_directory_fsync(tmp_path):
    storage = FaultyStorage()
    update_checkpoint_state_internal(str(tmp_path), "/r/m-1", storage=storage)
    assert [op for op, _ in storage.calls] == [
        "open",
        "write",
        "fsync",
        "close",
        "rename",
        "fsync_dir",
    ]


def test_concurrent_writers_never_expose_a_torn_file(tmp_path):
    d = str(tmp_path)
    update_checkpoint_state(d, "/r/seed")
    errors: list[BaseException] = []
    bad_reads: list[object] = []
    stop = threading.Event()

    def writer(tag: str) -> None:
        try:
            for i in range(40):
                paths = [f"/r/{tag}-{j}" for j in range(i + 1)]
                update_checkpoint_state(d, paths[-1], paths)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    def reader() -> None:
        try:
            while not stop.is_set():
                state = get_checkpoint_state(d)
                if state is None or (
                    state.model_checkpoint_path != "/r/seed"
                    and state.all_model_checkpoint_paths[-1] != state.model_checkpoint_path
                ):
                    bad_reads.append(state)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    writers = [threading.Thread(target=writer, args=(t,)) for t in "ab"]
    read_thread = threading.Thread(target=reader)
    read_thread.start()
    for t in writers:
        t.start()
    for t in writers:
        t.join(timeout=60)
    stop.set()
    read_thread.join(timeout=60)
    assert not any(t.is_alive() for t in [*writers, read_thread])
    assert errors == []
    assert bad_reads == []
    assert [n for n in os.listdir(d) if is_temporary_name(n)] == []


# ----------------------------------------------------------------------------- reading


def test_missing_file_or_directory_is_none_without_warnings(tmp_path, caplog):
    assert get_checkpoint_state(str(tmp_path)) is None
    assert get_checkpoint_state(str(tmp_path / "nope")) is None
    (tmp_path / "afile").write_text("x")
    assert get_checkpoint_state(str(tmp_path / "afile")) is None
    assert latest_checkpoint(str(tmp_path)) is None
    assert _warnings(caplog) == []


def test_dot_relative_path_is_joined_without_normalisation(tmp_path):
    d = str(tmp_path)
    _write(
        tmp_path / "checkpoint",
        'model_checkpoint_path: "./model.ckpt-687529"\n'
        'all_model_checkpoint_paths: "./model.ckpt-687528"\n'
        'all_model_checkpoint_paths: "./model.ckpt-687529"\n',
    )
    state = get_checkpoint_state(d)
    assert state.model_checkpoint_path == d + os.sep + "./model.ckpt-687529"
    assert list(state.all_model_checkpoint_paths) == [
        d + os.sep + "./model.ckpt-687528",
        d + os.sep + "./model.ckpt-687529",
    ]


def test_absolute_paths_in_file_are_returned_as_stored(tmp_path):
    _write(
        tmp_path / "checkpoint",
        'model_checkpoint_path: "/else/where/m-2"\nall_model_checkpoint_paths: "m-1"\n'
        'all_model_checkpoint_paths: "/else/where/m-2"\n',
    )
    state = get_checkpoint_state(str(tmp_path))
    assert state.model_checkpoint_path == "/else/where/m-2"
    assert list(state.all_model_checkpoint_paths) == [
        os.path.join(str(tmp_path), "m-1"),
        "/else/where/m-2",
    ]


@pytest.mark.parametrize(
    "text",
    [
        "",
        "\n\n# only a comment\n",
        'all_model_checkpoint_paths: "m-1"\n',
        'model_checkpoint_path: ""\n',
    ],
)
def test_no_model_path_is_tfs_value_error(tmp_path, text):
    _write(tmp_path / "checkpoint", text)
    with pytest.raises(ValueError) as info:
        get_checkpoint_state(str(tmp_path))
    assert str(info.value) == "Invalid checkpoint state loaded from " + str(tmp_path)
    with pytest.raises(ValueError, match="Invalid checkpoint state loaded from"):
        latest_checkpoint(str(tmp_path))


@pytest.mark.parametrize(
    ("data", "error_type"),
    [
        ("this is not a checkpoint state", "ParseError"),
        ('model_checkpoint_path: "unterminated\n', "ParseError"),
        ('model_checkpoint_path: "m" unknown_field: 3\n', "ParseError"),
        ("model_checkpoint_path { }\n", "ParseError"),
        ('model_checkpoint_path: "\\377\\376"\n', "ParseError"),
        ("last_preserved_timestamp: not_a_number\n", "ParseError"),
        ("[tensorflow.ext]: 1\n", "ParseError"),
        ("__import__('os').system('touch PWNED')\n", "ParseError"),
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe", "UnicodeDecodeError"),
        (b'model_checkpoint_path: "\xc3\x28"', "UnicodeDecodeError"),
        (b"\x00\x00\x00\x00", "ParseError"),
    ],
)
def test_garbage_gives_two_warnings_and_none(tmp_path, monkeypatch, caplog, data, error_type):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "checkpoint"
    _write(path, data)
    assert get_checkpoint_state(str(tmp_path)) is None
    messages = _warnings(caplog)
    assert len(messages) == 2
    assert messages[0].startswith(f"{error_type}: ")
    assert messages[1] == f"{path}: Checkpoint ignored"
    assert latest_checkpoint(str(tmp_path)) is None
    assert not (tmp_path / "PWNED").exists()


def test_unreadable_state_file_gives_two_warnings_and_none(tmp_path, caplog):
    (tmp_path / "checkpoint").mkdir()  # An I/O error on read: it is a directory.
    assert get_checkpoint_state(str(tmp_path)) is None
    messages = _warnings(caplog)
    assert len(messages) == 2
    assert messages[0].startswith("NotRegularFileError: ")
    assert "not a regular file (a directory)" in messages[0]
    assert messages[1] == f"{tmp_path / 'checkpoint'}: Checkpoint ignored"


@pytest.mark.parametrize(
    "text",
    [
        "# written by hand\nmodel_checkpoint_path:'m-2'  # trailing comment\n"
        "all_model_checkpoint_paths:'m-1'\nall_model_checkpoint_paths:\"m-2\"\n",
        'all_model_checkpoint_paths: "m-1"\nall_model_checkpoint_paths: "m-2"\n'
        'model_checkpoint_path: "m-2"\n',
        'all_model_checkpoint_paths: ["m-1", \'m-2\'] model_checkpoint_path: "m-" "2"',
        '\ufeffmodel_checkpoint_path: "m-2"\r\nall_model_checkpoint_paths: "m-1"\r\n'
        'all_model_checkpoint_paths: "m-2"\r\n',
        'model_checkpoint_path: "m-0"\nmodel_checkpoint_path: "m-2"\n'  # Last one wins.
        'all_model_checkpoint_paths: "m-1" all_model_checkpoint_paths: "m-2"',
    ],
)
def test_tolerant_reader_accepts_text_format_variants(tmp_path, text):
    _write(tmp_path / "checkpoint", text)
    state = get_checkpoint_state(str(tmp_path))
    d = str(tmp_path)
    assert state.model_checkpoint_path == os.path.join(d, "m-2")
    assert list(state.all_model_checkpoint_paths) == [
        os.path.join(d, "m-1"),
        os.path.join(d, "m-2"),
    ]


def test_reader_accepts_timestamp_spellings(tmp_path):
    _write(
        tmp_path / "checkpoint",
        'model_checkpoint_path: "m"\nall_model_checkpoint_timestamps: 1\n'
        "all_model_checkpoint_timestamps: 2.5e3 last_preserved_timestamp: -inf",
    )
    state = get_checkpoint_state(str(tmp_path))
    assert list(state.all_model_checkpoint_timestamps) == [1.0, 2500.0]
    assert state.last_preserved_timestamp == float("-inf")


def test_fuzzed_state_files_only_fail_as_documented(tmp_path, caplog):
    rng = random.Random(1234)
    vocabulary = [
        "model_checkpoint_path",
        "all_model_checkpoint_paths",
        "all_model_checkpoint_timestamps",
        "last_preserved_timestamp",
        ":",
        '"m-1"',
        "'x'",
        "[",
        "]",
        ",",
        "{",
        "}",
        "<",
        ">",
        "1.5",
        "-",
        "nan",
        "#",
        "\n",
        " ",
        '"\\',
        "\\x",
        "0x1f",
        "1e400",
        "\x00",
        "\ud7ff",
        "[a.b]",
        "true",
    ]
    valid = b'model_checkpoint_path: "m-2"\nall_model_checkpoint_paths: "m-1"\n'
    outcomes = set()
    for i in range(600):
        if i % 3 == 0:
            data: bytes = rng.randbytes(rng.randrange(0, 64))
        elif i % 3 == 1:  # A valid file with up to two bytes changed, or truncated.
            buf = bytearray(valid)
            for _ in range(rng.randrange(0, 3)):
                buf[rng.randrange(len(buf))] = rng.randrange(256)
            data = bytes(buf[: rng.randrange(len(buf) + 1)] if rng.random() < 0.3 else buf)
        else:
            words = rng.choices(vocabulary, k=rng.randrange(0, 12))
            data = "".join(words).encode("utf-8", "surrogatepass")
        _write(tmp_path / "checkpoint", data)
        try:
            state = get_checkpoint_state(str(tmp_path))
        except ValueError as e:
            assert str(e) == "Invalid checkpoint state loaded from " + str(tmp_path)
            outcomes.add("ValueError")
            continue
        outcomes.add("None" if state is None else "state")
    assert outcomes == {"ValueError", "None", "state"}


def test_parse_checkpoint_state_returns_paths_as_stored():
    state = parse_checkpoint_state(b'model_checkpoint_path: "./m-1"')
    assert state.model_checkpoint_path == "./m-1"


# ----------------------------------------------------------------------------- latest_checkpoint


def test_latest_checkpoint_returns_prefix_when_index_exists(tmp_path):
    prefix = str(tmp_path / "model.ckpt-12")
    _touch_index(prefix)
    update_checkpoint_state(str(tmp_path), prefix)
    assert latest_checkpoint(str(tmp_path)) == prefix
    assert latest_checkpoint(tmp_path) == prefix


def test_latest_checkpoint_without_index_logs_error_and_is_none(tmp_path, caplog):
    prefix = str(tmp_path / "model.ckpt-12")
    _write(prefix + ".data-00000-of-00001", b"payload")  # Data but no committed index.
    update_checkpoint_state(str(tmp_path), prefix)
    assert latest_checkpoint(str(tmp_path)) is None
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == [f"Couldn't match files for checkpoint {prefix}"]


def test_latest_checkpoint_in_directory_with_glob_characters(tmp_path):
    d = tmp_path / "exp[1]*?"
    d.mkdir()
    prefix = str(d / "model.ckpt-3")
    _touch_index(prefix)
    update_checkpoint_state(str(d), prefix)
    assert latest_checkpoint(str(d)) == prefix


def test_latest_checkpoint_ignores_garbage_state_file(tmp_path, caplog):
    _write(tmp_path / "checkpoint", b"\xff\xfe")
    assert latest_checkpoint(str(tmp_path)) is None
    assert len(_warnings(caplog)) == 2


def test_checkpoint_state_message_has_tfs_descriptor():
    descriptor = CheckpointState.DESCRIPTOR
    assert descriptor.full_name == "tensorflow.CheckpointState"
    fd = descriptor_pb2.FieldDescriptorProto

    def repeated(f) -> bool:  # protobuf >= 5 has is_repeated; older versions only label.
        return f.is_repeated if hasattr(f, "is_repeated") else f.label == f.LABEL_REPEATED

    fields = {f.name: (f.number, f.type, repeated(f)) for f in descriptor.fields}
    assert fields == {
        "model_checkpoint_path": (1, fd.TYPE_STRING, False),
        "all_model_checkpoint_paths": (2, fd.TYPE_STRING, True),
        "all_model_checkpoint_timestamps": (3, fd.TYPE_DOUBLE, True),
        "last_preserved_timestamp": (4, fd.TYPE_DOUBLE, False),
    }
    assert descriptor.file.package == "tensorflow"
    # Binary wire format round trip (the proto is real, not just a text convention).
    state = CheckpointState(model_checkpoint_path="m", all_model_checkpoint_timestamps=[1.0])
    assert CheckpointState.FromString(state.SerializeToString()) == state
    assert state_file.DEFAULT_STATE_FILENAME == "checkpoint"


def test_pathlib_path_round_trip(tmp_path):
    p = pathlib.Path(tmp_path)
    update_checkpoint_state(p, p / "m-1")
    assert get_checkpoint_state(p).model_checkpoint_path == str(p / "m-1")


def test_timestamps_may_be_a_numpy_array(tmp_path):
    np = pytest.importorskip("numpy")
    state = generate_checkpoint_state_proto(
        str(tmp_path), "/r/m-2", ["/r/m-1", "/r/m-2"], np.array([1.5, 2.5])
    )
    assert list(state.all_model_checkpoint_timestamps) == [1.5, 2.5]
