"""Layer rules: inner products of per-example gradients without Jacobians.

``_protocol`` declares what a rule is, ``_registry`` chooses one per module
(``make_rule``); each rule family has its module (``_linear``, ``_conv``,
``_distance``, ``_generic``, and ``_jacobian`` for the whole network). Importing
this package registers the rules.
"""

from . import _conv, _distance, _generic, _linear  # noqa: F401  (they register their rules)
from ._registry import make_rule

__all__ = ["make_rule"]
