#!/bin/bash
# Submit an agoq pretraining job, or print its exact per-node commands without submitting anything.
#
#   NNODES=2 GPUS_PER_NODE=8 CONFIG=configs/model/llama3-8b.yaml SAVE_DIR=/shared/ckpt/8b \
#   DATA_PATH=/shared/data/mydata TOKENIZER=/shared/data/tokenizer.model slurm/launch.sh [sbatch options]
#
#   slurm/launch.sh --dry-run [--nodelist 'gpu[01-02]'] [--simulate-signal step|task]
#       runs slurm/pretrain.sbatch under a fake Slurm (scripts/slurm_dryrun.py) and prints the srun
#       command and, for every node, the torchrun command with its environment. No Slurm needed.
#
# Environment: see the header of slurm/pretrain.sbatch. NNODES (default 2) and GPUS_PER_NODE
# (default 8) become sbatch's --nodes and --gpus-per-node; everything else is passed to the job by
# sbatch's default --export=ALL. Extra arguments go to sbatch (e.g. --partition=gpu --time=12:00:00
# --account=myproj), or to the dry run after --dry-run.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export NNODES="${NNODES:-2}"
export GPUS_PER_NODE="${GPUS_PER_NODE:-8}"

if [[ "${1:-}" == "--dry-run" ]]; then
    shift
    exec "${PYTHON:-python}" scripts/slurm_dryrun.py --nodes "$NNODES" --gpus-per-node "$GPUS_PER_NODE" "$@"
fi

: "${CONFIG:?set CONFIG=configs/model/<model>.yaml}"
: "${SAVE_DIR:?set SAVE_DIR=<checkpoint directory on a filesystem every node sees>}"
mkdir -p logs   # sbatch --output=logs/%x-%j.out: Slurm does not create the directory
exec sbatch --nodes="$NNODES" --gpus-per-node="$GPUS_PER_NODE" --export=ALL "$@" slurm/pretrain.sbatch
