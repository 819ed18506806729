"""The optional packages of the studies (the ``benchmarks`` extra), checked up front.

``pip install -c constraints.txt dattri captum mlxtend`` (or the package's
``benchmarks`` extra; ``-c constraints.txt`` keeps pip from replacing torch).
"""

import importlib.util
import sys

INSTALL = "pip install -c constraints.txt dattri captum mlxtend (the 'benchmarks' extra)"


def missing(*modules):
    """The names in ``modules`` that cannot be imported."""
    return [name for name in modules if importlib.util.find_spec(name) is None]


def require(modules, quick, what):
    """Exit when one of ``modules`` is missing, saying that ``what`` needs it: with
    status 0 under ``--quick`` (the smoke run is skipped, not failed), 1 otherwise."""
    absent = missing(*modules)
    if absent:
        print(f"{what} needs {', '.join(absent)}: {INSTALL}; "
              f"{'skipped' if quick else 'not run'}.")  # fmt: skip
        sys.exit(0 if quick else 1)
