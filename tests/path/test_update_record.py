"""UpdateRecord's deferred preconditioners: computed once, at the first read, and
pickled as values."""

import pickle

import numpy as np
import pytest
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


@pytest.mark.parametrize(
    "buffer_decay, gradient_scale, direct",
    [(0.9, 1.0, 0.0), (0.9, 0.1, 0.05), (0.0, 1.0, 0.01)],
    ids=["momentum", "nesterov-like", "no-buffer-decay"],
)
def test_backward_accumulation_in_place_rounds_as_the_plain_recursion(
    buffer_decay, gradient_scale, direct
):
    """psi from the buffer updated in place through a scratch tensor (the buffer
    itself where zeta = 0 and gamma = 1): bitwise the recursion written out, for
    two layers of different sizes, each psi read before the next step is fed."""
    n_steps = 5
    rates = np.linspace(0.01, 0.05, n_steps)
    record = UpdateRecord(
        buffer_decay, gradient_scale, 0.0, rates, np.full(n_steps, direct), rates * 0
    )
    gen = torch.Generator().manual_seed(1)
    u = [torch.randn(n_steps, 3, 1, width, dtype=torch.float64, generator=gen) for width in (7, 4)]
    given = [layer.clone() for layer in u]
    accumulation = record.backward()
    buffer = None
    for step in reversed(range(n_steps)):
        layers = [layer[step] for layer in u]
        psi = accumulation.psi(step, layers)
        alpha, zeta = record.gradient_rates[step], record.direct_rates[step]
        if buffer is None:
            buffer = [alpha * layer for layer in layers]
        else:
            pairs = zip(layers, buffer, strict=True)
            buffer = [alpha * layer + buffer_decay * old for layer, old in pairs]
        pairs = zip(buffer, layers, strict=True)
        expected = [gradient_scale * b + zeta * layer for b, layer in pairs]
        for got, want in zip(psi, expected, strict=True):
            assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(u, given, strict=True))  # u left as given


def test_backward_accumulation_over_chunks_with_a_carry_equals_the_closed_form():
    """psi_r from no buffer over a chunk [a, b), plus the carried part of B_b,
    equals psi_r = sum_{s >= r} c_{s,r} u_s from UpdateRecord.mixing (closed form);
    the chunk's buffer at a plus beta^(b - a) B_b is the whole run's B_a."""
    rng = np.random.RandomState(0)
    n_steps, a, b = 7, 2, 5
    record = UpdateRecord(
        0.8, 0.3, 0.0, rng.rand(n_steps), rng.rand(n_steps), np.zeros(n_steps), None
    )
    u = [[torch.tensor(rng.randn(2, 3)), torch.tensor(rng.randn(4))] for _ in range(n_steps)]
    whole = record.backward()
    buffers = {}
    for step in reversed(range(n_steps)):
        whole.psi(step, u[step])
        buffers[step] = [layer.clone() for layer in whole.buffer]  # (updated in place)
    chunk = record.backward()
    # (psi is updated in place by the next step: kept as copies)
    local = {step: [p.clone() for p in chunk.psi(step, u[step])] for step in reversed(range(a, b))}
    carried = record.backward(carry=buffers[b], stop=b)
    for step in reversed(range(a, b)):
        carry_part = carried.carried(step)
        expected = [
            sum(record.mixing(s, step) * u[s][layer] for s in range(step, n_steps))
            for layer in range(2)
        ]
        for layer in range(2):
            torch.testing.assert_close(
                local[step][layer] + carry_part[layer], expected[layer], rtol=1e-14, atol=1e-14
            )
    decay = record.carry_decay(b - a)
    assert decay == 0.8 ** (b - a)
    for layer in range(2):
        torch.testing.assert_close(
            chunk.buffer[layer] + decay * buffers[b][layer],
            buffers[a][layer],
            rtol=1e-14,
            atol=1e-14,
        )


def test_a_carry_needs_its_step_and_steps_come_last_to_first():
    record = _record(None)
    with pytest.raises(ValueError, match="stop"):
        record.backward(carry=[torch.ones(3)])
    with pytest.raises(ValueError, match="No buffer to carry"):
        record.backward().carried(1)
    accumulation = record.backward(carry=[torch.ones(3)], stop=2)
    with pytest.raises(ValueError, match="last to first"):
        accumulation.carried(0)
