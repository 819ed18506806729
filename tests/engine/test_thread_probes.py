"""Network probes and threads (``_engine/_steps.py``, ``_engine/_probe.py``).

A probe evaluates its module with forward hooks and patched forwards installed
for the length of one pass, so a probe serves one thread at a time. The cause
of a rare ``NotImplementedError`` ("The layer Linear is called more than once
per forward pass") in the threaded scan of ``benchmarks/bench_step_chunks.py``:
``Planner.factor_row_bytes`` measured on the main thread's probe, and with a
scalar target its first measurement (``one_output=True``) ran in the joblib
worker threads, both at once, on that one probe.

The interleavings are forced (no sleeps, no luck): :class:`Interleaved` holds
the first two forward passes of the probes until both threads have their hooks
installed, then runs one pass and then the other. Also checked: a probe
shared by two threads at once is refused with a clear error (before that
check, the second thread's moved-output hooks acted on the first thread's
pass without raising and the outputs were silently wrong), a worker's probe
is copied from a module no probe hooks, and threaded decompositions of a
fresh engine equal the single pass, repeatedly.
"""

import itertools
import threading

import numpy as np
import pytest
import torch
from _recorded_loops import data, run
from torch import nn
from torch.func import functional_call

from sklearn_pathkernel._engine import _probe
from sklearn_pathkernel._engine._facade import PathKernelEngine
from sklearn_pathkernel._engine._probe import NetworkProbe
from sklearn_pathkernel._engine._steps import ThreadProbes
from sklearn_pathkernel._engine._targets import OutputTarget, QueryTargets
from sklearn_pathkernel._path import log_softmax

WAIT_SECONDS = 20  # (a safety net against a hang; the forced orders never wait that long)


class Interleaved:
    """The probes' first two forward passes (``functional_call``) on two threads,
    each held until both threads are inside it (their hooks installed), then the
    first to arrive runs its pass to the end, then the second.

    :meth:`run` runs the targets on threads of their own and gives back, per
    target, ``(result, None)`` or ``(None, exception)``; a thread that fails
    before its pass releases the other one.
    """

    def __init__(self):
        self.barrier = threading.Barrier(2)
        self.first_done = threading.Event()
        self._turns = itertools.count()
        self._lock = threading.Lock()

    def __call__(self, module, *args, **kwargs):
        with self._lock:
            turn = next(self._turns)
        if turn < 2:
            try:
                self.barrier.wait(WAIT_SECONDS)
            except threading.BrokenBarrierError:  # the other thread failed first
                pass
            if turn == 1:
                self.first_done.wait(WAIT_SECONDS)
        try:
            return functional_call(module, *args, **kwargs)
        finally:
            if turn == 0:
                self.first_done.set()

    def run(self, *targets):
        outcomes = [None] * len(targets)

        def work(i, target):
            try:
                outcomes[i] = (target(), None)
            except Exception as error:  # noqa: BLE001 (handed to the test)
                outcomes[i] = (None, error)
                self.barrier.abort()

        threads = [
            threading.Thread(target=work, args=(i, target)) for i, target in enumerate(targets)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return outcomes


def _interleave(monkeypatch):
    """The probes' next two forward passes in the order :class:`Interleaved` forces."""
    order = Interleaved()
    monkeypatch.setattr(_probe, "functional_call", order)
    return order


def _recording(epochs=2):
    X, y = data(30)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3)).double()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.02)
    return run(model, optimizer, X, y, epochs=epochs, batch_size=8)


def _engine(recording, **kwargs):
    base = recording._engine()
    return PathKernelEngine(base.module, base.path, base.X_train, link=base.link, **kwargs)


def test_the_planner_measures_on_the_calling_thread_s_probe(monkeypatch):
    """The root cause: two joblib threads measuring a row's factors at once (the
    first ``pass_rows(one_output=True)`` of a scalar target's decomposition) did
    it on the main thread's probe, and the second thread's pass met the first's
    capturing hooks: ``NotImplementedError`` ("called more than once per forward
    pass"). Each thread measures on its own probe: the same bytes, no error."""
    engine = _engine(_recording(), step_chunks=2, n_jobs=2)
    planner = engine._planner
    assert True not in planner._row_bytes  # (the measurement a scalar target's tasks ask)

    outcomes = _interleave(monkeypatch).run(
        lambda: planner.factor_row_bytes(one_output=True),
        lambda: planner.factor_row_bytes(one_output=True),
    )
    assert [error for _, error in outcomes] == [None, None]
    expected = sum(
        f.nbytes
        for f in engine._probes.main.factors(
            engine._steps.weights(0), engine.X_train[:1], torch.zeros(1, dtype=torch.long)
        )
    )
    assert [result for result, _ in outcomes] == [max(8, expected)] * 2


def test_a_probe_shared_by_two_threads_at_once_is_refused(relu_case, monkeypatch):
    """One probe evaluated by two threads at once: each pass at per-row points of
    a step installs a hook per layer adding ``t_i`` times the layer's moved
    output; the other thread's hooks then acted on its pass too and added theirs,
    a wrong output with no error. The second thread is now refused with an error
    naming the problem, and the first thread's output is exact."""
    module, path, _, _, X = relu_case
    probe = NetworkProbe(module, path, X[:1])
    start, direction = path.weights[2], path.weights[3] - path.weights[2]
    t = torch.linspace(0.1, 0.9, X.shape[0], dtype=torch.float64)
    expected = probe.output(start, X, direction, t)

    outcomes = _interleave(monkeypatch).run(
        lambda: probe.output(start, X, direction, t),
        lambda: probe.output(start, X, direction, t),
    )
    errors = [error for _, error in outcomes if error is not None]
    assert len(errors) == 1, "the second thread was not refused"
    assert isinstance(errors[0], RuntimeError)
    assert "two threads" in str(errors[0])
    (result,) = [result for result, error in outcomes if error is None]
    torch.testing.assert_close(result, expected, rtol=0, atol=0)
    # The probe serves either thread once the other is done.
    torch.testing.assert_close(probe.output(start, X, direction, t), expected, rtol=0, atol=0)


def test_a_worker_probe_is_copied_from_a_module_no_probe_hooks(relu_case, monkeypatch):
    """A worker thread's probe is built (``current()``) while the main thread's
    probe has its hooks installed, mid-pass: the module it copies is not the one
    hooked (each probe evaluates a copy of its own), so the copy carries no hook."""
    module, path, _, _, X = relu_case
    probes = ThreadProbes(module, path, X[:1], log_softmax)
    seen = {}

    def during_the_main_pass(module_, *args, **kwargs):
        if threading.current_thread() is threading.main_thread() and not seen:
            seen["main hooks"] = sum(len(m._forward_hooks) for m in probes.main.module.modules())
            worker = threading.Thread(target=lambda: seen.setdefault("worker", probes.current()))
            worker.start()
            worker.join()
        return functional_call(module_, *args, **kwargs)

    monkeypatch.setattr(_probe, "functional_call", during_the_main_pass)
    start = path.weights[0]
    probes.main.factors(start, X, None)
    assert seen["main hooks"] > 0  # (the copy was made mid-pass)
    worker = seen["worker"]
    assert worker is not probes.main and worker.module is not probes.main.module
    assert not any(m._forward_hooks or "forward" in vars(m) for m in worker.module.modules())
    assert not any(m._forward_hooks for m in module.modules())
    monkeypatch.undo()
    torch.testing.assert_close(
        worker.output(start, X), probes.main.output(start, X), rtol=0, atol=0
    )


@pytest.mark.parametrize("targets", [False, True], ids=["outputs", "target"])
def test_threaded_decompositions_of_a_fresh_engine_equal_the_single_pass(targets):
    """Threads as the benchmark runs them, repeatedly and on a fresh engine each
    time (its first measurements run in the worker threads): the chunks of steps
    as a scan on two joblib threads, and tiles of query rows on two threads,
    equal the single pass to 1e-12."""
    recording = _recording()
    X = torch.tensor(np.random.RandomState(3).randn(6, 4))
    query_targets = QueryTargets(OutputTarget(), torch.tensor([0, 1, 2, 1, 0, 2]))
    query_targets = query_targets if targets else None
    single = _engine(recording).decompose(X, targets=query_targets)
    # (settings, batch_size): the scan's two chunks on two threads; three tiles of query
    # rows on two threads
    routes = [({"step_chunks": 2, "n_jobs": 2}, None), ({"n_jobs": 2}, 2)]
    for _, (settings, batch_size) in itertools.product(range(3), routes):
        engine = _engine(recording, **settings)
        parts = engine.decompose(X, batch_size=batch_size, targets=query_targets)
        for key in ("contributions", "decay", "bias", "output", "quadrature_error"):
            scale = max(1.0, np.abs(single[key]).max())
            np.testing.assert_allclose(
                parts[key], single[key], rtol=0, atol=1e-12 * scale, err_msg=f"{settings} {key}"
            )
