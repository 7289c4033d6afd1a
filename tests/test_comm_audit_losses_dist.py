"""Covers: losses and casts of the communication audit (bench/comm_audit.py)
against PyTorch's DTensor, as the audit counts them (the op plus making its
result a full tensor, 2-rank Gloo world). Ours must send no more wire bytes
(for equal bytes, no more collectives) than PyTorch's and equal the
single-device value:

- ``fill_`` keeps a sharded layout (``cosine_embedding_loss`` and
  ``hinge_embedding_loss`` fill a sharded buffer; dtensor/rules/tensor_ops.py);
- ``log_sigmoid_forward`` is point-wise (``F.logsigmoid``,
  ``multilabel_soft_margin_loss``; dtensor/rules/pointwise.py);
- an integer-to-float cast keeps pieces (``masked.std``'s element count;
  dtensor/rules/tensor_ops.py);
- a point-wise op of operands cut on different dims, each moving as many
  bytes, keeps the lower dim's shard: the triplet losses' distances and the
  cosine losses reduce over the trailing feature dim, which the batch shard
  leaves whole (dtensor/rules/pointwise.py).

And accepted differences, where PyTorch sends less by computing something
else: its ``gaussian_nll_loss`` of sharded operands checks ``any(var < 0)``
on each rank's block alone, sending nothing where ours combines the ranks'
answers; its mean ``nll_loss`` (cross entropy) of a sharded batch averages
the ranks' means, wrong where the ranks' weight totals differ (ignored
targets, class weights), where ours sends the sum and the total: also of
N-d targets and of ``linear_cross_entropy`` (chunked too) with the batch cut
and the class weight or targets cut on other dims.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_comm_audit_fixes_dist import _check_no_more_than_torch, _libs, _pieces


@pytest.mark.world_size(2)
@pytest.mark.parametrize(("loss", "layout"), [
    ("cosine_embedding", "S0"), ("hinge_embedding", "S0"), ("hinge_embedding", "S1")])
def test_embedding_losses_fill_without_gathering(world, loss, layout) -> None:
    a, b = _pieces((6, 4), 80, 1), _pieces((6, 4), 81, 1)
    target = [torch.tensor([1.0, -1.0, 1.0, -1.0, -1.0, 1.0])]
    if loss == "cosine_embedding":
        def fn(x, y, t):
            return F.cosine_embedding_loss(x, y, t, margin=0.2, reduction="none")
        inputs = [(layout, a), (layout, b), ("S0", target)]
    else:
        def fn(x, y):
            return F.hinge_embedding_loss(x, y, margin=0.5, reduction="none")
        inputs = [(layout, a), (layout, [target[0].sign().expand(4, 6).t().contiguous()])]
    _check_no_more_than_torch(world, fn, inputs)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("layout", ["S0", "S1"])
def test_log_sigmoid_keeps_shards(world, layout) -> None:
    x, y = _pieces((6, 4), 82, 1), [(torch.rand(6, 4, generator=torch.Generator().manual_seed(83))
                                     > 0.5).float()]
    _check_no_more_than_torch(world, F.logsigmoid, [(layout, x)])
    _check_no_more_than_torch(world, F.multilabel_soft_margin_loss, [(layout, x), (layout, y)])


@pytest.mark.world_size(2)
@pytest.mark.parametrize("kind", ["Psum", "Pmax"])
def test_integer_to_float_cast_keeps_pieces(world, kind) -> None:
    pieces = [(p * 10).to(torch.int64) for p in _pieces((5, 4), 84)]
    _check_no_more_than_torch(world, lambda x: x.to(torch.float32), [(kind, pieces)])


@pytest.mark.world_size(2)
def test_masked_std_sends_no_more_than_torch(world) -> None:
    x = _pieces((5, 5, 5), 85, 1)
    mask = [torch.rand(5, 5, 5, generator=torch.Generator().manual_seed(86)) > 0.4]
    _check_no_more_than_torch(world, lambda a, m: torch.masked.std(a, mask=m),
                              [("S0", x), ("S0", mask)])


@pytest.mark.world_size(2)
def test_torch_any_of_a_shard_reads_only_the_local_block(world) -> None:
    """Why sharded ``gaussian_nll_loss`` is an accepted difference: its
    ``any(var < 0)`` check is rank-local in PyTorch, global in ours."""
    import comm_audit

    assert comm_audit.accepted("nn.functional.gaussian_nll_loss", "(R, S(0), S(0))")
    assert not comm_audit.accepted("nn.functional.gaussian_nll_loss", "P(sum)")
    x = torch.tensor([1.0, 2.0, 3.0, -4.0])  # the negative value is in rank 1's block
    seen = {}
    for name, (lib, mesh) in _libs(world).items():
        d = lib.distribute_tensor(x, mesh, [lib.Shard(0)])
        seen[name] = bool(torch.any(d < 0))
    assert seen["ours"] is True
    assert seen["torch"] is (world.rank == 1)  # rank 0 never sees the negative value


@pytest.mark.world_size(2)
@pytest.mark.parametrize("layouts", [("S1", "S0", "R"), ("S1", "R", "S0"),
                                     ("S1", "S0", "S1"), ("S1", "S1", "S0")])
@pytest.mark.parametrize("loss", ["margin", "with_distance"])
def test_triplet_losses_of_an_s1_anchor_keep_the_batch_shard(world, loss, layouts) -> None:
    xs = [_pieces((5, 10), 87 + i, 1) for i in range(3)]
    fn = (F.triplet_margin_loss if loss == "margin"
          else F.triplet_margin_with_distance_loss)
    _check_no_more_than_torch(world, fn, [(lay, ps) for lay, ps in zip(layouts, xs, strict=True)])


@pytest.mark.world_size(2)
def test_cosine_losses_of_mixed_cuts_keep_the_batch_shard(world) -> None:
    a, b = _pieces((5, 10), 90, 1), _pieces((5, 10), 91, 1)
    target = [torch.tensor([1.0, -1.0, 1.0, 1.0, -1.0])]
    _check_no_more_than_torch(world, F.cosine_similarity, [("S1", a), ("S0", b)])
    _check_no_more_than_torch(world, F.cosine_embedding_loss,
                              [("S1", a), ("S0", b), ("R", target)])


@pytest.mark.world_size(2)
def test_torch_mean_nll_loss_averages_the_ranks_means(world) -> None:
    """Why mean cross entropy of a sharded batch sends 4 B more than PyTorch:
    its mean of the ranks' means is wrong where a rank's targets are ignored."""
    from test_comm_audit_fixes_dist import _run

    logits = _pieces((4, 3), 92, 1)
    target = [torch.tensor([0, -100, 1, 2])]  # rank 0 holds one counted target, rank 1 two
    got, want = _run(world, F.cross_entropy, [("S0", logits), ("S0", target)])
    torch.testing.assert_close(got["ours"][2], want)
    assert not torch.allclose(got["torch"][2], want)
    assert (got["ours"][1], got["torch"][1]) == (8, 4)  # the sum and the total; one mean


def _linear_ce(**kw):
    def fn(x, w, t):
        return F.linear_cross_entropy(x, w, t, **kw)
    return fn


@pytest.mark.world_size(2)
@pytest.mark.parametrize("case", ["cross_entropy_nd", "linear", "linear_nd", "linear_nd_chunked"])
def test_torch_mean_cross_entropy_of_a_cut_batch_averages_the_ranks_means(world, case) -> None:
    """The layouts of the audit's N-d and linear cross entropy that send 4 B
    more than PyTorch (``ACCEPTED_EXACT``) cut the batch too (input
    ``S(0)``; the class weight and targets cut or whole): PyTorch's mean is
    again the mean of the ranks' means, wrong where the ranks count
    different numbers of ignored targets."""
    import comm_audit
    from test_comm_audit_fixes_dist import _run
    from torch.nn import LinearCrossEntropyOptions

    x = _pieces((4, 3), 93, 1)
    chunked = {"options": LinearCrossEntropyOptions(batch_chunk_size=2)}
    op, fn, inputs, layouts = {
        # (4, 3, 1) logits, (4, 1) targets cut along their size-1 dim
        "cross_entropy_nd": ("nn.functional.cross_entropy", F.cross_entropy,
                             [_pieces((4, 3, 1), 94, 1), [torch.tensor([[0], [-100], [1], [2]])]],
                             ["(S(0), S(1))"]),
        "linear": ("nn.functional.linear_cross_entropy", _linear_ce(),
                   [x, _pieces((5, 3), 95, 1), [torch.tensor([0, -100, 1, 4])]],
                   ["(S(0), R, S(0))", "(S(0), S(1), S(0))"]),
        # (2, 3, 3) weight: (4, 2, 3) logits, (4, 3) targets
        "linear_nd": ("nn.functional.linear_cross_entropy", _linear_ce(),
                      [x, _pieces((2, 3, 3), 96, 1),
                       [torch.tensor([[0, 1, 0], [-100, -100, 1], [1, 1, 0], [0, 1, 1]])]],
                      ["(S(0), R, S(1))", "(S(0), S(1), S(0))", "(S(0), S(1), S(1))",
                       "(S(0), S(2), R)", "(S(0), S(2), S(1))"]),
        "linear_nd_chunked": ("nn.functional.linear_cross_entropy.chunked",
                              _linear_ce(**chunked),
                              [x, _pieces((2, 3, 3), 96, 1),
                               [torch.tensor([[0, 1, 0], [-100, -100, 1], [1, 1, 0], [0, 1, 1]])]],
                              ["(S(0), R, R)", "(S(0), R, S(1))", "(S(0), S(1), S(0))",
                               "(S(0), S(1), S(1))", "(S(0), S(2), R)", "(S(0), S(2), S(1))"]),
    }[case]
    for layout in layouts:
        assert comm_audit.accepted(op, layout), layout
        lays = [f"S{p[2]}" if p.startswith("S") else p for p in layout[1:-1].split(", ")]
        got, want = _run(world, fn, list(zip(lays, inputs, strict=True)))
        torch.testing.assert_close(got["ours"][2], want, msg=layout)
        assert not torch.allclose(got["torch"][2], want), layout
        # the same collectives but for the loss's: the sum and the total, or one mean
        assert (got["ours"][0], got["ours"][1] - got["torch"][1]) == (got["torch"][0], 4), layout


@pytest.mark.world_size(2)
def test_gaussian_nll_loss_of_pieces_reduces_the_variance_once(world) -> None:
    # The loss clones the variance and clamps the clone in place: the clone
    # takes the reduced layout, so log(var) and / var read it as it is.
    x, t = _pieces((5,), 84), _pieces((5,), 85)
    var = [p.abs() + 0.5 for p in _pieces((5,), 86)]
    _check_no_more_than_torch(world, F.gaussian_nll_loss, [("Psum", x), ("Psum", t), ("Psum", var)])


@pytest.mark.world_size(2)
def test_an_in_place_op_on_pieces_takes_the_reduced_layout_unless_shared(world) -> None:
    import dtensor
    from dtensor import Partial, Replicate

    from dtensor.debug import CommDebugMode

    mesh = dtensor.DeviceMesh("cpu", [0, 1])
    pieces = [torch.tensor([0.5, -1.0, 2.0]), torch.tensor([0.5, -1.0, 2.0])]
    want = torch.clamp(pieces[0] + pieces[1], min=1.5)
    p = dtensor.DTensor.from_local(pieces[world.rank].clone(), mesh, [Partial()])
    alone = p.clone()
    with CommDebugMode() as comm:
        alone.clamp_(min=1.5)
        log = torch.log(alone)
        ratio = 1 / alone
    assert alone.placements == (Replicate(),)
    assert comm.get_total_counts() == 1, comm.get_comm_counts()
    torch.testing.assert_close(alone.full_tensor(), want)
    torch.testing.assert_close(log.full_tensor(), want.log())
    torch.testing.assert_close(ratio.full_tensor(), 1 / want)
    # A block another DTensor views keeps its pieces: the view reads the same
    # storage under its own Partial spec.
    shared = p.clone()
    view = shared.view(3)
    shared.clamp_(min=1.5)
    assert shared.placements == (Partial(),) and view.placements == (Partial(),)
    torch.testing.assert_close(shared.full_tensor(), want)
    torch.testing.assert_close(view.full_tensor(), want)
