"""The result of ``explain(X, k)``: top-k proponents and opponents per query and output."""

from dataclasses import dataclass

import numpy as np

from ._checks import check_index
from ._frames import pandas, pyplot
from ._plotting import check_image_shape, draw_image, new_axes, signed_bars


@dataclass(frozen=True)
class Explanation:
    """Each query's top-k proponents and opponents, per output.

    The proponents of output ``k`` at query ``q`` are the training points whose
    contributions raised ``f_k(x_q)`` most, the opponents those that lowered it
    most; the contributions are the exact terms of ``decompose`` (or, with
    ``normalized=True``, those divided by each training point's path norm).

    Attributes
    ----------
    proponent_indices, opponent_indices : ndarray of shape (n, K, k)
        Training indices, strongest first.
    proponent_values, opponent_values : ndarray of shape (n, K, k)
        Their contributions (opponents' negative, most negative first).
    proponent_shares, opponent_shares : ndarray of shape (n, K, k)
        Each value over ``sum_i |c_i|`` of its query and output: the signed share
        of all that the training points moved.
    proponent_targets, opponent_targets : ndarray of shape (n, K, k, ...)
        Their training labels (classifiers) or target values (regressors).
    total, bias, decay, output : ndarray of shape (n, K)
        ``sum_i c_i`` (unnormalised), the initial network, the weight decay's
        part and the trained network's output: ``bias + total + decay = output``.
    predicted : ndarray of shape (n,)
        The output each query predicts (the class of the largest output, or
        output 0 of a regressor): the one :meth:`plot` shows by default.
    output_names : tuple of str
    normalized : bool
    method : str
        ``"contributions"`` (the exact terms of ``decompose``) or
        ``"counterfactual"`` (the scores of ``counterfactual``: what retraining with
        each point weighted more would change; ``bias`` and ``decay`` are NaN).
    queries : ndarray of shape (n, n_features)
        The query rows, for drawing.
    training_rows : ndarray of shape (M, n_features)
        The training rows, for drawing.
    """

    proponent_indices: np.ndarray
    proponent_values: np.ndarray
    proponent_shares: np.ndarray
    proponent_targets: np.ndarray
    opponent_indices: np.ndarray
    opponent_values: np.ndarray
    opponent_shares: np.ndarray
    opponent_targets: np.ndarray
    total: np.ndarray
    bias: np.ndarray
    decay: np.ndarray
    output: np.ndarray
    predicted: np.ndarray
    output_names: tuple
    normalized: bool
    queries: np.ndarray
    training_rows: np.ndarray
    method: str = "contributions"

    @property
    def k(self):
        """Training points kept per query, output and side."""
        return self.proponent_indices.shape[-1]

    def _output_index(self, query, output):
        if output is None:
            return int(self.predicted[query])
        return check_index(output, len(self.output_names), "output", "outputs")

    def to_frame(self):
        """A tidy ``pandas.DataFrame``: one row per query, output, side and rank.

        Columns: ``query``, ``output`` (its name), ``role`` ("proponent" or
        "opponent"), ``rank`` (1 = strongest), ``train_index``,
        ``contribution``, ``share``, ``target`` (the training row's label or value).
        """
        pd = pandas()
        n, K, k = self.proponent_indices.shape
        frames = []
        for role, indices, values, shares, targets in (
            ("proponent", self.proponent_indices, self.proponent_values,
             self.proponent_shares, self.proponent_targets),
            ("opponent", self.opponent_indices, self.opponent_values,
             self.opponent_shares, self.opponent_targets),
        ):  # fmt: skip
            q, o, r = np.meshgrid(np.arange(n), np.arange(K), np.arange(k), indexing="ij")
            frames.append(
                pd.DataFrame(
                    {
                        "query": q.ravel(),
                        "output": np.asarray(self.output_names, dtype=object)[o.ravel()],
                        "role": role,
                        "rank": r.ravel() + 1,
                        "train_index": indices.ravel(),
                        "contribution": values.ravel(),
                        "share": shares.ravel(),
                        "target": list(targets.reshape(n * K * k, -1).squeeze(-1))
                        if targets.ndim == 3 or targets.shape[-1] == 1
                        else list(targets.reshape(n * K * k, -1)),
                    }
                )
            )
        return pd.concat(frames, ignore_index=True)

    def plot(self, query=0, output=None, *, image_shape=None, ax=None):
        """Draw one query's explanation of one output.

        Parameters
        ----------
        query : int, default=0
        output : int or None, default=None
            The output's index (None: the query's predicted output).
        image_shape : tuple of int or None, default=None
            Without it, bars of the top proponents and opponents; with it (the
            rows as images, e.g. ``(8, 8)``), a grid: the query beside its
            proponents (top row) and opponents (bottom row).
        ax : matplotlib Axes or None
            For the bars only (the grid makes its own figure).

        Returns
        -------
        matplotlib Figure (grid) or Axes (bars)
        """
        query = check_index(query, self.proponent_indices.shape[0], "query", "queries")
        column = self._output_index(query, output)
        name = self.output_names[column]
        if image_shape is not None:
            shape = check_image_shape(image_shape, self.queries.shape[1])
            return self._image_grid(query, column, shape)
        ax = new_axes(ax, (6, 0.3 * 2 * self.k + 1.5))
        pro, con = self.proponent_indices[query, column], self.opponent_indices[query, column]
        labels = [
            f"#{i} ({_short(t)})"
            for i, t in zip(
                np.r_[pro, con[::-1]],
                np.r_[
                    self.proponent_targets[query, column],
                    self.opponent_targets[query, column][::-1],
                ],
                strict=True,
            )
        ]
        values = np.r_[
            self.proponent_values[query, column], self.opponent_values[query, column][::-1]
        ]
        kind = "normalised contribution" if self.normalized else "contribution"
        if self.method == "counterfactual":
            kind = "counterfactual score"
        signed_bars(ax, labels, values, f"{kind} to output {name!r}")
        ax.set_title(f"query {query}: output {name!r} = {self.output[query, column]:.3g}")
        return ax

    def _image_grid(self, query, column, shape):
        plt = pyplot()
        fig, axes = plt.subplots(2, self.k + 1, figsize=(1.3 * (self.k + 1), 3.0), squeeze=False)
        draw_image(
            axes[0, 0], self.queries[query], shape, f"query {query}\n→ {self.output_names[column]}"
        )
        axes[1, 0].axis("off")
        for row, (indices, values, targets, color) in enumerate(
            (
                (self.proponent_indices, self.proponent_values, self.proponent_targets, "#c0392b"),
                (self.opponent_indices, self.opponent_values, self.opponent_targets, "#2e86c1"),
            )
        ):
            for j in range(self.k):
                index = indices[query, column, j]
                label = _short(targets[query, column, j])
                title = f"#{index} y={label}\n{values[query, column, j]:+.3g}"
                draw_image(axes[row, j + 1], self.training_rows[index], shape, title, color)
        fig.suptitle(f"proponents (top) and opponents (bottom) of {self.output_names[column]!r}")
        fig.subplots_adjust(top=0.75, hspace=0.6)
        return fig


def _short(target):
    """A training target for a label: the value, rounded when numeric."""
    target = np.asarray(target)
    if target.ndim:
        return ",".join(_short(t) for t in target)
    if target.dtype.kind == "f":
        return f"{float(target):.3g}"
    return str(target)
