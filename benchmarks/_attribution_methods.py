"""The attribution methods of ``bench_attribution.py``: ours and the peers' own libraries.

Every method gives, from a :class:`Context`, ``attribute(ctx)``: scores (M,
n_test) on the clean model, higher = the training point raised the test point's
true-label margin more; and ``self_scores(ctx)``: one score (M,) per training
point of the model trained on flipped labels, higher = more suspicious. Either
may be None (not applicable).

Ours (the exact decomposition, ``sklearn_pathkernel``'s explanation API):

- ``ours``: the contribution of training point ``i`` to the test point's
  true-label log-probability (``influence_matrix``); self:
  ``self_influence(target="output")`` (the scores of ``self_influence()``, one
  output's work);
- ``ours-norm``: divided by the training point's path norm (``normalize=True``);
- ``ours-late``: only the gradients of the second half of the epochs
  (``explain_over_time``; self: ``self_influence(first_epoch=E // 2)``);
- ``ours-epoch-norm``: each epoch's terms divided by their total absolute value
  (per query), then summed: no epoch outweighs the others; no self score;
- ``ours-skip-first``: every epoch but the first (self:
  ``self_influence(first_epoch=1)``), a variant chosen after seeing the per-epoch
  LDS of the digits MLP with Adam (see the docs page);
- ``ours-ens``: the mean over models trained from ``ensemble`` seeds (TRAK's
  ensembling, on the exact decomposition);
- ``counterfactual``: ``counterfactual(X_test, y_test, target="margin").scores``, the
  derivative of the test margin with respect to each row's sample weight through the
  whole run, by the optimiser family's rule (exact for SGD, the Hessian term cut for
  Adam); self: ``self_influence(method="counterfactual")``; ``counterfactual-exact``
  and ``counterfactual-no-hessian`` force ``hessian=True`` / ``False``;
- ``counterfactual-h1``, ``counterfactual-hE``, ``counterfactual-h4E``: the rule's
  sweep with a geometric horizon (private ``horizon`` of the adjoint sweep) of one
  step, one epoch's steps and four epochs' steps: a move is scored by the target
  that many steps later on average, between TracIn-like (one step, no later
  reaction) and the exact derivative (the whole run's reaction); self: the same
  sweep with each training row as its own query (``counterfactual-h2E`` and
  ``counterfactual-h8E``: the same at two and eight epochs, the rule's sensitivity);
- ``counterfactual-ens``: the plain mean of ``counterfactual``'s scores (and self
  scores) over the models trained from ``ensemble`` seeds (``_ensemble``: seed 0 is
  the benchmark's own model), by the same rule on every run: an estimate of the
  derivative of the *expected* retrained margin over seeds, the fresh-seed LDS's
  target; ``counterfactual-ens-std`` (an ablation, no self score): each run's scores
  standardised per test point (zero mean, unit deviation over the training rows)
  before the mean.

Peers (dattri 0.3.0, captum 0.9.0), on the same network and its recorded weight
path (float64): TracIn over 10 checkpoints and over every step (dattri's
``TracInAttributor``, learning-rate weights, *no* random projection: the
attributor's ``projector_kwargs`` is set to None after construction, since
dattri's constructor always fills in its 512-d default), Grad-Dot and Grad-Cos
(the final weights), TRAK with its CPU projector (``min(512, M / 2)``
dimensions: its ``X^T X`` is singular above M) on the final model
and on an ensemble of 10 independently trained models (``attribute``; its
``self_attribute`` fails on CPU, so TRAK's self score is the diagonal of
``attribute`` with the training set as queries), influence functions
(``IFAttributorExplicit``, the Hessian of the training loss at the final
weights, regularisation 0.01; its ``self_attribute`` fails too, so its self
score is also the diagonal of ``attribute``), influence functions by DataInf
(``IFAttributorDataInf``, layer-wise closed-form inverse, regularisation 0.01:
the explicit Hessian of a 10^5-weight network does not fit in memory; no self
score: the diagonal of its M x M attribution took 448 s at M=200), influence
functions by EK-FAC (``IFAttributorEKFAC``, the eigenvalue-corrected
Kronecker-factored Fisher of every linear layer at the final weights, damping 0.1
times the mean corrected eigenvalue, kronfluence's heuristic: per layer two small
factors, so it fits at the field's size; its ``self_attribute``
fails in dattri 0.3.0, so its self score is the diagonal of ``attribute``), captum's
``TracInCP`` (10 checkpoints, all layers), and random scores. ``tracin-ens`` and
``grad-dot-ens``: the mean of ``tracin-10``'s and ``grad-dot``'s scores (and self
scores) over the same ``ensemble`` models as ``counterfactual-ens`` (the peers at an
equal number of models).

DVEmb (``dvemb``: dattri's ``DVEmbAttributor``, data value embeddings, Wang et al.
2024; full gradients, no projection, no factorisation) needs the per-sample gradients
of every training step, cached during training (``cache_gradients(epoch, batch,
indices, learning_rate)``), and models plain mini-batch SGD on the batch's mean loss
(``w_{t+1} = w_t - lr_t / |B_t| sum_i g_i``: no momentum, no weight decay, no Adam).
It is driven by the estimator's recorded path: for every step the recorded weights
are loaded into the network, the recorded batch and learning rate are given to
``cache_gradients``, and the run is replayed from dattri's own per-sample gradients,
``w_s - lr_s mean_i g_i``, which must equal the recorded ``w_{s+1}`` (to 1e-12, as
must the weights dattri reads equal the recorded ones), so DVEmb sees exactly the
run the other methods read. Its self score is the diagonal of ``attribute`` with the
training set as queries (dattri has no ``self_attribute`` for it). On a run it does
not model (``dvemb_unsupported``) the benchmarks print "not supported (reason)".
"""

import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.func import functional_call
from torch.utils.data import DataLoader, TensorDataset

from sklearn_pathkernel._estimators._explanation_context import estimator_context
from sklearn_pathkernel._explain._counterfactual import counterfactual_attribution
from sklearn_pathkernel._explain._scoring import path_norms

#: The replay of the recorded run from dattri DVEmb's per-sample gradients must
#: reproduce every recorded weight to this (absolute; the weights are of order 1).
DVEMB_REPLAY_TOLERANCE = 1e-12
#: DVEmb (unprojected) keeps a float64 W x W matrix: larger runs are left out.
DVEMB_MAX_MATRIX_BYTES = 8 * 2**30

LOADER_BATCH = 50


@dataclass
class Context:
    """What the methods read (fitted once in the parent process)."""

    task: object
    clf: object  # the clean model, seed 0
    noisy: object  # the model on flipped labels, seed 0
    noisy_y: np.ndarray
    ensemble: int

    def test_codes(self):
        return np.searchsorted(self.clf.classes_, self.task.y_test)


# -- ours ----------------------------------------------------------------------------


def ours_matrix(clf, task, normalize=False):
    codes = np.searchsorted(clf.classes_, task.y_test)
    return clf.influence_matrix(task.X_test, columns=codes, normalize=normalize).T


def ours(ctx):
    return ours_matrix(ctx.clf, ctx.task)


def ours_self(ctx):
    # a classifier's scores read its own label's output: target="output" gives the
    # same scores (tests/explain/test_self_influence_targets.py) for one output's work
    return ctx.noisy.self_influence(target="output").scores


def ours_norm(ctx):
    return ours_matrix(ctx.clf, ctx.task, normalize=True)


def ours_norm_self(ctx):
    return ctx.noisy.self_influence().scores / path_norms(ctx.noisy._engine())


def ours_late(ctx):
    over_time = ctx.clf.explain_over_time(ctx.task.X_test, period="epoch")
    n_epochs = over_time.values.shape[1]
    late = over_time.values[:, n_epochs // 2 :].sum(axis=1)  # (n_test, M, K)
    return late[np.arange(late.shape[0]), :, ctx.test_codes()].T


def ours_skip_first(ctx):
    """Every epoch but the first (Adam's warm-up, where the preconditioner is large)."""
    values = ctx.clf.explain_over_time(ctx.task.X_test, period="epoch").values
    late = values[:, 1:].sum(axis=1)
    return late[np.arange(late.shape[0]), :, ctx.test_codes()].T


def ours_skip_first_self(ctx):
    return ctx.noisy.self_influence(first_epoch=1).scores


def ours_epoch_norm(ctx):
    """Each epoch's terms over their total absolute value per query: no epoch
    (Adam's first, with its huge preconditioner) outweighs the others."""
    values = ctx.clf.explain_over_time(ctx.task.X_test, period="epoch").values
    picked = values[np.arange(values.shape[0]), :, :, ctx.test_codes()]  # (n, E, M)
    mass = np.abs(picked).sum(axis=2, keepdims=True)
    return (picked / np.where(mass > 0, mass, 1.0)).sum(axis=1).T


def ours_late_self(ctx):
    return ctx.noisy.self_influence(first_epoch=ctx.noisy.n_iter_ // 2).scores


def _ensemble(ctx, noisy):
    for seed in range(ctx.ensemble):
        if seed == 0:
            yield ctx.noisy if noisy else ctx.clf
        else:
            yield ctx.task.fit(seed=seed, y=ctx.noisy_y if noisy else None)


def ours_ens(ctx):
    return np.mean([ours_matrix(clf, ctx.task) for clf in _ensemble(ctx, False)], axis=0)


def ours_ens_self(ctx):
    return np.mean([clf.self_influence().scores for clf in _ensemble(ctx, True)], axis=0)


# -- dattri --------------------------------------------------------------------------


def _module(clf):
    module = clf.module_
    for param in module.parameters():
        param.requires_grad_(True)
    return module


def _checkpoints(clf, steps):
    """State dicts of the recorded path at ``steps`` (weight rows)."""
    path = clf.path_
    return [{k: v.clone() for k, v in path.unflatten(path.weights[s]).items()} for s in steps]


def _loaders(X, y, batch_size=LOADER_BATCH):
    data = TensorDataset(torch.tensor(X, dtype=torch.float64), torch.tensor(y, dtype=torch.long))
    return DataLoader(data, batch_size=batch_size, shuffle=False)


def _codes(clf, y):
    return np.searchsorted(clf.classes_, y)


def _as_batch(x, y):
    return (x.unsqueeze(0), y.unsqueeze(0)) if y.dim() == 0 else (x, y)


def _loss_task(clf, checkpoints):
    from dattri.task import AttributionTask

    model = _module(clf)

    def loss(params, data):
        x, y = _as_batch(*data)  # one sample (vmapped attributors) or a batch (IF)
        logits = functional_call(model, params, (x,))
        return nn.functional.cross_entropy(logits, y)

    return AttributionTask(loss_func=loss, model=model, checkpoints=checkpoints)


def _tracin(clf, X, y, X_test, y_test, steps, weights, normalized):
    from dattri.algorithm.tracin import TracInAttributor

    task = _loss_task(clf, _checkpoints(clf, steps))
    attributor = TracInAttributor(
        task, weight_list=torch.tensor(weights, dtype=torch.float64), normalized_grad=normalized
    )
    attributor.projector_kwargs = None  # full gradients, no random projection
    train = _loaders(X, _codes(clf, y))
    if X_test is None:
        return attributor.self_attribute(train).numpy()
    return attributor.attribute(train, _loaders(X_test, _codes(clf, y_test))).numpy()


def _every_step(clf):
    return np.arange(clf.n_steps_)


def _ten_checkpoints(clf):
    return np.linspace(clf.n_steps_ / 10, clf.n_steps_, 10).round().astype(int)


def _lr(clf, steps):
    return np.full(len(steps), float(clf.learning_rate))


def tracin(ctx, steps_of=_ten_checkpoints):
    t, clf = ctx.task, ctx.clf
    steps = steps_of(clf)
    return _tracin(clf, t.X_train, t.y_train, t.X_test, t.y_test, steps, _lr(clf, steps), False)


def tracin_self(ctx, steps_of=_ten_checkpoints):
    clf = ctx.noisy
    steps = steps_of(clf)
    return _tracin(clf, ctx.task.X_train, ctx.noisy_y, None, None, steps, _lr(clf, steps), False)


def tracin_all(ctx):
    return tracin(ctx, _every_step)


def tracin_all_self(ctx):
    return tracin_self(ctx, _every_step)


def _final(clf):
    return [clf.n_steps_]


def grad_dot(ctx, normalized=False):
    t, clf = ctx.task, ctx.clf
    return _tracin(clf, t.X_train, t.y_train, t.X_test, t.y_test, _final(clf), [1.0], normalized)


def grad_dot_self(ctx, normalized=False):
    clf = ctx.noisy
    return _tracin(clf, ctx.task.X_train, ctx.noisy_y, None, None, _final(clf), [1.0], normalized)


def grad_cos(ctx):
    return grad_dot(ctx, normalized=True)


def grad_cos_self(ctx):
    return grad_dot_self(ctx, normalized=True)


def _trak(clfs, X, y, X_test, y_test):
    from dattri.algorithm.trak import TRAKAttributor
    from dattri.task import AttributionTask

    model = _module(clfs[0])

    def margin(params, data):
        x, label = data
        logits = functional_call(model, params, (x.unsqueeze(0),))
        logp = -nn.functional.cross_entropy(logits, label.unsqueeze(0))
        return logp - torch.log(1 - torch.exp(logp))

    def correct_probability(params, data):
        x, label = data
        logits = functional_call(model, params, (x.unsqueeze(0),))
        return torch.exp(-nn.functional.cross_entropy(logits, label.unsqueeze(0)))

    checkpoints = [_checkpoints(clf, _final(clf))[0] for clf in clfs]
    task = AttributionTask(loss_func=margin, model=model, checkpoints=checkpoints)
    attributor = TRAKAttributor(
        task,
        correct_probability_func=correct_probability,
        # at most M / 2 dimensions: TRAK solves with the (proj_dim, proj_dim) matrix
        # X^T X of the M projected gradients, singular when proj_dim > M
        projector_kwargs={"device": "cpu", "proj_dim": min(512, X.shape[0] // 2)},
        device="cpu",
    )
    codes = _codes(clfs[0], y)
    train = _loaders(X, codes)
    attributor.cache(train)
    if X_test is None:  # self_attribute fails on CPU in dattri 0.3.0: the diagonal
        return np.diag(attributor.attribute(train).numpy()).copy()
    return attributor.attribute(_loaders(X_test, _codes(clfs[0], y_test))).numpy()


def _trak_models(ctx, n_models, noisy):
    if n_models == 1:
        return [ctx.noisy if noisy else ctx.clf]
    y = ctx.noisy_y if noisy else None
    return [ctx.noisy if noisy and s == 0 else ctx.task.fit(seed=s, y=y) for s in range(n_models)]


def trak1(ctx):
    t = ctx.task
    return _trak(_trak_models(ctx, 1, False), t.X_train, t.y_train, t.X_test, t.y_test)


def trak1_self(ctx):
    return _trak(_trak_models(ctx, 1, True), ctx.task.X_train, ctx.noisy_y, None, None)


def trak10(ctx):
    t = ctx.task
    return _trak(_trak_models(ctx, 10, False), t.X_train, t.y_train, t.X_test, t.y_test)


def trak10_self(ctx):
    return _trak(_trak_models(ctx, 10, True), ctx.task.X_train, ctx.noisy_y, None, None)


def trak_ens(ctx):
    """TRAK on ``ctx.ensemble`` independently trained models."""
    t = ctx.task
    return _trak(_trak_models(ctx, ctx.ensemble, False), t.X_train, t.y_train, t.X_test, t.y_test)


def trak_ens_self(ctx):
    return _trak(_trak_models(ctx, ctx.ensemble, True), ctx.task.X_train, ctx.noisy_y, None, None)


def _influence(clf, X, y, X_test, y_test):
    from dattri.algorithm.influence_function import IFAttributorExplicit

    task = _loss_task(clf, _checkpoints(clf, _final(clf))[0])
    attributor = IFAttributorExplicit(task, regularization=0.01)
    # one batch each: dattri forms and inverts the Hessian once per (test batch,
    # training batch) pair
    train = _loaders(X, _codes(clf, y), batch_size=len(X))
    attributor.cache(train)
    if X_test is None:  # self_attribute fails here in dattri 0.3.0: the diagonal
        return np.diag(attributor.attribute(train, train).detach().numpy()).copy()
    test = _loaders(X_test, _codes(clf, y_test), batch_size=len(X_test))
    return attributor.attribute(train, test).detach().numpy()


def _datainf(clf, X, y, X_test, y_test):
    from dattri.algorithm.influence_function import IFAttributorDataInf

    task = _loss_task(clf, _checkpoints(clf, _final(clf))[0])
    attributor = IFAttributorDataInf(task, regularization=0.01)
    train = _loaders(X, _codes(clf, y))
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # (dattri 0.3.0 makes float32 buffers otherwise)
    try:
        attributor.cache(train)
        if X_test is None:  # the diagonal, as for the explicit IF
            return np.diag(attributor.attribute(train, train).detach().numpy()).copy()
        test = _loaders(X_test, _codes(clf, y_test))
        return attributor.attribute(train, test).detach().numpy()
    finally:
        torch.set_default_dtype(default)


#: Training rows per batch of EK-FAC's ``attribute`` (see :func:`_ekfac`).
EKFAC_TRAIN_BATCH = 1500


def _ekfac(clf, X, y, X_test, y_test, damping=None):
    """dattri's EK-FAC influence (the Kronecker-factored eigenbasis of the Fisher of
    every ``nn.Linear`` layer, eigenvalues corrected on the training rows) at the
    final weights: per layer two small factors, not a W x W matrix, so it fits where
    the explicit Hessian and DataInf do not. ``damping`` None: kronfluence's heuristic
    (its ``damping_factor=None``), 0.1 times the mean corrected eigenvalue over every
    layer; an absolute damping
    far above the eigenvalues (0.01 at the field's size) makes the inverse a multiple
    of the identity, i.e. Grad-Dot's ranking."""
    from dattri.algorithm.influence_function import IFAttributorEKFAC

    task = _loss_task(clf, _checkpoints(clf, _final(clf))[0])
    attributor = IFAttributorEKFAC(task, damping=0.0 if damping is None else damping)
    train = _loaders(X, _codes(clf, y))
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # (as for DataInf)
    try:
        attributor.cache(train)
        if damping is None:
            eigenvalues = torch.cat([v.flatten() for v in attributor.cached_lambdas.values()])
            attributor.damping = 0.1 * float(eigenvalues.mean())
        # dattri's attribute recomputes and transforms every test batch's gradients
        # for each training batch: few, large batches (the gradients of 1500 rows
        # are 1.3 GB here) instead of LOADER_BATCH's
        rows = _loaders(X, _codes(clf, y), batch_size=EKFAC_TRAIN_BATCH)
        if X_test is None:  # (self_attribute fails in dattri 0.3.0: the diagonal)
            return np.diag(attributor.attribute(rows, rows).detach().numpy()).copy()
        test = _loaders(X_test, _codes(clf, y_test), batch_size=len(X_test))
        return attributor.attribute(rows, test).detach().numpy()
    finally:
        torch.set_default_dtype(default)


def if_ekfac(ctx):
    t = ctx.task
    return _ekfac(ctx.clf, t.X_train, t.y_train, t.X_test, t.y_test)


def if_ekfac_self(ctx):
    return _ekfac(ctx.noisy, ctx.task.X_train, ctx.noisy_y, None, None)


def if_datainf(ctx):
    t = ctx.task
    return _datainf(ctx.clf, t.X_train, t.y_train, t.X_test, t.y_test)


def if_datainf_self(ctx):
    return _datainf(ctx.noisy, ctx.task.X_train, ctx.noisy_y, None, None)


def influence(ctx):
    t = ctx.task
    return _influence(ctx.clf, t.X_train, t.y_train, t.X_test, t.y_test)


def influence_self(ctx):
    return _influence(ctx.noisy, ctx.task.X_train, ctx.noisy_y, None, None)


# -- captum --------------------------------------------------------------------------


def _captum(clf, X, y, X_test, y_test):
    from captum.influence import TracInCP

    steps = _ten_checkpoints(clf)
    model = _module(clf)
    with tempfile.TemporaryDirectory() as folder:
        paths = []
        for number, state in enumerate(_checkpoints(clf, steps)):
            paths.append(str(Path(folder) / f"checkpoint{number}.pt"))
            torch.save(state, paths[-1])

        def load(module, filename):
            module.load_state_dict(torch.load(filename))
            return float(clf.learning_rate)

        data = TensorDataset(
            torch.tensor(X, dtype=torch.float64), torch.tensor(_codes(clf, y), dtype=torch.long)
        )
        tracincp = TracInCP(
            model,
            data,
            checkpoints=paths,
            checkpoints_load_func=load,
            loss_fn=nn.CrossEntropyLoss(reduction="sum"),
            batch_size=LOADER_BATCH,
            sample_wise_grads_per_batch=True,
        )
        if X_test is None:
            return tracincp.self_influence().detach().numpy()
        inputs = (
            torch.tensor(X_test, dtype=torch.float64),
            torch.tensor(_codes(clf, y_test), dtype=torch.long),
        )
        return tracincp.influence(inputs).detach().numpy().T


def captum_tracin(ctx):
    t = ctx.task
    return _captum(ctx.clf, t.X_train, t.y_train, t.X_test, t.y_test)


def captum_tracin_self(ctx):
    return _captum(ctx.noisy, ctx.task.X_train, ctx.noisy_y, None, None)


# -- counterfactual ------------------------------------------------------------------


def counterfactual(ctx, hessian=None):
    """d margin / d log(sample weight) of each training row, through the whole run
    (``hessian=None``: the optimiser family's rule, exact for SGD, without the
    Hessian term for Adam)."""
    task = ctx.task
    found = ctx.clf.counterfactual(task.X_test, task.y_test, target="margin", hessian=hessian)
    return found.scores.T


def counterfactual_self(ctx, hessian=None):
    return ctx.noisy.self_influence(method="counterfactual", hessian=hessian).scores


def counterfactual_exact(ctx):
    return counterfactual(ctx, hessian=True)


def counterfactual_exact_self(ctx):
    return counterfactual_self(ctx, hessian=True)


def counterfactual_no_hessian(ctx):
    return counterfactual(ctx, hessian=False)


def counterfactual_no_hessian_self(ctx):
    return counterfactual_self(ctx, hessian=False)


#: ``counterfactual-hN``: the rule's sweep with a geometric horizon of mean ``N`` epochs'
#: steps (``AdjointSweep.run_queries(horizon=...)``, private; the horizon experiment),
#: ``None`` a horizon of one step. One rule for every task, never tuned per task.
#: (``h2E`` and ``h8E``: the sensitivity of the rule, measured after the first three.)
HORIZON_EPOCHS = {
    "counterfactual-h1": None,
    "counterfactual-hE": 1,
    "counterfactual-h2E": 2,
    "counterfactual-h4E": 4,
    "counterfactual-h8E": 8,
}


def _horizon_steps(clf, epochs):
    """``epochs`` epochs' steps of ``clf``'s run (one step for None)."""
    if epochs is None:
        return 1
    n_steps = clf._engine().path.n_steps
    return epochs * max(1, -(-n_steps // max(1, clf.n_iter_)))


def _horizon_sweep(clf, queries, columns, epochs, target):
    """The sample-weight scores (n, M) of ``target`` of ``queries`` at ``columns``."""
    context = estimator_context(clf)
    found = counterfactual_attribution(
        context, context.queries(queries), target=target, columns=columns,
        horizon=_horizon_steps(clf, epochs),
    )  # fmt: skip
    return found.scores


def counterfactual_horizon(epochs):
    """``(attribute, self_scores)``: the margin, as ``counterfactual``; the self score
    of the own label's output, as ``self_influence(method="counterfactual")``."""

    def attribute(ctx):
        return _horizon_sweep(ctx.clf, ctx.task.X_test, ctx.test_codes(), epochs, "margin").T

    def self_scores(ctx):
        context = estimator_context(ctx.noisy)
        rows, codes = context.engine.X_train.cpu().numpy(), context.label_codes()
        return np.diagonal(_horizon_sweep(ctx.noisy, rows, codes, epochs, "output")).copy()

    return attribute, self_scores


def counterfactual_ens(ctx):
    """The mean of the rule's scores over ``ctx.ensemble`` independently seeded runs."""
    task = ctx.task
    return np.mean(
        [clf.counterfactual(task.X_test, task.y_test, target="margin").scores.T
         for clf in _ensemble(ctx, False)],
        axis=0,
    )  # fmt: skip


def counterfactual_ens_self(ctx):
    return np.mean(
        [clf.self_influence(method="counterfactual").scores for clf in _ensemble(ctx, True)],
        axis=0,
    )


def _standardised(scores):
    """Each column (test point) to zero mean and unit deviation over the rows."""
    centred = scores - scores.mean(axis=0, keepdims=True)
    deviation = centred.std(axis=0, keepdims=True)
    return centred / np.where(deviation > 0, deviation, 1.0)


def counterfactual_ens_std(ctx):
    """Ablation: every run's scores standardised per test point, then the mean."""
    task = ctx.task
    return np.mean(
        [_standardised(clf.counterfactual(task.X_test, task.y_test, target="margin").scores.T)
         for clf in _ensemble(ctx, False)],
        axis=0,
    )  # fmt: skip


def _single(ctx, clf, noisy):
    """A :class:`Context` whose clean (or noisy) model is ``clf``."""
    if noisy:
        return Context(ctx.task, ctx.clf, clf, ctx.noisy_y, 1)
    return Context(ctx.task, clf, ctx.noisy, ctx.noisy_y, 1)


def _peer_ens(method, noisy):
    def mean_over_runs(ctx):
        return np.mean([method(_single(ctx, clf, noisy)) for clf in _ensemble(ctx, noisy)], axis=0)

    return mean_over_runs


tracin_ens, tracin_ens_self = _peer_ens(tracin, False), _peer_ens(tracin_self, True)
grad_dot_ens, grad_dot_ens_self = _peer_ens(grad_dot, False), _peer_ens(grad_dot_self, True)


# -- DVEmb ---------------------------------------------------------------------------


class NotSupported(Exception):
    """A method does not model the task's training run (the message says why)."""


def dvemb_unsupported(clf):
    """Why dattri's DVEmb does not model ``clf``'s run, or None when it does.

    ``DVEmbAttributor`` unrolls ``w_{t+1} = w_t - lr_t / |B_t| sum_{i in B_t} g_i(w_t)``
    (its ``cache_gradients`` takes a learning rate per step and divides it by the
    batch's size): plain SGD on each batch's unweighted mean loss, gradients from a
    deterministic network.
    """
    reasons = []
    if clf.solver != "sgd":
        reasons.append(f"solver {clf.solver!r}: dattri's DVEmb models plain SGD only")
    if clf.solver == "sgd" and clf.momentum:
        reasons.append(f"momentum {clf.momentum}: dattri's DVEmb models SGD without momentum")
    if clf.weight_decay:
        reasons.append(f"weight decay {clf.weight_decay}: not in DVEmb's update")
    path = clf.path_
    if path.dropout_masks is not None:
        reasons.append("dropout in training: dattri's per-sample gradients draw other masks")
    if 8 * path.n_weights**2 > DVEMB_MAX_MATRIX_BYTES:
        reasons.append(
            f"{path.n_weights} weights: DVEmb's unprojected W x W matrix would take "
            f"{8 * path.n_weights**2 / 2**30:.0f} GiB"
        )
    shares = [g.abs().sum(dim=1) for g in path.output_gradients]
    if any(not torch.allclose(share, share.new_full(share.shape, 1.0 / len(share)))
           for share in shares):  # fmt: skip
        reasons.append("sample weights: DVEmb weighs each batch row by 1 / |B|")
    return "; ".join(reasons) or None


def _load_flat(model, path, flat):
    """Copy the flat weight row ``flat`` into ``model``'s parameters; return what the
    model now holds, flattened as dattri flattens it."""
    from dattri.func.utils import flatten_params

    named = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in path.unflatten(flat).items():
            named[name].copy_(value)
    return flatten_params({k: v.detach() for k, v in model.named_parameters()})


def _dvemb(clf, X, y, X_test, y_test):
    """dattri's ``DVEmbAttributor`` on ``clf``'s recorded run: (M, n_test) scores, or
    the diagonal of the (M, M) training-set attribution when ``X_test`` is None."""
    from dattri.algorithm.dvemb import DVEmbAttributor

    reason = dvemb_unsupported(clf)
    if reason:
        raise NotSupported(reason)
    path = clf.path_
    model = _module(clf)
    model.eval()  # (no dropout or BatchNorm in the supported runs; eval is what dattri uses)
    # the checkpoints are not read by DVEmb; the final weights stand in
    task = _loss_task(clf, _checkpoints(clf, _final(clf))[0])
    attributor = DVEmbAttributor(task)  # full gradients: no projection, no factorisation
    X_all, y_all = (torch.tensor(X, dtype=torch.float64),
                    torch.tensor(_codes(clf, y), dtype=torch.long))  # fmt: skip
    steps_per_epoch = path.n_steps // clf.n_iter_
    worst_weights = worst_replay = 0.0
    for step in range(path.n_steps):
        recorded = path.weights[step]
        seen = _load_flat(model, path, recorded)
        worst_weights = max(worst_weights, float((seen - recorded).abs().max()))
        indices = torch.as_tensor(np.asarray(path.batches[step]), dtype=torch.long)
        rate = float(path.learning_rates[step])
        epoch = step // steps_per_epoch
        attributor.cache_gradients(epoch, (X_all[indices], y_all[indices]), indices, rate)
        gradients = attributor.cached_gradients[epoch][-1]  # (|B|, W), dattri's own
        replayed = recorded - rate * gradients.mean(dim=0)
        worst_replay = max(worst_replay, float((replayed - path.weights[step + 1]).abs().max()))
    if max(worst_weights, worst_replay) > DVEMB_REPLAY_TOLERANCE:
        raise AssertionError(
            f"DVEmb does not see the recorded run: weights differ by {worst_weights:.2e}, "
            f"the replayed steps by {worst_replay:.2e} (tolerance {DVEMB_REPLAY_TOLERANCE})"
        )
    print(f"    (dvemb: {path.n_steps} steps replayed from dattri's gradients, weights "
          f"{worst_weights:.1e}, steps {worst_replay:.1e} from the recorded path)",
          flush=True)  # fmt: skip
    attributor.cache()
    final = path.weights[path.n_steps]
    if float((_load_flat(model, path, final) - final).abs().max()) > DVEMB_REPLAY_TOLERANCE:
        raise AssertionError("DVEmb's test gradients are not at the final weights")
    if X_test is None:
        train = _loaders(X, _codes(clf, y))
        return np.diag(attributor.attribute(train).detach().numpy()).copy()
    test = _loaders(X_test, _codes(clf, y_test))
    return attributor.attribute(test).detach().numpy()


def dvemb(ctx):
    t = ctx.task
    return _dvemb(ctx.clf, t.X_train, t.y_train, t.X_test, t.y_test)


def dvemb_self(ctx):
    return _dvemb(ctx.noisy, ctx.task.X_train, ctx.noisy_y, None, None)


# -- random --------------------------------------------------------------------------


def random_scores(ctx):
    return np.random.RandomState(0).randn(ctx.task.n_train, ctx.task.X_test.shape[0])


def random_self(ctx):
    return np.random.RandomState(1).randn(ctx.task.n_train)


#: name -> (attribute, self_scores)
METHODS = {
    "ours": (ours, ours_self),
    "ours-norm": (ours_norm, ours_norm_self),
    "ours-late": (ours_late, ours_late_self),
    "ours-ens": (ours_ens, ours_ens_self),
    "ours-epoch-norm": (ours_epoch_norm, None),
    "ours-skip-first": (ours_skip_first, ours_skip_first_self),
    "tracin-10": (tracin, tracin_self),
    "tracin-all": (tracin_all, tracin_all_self),
    "grad-dot": (grad_dot, grad_dot_self),
    "grad-cos": (grad_cos, grad_cos_self),
    "trak-1": (trak1, trak1_self),
    "trak-10": (trak10, trak10_self),
    "trak-ens": (trak_ens, trak_ens_self),
    "if-explicit": (influence, influence_self),
    # (its self score, the diagonal of the M x M attribution, takes minutes at M=200)
    "if-datainf": (if_datainf, None),
    "if-ekfac": (if_ekfac, if_ekfac_self),
    "captum-tracincp-10": (captum_tracin, captum_tracin_self),
    "dvemb": (dvemb, dvemb_self),
    "random": (random_scores, random_self),
    "counterfactual": (counterfactual, counterfactual_self),
    "counterfactual-exact": (counterfactual_exact, counterfactual_exact_self),
    "counterfactual-no-hessian": (counterfactual_no_hessian, counterfactual_no_hessian_self),
    **{name: counterfactual_horizon(epochs) for name, epochs in HORIZON_EPOCHS.items()},
    "counterfactual-ens": (counterfactual_ens, counterfactual_ens_self),
    "counterfactual-ens-std": (counterfactual_ens_std, None),
    "tracin-ens": (tracin_ens, tracin_ens_self),
    "grad-dot-ens": (grad_dot_ens, grad_dot_ens_self),
}

#: name -> ``reason(clf)``: why the method does not model ``clf``'s run, or None.
SUPPORT = {"dvemb": dvemb_unsupported}


def unsupported(method, ctx):
    """Why ``method`` does not model the run of ``ctx``'s models, or None."""
    check = SUPPORT.get(method)
    if check is None:
        return None
    reasons = {check(ctx.clf), check(ctx.noisy)} - {None}
    return "; ".join(sorted(reasons)) or None


#: Methods added for ``bench_field.py``, not in ``bench_attribution.py``'s default list.
FIELD_METHODS = ("trak-ens", "if-datainf", "if-ekfac")
#: The ensembles of ``counterfactual`` and of the peers (for the fresh-seed LDS),
#: not in ``bench_attribution.py``'s default list: they retrain.
ENSEMBLE_METHODS = ("counterfactual-ens", "counterfactual-ens-std", "tracin-ens", "grad-dot-ens")
#: The horizon experiment's methods, not in the default list either.
HORIZON_METHODS = tuple(HORIZON_EPOCHS)

#: name -> the label of the table
LABELS = {
    "tracin-10": "TracIn, 10 checkpoints (dattri)",
    "tracin-all": "TracIn, every step (dattri)",
    "grad-dot": "Grad-Dot (dattri)",
    "grad-cos": "Grad-Cos (dattri)",
    "trak-1": "TRAK, 1 model (dattri)",
    "trak-10": "TRAK, 10 models (dattri)",
    "trak-ens": "TRAK, ensemble (dattri)",
    "tracin-ens": "TracIn, 10 checkpoints, ensemble (dattri)",
    "grad-dot-ens": "Grad-Dot, ensemble (dattri)",
    "if-explicit": "IF explicit (dattri)",
    "if-datainf": "IF DataInf (dattri)",
    "if-ekfac": "IF EK-FAC (dattri)",
    "captum-tracincp-10": "TracInCP, 10 checkpoints (captum)",
    "dvemb": "DVEmb (dattri)",
}
