"""Docstring fragments shared by the estimators (one text, no copies)."""

SOLVER_PARAMETERS = """solver : {"sgd", "adam", "adamw"}, default="sgd"
        The torch.optim optimiser: ``"sgd"`` (gradient descent, with optional
        ``momentum``), ``"adam"`` or ``"adamw"``. The exact path kernel holds for
        every solver: its updates are linear in the training gradients once the
        run's own Adam preconditioner is taken as given (see the user guide,
        "Optimisers").
    momentum : float, default=0.0
        Momentum of ``"sgd"`` (dampening 0, as ``torch.optim.SGD``).
    nesterovs_momentum : bool, default=False
        Nesterov momentum for ``"sgd"`` (only with ``momentum > 0``).
    beta_1 : float, default=0.9
        Decay of the first-moment estimate of ``"adam"`` and ``"adamw"``.
    beta_2 : float, default=0.999
        Decay of the second-moment estimate of ``"adam"`` and ``"adamw"``.
    epsilon : float, default=1e-8
        Added to the denominator of ``"adam"`` and ``"adamw"``.
    weight_decay : float, default=0.0
        Weight decay, exactly as torch.optim: an L2 term added to the gradient
        for ``"sgd"`` and ``"adam"``, decoupled (``w <- (1 - lr weight_decay) w``)
        for ``"adamw"``. What it moves is reported apart from the training
        points' contributions (``decompose(X).decay``)."""


def fill_doc(**fragments):
    """Class decorator: replace ``{name}`` in the docstring by ``fragments[name]``."""

    def decorate(cls):
        doc = cls.__doc__
        for name, text in fragments.items():
            doc = doc.replace("{" + name + "}", text)
        cls.__doc__ = doc
        return cls

    return decorate
