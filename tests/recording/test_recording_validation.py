"""Bad queries to a Recording get the estimators' strictness: a clear error, before torch."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sklearn_pathkernel import TrainingRecorder


def _record(X, model, y, steps=4):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    recorder = TrainingRecorder(model, optimizer, X, y=y)
    for step in range(steps):
        rows = torch.arange(step % 2, X.shape[0], 2)
        optimizer.zero_grad()
        out = model(X[rows])
        recorder.rows(rows)
        F.cross_entropy(out, y[rows]).backward()
        optimizer.step()
    return recorder.finish()


@pytest.fixture(scope="module")
def dense():
    generator = torch.Generator().manual_seed(0)
    X = torch.randn(12, 4, generator=generator, dtype=torch.float64)
    y = torch.arange(12) % 3
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3)).double()
    return _record(X, model, y), X


@pytest.fixture(scope="module")
def images():
    generator = torch.Generator().manual_seed(1)
    X = torch.randn(8, 1, 5, 5, generator=generator, dtype=torch.float64)
    y = torch.arange(8) % 2
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(18, 2)).double()
    return _record(X, model, y), X


def _entries(recording):
    """Every public method of a recording that takes query rows."""
    return {
        "decompose": recording.decompose,
        "gram": recording.gram,
        "gram B": lambda X: recording.gram(recording.X_train_[:2], X),
        "explain": lambda X: recording.explain(X, k=2),
        "explain_over_time": recording.explain_over_time,
        "class_contributions": recording.class_contributions,
        "influence_matrix": recording.influence_matrix,
    }


@pytest.mark.parametrize("bad", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("as_tensor", [True, False])
def test_non_finite_queries_are_refused(dense, bad, as_tensor):
    recording, X = dense
    queries = X[:3].clone()
    queries[1, 2] = float(bad)
    queries = queries if as_tensor else queries.numpy()
    what = "NaN" if bad == "nan" else "infinity"
    for name, method in _entries(recording).items():
        with pytest.raises(ValueError, match=f"contains {what} \\(first in row 1;"):
            method(queries)
        assert name  # every entry refused


def test_wrong_width_is_named_before_torch(dense, images):
    recording, X = dense
    for method in _entries(recording).values():
        with pytest.raises(
            ValueError, match=r"rows of shape \(3,\).*training rows have shape \(4,\)"
        ):
            method(X[:2, :3])
    recording, X = images
    for method in _entries(recording).values():
        with pytest.raises(ValueError, match=r"queries must be \(n_queries, 1, 5, 5\)"):
            method(X[:2].reshape(2, 25))


def test_one_row_without_its_batch_axis(dense, images):
    for recording, X in (dense, images):
        with pytest.raises(ValueError, match=r"the shape of one training row.*X\[None\]"):
            recording.decompose(X[0])


def test_wrong_dtype_and_empty_queries(dense):
    recording, X = dense
    with pytest.raises(ValueError, match="Complex data not supported"):
        recording.decompose(X[:2].to(torch.complex128))
    with pytest.raises(ValueError, match="Complex data not supported"):
        recording.decompose(X[:2].numpy().astype(complex))
    with pytest.raises(ValueError, match="could not convert|dtype"):
        recording.decompose(np.array([["a", "b", "c", "d"]], dtype=object))
    with pytest.raises(ValueError, match="0 sample"):
        recording.decompose(X[:0])
    with pytest.raises(TypeError, match="Sparse data was passed for X"):
        from scipy import sparse

        recording.decompose(sparse.csr_matrix(X[:2].numpy()))


def test_valid_queries_of_any_real_type_agree(dense):
    # Lists, float32 and integer tensors are converted to float64 like estimators' X.
    recording, X = dense
    reference = recording.decompose(X[:2]).contributions
    np.testing.assert_array_equal(
        recording.decompose(X[:2].numpy().tolist()).contributions, reference
    )
    rounded = torch.round(X[:2])
    np.testing.assert_array_equal(
        recording.decompose(rounded.to(torch.int64)).contributions,
        recording.decompose(rounded).contributions,
    )


def test_explanation_objects_check_their_indices(dense):
    recording, X = dense
    result = recording.explain(X[:2], k=2)
    with pytest.raises(TypeError, match="query must be an int, got float 0.5"):
        result.plot(query=0.5)
    with pytest.raises(ValueError, match="query=-1 is out of range: there are 2 queries"):
        result.plot(query=-1)
    with pytest.raises(ValueError, match="output=3 is out of range: there are 3 outputs"):
        result.plot(output=3)
    over_time = recording.explain_over_time(X[:2])
    with pytest.raises(ValueError, match="query=2 is out of range"):
        over_time.plot(query=2)
    with pytest.raises(ValueError, match="output=-1 is out of range"):
        over_time.plot(output=-1)
    with pytest.raises(ValueError, match="top must be a positive int, got -1"):
        over_time.plot(top=-1)
