"""Tolerances derived from the dtypes' numerics: one place for every comparison of two ways to compute a value.

Two computations of the same quantity that differ only in evaluation order (a compiled kernel against eager ATen,
oneDNN against a reduction, one CPU's vector width against another's) or in where values are rounded agree to
within the rounding of the dtypes involved, whatever the CPU:

* unit roundoff ``u(dtype) = eps / 2``: float32 6.0e-8, float16 4.9e-4, bfloat16 3.9e-3;
* a sum of ``depth`` terms evaluated in two orders differs by at most ``2 * gamma(depth) * sum |term|`` with
  ``gamma(n) = n u / (1 - n u)`` (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., eq. 3.4):
  that is the bound for a matmul, a softmax's sum or an RMSNorm's mean over ``depth`` elements;
* a value rounded to a storage dtype (``u_s``) after two computations that differ slightly can land on two adjacent
  representable neighbours: one ulp, ``2 u_s |x|``; each such rounding stage a result passes through (bfloat16
  scores, probabilities, outputs ...) can add that much again, relative to the values' magnitude.

``tolerance`` turns a description of the computation into ``assert_close`` keyword arguments (an absolute bound on
the magnitude ``scale`` of the compared values, and the same relative bound); ``assert_numerically_close`` applies
it. Where exactness is the claim (speculation's greedy tokens, tensor-parallel shards of an fp32 model that sum in
the same order, a cache that stores codes) tests use ``torch.equal`` instead and say why.
"""

from __future__ import annotations

import torch
from torch import Tensor


def unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


def gamma(n: int, dtype: torch.dtype) -> float:
    """Higham's gamma_n: the relative error bound of an n-term floating-point sum in dtype."""
    nu = n * unit_roundoff(dtype)
    assert nu < 1, f"a {n}-term sum in {dtype} has no meaningful bound"
    return nu / (1 - nu)


def tolerance(scale: float, *, compute: torch.dtype = torch.float32, depth: int = 1,
              storage: torch.dtype | None = None, roundings: int = 0) -> dict[str, float]:
    """assert_close's (atol, rtol) for two evaluations of values of magnitude `scale`: sums of `depth` terms in
    `compute` taken in different orders (2 gamma(depth) each way), plus `roundings` stages that round to `storage`
    and may pick adjacent neighbours (one ulp, 2 u(storage), each)."""
    rel = 2 * gamma(max(depth, 1), compute)
    if storage is not None:
        rel += roundings * 2 * unit_roundoff(storage)
    return {"atol": rel * scale, "rtol": rel}


def model_depth(args, context: int) -> int:
    """The reductions along one token's path through a model (each layer's projections, attention over
    `context` keys and FFN, then the head): the depth of a logit's rounding, for `tolerance`."""
    layer = 2 * args.dim + args.n_heads * args.head_dim + context + args.intermediate_size
    return args.n_layers * layer + args.dim


def assert_numerically_close(actual: Tensor, expected: Tensor, *, compute: torch.dtype = torch.float32,
                             depth: int = 1, storage: torch.dtype | None = None, roundings: int = 0,
                             msg: str | None = None) -> None:
    """assert_close with the tolerance of `tolerance`, the scale taken from the reference's largest magnitude
    (standing in for sum |term|: for the random, zero-mean data of the tests a result is of the order of its terms'
    root-sum-square, and the worst case n u that the bound takes is ~sqrt(n) times the typical error)."""
    scale = float(expected.detach().abs().max()) if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, msg=msg,
                               **tolerance(scale, compute=compute, depth=depth, storage=storage, roundings=roundings))
