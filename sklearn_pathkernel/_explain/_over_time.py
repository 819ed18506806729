"""Attribution over training time: what each training point (or class) moved
during each step or epoch.

The decomposition's contribution ``c_i(x) = sum_s [i in B_s] <psi_s(x), sum_k
e_{s,i,k} g_k(x_i; w_s)>`` is a sum over the steps at which ``i``'s gradient was
taken; :class:`TimeAttribution` keeps the steps (or epochs) apart, so that its
sum over periods is ``decompose(X).contributions`` exactly. With momentum or Adam
a step's gradient moves the weights during that step and every later one: the
term of step ``s`` is everything its gradients moved (the same convention as
``decompose``). No checkpoint method can resolve this: the terms need the
gradient at every step. Cost: that of ``decompose`` (one pass over the steps),
with materialised features; memory: the result, ``n P G K`` numbers for ``P``
periods and ``G`` groups (training points or classes).
"""

import enum
from dataclasses import dataclass

import numpy as np
import torch

from .._engine import OutputTarget, QueryTargets
from ._checks import check_index
from ._frames import pandas
from ._plotting import new_axes
from ._streaming import check_columns, query_tiles, result_array

#: Largest result, in bytes, built without a clear error.
MAX_RESULT_BYTES = 2 * 2**30


class Period(enum.Enum):
    """The unit of training time: one step (a batch) or one epoch."""

    STEP = "step"
    EPOCH = "epoch"

    @classmethod
    def of(cls, period):
        try:
            return cls(period)
        except ValueError:
            raise ValueError(f"period must be 'step' or 'epoch', got {period!r}.") from None

    def of_steps(self, epochs):
        """The period of every step: ``epochs`` (the epoch of every step) or the step itself."""
        return np.arange(epochs.size) if self is Period.STEP else np.asarray(epochs)


@dataclass(frozen=True)
class TimeAttribution:
    """Contributions resolved over training time.

    Attributes
    ----------
    values : ndarray or numpy.memmap of shape (n, P, G, K)
        What group ``g`` (a training point, or the training points of a class)
        moved output ``k`` at query ``q`` through the gradients of period ``p``.
        ``values.sum(axis=1)`` is ``decompose(X).contributions`` (or its
        per-class sums). With ``columns``, ``K = 1``: query ``q``'s output
        ``columns[q]``.
    period : str
        "step" or "epoch".
    group_names : tuple
        The training indices, or the classes.
    output_names : tuple of str
    """

    values: np.ndarray
    period: str
    group_names: tuple
    output_names: tuple
    columns: np.ndarray | None = None

    def totals(self):
        """Per query, period and output, summed over the groups: (n, P, K)."""
        return self.values.sum(axis=2)

    def to_frame(self):
        """A tidy ``pandas.DataFrame``: ``query``, ``period`` ("step" or "epoch"
        index), ``group``, ``output``, ``contribution``; zero entries left out."""
        pd = pandas()
        q, p, g, k = np.nonzero(self.values)
        return pd.DataFrame(
            {
                "query": q,
                self.period: p,
                "group": np.asarray(self.group_names, dtype=object)[g],
                "output": np.asarray(self.output_names, dtype=object)[k],
                "contribution": self.values[q, p, g, k],
            }
        )

    def plot(self, query=0, output=0, *, top=5, ax=None):
        """Stacked bars over the periods: the ``top`` groups by total absolute
        contribution, the rest summed, and the cumulative total as a line."""
        query = check_index(query, self.values.shape[0], "query", "queries")
        output = check_index(output, self.values.shape[3], "output", "outputs")
        if isinstance(top, bool) or not isinstance(top, int | np.integer) or top < 1:
            raise ValueError(f"top must be a positive int, got {top!r}.")
        ax = new_axes(ax, (7, 3.5))
        values = self.values[query, :, :, output]  # (P, G)
        order = np.argsort(-np.abs(values).sum(axis=0), kind="stable")[:top]
        rest = np.delete(values, order, axis=1).sum(axis=1)
        periods = np.arange(values.shape[0])
        below_pos, below_neg = np.zeros(periods.size), np.zeros(periods.size)
        series = [(str(self.group_names[g]), values[:, g]) for g in order] + [("rest", rest)]
        for label, heights in series:
            base = np.where(heights >= 0, below_pos, below_neg)
            ax.bar(periods, heights, bottom=base, label=label, width=0.9)
            below_pos += np.clip(heights, 0, None)
            below_neg += np.clip(heights, None, 0)
        ax.plot(periods, values.sum(axis=1).cumsum(), "k.-", lw=1, label="cumulative")
        ax.axhline(0.0, color="k", lw=0.5)
        ax.set_xlabel(self.period)
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_ylabel(f"contribution to {self.output_names[output]!r}")
        ax.legend(fontsize=7, ncol=2)
        return ax


def attribute_over_time(
    context, stepwise, X, period, groups=None, group_names=None, *, columns=None,
    filename=None, batch_size=64, norms=None,
):  # fmt: skip
    """The :class:`TimeAttribution` of query rows ``X`` (a tensor).

    ``groups`` (M,) maps every training point to a group index (its class); None
    keeps the points apart. ``columns`` (n,) keeps one output per query; with
    ``filename`` the values stream into a ``.npy`` memmap there, ``batch_size``
    queries at a time (memory: one tile's terms besides the result); ``norms``
    (M,) divides every training point's terms by its path norm.
    """
    period = Period.of(period)
    per_step = period.of_steps(context.epochs)
    n, K = X.shape[0], context.engine.n_outputs
    columns = check_columns(columns, n, K)
    n_periods = int(per_step.max()) + 1 if per_step.size else 0
    n_groups = context.n_train if groups is None else len(group_names)
    width = K if columns is None else 1
    size = 8 * n * n_periods * n_groups * width
    if filename is None and size > MAX_RESULT_BYTES:
        raise ValueError(
            f"An attribution over time of {n} queries, {n_periods} periods and "
            f"{n_groups} groups needs {size / 2**30:.1f} GiB: ask for fewer queries, "
            "one output per query (columns=), period='epoch', by_class=True, or a "
            "filename= to stream it to disk."
        )
    values = result_array((n, n_periods, n_groups, width), filename)
    # one output per query: its terms as a scalar target, one output's work
    targets = None
    if columns is not None:
        targets = QueryTargets(OutputTarget(), torch.as_tensor(columns, device=X.device))
    for tile in query_tiles(n, batch_size):
        tile_values = np.zeros((tile.stop - tile.start, n_periods, n_groups, width))
        of_tile = None if targets is None else targets.take(tile)
        for term in stepwise.terms(X[tile], of_tile):
            found = term.values
            if norms is not None:
                found = found / norms[term.batch][None, :, None]
            target = tile_values[:, per_step[term.step]]
            if groups is None:
                target[:, term.batch] += found  # a batch holds each point once
            else:
                np.add.at(target, (slice(None), groups[term.batch]), found)
        values[tile] = tile_values
    if filename is not None:
        values.flush()
    names = tuple(range(context.n_train)) if groups is None else tuple(group_names)
    output_names = context.output_names if columns is None else ("output of columns",)
    return TimeAttribution(values, period.value, names, output_names, columns)
