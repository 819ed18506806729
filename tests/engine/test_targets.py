"""The counterfactual targets against their closed forms."""

import numpy as np
import torch
from torch.func import vmap

from sklearn_pathkernel._engine._targets import LossTarget, MarginTarget, OutputTarget
from sklearn_pathkernel._training._losses import CrossEntropy, SquaredError


def _log_proba(n=4, K=3, seed=0):
    z = torch.tensor(np.random.default_rng(seed).normal(size=(n, K)))
    return torch.log_softmax(z, 1), z


def test_output_is_the_column():
    f, _ = _log_proba()
    labels = torch.tensor([0, 2, 1, 2])
    values = vmap(OutputTarget())(f, labels)
    torch.testing.assert_close(values, f[torch.arange(4), labels])


def test_margin_is_the_log_odds_and_the_logit_margin():
    f, z = _log_proba()
    labels = torch.tensor([1, 0, 2, 2])
    values = vmap(MarginTarget())(f, labels)
    p = f.exp()[torch.arange(4), labels]
    torch.testing.assert_close(values, torch.log(p) - torch.log1p(-p))
    mask = torch.nn.functional.one_hot(labels, 3).bool()
    others = torch.logsumexp(z.masked_fill(mask, -torch.inf), 1)
    torch.testing.assert_close(values, z[torch.arange(4), labels] - others)


def test_loss_is_the_per_sample_loss():
    f, _ = _log_proba()
    labels = torch.tensor([1, 0, 2, 2])
    values = vmap(LossTarget(CrossEntropy()))(f, labels)
    torch.testing.assert_close(values, -f[torch.arange(4), labels])
    y = torch.tensor(np.random.default_rng(1).normal(size=(4, 3)))
    values = vmap(LossTarget(SquaredError()))(f, y)
    torch.testing.assert_close(values, 0.5 * ((f - y) ** 2).mean(1))


def test_batched_values_and_gradients_are_the_vmapped_ones():
    from torch.func import grad

    f, _ = _log_proba(n=5, K=4)
    labels = torch.tensor([1, 0, 3, 2, 2])
    y = torch.tensor(np.random.default_rng(2).normal(size=(5, 4)))
    cases = [
        (OutputTarget(), labels),
        (MarginTarget(), labels),
        (LossTarget(CrossEntropy()), labels),
        (LossTarget(SquaredError()), y),
    ]
    for target, label in cases:
        torch.testing.assert_close(target.values(f, label), vmap(target)(f, label))
        torch.testing.assert_close(target.gradients(f, label), vmap(grad(target))(f, label))
