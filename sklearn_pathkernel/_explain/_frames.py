"""pandas and matplotlib, optional: imported when a frame or a plot is asked for."""

import importlib


def _optional(module, used_by, package):
    """``module`` imported, or an ImportError that names what needs it and how to get it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(
            f"{used_by} needs {package}, an optional dependency: pip install {package}"
        ) from error


def pandas():
    """The pandas module (for ``to_frame()``)."""
    return _optional("pandas", "to_frame()", "pandas")


def pyplot():
    """matplotlib.pyplot (for ``plot()``)."""
    return _optional("matplotlib.pyplot", "plot()", "matplotlib")
