"""TrainingRecorder: the exact path kernel of a user's own PyTorch loop, in two lines.

The recording itself (hooks, per-step checks, the step log) is the training floor's
:class:`~sklearn_pathkernel._training.PathRecorder`, the one the estimators' loop
uses too; this public face adds :meth:`TrainingRecorder.finish`, which hands the
run to a :class:`~._recording.Recording`, and keeps what counterfactual attribution
needs beyond the path: the loss the user states and the optimiser's settings at every
step (:class:`~sklearn_pathkernel._training.SettingsLog`, called from the recorder's
step hooks).
"""

import torch

from .._training import PathRecorder, SettingsLog, check_sample_weight, resolve_loss
from ._recording import Recording


class TrainingRecorder(PathRecorder):
    """Records the exact path kernel's data from a user's own training loop.

    Parameters
    ----------
    module : torch.nn.Module
        The network, at its initial weights. Its output (n, K) is the function
        ``f`` the kernel decomposes. Parameters with ``requires_grad=False`` when
        the recorder is created are constants (a frozen backbone); every other
        parameter must be in ``optimizer``.
    optimizer : torch.optim.Optimizer
        ``torch.optim.SGD`` (dampening 0), ``Adam`` or ``AdamW`` (or any
        optimiser with a registered rule), with any parameter groups and scheduler.
    X : torch.Tensor of shape (n_samples, ...)
        The training inputs; :meth:`rows` names rows of it. Each training batch
        must equal ``X[rows]`` exactly (a randomly augmented batch is refused).
    y : array-like or torch.Tensor, default=None
        The training targets, kept with the recording (for explanations that
        group training points by class, and counterfactual attribution); not
        used by the kernel.
    loss : str, Loss or None, default=None
        The loss the loop minimises, on ``f`` (the module's output, or ``link``'s),
        averaged over each step's rows: a registered loss name, ``"log_loss"``
        (``torch.nn.functional.cross_entropy(f, y)``) or ``"squared_error"``
        (``0.5 * torch.nn.functional.mse_loss(f, y)``), or a ``Loss`` instance.
        Counterfactual attribution (``recording.counterfactual``,
        ``method="counterfactual"``) needs it and ``y``; it is checked against
        the recorded output gradients of every step, not trusted. Not used by the
        kernel.
    sample_weight : array-like of shape (n_samples,) or None, default=None
        With ``loss``: the rows' weights when each batch's loss is their weighted
        mean, ``(w[rows] * l).sum() / w[rows].sum()`` (the estimators'
        convention); None for the plain mean. Counterfactual scores are then with
        respect to these weights.
    check : {"first", "every", "none"}, default="first"
        Recompute a step's gradient from its recorded rows and output gradients
        (one extra forward and backward pass) and compare it with the
        optimiser's: at the first step, at every step, or never. With
        ``"every"`` the gradients are also fingerprinted by their L1 norm, which
        catches in-place edits that do not bump torch's version counter (an AMP
        scaler's ``unscale_``) at any step; otherwise the version counter and
        the tensor's identity catch clipping and manual edits. Whatever the
        setting, a recording checks every step's move against its recorded
        output gradients before its first query (one forward and backward pass
        per step, once; to float64 rounding for a float64 run, to float32
        rounding for a float32 one): ``check`` says when a step is refused, in
        the loop or at the first query.
    max_steps : int or None, default=None
        The number of steps expected, if known (any number may be taken): the
        host arrays are allocated once for that many. Otherwise they start
        small and double when full (each row is then copied about once more).
    link : callable or None, default=None
        ``f = link(module(x))``, the function the kernel decomposes (the
        identity when None). With a link, pass its output to :meth:`rows`
        (``output=``): the output gradients are then taken on ``f``.
    storage : "memory", "disk" or path-like, default="memory"
        Where the weights and scales live (see
        :func:`~sklearn_pathkernel._path.allocate_weights`); on disk needs ``max_steps``.
    on_mismatch : {"refuse", "record"}, default="refuse"
        What :meth:`finish` (and every query of the recording, while it holds
        the user's module) does when the network the user holds is not the
        recorded one: its trained parameters differ from the recorded final
        weights, or a constant (frozen parameter, buffer) changed since the
        recorder was created. ``"refuse"`` raises :class:`RecordingRefused`
        naming the tensor and the size of the difference; ``"record"`` keeps
        the kernel of the recorded network and says, in every result, that the
        user's model is another (``model_difference`` of ``decompose``, a
        warning from every other query). Weights changed *between* steps are
        always refused, at the step.

    Notes
    -----
    Cost per step: copies of the weights ``W`` (and, for Adam, of its second
    moments, ``W`` more numbers, turned into ``P_s`` when the recording is first
    used) and of the output gradients (``|B_s| K``) to the host, the step's row indices, one
    bitwise comparison of the weights with the previous step's result and one of
    the batch's inputs with ``X[rows]``; the inputs are not copied. For small
    networks the time is that of the hooks' Python (about 0.15 ms per step on a
    shared 2-core machine, for an MLP 64-64-10 at batch 64, plus a few
    milliseconds for creating the recorder and ``finish``): see the user guide's
    "Cost" for where it goes (``benchmarks/bench_recorder_hooks.py``). Keeping
    the optimiser's settings (for counterfactual attribution): one learning rate
    per parameter group and a comparison of the other settings with the first
    step's (3 to 4 microseconds a step, measured).
    """

    def __init__(self, module, optimizer, X, y=None, *, loss=None, sample_weight=None,
                 check="first",
                 max_steps=None, link=None, storage="memory", on_mismatch="refuse",
                 generator=None):  # fmt: skip
        if loss is not None:
            resolve_loss(loss)  # (an unknown name is refused now, not after the run)
        if isinstance(X, torch.Tensor):
            sample_weight = check_sample_weight(sample_weight, X.shape[0])
        super().__init__(
            module, optimizer, X, y, check=check, max_steps=max_steps, link=link,
            storage=storage, on_mismatch=on_mismatch, generator=generator,
        )  # fmt: skip
        self.loss, self.sample_weight = loss, sample_weight
        self._settings = SettingsLog(self._rule)
        self.watch_steps(self._settings)  # (in the recorder's own step hooks)

    def finish(self, at_step=None):
        """Detach the hooks and return the :class:`Recording` of the run.

        The network the user holds must be the recorded one: its trained
        parameters bitwise the weights after the last step (or after step
        ``at_step``) and its constants (frozen parameters, buffers) as they were
        when the recorder was created; otherwise see ``on_mismatch``.

        Parameters
        ----------
        at_step : int or None, default=None
            Early stopping that restored earlier weights: the recording of the
            first ``at_step`` steps, whose network is the weights after them
            (those the module must hold). None: all recorded steps.

        Returns
        -------
        recording : Recording

        Raises
        ------
        RecordingRefused
            If the module's weights or constants are not the recorded network's
            (with ``on_mismatch="refuse"``), naming the tensor, the size of the
            difference and, when the weights are those of another recorded
            step, that step.
        """
        run = self.finish_run(at_step)
        settings = self._settings.settings(run.path.n_steps)
        return Recording(
            **run.arguments(),
            loss=self.loss,
            sample_weight=self.sample_weight,
            optimizer_settings=settings,
        )
