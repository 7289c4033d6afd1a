"""Covers: dtensor/testing/certify.py: exhaustive certificates for a user's
rule (right: N cases, 0 wrong; wrong: the first wrong case) and for every
built-in rule family, on this runtime; and PyTorch's for one family.

The built-in families' certificates are the counts in docs/ops.md
("Certificates"); they run on a 4-rank world (meshes (4,) and (2, 2)).
"""

from __future__ import annotations

import pytest
import torch

from dtensor import Replicate, Sharding, register_rule
from dtensor.testing import RuleCounterexample
from dtensor.testing.certify import all_placements, base_shapes, certify_rule

lib = torch.ops.dtensor_certify


def _op(name, fn, fake):
    op = torch.library.custom_op(f"dtensor_certify::{name}", mutates_args=())(fn)
    op.register_fake(fake)
    return getattr(lib, name).default


def _triple(x: torch.Tensor) -> torch.Tensor:
    return x * 3


def _every_other(x: torch.Tensor) -> torch.Tensor:
    return x[::2].clone()


TRIPLE = _op("triple", _triple, lambda x: torch.empty_like(x))
EVERY_OTHER = _op("every_other", _every_other,
                  lambda x: x.new_empty(((x.shape[0] + 1) // 2, *x.shape[1:])))


@register_rule(TRIPLE)
def _triple_rule(call):
    (spec,) = call.specs
    return Sharding(inputs=(None,), outputs=(spec.placements,))


@register_rule(EVERY_OTHER)
def _every_other_even_only(call):
    (spec,) = call.specs
    want = tuple(Replicate() if p.is_partial() else p for p in spec.placements)
    return Sharding(inputs=(want,), outputs=(want,))


def test_enumeration_counts() -> None:
    assert len(base_shapes(max_size=3, max_dims=2)) == 4 + 16
    assert len(all_placements(2, 2, ("sum", "max"))) == 5 * 5
    assert len(all_placements(2, 2, ("sum", "max"), mixed_reduce_ops=False)) == 25 - 2


@pytest.mark.world_size(2)
def test_right_rule_gets_a_clean_certificate(world) -> None:
    cert = certify_rule(TRIPLE, max_size=3)
    # 20 shapes; on (2,): 1 + ndim + 4 placements per tensor (6 for 1-D, 7 for 2-D)
    assert cert.ok and cert.wrong == 0, str(cert)
    assert cert.cases == 4 * 6 + 16 * 7, str(cert)
    assert "0 wrong" in str(cert)


@pytest.mark.world_size(2)
def test_wrong_rule_gets_its_first_wrong_case(world) -> None:
    with pytest.raises(AssertionError, match="every_other"):
        certify_rule(EVERY_OTHER, max_size=3)
    cert = certify_rule(EVERY_OTHER, max_size=3, raise_on_wrong=False)
    assert cert.wrong > 0 and cert.first_wrong is not None, str(cert)
    assert "sharding rule counterexample" in cert.first_wrong
    assert not cert.ok


@pytest.mark.world_size(2)
def test_torch_runtime_certificate(world) -> None:
    cert = certify_rule(torch.relu, max_size=2, impl="torch", reduce_ops=("sum",))
    assert cert.ok, str(cert)


# Every built-in rule family -------------------------------------------------------
def _two(x):
    return (x, x.flip(0) + 1)


#: family -> [(name, op, make_args, bounds)]; bounds keep each family to seconds.
FAMILIES = {
    "pointwise": [
        ("relu", torch.relu, None, {}),
        ("exp", torch.exp, None, {}),
        ("add", torch.add, _two, {"mesh_shapes": [(4,)], "max_size": 2}),
        ("mul", torch.mul, _two, {"mesh_shapes": [(4,)], "max_size": 2}),
    ],
    "reduction": [
        ("sum(0)", lambda x: x.sum(0), None, {}),
        ("amax(-1)", lambda x: x.amax(-1), None, {}),
        ("mean", lambda x: x.mean(), None, {}),
    ],
    "matmul": [
        ("mm", torch.mm, lambda x: (x, x.t() + 1),
         {"mesh_shapes": [(4,)], "min_dims": 2, "max_size": 2}),
    ],
    "view": [
        ("reshape(-1)", lambda x: x.reshape(-1), None, {}),
        ("t", lambda x: x.t(), None, {}),
        ("unsqueeze(0)", lambda x: x.unsqueeze(0), None, {}),
    ],
    "tensor_ops": [
        ("cat", lambda x: torch.cat([x, x]), None, {}),
    ],
    "nn": [
        ("softmax(-1)", lambda x: torch.softmax(x, -1), None, {}),
    ],
    "norms": [
        ("vector_norm", lambda x: torch.linalg.vector_norm(x), None, {}),
    ],
    "foreach": [
        ("_foreach_mul", lambda x: torch._foreach_mul([x], 2.0), None, {}),
    ],
}


@pytest.mark.world_size(4)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_builtin_family_certificate(world, family, record_property) -> None:
    for name, op, make_args, bounds in FAMILIES[family]:
        cert = certify_rule(op, make_args, dtype=torch.float64, name=f"{family}/{name}",
                            **{"max_size": 3, **bounds}, raise_on_wrong=False)
        record_property(name, str(cert))
        print(f"{family}/{name}: {cert}")
        assert cert.ok, f"{family}/{name}: {cert}"


def test_counterexample_is_an_assertion_error() -> None:
    assert issubclass(RuleCounterexample, AssertionError)
