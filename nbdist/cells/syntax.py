"""A cell's syntax, checked in the notebook before anything is sent: a typo that cannot even be
parsed is reported like a local SyntaxError, and no rank (nor its process group) sees it."""

from __future__ import annotations

import ast


def check_syntax(code: str) -> None:
    """Raise the cell's SyntaxError, as IPython would report it locally. IPython syntax (magics,
    `!cmd`, `x?`) is turned into Python first, exactly as the engines' IPython will."""
    try:
        from IPython.core.inputtransformer2 import TransformerManager
    except ImportError:  # pragma: no cover - IPython comes with ipykernel
        source = code
    else:
        try:
            source = TransformerManager().transform_cell(code)
        except SyntaxError:
            raise
        except Exception:  # a transformer that chokes: let the engines' IPython judge the cell
            return
    # top-level await is valid in a cell (IPython runs it), so it is valid here too
    compile(source, "<distributed cell>", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT,
            dont_inherit=True)
