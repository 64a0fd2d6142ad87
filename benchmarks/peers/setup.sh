#!/usr/bin/env bash
# Builds the peer virtual environments used by the side-by-side benchmarks.
#
#   bash benchmarks/peers/setup.sh            # both peers
#   bash benchmarks/peers/setup.sh trl        # TRL only
#   bash benchmarks/peers/setup.sh tunix      # Tunix only
#
# TRL:   $TRL_VENV   torch 2.13.0 (CPU wheel), trl 1.16.0, a transformers that trl accepts,
#        and peft (LoRA of the 135M DPO workload, `dpo135_lora`).
# Tunix: $TUNIX_VENV google-tunix 0.1.7 with the flax it pins.
# Defaults: $PEER_ROOT/venv-trl and $PEER_ROOT/venv-tunix, with PEER_ROOT defaulting to
# .venv-peers at the repository root (ignored by git), where
# benchmarks/side_by_side/driver.py looks for them when TRL_VENV / TUNIX_VENV are unset.
# Each venv also gets numpy and matplotlib (the plot script runs in the TRL venv).
# Logs go to <venv>-setup.log beside each venv.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
root="${PEER_ROOT:-$repo/.venv-peers}"
trl_venv="${TRL_VENV:-$root/venv-trl}"
tunix_venv="${TUNIX_VENV:-$root/venv-tunix}"
py="${PYTHON:-python3}"
which="${1:-all}"

setup_trl() {
  "$py" -m venv "$trl_venv"
  "$trl_venv/bin/pip" install -q --upgrade pip
  "$trl_venv/bin/pip" install torch==2.13.0 trl==1.16.0 "transformers>=4.56" peft numpy matplotlib psutil
  "$trl_venv/bin/python" -c "import torch, trl, transformers, peft; print('torch', torch.__version__, 'trl', trl.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
}

setup_tunix() {
  "$py" -m venv "$tunix_venv"
  "$tunix_venv/bin/pip" install -q --upgrade pip
  "$tunix_venv/bin/pip" install google-tunix==0.1.7 flax numpy psutil
  "$tunix_venv/bin/python" -c "import jax, flax, tunix; print('jax', jax.__version__, 'flax', flax.__version__, 'tunix ok')"
}

case "$which" in
  trl | tunix | all) mkdir -p "$(dirname "$trl_venv")" "$(dirname "$tunix_venv")" ;;
  *) echo "unknown peer '$which' (expected trl, tunix or all)" >&2; exit 2 ;;
esac
case "$which" in
  trl) setup_trl 2>&1 | tee "$trl_venv-setup.log" ;;
  tunix) setup_tunix 2>&1 | tee "$tunix_venv-setup.log" ;;
  all)
    setup_trl 2>&1 | tee "$trl_venv-setup.log"
    setup_tunix 2>&1 | tee "$tunix_venv-setup.log"
    ;;
esac
