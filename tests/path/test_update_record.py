"""UpdateRecord's deferred preconditioners: computed once, at the first read, and
pickled as values."""

import pickle

import numpy as np
import torch

from sklearn_pathkernel._path import Deferred, UpdateRecord


def _record(preconditioners):
    rates = np.array([0.1, 0.2])
    return UpdateRecord(0.9, 0.1, 0.0, rates, rates * 0, rates * 0, preconditioners)


def test_deferred_preconditioners_are_computed_once_at_first_read():
    values = torch.arange(6.0).reshape(2, 3)
    calls = []

    def compute():
        calls.append(1)
        return values

    record = _record(Deferred(compute))
    assert calls == []
    assert record.preconditioners is values and record.preconditioners is values
    assert calls == [1]
    assert not record.per_step  # (a read like any other)
    assert torch.equal(record.truncated(1).preconditioners, values[:1])


def test_plain_and_missing_preconditioners_read_as_given():
    values = torch.ones(2, 3)
    assert _record(values).preconditioners is values
    assert _record(None).preconditioners is None
    assert UpdateRecord().preconditioners is None


def test_a_deferred_record_pickles_its_values():
    values = torch.arange(6.0).reshape(2, 3)
    record = _record(Deferred(lambda: values))  # (a lambda: not picklable itself)
    loaded = pickle.loads(pickle.dumps(record))
    assert torch.equal(loaded.preconditioners, values)
    assert loaded.preconditioners is not values
