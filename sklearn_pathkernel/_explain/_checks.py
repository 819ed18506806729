"""Index arguments of the explanation objects' methods, checked with a clear error."""

import numpy as np


def check_index(value, size, name, what):
    """``value`` as an int in ``[0, size)``, or a clear error.

    Parameters
    ----------
    value : int
        The index given (``query=...``, ``output=...``).
    size : int
        How many there are.
    name : str
        The argument's name.
    what : str
        What is counted, plural (``"queries"``, ``"outputs"``).

    Raises
    ------
    TypeError
        If ``value`` is not an integer (a bool is not one).
    ValueError
        If it is outside ``[0, size)``.
    """
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}.")
    if not 0 <= value < size:
        raise ValueError(f"{name}={value} is out of range: there are {size} {what}.")
    return int(value)
