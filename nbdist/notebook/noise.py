"""Third-party lines a learner cannot act on, each shown as one line that says what it means; the
rank's own record keeps the originals (`_dist_result.output(rank)`)."""

from __future__ import annotations

import re

_LIBAIO = re.compile(r"\bld\S*: cannot find -laio\b")
"""The linker, when DeepSpeed checks whether its async_io op could be built (it compiles and links
a test program against libaio): DeepSpeed means to hide the linker's stderr, but a rank's fd 2 is
not the one it redirects."""

_LINK_FAILED = "collect2: error: ld returned 1 exit status"

LIBAIO_NOTE = ("nbdist: DeepSpeed checked for libaio (its async_io op, used only to offload to "
               "NVMe) and the linker did not find it: harmless unless you offload to NVMe (then "
               "`apt-get install libaio-dev`); the linker's own lines: _dist_result.output(rank)")


class KnownNoise:
    """One stream's lines per rank, with each known noise replaced by its note (once per rank:
    DeepSpeed checks again for each engine it makes)."""

    def __init__(self) -> None:
        self._noted: set[int] = set()
        self._after_noise: set[int] = set()  # ranks whose last line was noise

    def filter(self, rank: int, lines: list[str]) -> list[str]:
        if rank not in self._after_noise and not any("-laio" in line for line in lines):
            return lines  # the usual case
        out = []
        for line in lines:
            if rank in self._after_noise:
                self._after_noise.discard(rank)
                if line.strip() == _LINK_FAILED:  # the linker's own last word on it
                    continue
            if _LIBAIO.search(line):
                self._after_noise.add(rank)
                if rank not in self._noted:
                    self._noted.add(rank)
                    out.append(LIBAIO_NOTE)
                continue
            out.append(line)
        return out
