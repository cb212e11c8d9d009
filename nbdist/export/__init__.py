"""Notebook to torchrun script: the %%distributed cells and pushed values of a session or a saved
notebook, written as one script that runs the same under torchrun."""

from nbdist.export.script import *  # noqa: F401,F403
