"""Events files on an object store roll at ``events_roll_bytes``: what one flush uploads stays
bounded, and the run's files read back, in order, as one series."""

from __future__ import annotations

from torchsupervisor import SummaryWriter, summary_iterator
from torchsupervisor.storage import configure, storage_for

ROLL_BYTES = 2000


def _events_files(url: str) -> list[str]:
    return sorted(f"{url}/{name}" for name in storage_for(url).list(url) if "tfevents" in name)


def test_an_events_file_on_an_object_store_rolls_and_the_series_reads_back_whole(memory_url):
    configure(memory_url, events_roll_bytes=ROLL_BYTES)
    writer = SummaryWriter(memory_url, flush_secs=3600)
    for step in range(400):
        writer.add_scalar("loss", 1.0 / (step + 1), global_step=step)
        if step % 25 == 24:
            writer.flush()
    writer.close()

    files = _events_files(memory_url)
    assert len(files) >= 5, files
    st = storage_for(memory_url)
    sizes = [st.size(path) for path in files]
    # A file is rolled once a batch takes it to the limit: at most one batch (25 scalars, well
    # under 2000 bytes) over it, so a flush never re-sends the run's whole history.
    assert max(sizes) < 2 * ROLL_BYTES, sizes
    steps = []
    for path in files:  # Name order is time order; each file starts with its file_version.
        events = list(summary_iterator(path))
        assert events[0].file_version == "brain.Event:2"
        steps += [e.step for e in events if e.HasField("summary")]
    assert steps == list(range(400))


def test_a_local_events_file_never_rolls(tmp_path):
    writer = SummaryWriter(str(tmp_path), flush_secs=3600)
    for step in range(400):
        writer.add_scalar("loss", float(step), global_step=step)
        if step % 25 == 24:
            writer.flush()
    writer.close()
    assert len([n for n in tmp_path.iterdir() if "tfevents" in n.name]) == 1
