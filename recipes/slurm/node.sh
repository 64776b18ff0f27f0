#!/bin/bash
# One node of a multi-node distillation: node-local caches, then `accelerate launch` with this node's rank.
#   node.sh ACCELERATE_CONFIG -m distill RECIPE.yaml [key=value ...]
# Reads SLURM_NODEID and SLURM_NNODES (set by srun; set them by hand elsewhere), MASTER_ADDR, MASTER_PORT and
# GPUS_PER_NODE (default 8). The datasets cache and temporary files go to NODE_LOCAL_DIR (default
# /tmp/$USER/swiftkv: a local disk), unless HF_DATASETS_CACHE is set to a folder every node shares; either
# way the run looks and tokenizes once per folder (docs/distill.md, "Several nodes").
set -euo pipefail
CONFIG=$1
shift
LOCAL=${NODE_LOCAL_DIR:-/tmp/${USER:-$(id -un)}/swiftkv}
export HF_DATASETS_CACHE=${HF_DATASETS_CACHE:-$LOCAL/hf-datasets}
export TMPDIR=$LOCAL/tmp
mkdir -p "$HF_DATASETS_CACHE" "$TMPDIR"
GPUS=${GPUS_PER_NODE:-8}
exec "${PYTHON:-python}" -m accelerate.commands.launch --config_file "$CONFIG" \
    --num_machines "$SLURM_NNODES" --num_processes $((SLURM_NNODES * GPUS)) --machine_rank "$SLURM_NODEID" \
    --main_process_ip "$MASTER_ADDR" --main_process_port "$MASTER_PORT" "$@"
