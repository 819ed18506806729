"""Progress over the steps of a long computation, shared by all of its tasks.

A Gram, a decomposition or a self-influence walks the recorded steps once per tile
of rows. Its bar counts (tile, step) units: ``tiles x steps`` in all, each advanced
when a task has finished that step, from whichever thread runs the task; so it
moves during a single block too. A bar pickled to another process (a dask worker)
arrives as :data:`NO_PROGRESS`: remote tasks do not report, and joblib's own
``verbose`` counts their blocks.
"""

import threading


class NoProgress:
    """A bar that shows nothing (``verbose=0``, or a task in another process)."""

    def over(self, indices):
        """``indices`` themselves."""
        return indices

    def close(self):
        """Nothing to close."""


NO_PROGRESS = NoProgress()


class StepProgress(NoProgress):
    """A ``tqdm`` bar over ``total`` (tile, step) units, thread-safe.

    Parameters
    ----------
    total : int
        Units of the computation: its row tiles times the steps each walks.
    desc : str
        What is computed (the bar's label).
    """

    def __init__(self, total, desc):
        from tqdm.auto import tqdm

        self._bar = tqdm(total=total, desc=desc, unit="step")
        self._lock = threading.Lock()

    def over(self, indices):
        """Yield ``indices``, advancing the bar by one when the caller asks for the
        next index (its loop body for the previous one is done, ``continue``
        included)."""
        for index in indices:
            yield index
            with self._lock:
                self._bar.update(1)

    def close(self):
        """Close the bar."""
        self._bar.close()

    def __reduce__(self):
        return NoProgress, ()


def step_progress(verbose, total, desc):
    """A :class:`StepProgress` when ``verbose`` is positive, else :data:`NO_PROGRESS`."""
    return StepProgress(total, desc) if verbose else NO_PROGRESS
