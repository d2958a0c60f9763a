"""RNGState: the global generators saved and restored, through a real checkpoint."""

from __future__ import annotations

import base64
import random

import numpy as np
import pytest
import torch
import torch.distributed as dist

from torchsupervisor import Saver, Session
from torchsupervisor.core import rng
from torchsupervisor.core.rng import RNGState, rank_rng_state, rank_seed


def _draw():
    return (
        [random.random() for _ in range(3)],
        np.random.rand(3).tolist(),
        np.random.normal(size=1).tolist(),
        torch.rand(3).tolist(),
        torch.nn.functional.dropout(torch.ones(8), 0.5).tolist(),
    )


def test_restored_generators_continue_the_same_streams(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    _draw()
    np.random.normal()  # Leaves a cached gaussian in NumPy's state.
    prefix = Saver().save(Session({"rng": RNGState()}), str(tmp_path / "m"))
    expected = _draw()
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    assert _draw() != expected
    Saver().restore(Session({"rng": RNGState()}), prefix)
    assert _draw() == expected


def test_state_layout():
    state = RNGState().state_dict()
    assert set(state) == {"python", "numpy", "torch", "cuda", "rank"}
    assert state["rank"] == 0 and RNGState(rank=3).state_dict()["rank"] == 3
    assert len(state["python"]["state"]) == 625
    assert state["numpy"]["keys"].dtype == torch.int64 and state["numpy"]["keys"].numel() == 624
    assert state["torch"].dtype == torch.uint8


def _synthetic_state(shift: int = 0) -> dict:
    """A state in RNGState's format whose contents do not depend on any library's seeding."""
    return {
        "python": {"version": 3, "state": [(i + shift) % 2**32 for i in range(624)] + [624]},
        "numpy": {
            "kind": "MT19937",
            "keys": torch.arange(624, dtype=torch.int64),
            "pos": 624,
            "has_gauss": 0,
            "cached_gaussian": 0.0,
        },
        "torch": torch.arange(5056, dtype=torch.int64).remainder(256).to(torch.uint8),
        "cuda": [],
    }


def test_rank_seed_is_a_fixed_function_of_the_state_and_the_rank():
    state = _synthetic_state()
    # Pinned: the same in every process and on every machine (SHA-256, no hash()).
    assert rank_seed(state, 1) == 2974659210488294065
    assert rank_seed(state, 1) == rank_seed(_synthetic_state(), 1)
    assert len({rank_seed(state, r) for r in range(8)}) == 8
    other_torch = dict(state, torch=state["torch"].roll(1))
    assert rank_seed(other_torch, 1) != rank_seed(state, 1)
    # Python's and NumPy's states do not count: unless seeded, they come from the OS's
    # entropy, and two runs of one program would give a rank other streams.
    assert rank_seed(_synthetic_state(shift=1), 1) == rank_seed(state, 1)
    other_numpy = dict(state, numpy=dict(state["numpy"], keys=torch.zeros(624, dtype=torch.int64)))
    assert rank_seed(other_numpy, 1) == rank_seed(state, 1)
    # A numpy array (as numpy gives it) and a tensor (as a checkpoint gives it) agree.
    as_numpy = dict(state, torch=state["torch"].numpy())
    assert rank_seed(as_numpy, 1) == rank_seed(state, 1)


def test_a_non_chief_derives_the_same_streams_whatever_the_os_seeded():
    """A replicated run's fresh start: the non-chiefs derive their streams from the chief's
    state, whose Python and NumPy generators (never seeded by the program) the OS seeded
    differently in each run; the derived streams are the same in both runs."""
    torch.manual_seed(0)
    first = RNGState(rank=0).state_dict()
    random.seed()  # What another run's interpreter would have: the OS's entropy.
    np.random.seed()
    torch.manual_seed(0)
    second = RNGState(rank=0).state_dict()
    assert first["python"]["state"] != second["python"]["state"]
    assert _draws_after_loading(first, 1) == _draws_after_loading(second, 1)


def _draws_after_loading(state: dict, rank: int | None) -> tuple:
    RNGState(rank=rank).load_state_dict(state)
    return (random.random(), np.random.rand(2).tolist(), torch.rand(2).tolist())


def test_each_rank_gets_its_own_streams_derived_from_the_saved_state():
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    state = RNGState().state_dict()
    chief = _draws_after_loading(state, 0)
    ranks = [_draws_after_loading(state, r) for r in (1, 2, 3)]
    # Rank 0 continues the saved streams (what a single process restores).
    assert chief == _draws_after_loading(state, None)  # No process group: rank 0.
    assert rank_rng_state(state, 0) is state
    # Every other rank: different numbers in every generator, from rank 0 and from each other.
    for k in range(3):
        values = [chief[k]] + [r[k] for r in ranks]
        assert len({repr(v) for v in values}) == 4, values
    # Deterministic: the same state and rank give the same numbers again.
    assert [_draws_after_loading(state, r) for r in (1, 2, 3)] == ranks
    derived = rank_rng_state(state, 2)
    generator = torch.Generator()
    generator.set_state(derived["torch"])
    assert torch.rand(2, generator=generator).tolist() == ranks[1][2]
    # Another saved state (a later checkpoint) gives other numbers to the same rank.
    torch.rand(1)
    assert _draws_after_loading(RNGState().state_dict(), 1) != ranks[0]


def test_the_rank_that_took_a_state_continues_it_and_the_others_derive():
    """Each rank of a sharded run restores its own memory-tier snapshot: it continues its own
    streams (not streams derived as if it were the chief's state); rank 0 given rank 2's
    state derives, as any other rank; a state without a rank (earlier versions) is rank 0's."""
    torch.manual_seed(9)
    state = RNGState(rank=2).state_dict()
    assert rank_rng_state(state, 2) is state
    own = _draws_after_loading(state, 2)
    torch.set_rng_state(state["torch"])  # The numbers that rank 2 would have drawn next.
    assert torch.rand(2).tolist() == own[2]
    assert rank_rng_state(state, 0) is not state
    assert _draws_after_loading(state, 0) != own
    legacy = {k: v for k, v in state.items() if k != "rank"}
    assert rank_rng_state(legacy, 0) is legacy and rank_rng_state(legacy, 2) is not legacy


def test_the_rank_is_the_process_groups(monkeypatch):
    state = RNGState().state_dict()
    expected = _draws_after_loading(state, 1)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda *a, **k: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 2)
    assert _draws_after_loading(state, None) == expected
    assert RNGState().state_dict()["rank"] == 1  # Taken by rank 1.


class FakeCuda:
    """Four CUDA devices with distinct generator states; records which ones are set."""

    def __init__(self, current: int) -> None:
        self.current = current
        self.states = {i: torch.full((16,), i, dtype=torch.uint8) for i in range(4)}
        self.set: list[int] = []

    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "get_rng_state", lambda i="cuda": self.states[i])
        monkeypatch.setattr(torch.cuda, "set_rng_state", self._set_rng_state)

    def _set_rng_state(self, state, device="cuda"):
        self.set.append(device)
        self.states[device] = state


@pytest.mark.parametrize("replicas", [False, True])
def test_cuda_generators_every_device_alone_only_the_current_one_with_replicas(
    monkeypatch, replicas
):
    cuda = FakeCuda(current=2)
    cuda.install(monkeypatch)
    monkeypatch.setattr(rng, "_replicas", lambda: replicas)
    state = RNGState().state_dict()
    if replicas:
        assert [s[0].item() for s in state["cuda"]] == [2]
    else:
        assert [s[0].item() for s in state["cuda"]] == [0, 1, 2, 3]
    state["cuda"] = [torch.full((16,), 9, dtype=torch.uint8), *state["cuda"][1:]]
    RNGState(rank=0).load_state_dict(state)
    assert cuda.set == ([2] if replicas else [0, 1, 2, 3])
    assert cuda.states[2 if replicas else 0][0].item() == 9


# ------------------------------------------------------------------ other ranks' states


def test_a_record_of_the_generators_decodes_to_the_same_state():
    random.seed(4)
    np.random.seed(4)
    torch.manual_seed(4)
    for gauss in (False, True):
        if gauss:
            random.gauss(0, 1)  # A cached gaussian in both Python's and NumPy's states.
            np.random.normal()
        state = dict(RNGState(rank=3).state_dict(), cuda=[torch.full((16,), 7, dtype=torch.uint8)])
        decoded = rng.decode_rng_state(rng.encode_rng_state(state))
        assert decoded["rank"] == 3 and decoded["python"] == state["python"]
        assert (decoded["python"]["gauss"] is None) is not gauss
        assert {k: v for k, v in decoded["numpy"].items() if k != "keys"} == {
            k: v for k, v in state["numpy"].items() if k != "keys"
        }
        for a, b in [
            (decoded["numpy"]["keys"], state["numpy"]["keys"]),
            (decoded["torch"], state["torch"]),
            *zip(decoded["cuda"], state["cuda"], strict=True),
        ]:
            assert a.dtype == b.dtype and torch.equal(a, b)
        # Loaded, it gives the same numbers as the state it was encoded from.
        assert _draws_after_loading(decoded, 3) == _draws_after_loading(state, 3)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda b: b"XXXX" + b[4:], "Not a generator state record"),
        (lambda b: b[:-1], "bytes, not"),
        (lambda b: b + b"\0", "bytes, not"),
        (lambda b: b[:10], "too short"),
    ],
    ids=["magic", "truncated", "longer", "a header's part"],
)
def test_a_damaged_record_is_refused(damage, message):
    record = rng.encode_rng_state(RNGState().state_dict())
    with pytest.raises(ValueError, match=message):
        rng.decode_rng_state(damage(record))


def _record(state: dict) -> str:
    return base64.b64encode(rng.encode_rng_state(state)).decode("ascii")


def test_a_rank_continues_its_own_state_carried_under_replicas(caplog):
    torch.manual_seed(1)
    chief = RNGState(rank=0).state_dict()
    torch.manual_seed(2)
    own = RNGState(rank=1).state_dict()
    expected = _draws_after_loading(own, 1)
    state = dict(chief, replicas={"1": _record(own)})
    assert _draws_after_loading(state, 1) == expected
    assert rank_rng_state(state, 0) is state  # The chief continues its own.
    # Rank 2 has none there: it derives, as from the chief's state alone.
    assert _draws_after_loading(state, 2) == _draws_after_loading(chief, 2)
    # A record filed under another rank's key, or damaged, is not taken: told, derived.
    derived = _draws_after_loading(chief, 1)
    for bad in (_record(dict(own, rank=2)), _record(own)[:-8], "not base64!"):
        caplog.clear()
        assert _draws_after_loading(dict(chief, replicas={"1": bad}), 1) == derived != expected
        assert "Rank 1's random streams in the checkpoint cannot be used" in caplog.text


def test_the_states_of_other_ranks_are_saved_beside_and_restored_with(tmp_path):
    torch.manual_seed(3)
    other = RNGState(rank=1).state_dict()
    saved = RNGState()
    saved.replicas = lambda: {"1": _record(other)}
    prefix = Saver().save(Session({"rng": saved}), str(tmp_path / "m"))
    saved.replicas = lambda: None
    assert "replicas" not in saved.state_dict()
    restored = RNGState()
    Saver().restore(Session({"rng": restored}), prefix)
    loaded = restored.loaded_replicas
    assert loaded == {"1": _record(other)}
    assert _draws_after_loading(dict(RNGState().state_dict(), replicas=loaded), 1) == (
        _draws_after_loading(other, 1)
    )


def test_a_record_names_its_rank_after_its_header_is_checked():
    record = rng.encode_rng_state(RNGState(rank=5).state_dict())
    assert rng.rng_record_rank(record) == 5
    with pytest.raises(ValueError, match="bytes, not"):
        rng.rng_record_rank(record[:-1])
