"""pandas, optional: the tidy frames of the result objects."""


def pandas():
    """The pandas module, or an ImportError that says how to get it."""
    try:
        import pandas as pd
    except ImportError as error:  # pragma: no cover - pandas is installed in CI
        raise ImportError(
            "to_frame() needs pandas, an optional dependency: pip install pandas"
        ) from error
    return pd


def pyplot():
    """matplotlib.pyplot, or an ImportError that says how to get it."""
    try:
        import matplotlib.pyplot as plt
    except ImportError as error:  # pragma: no cover - matplotlib is installed in CI
        raise ImportError(
            "plot() needs matplotlib, an optional dependency: pip install matplotlib"
        ) from error
    return plt
