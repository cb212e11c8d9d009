"""`ProfileView`: the interactive profile timeline (anywidget; drawing in ``profile_view.js``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anywidget
import traitlets


class ProfileView(anywidget.AnyWidget):
    """One row per rank, zoomable; the data is sent once (``ProfileReport.view_data``)."""

    _esm = Path(__file__).parent / "profile_view.js"

    data = traitlets.Dict().tag(sync=True)

    def __init__(self, data: dict[str, Any], **kwargs: Any) -> None:
        super().__init__(data=data, **kwargs)

    def _repr_mimebundle_(self, **kwargs: Any) -> tuple[dict[str, Any], dict[str, Any]] | None:
        bundle = super()._repr_mimebundle_(**kwargs)
        if bundle is None:
            return None
        data, metadata = bundle
        # what a reader without the kernel sees for this output (the SVG is the output above)
        data = {**data, "text/plain": "nbdist profile view (interactive; needs the kernel; the "
                                      "static timeline above is what a saved notebook shows)"}
        return data, metadata
