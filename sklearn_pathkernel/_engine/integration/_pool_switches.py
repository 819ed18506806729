"""Max-pool switches in closed form: where two pooled entries' polynomials cross.

A max-pool's gradient follows the winner of each window, so it kinks where the
winner changes: where the largest two of the window's entries cross. When every
entry of a window is linear or quadratic in ``t`` on an interval (a first
convolution's outputs, or their ReLU on a piece where none of them switches;
quadratic one moving layer down), the winner changes only at the roots of the
differences of two entries at which both are the window's largest: all found
from four samples (:mod:`._polynomials`), with no search.

:func:`pool_windows` gives the input positions of every window (from the pool's
own arguments, recorded by :class:`._switches.SwitchRecorder`);
:func:`polynomial_pools` the kinks of the windows so solved.

Cost, per interval and window of ``k`` entries: ``k (k - 1)`` candidate roots,
each compared with the ``k`` entries' values there.
"""

import inspect
from functools import lru_cache
from itertools import combinations
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from ._polynomials import fit_samples, quadratic_roots

#: A candidate crossing of entries ``i`` and ``j`` is a kink when their value there
#: is within this fraction of the window's coefficients of the window's maximum.
#: Rounding puts the true winners within a few eps; a spurious kink (an entry just
#: below the maximum) only splits a smooth piece in two.
WINNER_RTOL = 1e-10
#: The spatial dimensions of the pools whose windows are known (``max_pool1d``
#: and ``max_pool2d`` without ``ceil_mode``); others are left to the search.
_SIGNATURE = inspect.signature(F.max_pool2d_with_indices)


class PoolSwitches(NamedTuple):
    """Kinks of max-pool windows in closed form.

    Attributes
    ----------
    solved : list of torch.Tensor
        Per pool, the mask (rows, channels, windows) of the windows solved.
    rows : ndarray
        Row (interval) position of every kink found.
    t : ndarray
        Its point along the step.
    """

    solved: list
    rows: np.ndarray
    t: np.ndarray


def pool_windows(args, kwargs, n_spatial):
    """The flat input positions of every window of a max-pool call, or None.

    ``args``, ``kwargs`` are the call's (as ``F.max_pool2d``'s); ``n_spatial`` its
    number of spatial dimensions. Returns a (windows, k) long tensor of positions
    in the flattened spatial input (-1 for padding), in the order of the pool's
    flattened output; None for a pool whose windows are not computed here (3-d,
    ``ceil_mode``, unbatched input).
    """
    bound = _SIGNATURE.bind(*args, **kwargs)
    bound.apply_defaults()
    arguments = bound.arguments
    x = arguments["input"]
    if n_spatial not in (1, 2) or arguments["ceil_mode"] or x.ndim != n_spatial + 2:
        return None

    def pair(value, fill):  # a 1-d pool is a 2-d one over rows of height 1
        value = tuple(value) if isinstance(value, list | tuple) else (value,) * n_spatial
        return ((fill,) + value) if n_spatial == 1 else value

    kernel = pair(arguments["kernel_size"], 1)
    stride = pair(arguments["stride"] or arguments["kernel_size"], 1)
    shape = pair(tuple(x.shape[2:]), 1)
    return _windows(
        shape,
        kernel,
        stride,
        pair(arguments["padding"], 0),
        pair(arguments["dilation"], 1),
        x.device,
    )


@lru_cache(maxsize=16)
def _pairs(k, device):
    """The pairs ``i < m`` of ``k`` entries, as two index tensors."""
    first, second = zip(*combinations(range(k), 2), strict=True) if k > 1 else ((), ())
    return (
        torch.tensor(first, dtype=torch.long, device=device),
        torch.tensor(second, dtype=torch.long, device=device),
    )


@lru_cache(maxsize=64)
def _windows(shape, kernel, stride, padding, dilation, device):
    positions = torch.arange(1, shape[0] * shape[1] + 1, dtype=torch.float64).view(1, 1, *shape)
    unfolded = F.unfold(positions, kernel, dilation=dilation, padding=padding, stride=stride)
    return (unfolded[0].T.round().long() - 1).to(device)


def polynomial_pools(states, rtol, settled=None):
    """Kinks of the max-pool windows whose entries are all polynomials in ``t``.

    ``states`` are the rows' :class:`._switches.SwitchState` at ``u = 0, 1/3,
    2/3, 1`` of their intervals ``[lo, hi]``. For a window whose entries
    ``v_m(u)`` are all linear or quadratic (:func:`._polynomials.fit_samples`),
    every root in ``(0, 1)`` of ``v_i - v_j`` (each pair of entries) at which
    ``v_i`` is the window's largest value (to ``WINNER_RTOL``) is a kink: there
    the winner passes from one to the other. ``rtol``: the polynomial test's
    tolerance (``_kinks.POLYNOMIAL_RTOL``). ``settled`` (one bool per pool, or
    None): pools whose windows were all solved on the pieces these intervals lie
    in, taken as solved without kinks inside them.

    Returns
    -------
    PoolSwitches
    """
    lo, hi = states[0].t, states[-1].t
    masks, kink_rows, kink_t = [], [], []
    for j, windows in enumerate(states[0].windows):
        indices = states[0].pools[j][1]
        if settled is not None and settled[j]:
            masks.append(torch.ones(indices.shape, dtype=torch.bool, device=indices.device))
            continue
        if windows is None:
            masks.append(torch.zeros(indices.shape, dtype=torch.bool, device=indices.device))
            continue
        samples = [state.pools[j][0] for state in states]
        # A pool's inputs are computed to a few eps of the row's largest one (the
        # largest at the ends stands for it): a ReLU output that rounding leaves
        # at 1e-18 instead of 0 is no kink.
        floor = torch.maximum(
            samples[0].flatten(1).abs().amax(1), samples[-1].flatten(1).abs().amax(1)
        )
        fit = fit_samples(*samples, rtol, floor[:, None, None])
        valid = windows >= 0  # (windows, k)
        where = windows.clamp(min=0)
        solved = (fit.solved[:, :, where] | ~valid).all(-1)  # (n, C, windows)
        masks.append(solved)
        # The winner of lines (a window of linear entries: their maximum is convex)
        # that wins at both ends wins throughout: only windows with a quadratic
        # entry, or whose winner differs at the ends, can switch.
        curved = (fit.quadratic[:, :, where] & valid).any(-1)
        ends_differ = indices != states[-1].pools[j][1]
        row, channel, window = torch.nonzero(solved & (curved | ends_differ), as_tuple=True)
        a, b, c = (
            coefficient[row[:, None], channel[:, None], where[window]] for coefficient in fit[2:]
        )  # (candidates, k)
        member = valid[window]
        size = (a.abs() + b.abs() + c.abs()).amax(-1)
        # every pair (i, m) of a window's entries at once: (candidates, pairs)
        first, second = _pairs(windows.shape[1], windows.device)
        paired = member[:, first] & member[:, second]
        roots = torch.stack(
            quadratic_roots(
                a[:, first] - a[:, second],
                b[:, first] - b[:, second],
                c[:, first] - c[:, second],
            )
        )
        inside = paired & (roots > 0) & (roots < 1)  # (nan and +-inf fail both tests)
        which, candidate, pair = torch.nonzero(inside, as_tuple=True)
        at = roots[which, candidate, pair]
        values = (
            a[candidate] + at[:, None] * (b[candidate] + at[:, None] * c[candidate])
        ).masked_fill(~member[candidate], -torch.inf)
        value = values.gather(1, first[pair][:, None])[:, 0]
        winner = value >= values.amax(1) - WINNER_RTOL * size[candidate]
        row = row[candidate]
        row, at = row[winner], at[winner]
        kink_rows.append(row.cpu().numpy())
        kink_t.append((lo[row] + (hi[row] - lo[row]) * at).cpu().numpy())
    return PoolSwitches(
        masks,
        np.concatenate(kink_rows) if kink_rows else np.zeros(0, int),
        np.concatenate(kink_t) if kink_t else np.zeros(0),
    )
