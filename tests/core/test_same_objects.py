"""``same_contents``: mappings that still hold the very same objects, and every way they may not."""

from __future__ import annotations

import pytest

from torchsupervisor.core.same_objects import contents, same_contents


def test_the_same_objects_under_the_same_keys_are_the_same():
    a, y, b = object(), [1.5], object()
    mappings = [{"x": a, "y": y}, {"z": b}]
    known = contents(mappings)
    assert same_contents(mappings, known)
    assert same_contents([{"x": a, "y": y}, {"z": b}], known)  # Other dicts, same contents.


@pytest.mark.parametrize(
    "change", ["equal value", "new key", "renamed key", "reordered", "split elsewhere", "gone"]
)
def test_any_change_is_seen(change):
    a, y, b = object(), [1.5], object()
    known = contents([{"x": a, "y": y}, {"z": b}])
    changed = {
        "equal value": [{"x": a, "y": [1.5]}, {"z": b}],  # Equal, not the same object.
        "new key": [{"x": a, "y": y}, {"z": b, "w": b}],
        "renamed key": [{"x": a, "y": y}, {"w": b}],
        "reordered": [{"y": y, "x": a}, {"z": b}],
        "split elsewhere": [{"x": a}, {"y": y, "z": b}],  # The same keys and values in turn.
        "gone": [{"y": y}, {"z": b}],
    }[change]
    assert not same_contents(changed, known), change
