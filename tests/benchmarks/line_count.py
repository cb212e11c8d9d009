"""Lines in nbdist/cluster/ + nbdist/worker/ (issue 26's figure) at git refs, side by side.

    .venv/bin/python -m tests.benchmarks.line_count            # print the figures
    .venv/bin/python -m tests.benchmarks.line_count --write    # and update RESULTS.md

Three trees: the one issue 26 was filed against (its "7.2k today"), main as the issue's work began
(issues 25, 27 and 29, filed with it, had landed by then and added rank-side features), and this
working tree. Each line of a module is counted once, as a docstring, comment, blank or code line;
then the lines over 100 characters, the modules over 400 lines and the functions over 60. The
commits between the first two trees that changed the count are listed with what they added.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tests.benchmarks.common import write_section

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "tests" / "benchmarks" / "RESULTS.md"
SECTION = "## Lines in nbdist/cluster/ + nbdist/worker/ (issue 26)"
PACKAGES = ("nbdist/cluster", "nbdist/worker")
FILED = "234bc48"  # main when issue 26 was filed: 7,179 lines, 274 over 100 characters in nbdist
BEGUN = "1dbc711"  # main just before issue 26's first merge (f2c656a)
TARGET = 0.80  # "down by at least 20 %"


@dataclass
class Count:
    total: int = 0
    code: int = 0
    docstring: int = 0
    comment: int = 0
    blank: int = 0
    long_lines: int = 0  # over 100 characters
    modules: int = 0
    long_modules: int = 0  # over 400 lines
    long_functions: int = 0  # over 60 lines

    def add(self, source: str) -> None:
        lines = source.splitlines()
        docstrings: set[int] = set()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.long_functions += _span(node) > 60
            body = getattr(node, "body", None)
            for statement in body if isinstance(body, list) else []:
                if (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant)
                        and isinstance(statement.value.value, str)):
                    docstrings.update(range(statement.lineno, statement.lineno + _span(statement)))
        for number, line in enumerate(lines, 1):
            text = line.strip()
            if not text:
                self.blank += 1
            elif number in docstrings:
                self.docstring += 1
            elif text.startswith("#"):
                self.comment += 1
            else:
                self.code += 1
        self.total += len(lines)
        self.long_lines += sum(len(line) > 100 for line in lines)
        self.modules += 1
        self.long_modules += len(lines) > 400


def _span(node: ast.stmt) -> int:
    return (node.end_lineno or node.lineno) - node.lineno + 1


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout


def count_at(ref: str | None) -> Count:
    """The count at a git ref, or in the working tree (None)."""
    count = Count()
    if ref is None:
        for package in PACKAGES:
            for path in sorted((ROOT / package).rglob("*.py")):
                count.add(path.read_text())
        return count
    for path in _git("ls-tree", "-r", "--name-only", ref, "--", *PACKAGES).split():
        if path.endswith(".py"):
            count.add(_git("show", f"{ref}:{path}"))
    return count


def landed_between(old: str, old_total: int, new: str) -> list[tuple[str, int, str]]:
    """(commit, lines it added or removed, subject) for each commit on main's first-parent line
    from `old` (`old_total` lines) to `new` that changed the count."""
    rows = []
    previous = old_total
    for line in _git("log", "--first-parent", "--reverse", "--format=%h %s",
                     f"{old}..{new}").splitlines():
        commit, subject = line.split(" ", 1)
        total = count_at(commit).total
        if total != previous:
            rows.append((commit, total - previous, subject))
        previous = total
    return rows


def _subject(text: str, width: int = 110) -> str:
    text = text.replace("|", "/")
    return text if len(text) <= width else text[: width - 1] + "…"


def section(filed: Count, begun: Count, now: Count,
            landed: list[tuple[str, int, str]]) -> str:
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    head = _git("log", "-1", "--format=%h", "--", *PACKAGES).strip()  # their last change
    dirty = " with uncommitted changes" if _git("status", "--porcelain", "--", *PACKAGES) else ""
    rows = [("lines", "total"), ("code", "code"), ("docstring", "docstring"),
            ("comment", "comment"), ("blank", "blank"), ("lines over 100 characters", "long_lines"),
            ("modules", "modules"), ("modules over 400 lines", "long_modules"),
            ("functions over 60 lines", "long_functions")]
    out = [SECTION, "",
           f"Measured {when} by `.venv/bin/python -m tests.benchmarks.line_count --write`; the "
           f"packages as of {head}{dirty}. Filed: {FILED}, main when issue 26 was filed. Begun: {BEGUN}, main "
           "just before the issue's first merge; issues 25, 27 and 29, filed at the same time, "
           "had landed by then (the commits below).", "",
           "| figure | filed | begun | this tree | ÷ filed | ÷ begun |",
           "| --- | --- | --- | --- | --- | --- |"]
    for label, name in rows:
        old, mid, new = (getattr(c, name) for c in (filed, begun, now))
        ratios = [f"{new / base:.2f}" if base else "" for base in (old, mid)]
        out.append(f"| {label} | {old:,} | {mid:,} | {new:,} | {ratios[0]} | {ratios[1]} |")
    verdicts = [f"{now.total / base.total:.1%} of {name} "
                f"({'met' if now.total <= TARGET * base.total else 'not met'})"
                for name, base in (("filed", filed), ("begun", begun))]
    out += ["", f"Target: at most {TARGET:.0%} of the lines, no feature lost: "
            f"{', '.join(verdicts)}.", "",
            f"What changed the count between filed and begun ({sum(d for _c, d, _s in landed):+,} "
            "lines):", "", "| commit | lines | subject |", "| --- | --- | --- |"]
    out += [f"| {commit} | {delta:+,} | {_subject(subject)} |" for commit, delta, subject in landed]
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true", help="update RESULTS.md")
    args = parser.parse_args()
    filed = count_at(FILED)
    text = section(filed, count_at(BEGUN), count_at(None),
                   landed_between(FILED, filed.total, BEGUN))
    print(text)
    if args.write:
        write_section(RESULTS, SECTION, text)


if __name__ == "__main__":
    main()
