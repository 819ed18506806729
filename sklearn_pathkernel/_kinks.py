"""Where the gradient jumps along a step: kinks of piecewise-linear operations.

Along a step ``w(t) = w_s + t (w_{s+1} - w_s)`` the gradient of a ReLU network
is smooth except where some ReLU input (or max-pool winner, ``abs`` input, clamp
bound...) changes sign. Any quadrature across such a jump converges only as
O(1/T); splitting the step at the kinks and integrating each smooth piece with
Gauss-Legendre is exact to machine precision with a handful of nodes.

A ``torch`` function mode records the *switching values* of those operations
during a forward pass (their signs select the linear piece), for any module and
with no knowledge of its code. A kink is located by regula falsi on the first
switching value to change sign, which is exact in one step for a first hidden
layer (its pre-activation is linear in ``t``) and converges fast elsewhere.
"""

import numpy as np
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_SIGN_AT_ZERO = {"relu", "relu_", "leaky_relu", "leaky_relu_", "abs", "abs_", "sign", "rrelu"}
_BOUNDED = {"hardtanh", "hardtanh_", "relu6", "clamp", "clamp_", "clip", "clip_", "threshold"}
_POOLS = {
    "max_pool1d": F.max_pool1d_with_indices,
    "_max_pool1d": F.max_pool1d_with_indices,
    "max_pool2d": F.max_pool2d_with_indices,
    "_max_pool2d": F.max_pool2d_with_indices,
    "max_pool3d": F.max_pool3d_with_indices,
    "_max_pool3d": F.max_pool3d_with_indices,
}
_PAIRWISE = {"maximum", "minimum", "fmax", "fmin"}


class SwitchRecorder(TorchFunctionMode):
    """Records, per row, the values whose signs pick the linear piece of the network.

    After a forward pass, ``switches`` is a list of (n, m) tensors (a kink where an
    entry crosses zero) and ``pools`` a list of ``(inputs, indices)`` of max-pools
    (a kink where a window's winner changes).
    """

    def __init__(self):
        super().__init__()
        self.switches, self.pools = [], []

    def _flat(self, tensor):
        tensor = tensor.detach()
        return tensor.flatten(1) if tensor.ndim > 1 else tensor[:, None]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _POOLS and not kwargs.get("return_indices", False):
            out, indices = _POOLS[name](*args, **kwargs)
            self.pools.append((args[0].detach().flatten(2), indices.flatten(2)))
            return out
        if args and isinstance(args[0], torch.Tensor) and args[0].ndim > 0:
            z = args[0]
            if name in _SIGN_AT_ZERO:
                self.switches.append(self._flat(z))
            elif name in _BOUNDED:
                for bound in _bounds(name, args, kwargs):
                    self.switches.append(self._flat(z - bound))
            elif name in _PAIRWISE and len(args) > 1 and isinstance(args[1], torch.Tensor):
                self.switches.append(self._flat(z - args[1]))
        return func(*args, **kwargs)


def _bounds(name, args, kwargs):
    if name == "relu6":
        return (0.0, 6.0)
    if name == "threshold":
        return (args[1] if len(args) > 1 else kwargs["threshold"],)
    if name.startswith("hardtanh"):
        low = args[1] if len(args) > 1 else kwargs.get("min_val", -1.0)
        high = args[2] if len(args) > 2 else kwargs.get("max_val", 1.0)
        return (low, high)
    low = args[1] if len(args) > 1 else kwargs.get("min")
    high = args[2] if len(args) > 2 else kwargs.get("max")
    return tuple(b for b in (low, high) if b is not None)


class SwitchState:
    """Switching values of a batch of rows at one point ``t`` of a step."""

    def __init__(self, t, n_rows, switches, pools):
        self.t, self.n_rows, self.switches, self.pools = t, n_rows, switches, pools

    def row(self, i):
        return SwitchState(
            self.t,
            1,
            [s[i : i + 1] for s in self.switches],
            [(a[i : i + 1], idx[i : i + 1]) for a, idx in self.pools],
        )

    def same_piece(self, other):
        """Boolean per row: are both states on the same linear piece?"""
        same = torch.ones(self.n_rows, dtype=torch.bool)
        for a, b in zip(self.switches, other.switches, strict=True):
            same &= ((a > 0) == (b > 0)).all(1)
        for (_, ia), (_, ib) in zip(self.pools, other.pools, strict=True):
            same &= (ia == ib).flatten(1).all(1)
        return same


def switch_state(probe, flat, X, t):
    """Record the switching values of the rows of ``X`` at flat weights ``flat``."""
    recorder = SwitchRecorder()
    with torch.no_grad(), recorder:
        probe._call(flat, X)
    return SwitchState(t, X.shape[0], recorder.switches, recorder.pools)


def _first_crossing(left, right):
    """Regula-falsi estimate of the first sign change between two single-row states."""
    lo, hi, best = left.t, right.t, np.inf
    for a, b in zip(left.switches, right.switches, strict=True):
        changed = (a > 0) != (b > 0)
        if changed.any():
            za, zb = a[changed], b[changed]
            best = min(best, float((lo + (hi - lo) * za / (za - zb)).min()))
    for (va, ia), (vb, ib) in zip(left.pools, right.pools, strict=True):
        changed = ia != ib
        if changed.any():
            # winner at the left end minus winner at the right end: >= 0, then <= 0
            da = (va.gather(2, ia) - va.gather(2, ib))[changed]
            db = (vb.gather(2, ia) - vb.gather(2, ib))[changed]
            denom = da - db
            ok = denom > 0
            if ok.any():
                best = min(best, float((lo + (hi - lo) * da[ok] / denom[ok]).min()))
    if not np.isfinite(best):
        best = 0.5 * (lo + hi)
    return best


def locate_kinks(evaluate, left, right, *, tol=1e-13, max_iter=60):
    """Breakpoints in ``(left.t, right.t)`` where a single row changes piece.

    Parameters
    ----------
    evaluate : callable
        ``evaluate(t) -> SwitchState`` of the row at ``t``.
    left, right : SwitchState
        The row's states at the ends of the interval.
    tol : float
        Each breakpoint is bracketed to within ``4 * tol``.

    Returns
    -------
    list of float
        Increasing breakpoints; between consecutive ones the row stays on one
        linear piece (up to undetected double crossings, which the certificate
        reveals).
    """
    kinks, a = [], left
    while not bool(a.same_piece(right)[0]):
        b = right
        for iteration in range(max_iter):
            width = b.t - a.t
            if width <= 4 * tol:
                break
            t = _first_crossing(a, b)
            if not (a.t < t < b.t):
                t = 0.5 * (a.t + b.t)
            # Nudge estimates off the bracket's ends so that it closes from both sides.
            t = min(max(t, a.t + tol), b.t - tol)
            middle = evaluate(t)
            if bool(a.same_piece(middle)[0]):
                a = middle
            else:
                b = middle
            if iteration >= 2 and b.t - a.t > 0.5 * width:  # slow regula falsi: bisect
                middle = evaluate(0.5 * (a.t + b.t))
                if bool(a.same_piece(middle)[0]):
                    a = middle
                else:
                    b = middle
        kinks.append(b.t)
        a = b  # the state just past this kink
    return kinks
