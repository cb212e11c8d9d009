#!/usr/bin/env bash
# Install what the browser tests (-m browser; their shared pieces are in tests/browser.py)
# need: Debian chromium (apt) and the `browser` extra (jupyterlab, notebook 7, playwright's Python
# package). No browser download: the test points Playwright at
# /usr/bin/chromium. Run from the repository root with the venv active:  bash tests/browser_setup.sh
set -euo pipefail
start=$(date +%s)
if ! command -v chromium >/dev/null 2>&1; then
    # root in CI containers; sudo elsewhere
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null
fi
# keep the torch build that is already installed (CPU or CUDA)
torch_pin=$(python -c 'import torch; print("torch==" + torch.__version__)' 2>/dev/null || true)
if [ -n "$torch_pin" ]; then
    python -m pip install -q -c <(echo "$torch_pin") "jupyterlab>=4" "notebook>=7" "playwright>=1.45"
else
    python -m pip install -q "jupyterlab>=4" "notebook>=7" "playwright>=1.45"
fi
chromium --version
python -c 'import playwright, jupyterlab, notebook; print("playwright ok, jupyterlab", jupyterlab.__version__, "notebook", notebook.__version__)'
echo "browser setup took $(( $(date +%s) - start )) s"
