"""Testing helpers for distributed tensors: strategies, asserts, an impl adapter.

Public and importable without a process group; the runtime never imports it.
"""

from __future__ import annotations

from dtensor.testing.asserts import (
    agree_on,
    assert_local_is_empty,
    assert_matches_single_device,
    tolerances,
)
from dtensor.testing.certify import Certificate, certify_rule
from dtensor.testing.impl import IMPLS, Impl, get_impl
from dtensor.testing.oracle import (
    assert_coordinate,
    assert_layout,
    reference_block,
    reference_coordinate,
)
from dtensor.testing.partial_inputs import PartialSplit, from_pieces, partial_splits
from dtensor.testing.rule_case import RuleCounterexample, Sample
from dtensor.testing.strategies import (
    DTYPES,
    DistributedInput,
    MeshLayout,
    distributed_inputs,
    dtypes,
    mesh_layouts,
    mesh_shapes,
    placements,
    sub_meshes,
    tensor_shapes,
    tensors,
)
from dtensor.testing.verify import rule_example, rule_test, verify_rule

__all__ = [
    "DTYPES",
    "IMPLS",
    "Certificate",
    "DistributedInput",
    "PartialSplit",
    "RuleCounterexample",
    "Sample",
    "Impl",
    "MeshLayout",
    "agree_on",
    "assert_coordinate",
    "assert_layout",
    "assert_local_is_empty",
    "assert_matches_single_device",
    "certify_rule",
    "distributed_inputs",
    "dtypes",
    "from_pieces",
    "get_impl",
    "mesh_layouts",
    "mesh_shapes",
    "partial_splits",
    "placements",
    "reference_block",
    "reference_coordinate",
    "rule_example",
    "rule_test",
    "sub_meshes",
    "tensor_shapes",
    "tensors",
    "tolerances",
    "verify_rule",
]
