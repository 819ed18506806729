"""Which parameters a module trains and an optimiser holds, checked at every step.

A recording is of one set of trained parameters: a parameter added, replaced,
frozen or unfrozen during the run (in the module or in the optimiser) makes the
later steps another network's. :class:`StructureWatch` notices it at the step
where it happens without walking the module at every step (inside the training
loop a walk of a small module's submodules costs tens of microseconds).
"""

import weakref

from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)

#: What a change of structure is, for the refusals' messages.
STRUCTURE_CHANGES = "a parameter added, replaced, removed, frozen or unfrozen"


class _Registrations:
    """How many parameters and submodules were registered, in any module, since the
    counter was made (torch's global registration hooks: every ``module.x = ...``
    of a parameter or a module, ``add_module`` and ``register_parameter`` of a
    tensor). Holds nothing of the recorder: the global hooks keep only this."""

    __slots__ = ("count",)

    def __init__(self):
        self.count = 0

    def __call__(self, module, name, value):
        self.count += 1


class StructureWatch:
    """Which parameters a module trains and an optimiser holds, checked at every step.

    The structure is the identities of the module's parameters that require a
    gradient (in ``module.parameters()`` order) and of the optimiser's. It is
    walked only when a cheap signature changed; the signature is

    - the count of parameter and submodule registrations in any module (torch's
      global registration hooks: a parameter or layer added or replaced),
    - the ``requires_grad`` flags of the module's parameters (frozen, unfrozen),
    - the identities of the optimiser's parameters (a group added, a parameter
      put in or taken out),
    - which trained parameters have a gradient at the step (``active``): a
      parameter removed from the module (``del``, which registers nothing) gets
      none from the next backward pass.

    Equal signatures mean an equal structure: the parameters held here cannot
    be replaced in the module without a registration, nor removed without
    losing their gradient. A different signature is settled by the walk (a new
    layer without parameters, or a parameter the loss does not reach at this
    step, is no change).

    Parameters
    ----------
    module : torch.nn.Module
    optimizer : torch.optim.Optimizer

    Notes
    -----
    Cost per step: one pass over the module's parameters (their flags) and over
    the optimiser's, and a comparison of lists; the walk of the module's
    parameters only after a registration or a change of the other parts.
    """

    def __init__(self, module, optimizer):
        self.module, self.optimizer = module, optimizer
        self._registrations = _Registrations()
        self._handles = [
            register_module_parameter_registration_hook(self._registrations),
            register_module_module_registration_hook(self._registrations),
        ]
        # (removed when this watch is collected, should close() never be called)
        weakref.finalize(self, _remove, self._handles)
        self._identity = self._structure()
        self._active = None  # (the first step walks once)
        self._learn()

    def _structure(self):
        trained = tuple(id(p) for p in self.module.parameters() if p.requires_grad)
        held = tuple(id(p) for g in self.optimizer.param_groups for p in g["params"])
        return trained, held

    def _learn(self):
        self._parameters = list(self.module.parameters())
        self._signature = self._read()

    def _read(self):
        return (
            self._registrations.count,
            [p.requires_grad for p in self._parameters],
            [id(p) for g in self.optimizer.param_groups for p in g["params"]],
        )

    def changed(self, active):
        """Whether a parameter was added, replaced, removed, frozen or unfrozen (in
        the module or the optimiser) since creation; ``active``: per trained
        parameter, whether it has a gradient at this step."""
        if active == self._active and self._read() == self._signature:
            return False
        self._active = active
        if self._structure() != self._identity:
            return True
        self._learn()
        return False

    def close(self):
        """Remove the global registration hooks."""
        _remove(self._handles)


def _remove(handles):
    for handle in handles:
        handle.remove()
    handles.clear()
