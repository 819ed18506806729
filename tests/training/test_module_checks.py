"""The checks of a user's module at fit: exact, or refused with the reason.

Each refusal must name the cause and, where there is one, the layer (its
qualified name and type); dropout other than nn.Dropout and nn.Dropout2d (whose
masks are recorded) is disabled with a warning; the user's module is never
changed by fit.
"""

import warnings

import numpy as np
import pytest
import torch
from sklearn.exceptions import NotFittedError
from sklearn.utils.validation import check_is_fitted
from torch import nn

from sklearn_pathkernel import ExactPathKernelClassifier, ExactPathKernelRegressor
from sklearn_pathkernel._training._module_checks import N_CHECK_ROWS, check_module

N_FEATURES, N_CLASSES = 4, 3


@pytest.fixture(scope="module")
def data():
    rng = np.random.RandomState(0)
    X = rng.randn(12, N_FEATURES)
    y = np.arange(12) % N_CLASSES
    return X, y


def make_clf(module, **params):
    defaults = dict(module=module, max_iter=3, learning_rate=0.1, random_state=0)
    defaults.update(params)
    return ExactPathKernelClassifier(**defaults)


def seeded(build):
    """``build()`` with torch's generator seeded, so two builds have the same weights."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return build()


def linear_head():
    return nn.Linear(8, N_CLASSES)


# -- modules used below ----------------------------------------------------------


class CenterBatch(nn.Module):
    """Subtracts the batch mean: a layer that couples the rows."""

    def forward(self, x):
        return x - x.mean(dim=0, keepdim=True)


class CentersInForward(nn.Module):
    """Couples the rows in its own forward, between two per-sample layers."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(N_FEATURES, 8)
        self.second = nn.Linear(8, N_CLASSES)

    def forward(self, x):
        h = self.first(x)
        return self.second(h - h.mean(dim=0))


class Block(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.linear = nn.Linear(N_FEATURES, 8)
        self.norm = norm

    def forward(self, x):
        return torch.tanh(self.norm(self.linear(x)))


class Noise(nn.Module):
    """Adds fresh noise at every call, in any mode."""

    def forward(self, x):
        return x + 0.1 * torch.randn_like(x)


class AlwaysDropout(nn.Module):
    def forward(self, x):
        return nn.functional.dropout(x, p=0.5, training=True)


class SequenceFirstAttention(nn.Module):
    """Self-attention over 2 tokens per row, sequence first (rows on dimension 1 of
    the attention's input and output), followed by ``after``."""

    def __init__(self, after):
        super().__init__()
        self.attention = nn.MultiheadAttention(2, 1)
        self.after = after
        self.head = nn.Linear(N_FEATURES, N_CLASSES)

    def forward(self, x):
        tokens = x.reshape(x.shape[0], 2, 2).transpose(0, 1)  # (2, n, 2)
        attended, _ = self.attention(tokens, tokens, tokens)
        return self.head(self.after(attended.transpose(0, 1).reshape(x.shape[0], -1)))


class Returns(nn.Module):
    """A linear layer whose output is passed through ``transform``."""

    def __init__(self, transform):
        super().__init__()
        self.linear = nn.Linear(N_FEATURES, N_CLASSES)
        self.transform = transform

    def forward(self, x):
        return self.transform(self.linear(x), x)


def nan_for_negative_first_feature(out, x):
    return torch.where(x[:, :1] < 0, torch.nan, out)


def state_of(module):
    return {key: value.clone() for key, value in module.state_dict().items()}


def modes_of(module):
    return {name: layer.training for name, layer in module.named_modules()}


# -- BatchNorm ---------------------------------------------------------------------


class SubclassedBatchNorm(nn.BatchNorm1d):
    pass


@pytest.mark.parametrize(
    "module, where",
    [
        (
            lambda: nn.Sequential(Block(SubclassedBatchNorm(8)), linear_head()),
            r"layer '0.norm' \(SubclassedBatchNorm\)",
        ),
        (
            lambda: nn.Sequential(Block(nn.SyncBatchNorm(8)), linear_head()),
            r"layer '0.norm' \(SyncBatchNorm\)",
        ),
    ],
    ids=["subclass", "SyncBatchNorm"],
)
def test_other_batch_norms_in_training_mode_are_refused(data, module, where):
    """Only nn.BatchNorm1d / nn.BatchNorm2d are followed in training mode (see
    tests/training/test_batchnorm.py); other types are refused by name."""
    X, y = data
    clf = make_clf(module())
    message = (
        where + r" is in training mode: only nn.BatchNorm1d and nn.BatchNorm2d are "
        r"followed in training mode.*Put it in eval mode"
    )
    with pytest.raises(ValueError, match=message):
        clf.fit(X, y)
    with pytest.raises(NotFittedError):
        check_is_fitted(clf)


def test_batch_norm_in_eval_mode_is_accepted(data):
    X, y = data
    module = nn.Sequential(nn.Linear(N_FEATURES, 8), nn.BatchNorm1d(8), nn.Tanh(), linear_head())
    with torch.no_grad():  # running statistics of a trained network: a per-sample affine map
        module[1].running_mean.uniform_(-1.0, 1.0)
        module[1].running_var.uniform_(0.5, 2.0)
    module.eval()
    state = state_of(module)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        clf = make_clf(module).fit(X, y)
    # The running statistics stay fixed: training runs in eval mode.
    for key in ("running_mean", "running_var", "num_batches_tracked"):
        assert torch.equal(clf.module_[1].state_dict()[key], state[f"1.{key}"])
    # ... and the output of a row is that of the affine map, whatever the batch.
    proba = clf.predict_proba(X)
    np.testing.assert_allclose(
        np.vstack([clf.predict_proba(X[i : i + 1]) for i in range(len(X))]), proba, rtol=1e-13
    )


def test_batch_norm_without_running_statistics_is_refused(data):
    X, y = data
    module = nn.Sequential(
        nn.Linear(N_FEATURES, 8), nn.BatchNorm1d(8, track_running_stats=False), linear_head()
    ).eval()
    with pytest.raises(
        ValueError,
        match=r"layer '1' \(BatchNorm1d\) has no running statistics "
        r"\(track_running_stats=False\).*even in eval mode.*LayerNorm or GroupNorm",
    ):
        make_clf(module).fit(X, y)


# -- modules that couple the rows (the numerical check) ------------------------------


@pytest.mark.parametrize(
    "module, where",
    [
        (
            lambda: nn.Sequential(nn.Linear(N_FEATURES, 8), CenterBatch(), linear_head()),
            r"first at layer '1' \(CenterBatch\)",
        ),
        (
            lambda: nn.Sequential(Block(CenterBatch()), linear_head()),
            r"first at layer '0.norm' \(CenterBatch\)",
        ),
        (CentersInForward, r"first at the module's own forward \(CentersInForward\)"),
        (lambda: SequenceFirstAttention(CenterBatch()), r"first at layer 'after' \(CenterBatch\)"),
    ],
    ids=["layer", "nested", "own-forward", "after-sequence-first-attention"],
)
def test_module_coupling_rows_is_refused_naming_the_layer(data, module, where):
    X, y = data
    message = (
        r"The module couples the rows of a batch: one row's output depends on the other "
        rf"rows \(evaluated on {N_CHECK_ROWS} rows together and one row at a time, the "
        r"outputs differ by up to [0-9.e+-]+ relative, " + where + r"\)\. The exact path "
        r"kernel needs a network that maps each sample on its own.*LayerNorm or GroupNorm"
    )
    with pytest.raises(ValueError, match=message):
        make_clf(module()).fit(X, y)


def test_per_sample_attention_with_rows_on_dimension_one_is_accepted(data):
    X, y = data
    # Its input and output hold the rows on dimension 1: not mistaken for coupling.
    module = seeded(lambda: SequenceFirstAttention(nn.Identity()))
    clf = make_clf(module).fit(X, y)
    assert clf.n_steps_ == 3


def test_batch_output_with_the_wrong_number_of_rows(data):
    X, y = data
    module = Returns(lambda out, x: out.mean(dim=0, keepdim=True))
    with pytest.raises(
        ValueError,
        match=rf"maps {N_CHECK_ROWS} samples to outputs of shape \(1, 3\): it must output "
        r"one row of logits per sample",
    ):
        make_clf(module).fit(X, y)


# -- randomness ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "layer", [nn.AlphaDropout(0.2), nn.FeatureAlphaDropout(0.2), nn.Dropout1d(0.2), nn.RReLU()]
)
def test_random_layers_in_training_mode_warn_and_are_disabled(data, layer):
    X, y = data

    def build(middle):
        return seeded(lambda: nn.Sequential(nn.Linear(N_FEATURES, 8), middle, linear_head()))

    name = type(layer).__name__
    with pytest.warns(
        UserWarning,
        match=rf"Dropout is disabled: the module's layers '1' \({name}.*\) are random in "
        r"training mode, but the network is trained and evaluated in eval mode.*the exact "
        r"path kernel needs a deterministic network",
    ):
        clf = make_clf(build(layer)).fit(X, y)
    # Disabled means eval mode: the same fit as the layer's eval-mode function.
    eval_layer = nn.LeakyReLU((layer.lower + layer.upper) / 2) if name == "RReLU" else None
    reference = make_clf(build(eval_layer or nn.Identity())).fit(X, y)
    np.testing.assert_array_equal(clf.predict_proba(X), reference.predict_proba(X))
    for key, value in reference.module_.state_dict().items():
        assert torch.equal(clf.module_.state_dict()[key], value)


def test_recorded_dropout_stays_in_training_mode(data):
    """nn.Dropout and nn.Dropout2d are trained with dropout (their masks recorded):
    no warning, the checks leave them in training mode and the rest in eval mode."""
    X, _ = data
    module = nn.Sequential(nn.Linear(N_FEATURES, 8), nn.Dropout(0.5), linear_head()).double()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_module(module, torch.as_tensor(X, dtype=torch.float64), N_CLASSES)
    assert module[1].training and not module[0].training


@pytest.mark.parametrize(
    "layer", [nn.Dropout(0.0), nn.Dropout(0.5).eval()], ids=["p=0", "eval-mode"]
)
def test_dropout_without_effect_does_not_warn(data, layer):
    X, y = data
    module = nn.Sequential(nn.Linear(N_FEATURES, 8), layer, linear_head())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_clf(module).fit(X, y)


@pytest.mark.parametrize(
    "module, where",
    [
        (
            lambda: nn.Sequential(nn.Linear(N_FEATURES, 8), Noise(), linear_head()),
            r"first at layer '1' \(Noise\)",
        ),
        (
            lambda: Returns(lambda out, x: AlwaysDropout()(out)),
            r"first at the module's own forward \(Returns\)",
        ),
    ],
    ids=["noise-layer", "dropout-in-forward"],
)
def test_random_module_is_refused_naming_the_layer(data, module, where):
    X, y = data
    module = module()
    torch_state = torch.get_rng_state()
    with pytest.raises(
        ValueError,
        match=r"The module's output is random: two evaluations of the same rows in eval "
        r"mode differ \(by up to [0-9.e+-]+ relative\), " + where + r"\. The exact path "
        r"kernel needs a deterministic network",
    ):
        make_clf(module).fit(X, y)
    # The checks draw from a forked generator: the user's global state is untouched.
    assert torch.equal(torch.get_rng_state(), torch_state)


# -- the output ----------------------------------------------------------------------


def test_output_not_a_tensor(data):
    X, y = data
    module = Returns(lambda out, x: (out, x))
    with pytest.raises(
        ValueError,
        match=r"must return a tensor of logits of shape \(n_samples, 3\), but it returned "
        r"a tuple; .*returns the logits only",
    ):
        make_clf(module).fit(X, y)


def test_output_not_floating_point(data):
    X, y = data
    module = Returns(lambda out, x: out.round().long())
    with pytest.raises(ValueError, match=r"dtype torch.int64: it must return floating point"):
        make_clf(module).fit(X, y)


def test_output_cast_to_float32(data):
    X, y = data
    module = Returns(lambda out, x: out.float())
    with pytest.raises(
        ValueError,
        match=r"The path kernel is computed in float64.*but the module's output is "
        r"float32: its forward casts to float32",
    ):
        make_clf(module).fit(X, y)


@pytest.mark.parametrize(
    "transform, problem",
    [
        (lambda out, x: out * torch.nan, rf"NaN in {N_CHECK_ROWS} of the {N_CHECK_ROWS} rows"),
        (lambda out, x: out / 0.0, rf"inf in {N_CHECK_ROWS} of the {N_CHECK_ROWS} rows"),
        (nan_for_negative_first_feature, None),
    ],
    ids=["nan", "inf", "nan-in-some-rows"],
)
def test_output_not_finite_at_initial_weights(data, transform, problem):
    X, y = data
    if problem is None:  # as many rows as the checked rows with a negative first feature
        n_bad = int((X[:N_CHECK_ROWS, 0] < 0).sum())
        assert 0 < n_bad < N_CHECK_ROWS
        problem = rf"NaN in {n_bad} of the {N_CHECK_ROWS} rows"
    with pytest.raises(
        ValueError,
        match=r"The module's output at its initial weights contains "
        + problem
        + r" checked: the loss and its gradient would not be finite",
    ):
        make_clf(Returns(transform)).fit(X, y)


# -- what the checks leave as it was -------------------------------------------------


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_fit_does_not_change_the_users_module(data, mode):
    X, y = data
    module = nn.Sequential(
        nn.Linear(N_FEATURES, 8),
        nn.BatchNorm1d(8).eval(),  # eval mode is required for BatchNorm
        nn.Dropout(0.5),
        nn.Tanh(),
        linear_head(),
    )
    module.train(mode == "train")
    module[1].eval()
    state, modes = state_of(module), modes_of(module)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the dropout warning in training mode
        clf = make_clf(module).fit(X, y)
    assert modes_of(module) == modes
    assert state_of(module).keys() == state.keys()
    for key, value in module.state_dict().items():
        assert torch.equal(value, state[key])
    assert all(p.requires_grad and p.grad is None for p in module.parameters())
    # The fitted copy is in eval mode, the mode it was trained in.
    assert not any(modes_of(clf.module_).values())


def test_check_module_is_cheap_and_leaves_eval_mode(data):
    X, _ = data

    class Counting(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(N_FEATURES, N_CLASSES).double()
            self.calls = []

        def forward(self, x):
            self.calls.append(x.shape[0])
            return self.linear(x)

    module = Counting()
    state = state_of(module)
    check_module(module, torch.as_tensor(X), N_CLASSES)
    # One row, the batch twice (determinism), the other rows one at a time.
    assert module.calls == [1, N_CHECK_ROWS, N_CHECK_ROWS] + [1] * (N_CHECK_ROWS - 1)
    assert not module.training
    for key, value in module.state_dict().items():
        assert torch.equal(value, state[key])


def test_check_module_evaluates_distinct_rows():
    # Duplicated rows hide a batch mean; the check takes distinct ones.
    X = torch.as_tensor(np.repeat(np.random.RandomState(0).randn(3, N_FEATURES), 5, axis=0))
    module = nn.Sequential(nn.Linear(N_FEATURES, 8), CenterBatch(), linear_head()).double()
    with pytest.raises(ValueError, match=r"evaluated on 3 rows together"):
        check_module(module, X, N_CLASSES)


def test_check_module_puts_back_buffers_that_forward_updates(data):
    X, _ = data

    class CountsCalls(nn.Module):
        """Updates a buffer at every call (its output does not depend on it)."""

        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(N_FEATURES, N_CLASSES).double()
            self.register_buffer("calls", torch.zeros((), dtype=torch.float64))

        def forward(self, x):
            self.calls += 1
            return self.linear(x)

    module = CountsCalls()
    check_module(module, torch.as_tensor(X), N_CLASSES)
    assert module.calls.item() == 0.0  # w_0's state is the module as it was built


@pytest.mark.parametrize(
    "y_shape, message",
    [
        (
            (12,),
            r"shape \(1, 3\) for one sample, but the target has 1 output: it must output "
            r"predictions of shape \(n_samples, 1\)",
        ),
        (
            (12, 2),
            r"shape \(1, 3\) for one sample, but the target has 2 outputs: it must "
            r"output predictions of shape \(n_samples, 2\)",
        ),
    ],
    ids=["1-d", "2-outputs"],
)
def test_regressor_output_width_names_both(data, y_shape, message):
    X, _ = data
    y = np.random.RandomState(0).randn(*y_shape)
    regressor = ExactPathKernelRegressor(module=nn.Linear(N_FEATURES, 3), max_iter=3)
    with pytest.raises(ValueError, match=message):
        regressor.fit(X, y)


def test_regressor_module_is_checked(data):
    X, _ = data
    y = np.random.RandomState(0).randn(X.shape[0])
    module = nn.Sequential(nn.Linear(N_FEATURES, 8), nn.SyncBatchNorm(8), nn.Linear(8, 1))
    with pytest.raises(ValueError, match=r"layer '1' \(SyncBatchNorm\) is in training mode"):
        ExactPathKernelRegressor(module=module, max_iter=3).fit(X, y)


def test_a_module_of_the_wrong_input_width_is_named(data):
    X, y = data
    wide = nn.Sequential(nn.Linear(N_FEATURES + 1, 8), nn.ReLU(), nn.Linear(8, N_CLASSES))
    with pytest.raises(
        ValueError,
        match=r"fails on one row of X, shape \(1, 4\) \(4 features per row\): its first layer "
        r"'0' \(Linear\) expects 5 input features, but X's rows have 4",
    ) as caught:
        make_clf(wide).fit(X, y)
    assert isinstance(caught.value.__cause__, RuntimeError)  # torch's own error, chained
    conv = nn.Sequential(nn.Conv2d(3, 2, 2), nn.Flatten(), nn.LazyLinear(N_CLASSES))
    with pytest.raises(ValueError, match=r"'0' \(Conv2d\) expects 3 input channels, .* have 1"):
        check_module(conv.double(), torch.zeros(2, 1, 4, 4, dtype=torch.float64), N_CLASSES)


class RowwiseWhenAlone(nn.Module):
    """A Linear map summed row by row for one row and by a matrix product for a
    batch: per-sample (the same numbers in exact arithmetic), but a float32 batch
    and its rows one at a time round differently (as BLAS blocking does for a
    784-wide MNIST layer: 1.2e-7 relative)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(N_CLASSES, 300))

    def forward(self, x):
        x = x.repeat(1, 75)  # (300 features: rounding of a long sum)
        if x.shape[0] == 1:
            return (x[:, None, :] * self.weight[None]).sum(-1)
        return x @ self.weight.T


def test_float32_rounding_is_not_taken_for_coupled_rows(data):
    """A float32 network is checked on its float64 copy: rounding that differs
    between a batch and its rows is accepted (the checks' tolerance is for
    float64), real coupling is still refused, and the modes are set on the
    user's network (dropout trained with its masks, the rest in eval mode)."""
    X, _ = data
    X32 = torch.as_tensor(X, dtype=torch.float32)
    torch.manual_seed(0)
    module = RowwiseWhenAlone()
    with torch.no_grad():  # (the premise: float32 rounds apart, float64 does not)
        rows = X32[:N_CHECK_ROWS]
        batch, single = module(rows), torch.cat([module(r[None]) for r in rows])
        assert (batch - single).abs().max() / batch.abs().max() > 1e-9
    network = nn.Sequential(RowwiseWhenAlone(), nn.Dropout(0.5), nn.Linear(N_CLASSES, N_CLASSES))
    network.train()
    check_module(network, X32, N_CLASSES)
    assert network[1].training and not network[0].training and not network[2].training
    assert network[0].weight.dtype == torch.float32  # (the user's network, not its copy)
    coupled = nn.Sequential(nn.Linear(N_FEATURES, 8), CenterBatch(), linear_head()).float()
    with pytest.raises(ValueError, match=r"couples the rows.*layer '1' \(CenterBatch\)"):
        check_module(coupled, X32, N_CLASSES)
