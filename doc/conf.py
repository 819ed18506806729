"""Sphinx configuration of the sklearn_pathkernel documentation.

Build with ``python -m sphinx -W -b html doc doc/_build/html``; the gallery runs
every ``examples/plot_*.py`` during the build.
"""

import os
import re
import sys
import warnings

sys.path.insert(0, os.path.abspath(".."))

import sklearn_pathkernel

project = "sklearn_pathkernel"
author = "sklearn_pathkernel developers"
copyright = "2026, sklearn_pathkernel developers"
version = release = sklearn_pathkernel.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.mathjax",
    "numpydoc",
    "sphinx_gallery.gen_gallery",
]

templates_path = ["_templates"]
exclude_patterns = ["_build", "auto_examples/*.ipynb", "auto_examples/*.py.md5"]
root_doc = "index"

autosummary_generate = True
autodoc_default_options = {"members": True, "inherited-members": True}
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False

html_theme = "pydata_sphinx_theme"
html_title = "sklearn_pathkernel"
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
    "secondary_sidebar_items": ["page-toc"],
}
html_static_path = []

# Matplotlib without a display; examples also save their figures as PNG when run as scripts.
os.environ.setdefault("MPLBACKEND", "Agg")
warnings.filterwarnings("ignore", message="Matplotlib is currently using agg")

sphinx_gallery_conf = {
    "examples_dirs": "../examples",
    "gallery_dirs": "auto_examples",
    # Executed during the build: every plot_*.py except the CNN quadrature comparison, whose
    # exact scheme takes minutes (doc/performance.rst); its page shows the code and the
    # numbers measured by running it as a script.
    "filename_pattern": r"/plot_",
    "ignore_pattern": r"(demo\.py|__init__\.py)$",
    "within_subsection_order": "FileNameSortKey",
    "download_all_examples": False,
    "remove_config_comments": True,
    "abort_on_example_error": True,
    "matplotlib_animations": False,
    "show_memory": False,
    "min_reported_time": 1,
    "reset_modules": ("matplotlib",),
}


def _skip_foreign_members(app, what, name, obj, skip, options):
    """Document only what this package defines: inherited scikit-learn and torch methods
    (``score``, ``get_params``, ``nn.Module.register_forward_hook``...) are documented by
    their own projects, and their docstrings cross-reference those projects' guides."""
    if what == "class":
        module = getattr(obj, "__module__", None) or ""
        if callable(obj) and not module.startswith("sklearn_pathkernel"):
            return True
    return skip


def _literal_shapes(app, what, name, obj, options, lines):
    """``(n_features_in_,)`` in a numpydoc type is a reST reference; make it literal."""
    for index, line in enumerate(lines):
        lines[index] = re.sub(r"\((n_features_in_),\)", r"(``\1``,)", line)


def setup(app):
    app.connect("autodoc-skip-member", _skip_foreign_members)
    app.connect("autodoc-process-docstring", _literal_shapes)
