"""Desync lint: collectives that only some ranks can reach, found in a cell's source before it is
sent. A collective under `if rank == 0:` with no matching one on the other path hangs every rank
that does call it; `%%distributed` prints the findings in one line (a warning, never a block)."""

from __future__ import annotations

import ast
from collections import Counter
from dataclasses import dataclass

COLLECTIVES = frozenset({
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all",
    "all_to_all_single", "barrier", "monitored_barrier", "broadcast", "broadcast_object_list",
    "gather", "gather_object", "reduce", "reduce_scatter", "reduce_scatter_tensor", "scatter",
    "scatter_object_list",
})
"""Calls every rank of the group must make (point-to-point send/recv are paired separately)."""

POINT_TO_POINT = {"send": "recv", "isend": "irecv", "recv": "send", "irecv": "isend"}
"""A send on one path is matched by a recv on the other (and the other way round)."""

RANK_NAMES = frozenset({"rank", "local_rank", "get_rank", "group_rank"})
"""Names whose appearance in an `if` test makes its branches rank-dependent."""


@dataclass(frozen=True)
class Finding:
    """One collective only some ranks reach: its cell line and what is wrong."""

    line: int
    message: str

    def __str__(self) -> str:
        return f"cell line {self.line}: {self.message}"


def lint(source: str) -> list[Finding]:
    """Findings for a cell's (or a script's) source; [] when it does not parse (the syntax
    check reports that) or every rank-dependent branch calls the same collectives."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    elifs = {id(n.orelse[0]) for n in ast.walk(tree)
             if isinstance(n, ast.If) and len(n.orelse) == 1 and isinstance(n.orelse[0], ast.If)}
    findings: list[Finding] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and id(node) not in elifs and _depends_on_rank(node.test):
            findings += _unmatched(_branches(node))
    findings += _unpaired(tree)
    return sorted(set(findings), key=lambda f: f.line)


def summary(findings: list[Finding]) -> str:
    """The one line `%%distributed` prints before dispatch."""
    shown = "; ".join(str(f) for f in findings[:3])
    more = f" (+{len(findings) - 3} more)" if len(findings) > 3 else ""
    return (f"nbdist lint: {shown}{more}. It runs anyway (--no-lint to silence); "
            "a rank that never joins leaves the others waiting until --timeout")


def _depends_on_rank(test: ast.expr) -> bool:
    for node in ast.walk(test):
        if isinstance(node, ast.Name) and node.id in RANK_NAMES:
            return True
        if isinstance(node, ast.Attribute) and node.attr in RANK_NAMES:
            return True
    return False


def _branches(node: ast.If) -> list[tuple[str, list[ast.stmt]]]:
    """The paths of an if/elif/else chain, each with the condition that leads there. A lone `if`
    has an implicit empty else (the other ranks); an elif chain without else is taken to cover
    every rank (`if rank == 0: ... elif rank == 1: ...` on two ranks)."""
    paths: list[tuple[str, list[ast.stmt]]] = []
    current: ast.If | None = node
    while current is not None:
        paths.append((f"where `{ast.unparse(current.test)}`", current.body))
        orelse = current.orelse
        if len(orelse) == 1 and isinstance(orelse[0], ast.If):
            current = orelse[0]
            continue
        if orelse or len(paths) == 1:
            paths.append(("on the other ranks' path", orelse))
        current = None
    return paths


def _unmatched(paths: list[tuple[str, list[ast.stmt]]]) -> list[Finding]:
    """Collectives one path calls more often than another path of the same chain."""
    calls = [(where, _calls(body)) for where, body in paths]
    counts = [Counter(name for name, _ in found if name in COLLECTIVES) for _, found in calls]
    findings = []
    for (where, found), mine in zip(calls, counts, strict=True):
        for name, line in found:
            if name in COLLECTIVES and any(other[name] < mine[name] for other in counts):
                findings.append(Finding(
                    line, f"{name}() runs only {where}: ranks on another path never call it "
                    "(a hang), unless they call it elsewhere"))
    return findings


def _unpaired(tree: ast.AST) -> list[Finding]:
    """Point-to-point calls with no partner anywhere in the cell (a send no rank receives)."""
    found = _calls([tree] if isinstance(tree, ast.stmt) else getattr(tree, "body", []))
    names = Counter(name for name, _ in found)
    return [
        Finding(line, f"{name}() with no {POINT_TO_POINT[name]}() anywhere in the cell")
        for name, line in found
        if name in POINT_TO_POINT and names[POINT_TO_POINT[name]] == 0
    ]


def _calls(statements: list[ast.stmt]) -> list[tuple[str, int]]:
    """(collective name, line) of every collective or point-to-point call in the statements."""
    found = []
    for statement in statements:
        for node in ast.walk(statement):
            if isinstance(node, ast.Call):
                name = _called_name(node.func)
                if name in COLLECTIVES or name in POINT_TO_POINT:
                    found.append((name, node.lineno))
    return found


def _called_name(func: ast.expr) -> str:
    if isinstance(func, ast.Attribute):
        return func.attr
    if isinstance(func, ast.Name):
        return func.id
    return ""
