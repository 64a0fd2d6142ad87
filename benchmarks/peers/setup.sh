#!/usr/bin/env bash
# Builds the peer virtual environments used by the side-by-side benchmarks.
#
#   bash benchmarks/peers/setup.sh            # both peers
#   bash benchmarks/peers/setup.sh trl        # TRL only
#   bash benchmarks/peers/setup.sh tunix      # Tunix only
#
# TRL:   /work/venv-trl   torch 2.13.0 (CPU wheel), trl 1.16.0, a transformers that trl accepts.
# Tunix: /work/venv-tunix google-tunix 0.1.7 with the flax it pins.
# Each venv also gets numpy and matplotlib (the plot script runs in venv-trl).
# Logs go to $PEER_ROOT/venv-<peer>-setup.log.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="${PEER_ROOT:-/work}"
py="${PYTHON:-python3}"
which="${1:-all}"

setup_trl() {
  "$py" -m venv "$root/venv-trl"
  "$root/venv-trl/bin/pip" install -q --upgrade pip
  "$root/venv-trl/bin/pip" install torch==2.13.0 trl==1.16.0 "transformers>=4.56" numpy matplotlib psutil
  "$root/venv-trl/bin/python" -c "import torch, trl, transformers; print('torch', torch.__version__, 'trl', trl.__version__, 'transformers', transformers.__version__)"
}

setup_tunix() {
  "$py" -m venv "$root/venv-tunix"
  "$root/venv-tunix/bin/pip" install -q --upgrade pip
  "$root/venv-tunix/bin/pip" install google-tunix==0.1.7 flax numpy psutil
  "$root/venv-tunix/bin/python" -c "import jax, flax, tunix; print('jax', jax.__version__, 'flax', flax.__version__, 'tunix ok')"
}

case "$which" in
  trl) setup_trl 2>&1 | tee "$root/venv-trl-setup.log" ;;
  tunix) setup_tunix 2>&1 | tee "$root/venv-tunix-setup.log" ;;
  all)
    setup_trl 2>&1 | tee "$root/venv-trl-setup.log"
    setup_tunix 2>&1 | tee "$root/venv-tunix-setup.log"
    ;;
  *) echo "unknown peer '$which' (expected trl, tunix or all)" >&2; exit 2 ;;
esac
