"""binder/: a CPU-only build (no CUDA downloads) that installs into a fresh venv and runs 00_quickstart.

The full install is slow (a fresh venv, torch from the local pin), so it is marked `slow`:

    .venv/bin/python -m pytest -q -m slow tests/test_binder.py
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BINDER = ROOT / "binder"


def _torch_pin() -> str:
    text = (ROOT / ".ci" / "constraints.txt").read_text()
    match = re.search(r"^torch==(\S+)", text, re.M)
    assert match, "constraints.txt pins torch"
    return match.group(1)


def test_binder_never_pulls_cuda_torch() -> None:
    requirements = (BINDER / "requirements.txt").read_text()
    lines = [ln.split("#")[0].strip() for ln in requirements.splitlines()]
    assert not [ln for ln in lines if ln.lower().startswith(("torch", "nvidia", "deepspeed"))]
    post_build = (BINDER / "postBuild").read_text()
    assert os.access(BINDER / "postBuild", os.X_OK)
    assert "download.pytorch.org/whl/cpu" in post_build
    assert f'"torch=={_torch_pin()}"' in post_build, "binder installs the same torch as CI"
    assert "-e ." in post_build


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_binder_files_install_into_fresh_venv_and_run_quickstart(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {**os.environ, "PATH": f"{venv / 'bin'}:{os.environ['PATH']}", "VIRTUAL_ENV": str(venv),
           "TORCH_INDEX_URL": "", "PIP_DISABLE_PIP_VERSION_CHECK": "1", "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)

    def sh(*cmd: str) -> str:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, f"{' '.join(cmd)}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        return proc.stdout

    py = str(venv / "bin" / "python")
    sh(py, "-m", "pip", "install", "--quiet", "-r", "binder/requirements.txt")
    sh("bash", "binder/postBuild")  # TORCH_INDEX_URL="": the local torch pin, never a CUDA build
    sh(py, "-m", "pip", "install", "--quiet", "nbclient", "nbformat")
    versions = sh(py, "-c", "import torch, nbdist; print(torch.__version__, torch.version.cuda, nbdist.__file__)")
    assert versions.startswith(_torch_pin()) and " None " in versions, versions
    out = sh(py, "-c", (
        "import nbformat, time; from nbclient import NotebookClient\n"
        "nb = nbformat.read('notebooks/00_quickstart.ipynb', as_version=4)\n"
        f"NotebookClient(nb, kernel_name='python3', timeout=240, resources={{'metadata': {{'path': {str(tmp_path)!r}}}}}).execute()\n"
        "print('kernel python', nb.metadata.get('language_info', {}).get('version'))\n"
        "print('\\n'.join(o.get('text', '') for c in nb.cells for o in c.get('outputs', [])))\n"
    ))
    assert "hello from rank 1 of 2" in out and "final loss" in out, out
