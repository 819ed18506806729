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

Threads do not oversubscribe the cores: while ``n`` joblib threads run tasks,
torch's intra-op threads (one pool for the process) are divided between them,
``torch.get_num_threads() // n`` each (at least one), and put back afterwards.

Under joblib's dask backend every task runs on the cluster (one alone too), and a
computation of several passes (``_step_scan``) ships its owner to the workers once
for all of them (:meth:`Scheduler.sharing`).

Cost: none beyond the tasks' own, plus joblib's dispatch per task.
"""

from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from joblib import Parallel, delayed, effective_n_jobs, parallel_config
from joblib._parallel_backends import ThreadingBackend
from joblib.parallel import get_active_backend
from sklearn.utils import gen_even_slices

from ._progress import NO_PROGRESS, step_progress


def _active_dask_backend():
    """joblib's active backend if it is its dask backend, else None."""
    try:
        import distributed  # noqa: F401
        from joblib._dask import DaskDistributedBackend
    except ImportError:
        return None
    backend, _ = get_active_backend(prefer="threads")
    return backend if isinstance(backend, DaskDistributedBackend) else None


class SharedByTasks:
    """Mixin of a task owner: its size includes its weight path (``self.path``).

    ``sys.getsizeof`` (and so ``dask.sizeof``) then reports the bytes the owner
    pickles to, and joblib's dask backend scatters it once per call instead of
    pickling it into every task.

    ``progress`` is the bar of the computation running (set by
    :meth:`Scheduler.run`; :data:`~._progress.NO_PROGRESS` otherwise): the
    tasks' step loops run over ``self.progress.over(range(...))``.
    """

    progress = NO_PROGRESS

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


@contextmanager
def torch_threads_shared_by(n_workers):
    """Torch's intra-op threads divided between ``n_workers`` joblib threads while
    the block runs (``n_workers * threads <=`` the threads torch had, at least one
    each); unchanged when joblib's active backend is not threads (processes and
    dask workers have their own)."""
    backend, _ = get_active_backend(prefer="threads")
    before = torch.get_num_threads()
    if n_workers <= 1 or not isinstance(backend, ThreadingBackend):
        yield
        return
    torch.set_num_threads(max(1, before // n_workers))
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass(frozen=True)
class StepChunks:
    """The steps of a path cut into contiguous chunks, first to last.

    Parameters
    ----------
    bounds : tuple of int
        ``0 = b_0 < b_1 < ... < b_c = n_steps``: chunk ``j`` is the steps
        ``[b_j, b_{j+1})`` (``(0,)``: a path of no steps, no chunk).
    """

    bounds: tuple

    def __post_init__(self):
        bounds = tuple(int(b) for b in self.bounds)
        if (
            not bounds
            or bounds[0] != 0
            or any(b <= a for a, b in zip(bounds[:-1], bounds[1:], strict=True))
        ):
            raise ValueError(
                f"Step chunks need increasing bounds from 0 with no empty chunk, got {bounds}."
            )
        object.__setattr__(self, "bounds", bounds)

    @classmethod
    def even(cls, n_steps, n_chunks):
        """``n_chunks`` chunks of sizes that differ by at most one (at most one per
        step), as :func:`sklearn.utils.gen_even_slices`."""
        if n_steps == 0:
            return cls((0,))
        n_chunks = max(1, min(n_steps, n_chunks))
        return cls((0, *(s.stop for s in gen_even_slices(n_steps, n_chunks))))

    @classmethod
    def of_sizes(cls, sizes):
        """Chunks of the given numbers of steps, in order."""
        return cls((0, *np.cumsum([int(size) for size in sizes]).tolist()))

    @property
    def slices(self):
        """The chunks as slices of steps, first to last."""
        return [slice(a, b) for a, b in zip(self.bounds[:-1], self.bounds[1:], strict=True)]

    @property
    def n_steps(self):
        """The steps of all chunks."""
        return self.bounds[-1]

    def __len__(self):
        return len(self.bounds) - 1


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
    step_chunks : int, StepChunks or None, default=None
        Chunks the steps are cut into (see :meth:`chunks`), evenly, or as given;
        None: as the computation needs.
    """

    def __init__(self, n_jobs, verbose, n_steps, step_chunks=None):
        self.n_jobs, self.verbose, self.n_steps = n_jobs, verbose, n_steps
        self.n_step_chunks = step_chunks

    def n_workers(self):
        """Workers running at once under the current joblib configuration."""
        return effective_n_jobs(self.n_jobs)

    def chunks(self, accumulated=False):
        """The path's steps as :class:`StepChunks`: ``step_chunks`` of them when
        set; else one per worker for steps that are independent (Gram matrices,
        plain SGD's decomposition), one for steps ``accumulated`` backward
        (momentum, Adam: their chunks need a scan, :mod:`._step_scan`)."""
        if isinstance(self.n_step_chunks, StepChunks):  # (chunks of chosen sizes)
            if self.n_step_chunks.n_steps != self.n_steps:
                raise ValueError(
                    f"The step chunks cover {self.n_step_chunks.n_steps} steps; the path "
                    f"has {self.n_steps}."
                )
            return self.n_step_chunks
        if self.n_step_chunks is not None:
            return StepChunks.even(self.n_steps, self.n_step_chunks)
        return StepChunks.even(self.n_steps, 1 if accumulated else self.n_workers())

    def step_chunks(self):
        """The slices of :meth:`chunks` for independent steps."""
        return self.chunks().slices

    @contextmanager
    def sharing(self, owner):
        """The calls of :meth:`run` inside share one copy of ``owner`` on a dask
        cluster: under joblib's dask backend, ``owner`` is scattered to every
        worker once, when the block starts (joblib's ``scatter``), instead of once
        per call (a computation of several passes, :mod:`._step_scan`); elsewhere
        nothing changes."""
        backend = _active_dask_backend()
        if backend is None:
            yield
            return
        shared = type(backend)(
            client=backend.client,
            scatter=[owner],
            wait_for_workers_timeout=backend.wait_for_workers_timeout,
        )
        with parallel_config(backend=shared):
            yield

    def run(self, tasks, *, units=None, desc="path kernel"):
        """The results of ``tasks`` (``functools.partial`` of bound methods of
        :class:`SharedByTasks` owners, complete calls), in order.

        With ``verbose``, a bar over ``units`` (tile, step) units (the tasks'
        owners advance it step by step); without ``units``, one per task.
        """
        owners = {id(task.func.__self__): task.func.__self__ for task in tasks}
        progress = step_progress(self.verbose, len(tasks) if units is None else units, desc)
        for owner in owners.values():
            owner.progress = progress
        try:
            # (one task runs here, unless a cluster is to run it: dask's workers)
            if self.n_workers() == 1 or (len(tasks) == 1 and _active_dask_backend() is None):
                return [task() for task in tasks]
            with torch_threads_shared_by(min(self.n_workers(), len(tasks))):
                return Parallel(n_jobs=self.n_jobs, verbose=self.verbose, prefer="threads")(
                    _delayed(task) for task in tasks
                )
        finally:
            for owner in owners.values():
                owner.__dict__.pop("progress", None)
            progress.close()
