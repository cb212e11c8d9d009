"""The mkdocs hook behind mkdocs.yml: pages keep their repository paths, and every link is checked.

Run alone on a built site, it checks that site's links: ``python docs/tools/site_hooks.py site``.
"""

from __future__ import annotations

import logging
import os
import posixpath
import re
import sys
from html.parser import HTMLParser
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from mkdocs.plugins import event_priority

log = logging.getLogger("mkdocs.hooks.nbdist")
ROOT = Path(__file__).resolve().parents[2]

# a scheme (https:, mailto:, data:) or protocol-relative //: not ours to check
_EXTERNAL = re.compile(r"^(?:[a-zA-Z][a-zA-Z0-9+.-]*:|//)")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
_MD_LINK = re.compile(r"(\]\(\s*<?)([^)\s>]+)")
_HTML_LINK = re.compile(r"""((?:href|src)=["'])([^"']+)""")
_HEADING = re.compile(r"<h([1-6])[^>]*\bid=\"([^\"]+)\"[^>]*>(.*?)</h\1>", re.S)
_TAG = re.compile(r"<[^>]+>")
IMAGES = "docs/images/*"


def _glob(pattern: str, named: set[str]) -> list[str]:
    """The files a nav glob matches, in name order, less those the nav names anywhere itself
    (so `docs/*.md` after a list of pages adds only the pages that list leaves out)."""
    found = sorted(p.relative_to(ROOT).as_posix() for p in ROOT.glob(pattern))
    return [path for path in found if path not in named]


def _expand_nav(items: list[Any], named: set[str] | None = None) -> list[Any]:
    """A nav entry ``Title: some/*.glob`` becomes a section of the matching files; a bare glob
    in a list becomes those files, in its place; either leaves out what the nav names itself."""
    if named is None:
        named = {path for path in _nav_paths(items) if "*" not in path}
    expanded: list[Any] = []
    for item in items:
        if isinstance(item, str) and "*" in item:
            expanded += _glob(item, named)
            continue
        if isinstance(item, dict):
            item = {title: (_glob(value, named) if isinstance(value, str) and "*" in value
                            else _expand_nav(value, named) if isinstance(value, list) else value)
                    for title, value in item.items()}
            if any(value == [] for value in item.values()):
                continue  # a glob that matched nothing new: no empty section
        expanded.append(item)
    return expanded


def _nav_paths(items: list[Any]) -> list[str]:
    paths: list[str] = []
    for item in items:
        values = item.values() if isinstance(item, dict) else [item]
        for value in values:
            if isinstance(value, list):
                paths += _nav_paths(value)
            elif isinstance(value, str) and not _EXTERNAL.match(value):
                paths.append(value)
    return paths


def on_config(config: Any) -> Any:
    config["nav"] = _expand_nav(config["nav"])
    return config


@event_priority(100)  # before mkdocs-jupyter's on_files, which must see the notebooks
def on_files(files: Any, config: Any) -> Any:
    """Replace the pages mkdocs found in docs_dir by the nav's files and the pictures under
    docs/images/, read from the repository root under their repository paths (theme and plugin
    assets stay)."""
    from mkdocs.structure.files import File

    docs_dir = os.path.abspath(config["docs_dir"])
    for file in list(files):
        if os.path.abspath(file.abs_src_path or "").startswith(docs_dir + os.sep):
            files.remove(file)
    for path in _nav_paths(config["nav"]):
        if not (ROOT / path).is_file():
            log.warning(f"mkdocs.yml nav: {path} is not a file in the repository")
            continue
        files.append(File(path, str(ROOT), config["site_dir"], config["use_directory_urls"]))
    for image in sorted(ROOT.glob(IMAGES)):  # the pictures pages show: copied, not linked away
        files.append(File(image.relative_to(ROOT).as_posix(), str(ROOT), config["site_dir"],
                          config["use_directory_urls"]))
    return files


def _github_url(config: Any, repo_path: str, anchor: str) -> str:
    kind = "tree" if (ROOT / repo_path).is_dir() else "blob"
    return f"{config['repo_url'].rstrip('/')}/{kind}/HEAD/{repo_path}{anchor}"


def _rewrite(target: str, page: Any, files: Any, config: Any, html: bool) -> str:
    """A relative link to a site page stays (as that page's URL in HTML); to any other repository
    file it becomes a GitHub link; to nothing, a warning (an error under --strict)."""
    if _EXTERNAL.match(target) or target.startswith(("#", "/")):
        return target
    path, _, anchor = target.partition("#")
    anchor = f"#{anchor}" if anchor else ""
    base = posixpath.dirname(page.file.src_uri)
    repo_path = posixpath.normpath(posixpath.join(base, unquote(path)))
    site_file = files.get_file_from_path(repo_path)
    if site_file is not None:
        return site_file.url_relative_to(page.file) + anchor if html else target
    if repo_path.startswith("..") or not (ROOT / repo_path).exists():
        if html:  # mkdocs itself warns about a markdown page's link to nothing
            log.warning(f"{page.file.src_uri}: link '{target}' points to no file in the repository")
        return target
    return _github_url(config, repo_path, anchor)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    def fix(match: re.Match[str]) -> str:
        return match.group(1) + _rewrite(match.group(2), page, files, config, html=False)

    out, last = [], 0
    for fence in _FENCE.finditer(markdown):  # code blocks keep their text
        prose = markdown[last:fence.start()]
        out += [_HTML_LINK.sub(fix, _MD_LINK.sub(fix, prose)), fence.group(0)]
        last = fence.end()
    out.append(_HTML_LINK.sub(fix, _MD_LINK.sub(fix, markdown[last:])))
    return "".join(out)


def _toc_from_headings(html: str) -> Any:
    """The table of contents of the headings the page really has: mkdocs-jupyter derives its own
    from a Markdown copy whose ids differ when a heading holds `code` (links to nowhere)."""
    from mkdocs.structure.toc import get_toc

    top: list[dict[str, Any]] = []
    stack: list[dict[str, Any]] = []
    for level, anchor, inner in _HEADING.findall(html):
        name = _TAG.sub("", inner).replace("\u00b6", "").strip()
        token = {"level": int(level), "id": anchor, "name": name, "children": []}
        while stack and stack[-1]["level"] >= token["level"]:
            stack.pop()
        (stack[-1]["children"] if stack else top).append(token)
        stack.append(token)
    return get_toc(top)


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    """Notebooks arrive as HTML (mkdocs-jupyter): their links get the same treatment here."""
    if not page.file.src_uri.endswith(".ipynb"):
        return html
    page.toc = _toc_from_headings(html)
    return _HTML_LINK.sub(
        lambda m: m.group(1) + _rewrite(m.group(2), page, files, config, html=True), html)


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if name in ("id", "name") and value and (name == "id" or tag == "a"):
                self.ids.add(value)
            elif name in ("href", "src") and value and tag in ("a", "img", "link", "script"):
                self.links.append(value)


def check_site(site_dir: str | os.PathLike[str]) -> list[str]:
    """Every relative href/src of every HTML page resolves to a file of the site, and every
    #anchor to an id on the page it names; returns one line per broken link."""
    site = Path(site_dir)
    parsed: dict[Path, _Links] = {}

    def parse(page: Path) -> _Links:
        if page not in parsed:
            parser = _Links()
            parser.feed(page.read_text(encoding="utf-8"))
            parsed[page] = parser
        return parsed[page]

    problems = []
    for page in sorted(site.rglob("*.html")):
        if page == site / "404.html":  # served at any depth, so its links are absolute
            continue
        for link in sorted(set(parse(page).links)):
            if _EXTERNAL.match(link):
                continue
            parts = urlsplit(link)
            target = page if not parts.path else (page.parent / unquote(parts.path)).resolve()
            if target.is_dir():
                target = target / "index.html"
            where = page.relative_to(site).as_posix()
            if not target.is_file():
                problems.append(f"{where}: link '{link}' points to no file of the site")
            elif parts.fragment and target.suffix == ".html" and \
                    unquote(parts.fragment) not in parse(target).ids:
                problems.append(f"{where}: link '{link}': no anchor #{parts.fragment} there")
    return problems


def on_post_build(config: Any) -> None:
    for problem in check_site(config["site_dir"]):
        log.warning(problem)


if __name__ == "__main__":
    found = check_site(sys.argv[1] if len(sys.argv) > 1 else ROOT / "site")
    print("\n".join(found) or "every link and anchor resolves")
    sys.exit(1 if found else 0)
