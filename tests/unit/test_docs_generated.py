"""The generated reference pages of docs/ are what `make docs` writes from today's sources."""

from __future__ import annotations

from pathlib import Path

import pytest
from batchpilot_tools import docs_gen

from tests.support import ROOT


@pytest.fixture(scope="module")
def rendered() -> dict[str, str]:
    return docs_gen.render_all(ROOT)


@pytest.mark.parametrize("page", docs_gen.PAGES)
def test_the_committed_page_is_what_make_docs_writes(rendered: dict[str, str], page: str) -> None:
    committed = (ROOT / page).read_text() if (ROOT / page).is_file() else None
    assert committed == rendered[page], f"{page} is stale: run `make docs`"


def test_check_names_each_stale_page(
    tmp_path: Path, rendered: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    # a copy of the sources, with one page edited by hand
    (tmp_path / "crds").mkdir()
    (tmp_path / "docs").mkdir()
    crd = docs_gen.CRD_PATH
    (tmp_path / crd).write_text((ROOT / crd).read_text())
    for page, text in rendered.items():
        (tmp_path / page).write_text(text)
    assert docs_gen.main(["--check", "--root", str(tmp_path)]) == 0
    (tmp_path / "docs/metrics.md").write_text(rendered["docs/metrics.md"] + "edited\n")
    assert docs_gen.main(["--check", "--root", str(tmp_path)]) == 1
    assert capsys.readouterr().err == "docs/metrics.md is stale: run `make docs`\n"


def test_every_metric_name_the_server_defines_is_on_the_page(rendered: dict[str, str]) -> None:
    from batchpilot_server import metric_names

    page = rendered["docs/metrics.md"]
    for name in docs_gen.names_in(metric_names):
        assert f"| `{name}` |" in page
    slot_steps = "| `batchpilot_batch_slot_steps_total` | counter | server |"
    assert f"{slot_steps} `model`, `mode`, `state` |" in page


def test_every_serve_flag_is_on_the_page(rendered: dict[str, str]) -> None:
    from batchpilot_server.serve_options import parser

    page = rendered["docs/cli.md"]
    serve = page[page.index("## batchpilot serve") : page.index("## batchpilot operator")]
    for action in docs_gen.flag_rows(parser()):
        assert f"| `{action.option_strings[0]}`" in serve
    assert "--dynamic-execution" in serve and "--max-wait-ms" in serve
