"""``TreeMemo``: a skeleton's encoding and JSON texts, taken again for the very same
containers; the texts exactly what the manifest's encoders write."""

from __future__ import annotations

import math

import pytest
import torch

from torchsupervisor.checkpoint.manifest_json import CANONICAL_ENCODER, ITEM_ENCODER
from torchsupervisor.checkpoint.tree_memo import TreeMemo
from torchsupervisor.core.state import MAX_STATE_DEPTH, TensorRef
from torchsupervisor.core.tree import encode_tree
from torchsupervisor.core.walk import WalkMemo, walk_state
from torchsupervisor.testing import save_cache_of

JSON_VALUES = [
    None,
    True,
    False,
    0,
    -7,
    2**70,
    0.1,
    -0.0,
    1e-7,
    1e300,
    3.0,
    "",
    "plain",
    'quote " and \\ backslash',
    "tab\t newline\n nul\x00",
    "caf\u00e9 \u2603 \U0001f600",
    [],
    {},
    [1, [2, [3, []]], {}],
    {"b": 1, "a": [True, None], "\u00e9": {"z": 0.5, "y": "x"}},
    {"dict": {"w": {"tensor": "model/w"}, "lr": 0.001}},
]


def _texts(skeleton: object) -> tuple[str, str]:
    """What the manifest's encoders write for ``skeleton``'s encoding."""
    encoded = encode_tree(skeleton)
    return ITEM_ENCODER.encode(encoded), CANONICAL_ENCODER.encode(encoded)


@pytest.mark.parametrize("value", JSON_VALUES, ids=range(len(JSON_VALUES)))
def test_the_memos_texts_are_the_manifest_encoders_texts(value):
    # Each value as a leaf, in a list and in a tuple: the memo joins the containers' texts.
    skeleton = {"value": value, "list": [value, value], "tuple": (value,)}
    texts = TreeMemo().encode(skeleton)[1]
    assert (texts.text, texts.canonical) == _texts(skeleton)


def test_the_memo_refuses_what_the_codec_refuses():
    for bad in (object(), [object()], {"a": {1: object()}}):
        with pytest.raises(TypeError):
            encode_tree(bad)
        with pytest.raises(TypeError):
            TreeMemo().encode(bad)


def _skeletons() -> list:
    ref, arr = TensorRef("model/w"), TensorRef("data/x", True)
    return [
        {},
        {"model": {"w": ref, "b": TensorRef("model/b")}, "step": 3},
        {"x": (1, 2.5, "s", None, (ref,)), "y": [arr, [], {}], "z": ()},
        {"keys": {1: "int", 2.5: "float", None: "none", False: "bool", math.inf: "inf"}},
        {"odd": [math.nan, -math.inf, b"\x00\xff", torch.float16, torch.device("cpu")]},
        {"text": "caf\u00e9 \u2603", "nested": {"a": {"b": {"c": [ref]}}}},
    ]


@pytest.mark.parametrize("skeleton", _skeletons(), ids=range(len(_skeletons())))
def test_the_memo_encodes_as_encode_tree_and_json_do(skeleton):
    memo = TreeMemo()
    for _ in range(2):  # Made, then taken again.
        encoded, texts = memo.encode(skeleton)
        assert encoded == encode_tree(skeleton)
        assert texts.text == ITEM_ENCODER.encode(encode_tree(skeleton))
        assert texts.canonical == CANONICAL_ENCODER.encode(encode_tree(skeleton))


def test_containers_are_taken_again_only_where_the_very_same_at_the_same_depth():
    memo = TreeMemo()
    inner = {"w": TensorRef("model/w"), "b": TensorRef("model/b")}
    group = [{"lr": 0.1, "params": ["model/w", "model/b"]}]
    memo.encode({"model": inner, "groups": group})
    assert memo.taken == 0
    encoded, texts = memo.encode({"model": inner, "groups": group})
    assert memo.taken == 2  # ``inner`` and ``group``: their children were not visited.
    # An equal but new container is encoded anew; the very same one one level deeper too.
    moved = {"model": dict(inner), "deeper": {"again": group}}
    encoded, texts = memo.encode(moved)
    assert memo.taken == 0
    assert encoded == encode_tree(moved)
    assert texts.canonical == CANONICAL_ENCODER.encode(encode_tree(moved))
    # Only what the last encode met is kept: ``inner`` itself was not met by it.
    memo.encode({"model": inner})
    assert memo.taken == 0


def test_the_memo_keeps_the_depth_limit():
    deep: object = TensorRef("t")
    for _ in range(MAX_STATE_DEPTH + 2):
        deep = [deep]
    keyed: object = {1: "x"}  # Keys that are not strings: encoded by the codec.
    for _ in range(MAX_STATE_DEPTH + 1):
        keyed = [keyed]
    for skeleton in (deep, keyed):
        with pytest.raises(ValueError, match="nests deeper"):
            encode_tree(skeleton)
        with pytest.raises(ValueError, match="nests deeper"):
            TreeMemo().encode(skeleton)


def test_a_walk_with_its_memo_hands_over_containers_the_tree_memo_takes_again():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 3)).sum().backward()
    optimizer.step()
    state = {"model": model, "optimizer": optimizer, "step": 1}
    walks, trees = WalkMemo(), TreeMemo()
    first, _ = walk_state(state, keep_vars=True, memo=walks, sharded=False, detach=False)
    first_texts = trees.encode(first)[1]
    optimizer.step()  # New values in the same tensors; a new float in the state.
    state["step"] = 2
    second, _ = walk_state(state, keep_vars=True, memo=walks, sharded=False, detach=False)
    assert second["model"] is first["model"]  # Taken as it was, never changed.
    encoded, texts = trees.encode(second)
    assert trees.taken >= 2  # The model's mapping and the optimizer's state.
    plain = encode_tree(walk_state(state)[0])
    assert encoded == plain
    assert (texts.text, texts.canonical) == (
        ITEM_ENCODER.encode(plain),
        CANONICAL_ENCODER.encode(plain),
    )
    assert texts.canonical != first_texts.canonical  # The step changed.


def test_a_savers_manifests_hold_the_states_tree_while_encodings_are_taken_again(tmp_path):
    from torchsupervisor import CheckpointReader, Saver
    from torchsupervisor.core.state import flatten_state

    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = {"model": model, "optimizer": optimizer, "epoch": 0}
    saver = Saver(var_list=state, max_to_keep=None)
    taken = []
    for step in (1, 2, 3):
        model(torch.ones(2, 3)).sum().backward()
        optimizer.step()
        state["epoch"] = step // 2  # A new value in the state at the third save only.
        path = saver.save(None, str(tmp_path / "model.ckpt"), global_step=step)
        reader = CheckpointReader(path)
        reader.verify()
        assert reader.manifest.tree == encode_tree(flatten_state(state)[0]), step
        taken.append(save_cache_of(saver).trees.taken)
    saver.close()
    assert taken[0] == 0 and taken[1] > 0 and taken[2] > 0, taken


def test_an_encode_keeps_only_what_it_met_without_the_garbage_collector():
    import gc
    import sys

    memo = TreeMemo()
    old = [TensorRef("t")]
    enabled = gc.isenabled()
    gc.disable()
    try:
        memo.encode({"a": old})
        memo.encode({"b": [TensorRef("u")]})  # Does not meet ``old``.
        assert sys.getrefcount(old) == 2  # This name and the call's argument.
    finally:
        if enabled:
            gc.enable()
