#!/usr/bin/env bash
# The test suite's device-independent modules on a GPU (README, "On a GPU"): EAGLESPEC_TEST_DEVICE=cuda puts the
# tests' tiny models there. Also what ran on the lent GPU machines, which have no package index: wheels they lack
# (transformers at our tested version, gguf) are carried in .whl and installed first.
# Usage: bash benchmarks/tools/gpu_check.sh [pytest args]; the log goes to $OUT (or ./gpu-check).
set -uo pipefail
out=${OUT:-gpu-check}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -c "import eaglespec" 2>/dev/null || python3 -m pip install -q --no-deps --no-build-isolation -e . \
  || export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi -L
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, \
'cuda', torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else '')"
modules="tests/test_engine.py tests/test_sampling.py tests/test_target.py tests/test_tree.py
  tests/test_sps.py tests/test_lookup.py tests/test_heads.py tests/test_adaptive.py tests/test_fastpath.py
  tests/test_autotree.py tests/test_models.py tests/test_cli.py tests/test_bench.py tests/test_train.py"
extra=()
python3 -c "import xdist" 2>/dev/null && extra+=(-n "${WORKERS:-8}")  # pytest-xdist, where installed
python3 -c "import pytest_timeout" 2>/dev/null && extra+=(--timeout 300)
EAGLESPEC_TEST_DEVICE=${EAGLESPEC_TEST_DEVICE:-cuda} PYTHONUNBUFFERED=1 python3 -m pytest -q -p no:cacheprovider -rfE \
  -m "not real_model" "${extra[@]}" $modules "$@" 2>&1 | tee "$out/pytest.log"
