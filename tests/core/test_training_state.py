"""``TrainingState``: the user's own mapping, read as it is now, plus the library's entries."""

from __future__ import annotations

import types

import pytest
import torch

from torchsupervisor.core.training_state import TrainingState


def test_reads_see_the_users_mapping_as_it_is_now_and_additions_stay_beside_it():
    user = {"model": torch.nn.Linear(2, 1), "best": 1e9}
    state = TrainingState(user)
    state.add("rng", object())
    user["best"] = 0.5
    user["late"] = 3  # An entry the loop adds later is saved too.
    assert state["best"] == 0.5 and state["late"] == 3
    assert set(state) == {"model", "best", "late", "rng"}
    assert "rng" not in user  # The library's entries never go into the user's mapping.
    state["best"] = 0.25  # What a restore does with a plain value.
    assert user["best"] == 0.25
    assert TrainingState.of(state) is state and state.user is user


@pytest.mark.parametrize("where", ["top", "nested"])
def test_a_plain_value_a_restore_could_not_put_back_is_refused_at_construction(where):
    frozen = types.MappingProxyType({"best": 1e9})
    user = frozen if where == "top" else {"metrics": frozen}
    with pytest.raises(TypeError, match=r"\['best'\] is a plain value \(float\) in a mappingproxy"):
        TrainingState(user)
    # Objects restored in place may live in any mapping.
    TrainingState(types.MappingProxyType({"model": torch.nn.Linear(2, 1)}))
