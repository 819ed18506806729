"""Scheduling: independent tasks of the engine through joblib.

A Gram, a diagonal or a decomposition is a sum over (tile of rows, chunk of
steps) tasks that share nothing; :class:`Scheduler` splits the steps into one
chunk per worker and runs the tasks, in order, on threads (torch releases the
GIL in its kernels; nothing to pickle) or on any ``joblib.parallel_config``
backend (e.g. dask, which pickles them).

Cost: none beyond the tasks' own, plus joblib's dispatch per task.
"""

from joblib import Parallel, delayed, effective_n_jobs
from sklearn.utils import gen_even_slices


class Scheduler:
    """Runs independent tasks serially or through joblib.

    Parameters
    ----------
    n_jobs : int or None
        joblib jobs (respects ``joblib.parallel_config``).
    verbose : int
        Show a progress bar over tasks.
    n_steps : int
        Steps of the path.
    """

    def __init__(self, n_jobs, verbose, n_steps):
        self.n_jobs, self.verbose, self.n_steps = n_jobs, verbose, n_steps

    def n_workers(self):
        """Workers running at once under the current joblib configuration."""
        return effective_n_jobs(self.n_jobs)

    def step_chunks(self):
        """The path's steps in one contiguous chunk per worker (at most one per step)."""
        n_chunks = max(1, min(self.n_steps, self.n_workers()))
        return list(gen_even_slices(self.n_steps, n_chunks))

    def run(self, tasks):
        """The results of ``tasks`` (callables without arguments, e.g.
        ``functools.partial``), in order."""
        if self.n_workers() == 1 or len(tasks) == 1:
            if self.verbose:
                from tqdm.auto import tqdm

                tasks = tqdm(tasks, desc="path kernel blocks")
            return [task() for task in tasks]
        return Parallel(n_jobs=self.n_jobs, verbose=self.verbose, prefer="threads")(
            delayed(task)() for task in tasks
        )
