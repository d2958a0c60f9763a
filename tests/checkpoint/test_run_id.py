"""The run id kept in a log directory: made once, the same at every restart."""

from __future__ import annotations

import re

from torchsupervisor.checkpoint.run_id import RUN_ID_FILENAME, ensure_run_id, read_run_id


def test_made_once_then_read_back(tmp_path):
    logdir = str(tmp_path)
    assert read_run_id(logdir) is None
    run_id = ensure_run_id(logdir)
    assert re.fullmatch("[0-9a-f]{32}", run_id)
    assert ensure_run_id(logdir) == run_id == read_run_id(logdir)
    assert (tmp_path / RUN_ID_FILENAME).read_text() == run_id + "\n"


def test_a_file_that_is_not_a_run_id_is_replaced(tmp_path):
    (tmp_path / RUN_ID_FILENAME).write_text("not an id\n")
    assert read_run_id(str(tmp_path)) is None
    run_id = ensure_run_id(str(tmp_path))
    assert read_run_id(str(tmp_path)) == run_id
