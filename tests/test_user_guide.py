"""The user guide's code runs as written: each task page's ``.. code-block:: python``
blocks, top to bottom in one namespace (what a reader pastes, page by page)."""

import re
import textwrap
from pathlib import Path

import pytest
import torch

GUIDE = Path(__file__).resolve().parents[1] / "doc" / "user_guide"
#: The dask recipe runs as a script of its own (tests/test_cluster_recipe.py).
RUN_ELSEWHERE = ("LocalCluster",)


def _blocks(page):
    text = (GUIDE / page).read_text(encoding="utf-8")
    blocks = re.findall(
        r"^\.\. code-block:: python\n((?:[ \t]+:.*\n)*)\n((?:[ \t]+.*\n|\n)+)", text, re.M
    )
    return [
        textwrap.dedent(body)
        for _, body in blocks
        if not any(marker in body for marker in RUN_ELSEWHERE)
    ]


PAGES = sorted(
    page.name for page in GUIDE.glob("*.rst") if page.name != "index.rst" and _blocks(page.name)
)


def test_the_task_pages_have_code():
    for page in (
        "using_the_kernel.rst",
        "explanations.rst",
        "choosing_an_attribution.rst",
        "counterfactual.rst",
        "user_loop.rst",
        "which_modules.rst",
    ):
        assert page in PAGES, f"{page} has no runnable python block"


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES)
def test_page_code_runs(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # (a block that saves a file writes it here)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    threads = torch.get_num_threads()
    namespace = {"__name__": "__user_guide__"}
    try:
        for number, block in enumerate(_blocks(page)):
            exec(compile(block, f"{page}[block {number}]", "exec"), namespace)  # noqa: S102
    finally:
        torch.set_num_threads(threads)
