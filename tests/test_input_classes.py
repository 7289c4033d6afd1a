"""Covers: dtensor/testing/input_classes.py, the fuzzing input classes in
DTensor's terms (mesh, placements, uneven shards), and the property suite's
``pytest_launch_classify`` hook that hands them to ``python -m launch fuzz``
(the test service itself knows no DTensor names)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from dtensor import Partial, Replicate, Shard
from dtensor.testing.input_classes import classify
from dtensor.testing.meshes import MeshLayout

ROOT = Path(__file__).resolve().parents[1]


def test_input_classes_from_drawn_values() -> None:
    x = torch.zeros(3, 5, dtype=torch.float64)
    got = classify([("layout", MeshLayout((2, 2), (0, 1, 2, 3))), ("x", x),
                    ("ps", (Shard(1), Replicate()))], op="abs")
    assert got == {"mesh": "2x2", "placements": "(S(1), R)", "op": "abs",
                   "dtype": "float64", "size": "uneven"}
    assert classify([("x", torch.zeros(0, 2))])["size"] == "empty"
    assert classify([("x", torch.tensor(1.0))])["size"] == "scalar"
    assert classify([("op", "rand"), ("shape", (4, 4)), ("m", MeshLayout((2,), (0, 1))),
                     ("p", (Shard(0),))]) == {"mesh": "2", "placements": "(S(0))",
                                              "op": "rand", "size": "even"}
    assert classify([("p", (Partial(),))])["placements"] == "(P(sum))"


def test_the_property_suite_hands_them_to_the_fuzzer() -> None:
    spec = importlib.util.spec_from_file_location(
        "properties_conftest_for_classes", ROOT / "tests" / "properties" / "conftest.py")
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    values = [("m", MeshLayout((2,), (0, 1))), ("p", (Shard(0),)), ("shape", (3, 3))]
    got = conftest.pytest_launch_classify(values=values, op="add")
    assert got == classify(values, "add") and got["size"] == "uneven"
