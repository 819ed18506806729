"""Switching values: what selects the linear piece of a network at given weights.

Along a step ``w(t) = w_s + t (w_{s+1} - w_s)`` the gradient of a ReLU network
is smooth except where some ReLU input (or max-pool winner, ``abs`` input, clamp
bound...) changes sign. A ``torch`` function mode records the *switching values*
of those operations during a forward pass (their signs select the linear piece),
for any module and with no knowledge of its code; :class:`SwitchState` holds them
per row, with the row's ``f`` and largest logit from the same pass.

Cost: one forward pass of the rows (no backward pass), plus a copy of every
switching value (a ReLU network: its hidden units per row).
"""

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ._pool_switches import pool_windows

_SIGN_AT_ZERO = {"relu", "relu_", "leaky_relu", "leaky_relu_", "abs", "abs_", "sign", "rrelu"}
_BOUNDED = {"hardtanh", "hardtanh_", "relu6", "clamp", "clamp_", "clip", "clip_", "threshold"}
_POOLS = {
    "max_pool1d": (F.max_pool1d_with_indices, 1),
    "_max_pool1d": (F.max_pool1d_with_indices, 1),
    "max_pool2d": (F.max_pool2d_with_indices, 2),
    "_max_pool2d": (F.max_pool2d_with_indices, 2),
    "max_pool3d": (F.max_pool3d_with_indices, 3),
    "_max_pool3d": (F.max_pool3d_with_indices, 3),
}
_PAIRWISE = {"maximum", "minimum", "fmax", "fmin"}


class SwitchRecorder(TorchFunctionMode):
    """Records, per row, the values whose signs pick the linear piece of the network.

    After a forward pass, ``switches`` is a list of (n, m) tensors (a kink where an
    entry crosses zero), ``pools`` a list of ``(inputs, indices)`` of max-pools
    (a kink where a window's winner changes) and ``windows`` the input positions
    of each pool's windows (:func:`._pool_switches.pool_windows`; None where
    unknown).
    """

    def __init__(self):
        super().__init__()
        self.switches, self.pools, self.windows = [], [], []

    @staticmethod
    def _rows(tensor):
        tensor = tensor.detach()
        return tensor.flatten(1) if tensor.ndim > 1 else tensor[:, None]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _POOLS and not kwargs.get("return_indices", False):
            pool, n_spatial = _POOLS[name]
            out, indices = pool(*args, **kwargs)
            self.pools.append((args[0].detach().flatten(2), indices.flatten(2)))
            self.windows.append(pool_windows(args, kwargs, n_spatial))
            return out
        if args and isinstance(args[0], torch.Tensor) and args[0].ndim > 0:
            z = args[0]
            if name in _SIGN_AT_ZERO:
                self.switches.append(self._rows(z))
            elif name in _BOUNDED:
                for bound in _bounds(name, args, kwargs):
                    self.switches.append(self._rows(z - bound))
            elif name in _PAIRWISE and len(args) > 1 and isinstance(args[1], torch.Tensor):
                self.switches.append(self._rows(z - args[1]))
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
    """Switching values of a batch of rows, row ``i`` at its own point ``t[i]``.

    ``outputs``, when recorded, is ``(f, scale)`` of the same forward pass
    (``scale``: each row's largest absolute logit), which the certificate reuses.
    ``windows``, per pool, its windows' input positions (the same for every row;
    None where unknown, and for every pool when not given).
    """

    def __init__(self, t, switches, pools, outputs=None, windows=None):
        self.t, self.switches, self.pools = t, switches, pools
        self.outputs = outputs
        self.windows = [None] * len(pools) if windows is None else windows

    def _map(self, fn):
        return SwitchState(
            fn(self.t),
            [fn(s) for s in self.switches],
            [(fn(a), fn(i)) for a, i in self.pools],
            None if self.outputs is None else tuple(fn(v) for v in self.outputs),
            self.windows,
        )

    def take(self, rows):
        return self._map(lambda x: x[rows])

    @staticmethod
    def cat(parts):
        first = parts[0]
        outputs = None
        if all(p.outputs is not None for p in parts):
            outputs = tuple(torch.cat([p.outputs[c] for p in parts]) for c in (0, 1))
        return SwitchState(
            torch.cat([p.t for p in parts]),
            [torch.cat([p.switches[j] for p in parts]) for j in range(len(first.switches))],
            [
                tuple(torch.cat([p.pools[j][c] for p in parts]) for c in (0, 1))
                for j in range(len(first.pools))
            ],
            outputs,
            first.windows,
        )

    def where(self, mask, other):
        """Rows of ``other`` where ``mask``, else rows of ``self``."""

        def pick(mine, theirs):
            return torch.where(mask.view(-1, *([1] * (mine.ndim - 1))), theirs, mine)

        return SwitchState(
            pick(self.t, other.t),
            [pick(a, b) for a, b in zip(self.switches, other.switches, strict=True)],
            [
                (pick(va, vb), pick(ia, ib))
                for (va, ia), (vb, ib) in zip(self.pools, other.pools, strict=True)
            ],
            windows=self.windows,
        )

    def put(self, rows, other):
        """A copy with ``rows`` replaced by the rows of ``other``."""

        def assign(mine, theirs):
            mine = mine.clone()
            mine[rows] = theirs
            return mine

        return SwitchState(
            assign(self.t, other.t),
            [assign(a, b) for a, b in zip(self.switches, other.switches, strict=True)],
            [
                (assign(va, vb), assign(ia, ib))
                for (va, ia), (vb, ib) in zip(self.pools, other.pools, strict=True)
            ],
            windows=self.windows,
        )

    def same_piece(self, other):
        """Boolean per row: are both states on the same linear piece?"""
        same = torch.ones(self.t.shape[0], dtype=torch.bool, device=self.t.device)
        for a, b in zip(self.switches, other.switches, strict=True):
            same &= ((a > 0) == (b > 0)).all(1)
        for (_, ia), (_, ib) in zip(self.pools, other.pools, strict=True):
            same &= (ia == ib).flatten(1).all(1)
        return same


class _Switches:
    """``NetworkProbe.per_row`` adapter recording switch states."""

    reads_inputs = False  # (switching values and outputs: no layer's inputs kept)

    def __init__(self, probe):
        self.probe = probe

    def __call__(self, start, X, direction, t, rows=None, along=None):
        recorder = SwitchRecorder()
        with torch.no_grad(), recorder:
            logits = self.probe._forward(start, X, direction, t, logits=True, along=along)
        with torch.no_grad():
            outputs = (self.probe.link(logits), logits.abs().amax(1))
        t_rows = (
            t
            if isinstance(t, torch.Tensor)
            else torch.full((X.shape[0],), float(t or 0.0), dtype=torch.float64, device=X.device)
        )
        return SwitchState(
            t_rows.to(torch.float64), recorder.switches, recorder.pools, outputs, recorder.windows
        )

    cat = staticmethod(SwitchState.cat)


def switch_state(probe, start, direction, X, t, rows=None):
    """Switch states of the rows of ``X`` (of ``X[rows]``, the step's query rows
    ``X``: see ``NetworkProbe.per_row``) at ``start + t direction`` (t per row or
    scalar)."""
    if not isinstance(t, torch.Tensor):
        n = X.shape[0] if rows is None else len(rows)
        t = torch.full((n,), float(t), dtype=torch.float64, device=X.device)
    return probe.per_row(_Switches(probe), start, X, direction, t, rows)
