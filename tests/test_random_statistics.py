"""Covers: the distributions of dtensor/random.py's block functions (pure; no
process group): a few million values each, deterministic seeds, thresholds
near 5 sigma, and a checker shown able to fail."""

from __future__ import annotations

import math

import pytest
import torch

import dtensor.random as R


N_STAT = 1 << 22
CHI2_99_LIMIT = 175.0  # chi-square, 99 dof: mean 99, sd 14; P(> 175) ~ 1e-6


def _chi2(counts: torch.Tensor) -> float:
    counts = counts.double()
    exp = counts.sum() / counts.numel()
    return float(((counts - exp) ** 2 / exp).sum())


def uniform_failures(u: torch.Tensor) -> list[str]:
    """Reasons ``u`` (1-d, float) does not look like i.i.d. U[0, 1)."""
    u = u.double()
    n = u.numel()
    bad = []
    if not (u.min() >= 0 and u.max() < 1):
        bad.append("range")
    if abs(u.mean() - 0.5) > 6 * math.sqrt(1 / 12 / n):
        bad.append("mean")
    if abs(u.var() - 1 / 12) > 6 * math.sqrt((1 / 80 - 1 / 144) / n):
        bad.append("variance")
    bins = (u * 100).long().clamp(0, 99)
    if _chi2(torch.bincount(bins, minlength=100)) > CHI2_99_LIMIT:
        bad.append("chi2")
    pairs = (u[0::2] * 10).long().clamp(0, 9) * 10 + (u[1::2] * 10).long().clamp(0, 9)
    if _chi2(torch.bincount(pairs, minlength=100)) > CHI2_99_LIMIT:
        bad.append("pairs-chi2")
    return bad


def test_statistics_checker_can_fail() -> None:
    n = 1 << 16
    assert "mean" in uniform_failures(torch.full((n,), 0.25))
    assert "chi2" in uniform_failures(torch.rand(n, generator=torch.Generator().manual_seed(0)) ** 1.2)
    assert "pairs-chi2" in uniform_failures(torch.linspace(0, 1 - 1e-9, n))
    assert uniform_failures(torch.rand(n, generator=torch.Generator().manual_seed(0))) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_uniform_statistics(dtype: torch.dtype) -> None:
    n = (N_STAT,)
    assert uniform_failures(R.uniform_block(12345, 6, n, (0,), n, dtype=dtype)) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_normal_statistics(dtype: torch.dtype) -> None:
    n = (N_STAT,)
    z = R.normal_block(7, 1, n, (0,), n, dtype=dtype).double()
    assert abs(z.mean()) < 6 / math.sqrt(N_STAT)
    assert abs(z.var() - 1) < 6 * math.sqrt(2 / N_STAT)
    assert abs((z**4).mean() - 3) < 6 * math.sqrt(96 / N_STAT)
    # normal CDF through the uniform checker (probability integral transform)
    assert uniform_failures((0.5 * torch.erfc(-z / math.sqrt(2))).clamp(max=1 - 1e-12)) == []


def test_exponential_bernoulli_randint_statistics() -> None:
    n = (N_STAT,)
    e = R.exponential_block(7, 2, n, (0,), n, lambd=2.0).double()
    assert e.min() >= 0 and abs(e.mean() - 0.5) < 6 * 0.5 / math.sqrt(N_STAT)
    b = R.bernoulli_block(7, 3, n, (0,), n, p=0.3).double()
    assert abs(b.mean() - 0.3) < 6 * math.sqrt(0.21 / N_STAT)
    r = R.randint_block(7, 4, n, (0,), n, low=0, high=100)
    assert _chi2(torch.bincount(r, minlength=100)) < CHI2_99_LIMIT
    big = R.randint_block(7, 5, n, (0,), n, low=0, high=100 * 2**30)
    assert _chi2(torch.bincount(big // 2**30, minlength=100)) < CHI2_99_LIMIT
