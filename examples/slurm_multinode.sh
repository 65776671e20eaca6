#!/bin/bash
# Multi-node training on SLURM with torchrun's c10d rendezvous: one torchrun per node, one process per GPU.
#   sbatch examples/slurm_multinode.sh configs/gpt2-small.yaml
#SBATCH --job-name=llm-trainer
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --time=48:00:00
#SBATCH --signal=TERM@120          # SIGTERM two minutes before the time limit: a final checkpoint is saved
#SBATCH --requeue
set -euo pipefail
CONFIG=${1:?usage: sbatch examples/slurm_multinode.sh CONFIG [overrides...]}
shift
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
# --max-restarts: if a process dies, torchrun restarts the whole group, which resumes from the latest
# checkpoint (resume_from_checkpoint=latest starts fresh when there is none yet).
srun torchrun \
  --nnodes="$SLURM_NNODES" --nproc_per_node="$SLURM_GPUS_PER_NODE" \
  --rdzv_backend=c10d --rdzv_endpoint="$head_node:29500" --rdzv_id="$SLURM_JOB_ID" \
  --max-restarts=3 \
  -m llm_trainer train --config "$CONFIG" training.resume_from_checkpoint=latest "$@"
