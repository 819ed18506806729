"""The one place layer rules are chosen: a table from module types to rule classes.

A rule class registers itself for the module types it handles, next to its
definition::

    @register_rule(nn.Linear)
    class LinearRule(LinearInWeights):
        @classmethod
        def for_module(cls, module, names): ...

:func:`make_rule` looks the module's exact type up (subclasses may override
``forward``, so they are not matched) and asks the rule class for a rule; a
module type without a registered rule, or one whose rule declines the module's
configuration (``for_module`` returns None), gets the generic ``torch.func`` rule
(registered with :func:`register_fallback`).
"""

#: Exact module type -> the rule class registered for it.
RULES = {}
_FALLBACK = []


def register_rule(*module_types):
    """Class decorator: register a :class:`LayerRule` subclass for ``module_types``."""

    def register(rule_class):
        for module_type in module_types:
            if module_type in RULES:
                raise ValueError(f"A rule is already registered for {module_type.__name__}.")
            RULES[module_type] = rule_class
        return rule_class

    return register


def register_fallback(rule_class):
    """Class decorator: the rule for modules without a registered rule of their own.

    Its ``for_module(module, names)`` must accept any module with parameters."""
    _FALLBACK[:] = [rule_class]
    return rule_class


def make_rule(module, prefix, path_names):
    """The rule for ``module``'s direct parameters that are part of the path, or None.

    Parameters
    ----------
    module : torch.nn.Module
    prefix : str
        The module's name in the network followed by a dot ("" for the root).
    path_names : set of str
        The path's parameter names.
    """
    local = [name for name, _ in module.named_parameters(recurse=False)]
    names = {name: f"{prefix}{name}" for name in local if f"{prefix}{name}" in path_names}
    if not names:
        return None
    rule_class = RULES.get(type(module))
    rule = None if rule_class is None else rule_class.for_module(module, names)
    return _FALLBACK[0].for_module(module, names) if rule is None else rule
