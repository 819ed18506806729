"""Sphinx configuration of the sklearn_pathkernel documentation.

Build with ``python -m sphinx -W -b html doc doc/_build/html``; the gallery runs
every ``examples/plot_*.py`` during the build.
"""

import os
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


def _skip_metadata_routing(app, what, name, obj, skip, options):
    """Hide scikit-learn's generated metadata-routing methods (their docstrings
    cross-reference scikit-learn's own user guide)."""
    if name == "get_metadata_routing" or (name.startswith("set_") and name.endswith("_request")):
        return True
    return skip


def setup(app):
    app.connect("autodoc-skip-member", _skip_metadata_routing)
