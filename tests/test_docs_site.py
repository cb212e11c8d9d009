"""The docs site (mkdocs.yml): it builds with --strict, which fails on any warning, including the
hook's check of every link and anchor; the API reference carries the docstrings, every tutorial
has its page, and the link checker itself catches what it claims to."""

from __future__ import annotations

import dataclasses
import html
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = [pytest.mark.docs, pytest.mark.timeout(660)]  # the build: ~1 min, more when busy
pytest.importorskip("mkdocs", reason="needs the docs extra: pip install -e '.[docs]'")

ROOT = Path(__file__).resolve().parent.parent


def _hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("site_hooks", ROOT / "docs/tools/site_hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _text(page: Path) -> str:
    """A built page's visible text, whitespace folded (tags dropped, so `code` reads as text)."""
    body = page.read_text(encoding="utf-8")
    return " ".join(html.unescape(re.sub(r"<[^>]+>", "", body)).split())


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("docs") / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's banner about MkDocs 2
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    warnings = [line for line in build.stderr.splitlines() if "WARNING" in line or "ERROR" in line]
    assert build.returncode == 0, "mkdocs build --strict failed:\n" + "\n".join(
        warnings or build.stderr.splitlines()[-30:])
    return out


def test_every_link_and_anchor_of_the_built_site_resolves(site: Path) -> None:
    assert _hooks().check_site(site) == []


def test_the_api_reference_carries_the_docstrings(site: Path) -> None:
    from nbdist.api import Cluster
    from nbdist.config import NbdistConfig

    cluster_page = _text(site / "docs/api/cluster.html")
    run_doc = " ".join((Cluster.run.__doc__ or "").split()).replace("`", "")
    assert run_doc and run_doc in cluster_page
    for inherited in ("start", "stop", "push", "pull"):
        assert f'id="nbdist.api.Cluster.{inherited}"' in (site / "docs/api/cluster.html").read_text()
    config_page = (site / "docs/api/config.html").read_text()
    for section in dataclasses.fields(NbdistConfig):  # every section and timing, documented
        assert f'id="nbdist.config.NbdistConfig.{section.name}"' in config_page
        kind = getattr(NbdistConfig(), section.name).__class__.__name__
        for field in dataclasses.fields(getattr(NbdistConfig(), section.name)):
            assert f'id="nbdist.config.{kind}.{field.name}"' in config_page
    assert "--gpus-per-rank" in _text(site / "docs/api/magics.html")  # the magics' usage


def test_every_tutorial_and_guide_has_its_page(site: Path) -> None:
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        page = site / "notebooks" / f"{notebook.stem}.html"
        assert page.is_file(), f"no page for {notebook.name}"
        assert 'class="jp-Cell' in page.read_text(encoding="utf-8")
    assert "Quickstart" in _text(site / "index.html")  # README is the home page
    for image in (ROOT / "docs/images").glob("*"):  # shown from the site, not linked to GitHub
        assert f'src="docs/images/{image.name}"' in (site / "index.html").read_text() or any(
            f'src="images/{image.name}"' in page.read_text() for page in site.glob("docs/*.html"))
        assert (site / "docs/images" / image.name).is_file()
    for guide in sorted((ROOT / "docs").glob("*.md")):
        assert (site / "docs" / f"{guide.stem}.html").is_file(), f"no page for {guide.name}"


def test_the_link_checker_finds_missing_files_and_anchors(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a/page.html").write_text(
        '<h2 id="here">x</h2><a href="#here">ok</a><a href="../b.html#there">ok</a>'
        '<a href="../b.html#gone">bad anchor</a><a href="missing.html">bad file</a>'
        '<a href="https://example.org/x">external</a><img src="data:image/png;base64,AA">')
    (tmp_path / "b.html").write_text('<p id="there">b</p>')
    assert _hooks().check_site(tmp_path) == [
        "a/page.html: link '../b.html#gone': no anchor #gone there",
        "a/page.html: link 'missing.html' points to no file of the site",
    ]


def test_magics_show_as_magics_and_prepare_options_as_tables(site: Path) -> None:
    from nbdist.notebook.magics import DistMagics
    from nbdist.strategies.ddp import DDPOptions
    from nbdist.strategies.deepspeed import DeepSpeedOptions
    from nbdist.strategies.fsdp import FSDPOptions

    magics_page = (site / "docs/api/magics.html").read_text(encoding="utf-8")
    for kind, prefix in (("line", "%"), ("cell", "%%")):
        for name in DistMagics.magics[kind]:
            assert re.search(rf'<h2 id="{name}"[^>]*><code>{prefix}{name}</code>', magics_page), name
    strategies_page = (site / "docs/api/strategies.html").read_text(encoding="utf-8")
    for options in (DDPOptions, FSDPOptions, DeepSpeedOptions):
        table = strategies_page.split(f'id="nbdist.strategies.{options.__module__.split(".")[-1]}'
                                      f'.{options.__name__}"', 1)[1].split("</table>", 1)[0]
        for field in dataclasses.fields(options):
            assert f"<code>{field.name}</code>" in table, (options.__name__, field.name)
