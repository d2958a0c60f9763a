"""ClusterSpec's TF API, ``as_cluster_def`` included (the map says "Same API")."""

from __future__ import annotations

import pytest

from torchsupervisor import ClusterSpec


def test_as_cluster_def_gives_tfs_cluster_def_as_data_and_round_trips():
    spec = ClusterSpec({"worker": ["w0:2222", "w1:2222"], "chief": {0: "c:2222"}})
    assert spec.as_cluster_def() == {
        "job": [
            {"name": "chief", "tasks": {0: "c:2222"}},
            {"name": "worker", "tasks": {0: "w0:2222", 1: "w1:2222"}},
        ]
    }
    assert ClusterSpec(spec.as_cluster_def()) == spec
    sparse = ClusterSpec({"worker": {3: "w3:1", 1: "w1:1"}})
    assert sparse.as_cluster_def() == {"job": [{"name": "worker", "tasks": {1: "w1:1", 3: "w3:1"}}]}
    assert ClusterSpec(sparse.as_cluster_def()).task_indices("worker") == [1, 3]


def test_a_job_named_job_is_still_a_job():
    # Only a list of {"name": ...} dicts reads as a ClusterDef.
    assert ClusterSpec({"job": ["h:1"]}).task_address("job", 0) == "h:1"
    with pytest.raises(TypeError, match="cluster must be"):
        ClusterSpec(["h:1"])
