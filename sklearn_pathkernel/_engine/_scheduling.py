"""Scheduling: independent tasks of the engine through joblib.

A Gram, a diagonal or a decomposition is a sum over (tile of rows, chunk of
steps) tasks that share nothing; :class:`Scheduler` splits the steps into one
chunk per worker and runs the tasks, in order, on threads (torch releases the
GIL in its kernels; nothing to pickle) or on any ``joblib.parallel_config``
backend (e.g. dask, which pickles them).

A task is a ``functools.partial`` of a method of an object that holds the
engine's parts (the network, the weight path, the training rows): the *owner*.
Through joblib the owner goes as an argument of its own, so that a backend that
ships tasks ships it once per computation: joblib's dask backend scatters an
argument that is large by ``dask.sizeof`` (``sys.getsizeof``, so the owner's
``__sizeof__``, :class:`SharedByTasks`) to the cluster once per call, and the
tasks refer to it, where a bound method would carry a copy of the path in every
task.

Cost: none beyond the tasks' own, plus joblib's dispatch per task.
"""

from joblib import Parallel, delayed, effective_n_jobs
from sklearn.utils import gen_even_slices


class SharedByTasks:
    """Mixin of a task owner: its size includes its weight path (``self.path``).

    ``sys.getsizeof`` (and so ``dask.sizeof``) then reports the bytes the owner
    pickles to, and joblib's dask backend scatters it once per call instead of
    pickling it into every task.
    """

    def __sizeof__(self):
        return object.__sizeof__(self) + self.path.nbytes


def _call(owner, name, *args, **kwargs):
    """``owner.name(*args, **kwargs)``: a task with its owner as an argument."""
    return getattr(owner, name)(*args, **kwargs)


def _delayed(task):
    """``task`` (a partial of an owner's method) as a joblib call with the owner as
    its first argument."""
    method = task.func
    return delayed(_call)(method.__self__, method.__name__, *task.args, **task.keywords)


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
        """The results of ``tasks`` (``functools.partial`` of bound methods of
        :class:`SharedByTasks` owners, complete calls), in order."""
        if self.n_workers() == 1 or len(tasks) == 1:
            if self.verbose:
                from tqdm.auto import tqdm

                tasks = tqdm(tasks, desc="path kernel blocks")
            return [task() for task in tasks]
        return Parallel(n_jobs=self.n_jobs, verbose=self.verbose, prefer="threads")(
            _delayed(task) for task in tasks
        )
