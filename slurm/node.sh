#!/bin/bash
# One node of slurm/pretrain.sbatch (run by srun, one task per node): torchrun with c10d rendezvous,
# GPUS_PER_NODE training processes, and SIGUSR1/SIGTERM relayed to them.
# Arguments: the flags for scripts/pretrain_llama.py. Environment: NNODES, GPUS_PER_NODE, MASTER_ADDR,
# MASTER_PORT (set by the sbatch script), SLURM_JOB_ID and SLURM_NODEID (set by Slurm).
#
# Why a wrapper: torchrun (torch.distributed.elastic) handles SIGTERM/SIGINT/SIGHUP/SIGQUIT only, so
# SIGUSR1 would kill it with the training processes still running; and on SIGTERM it kills them with
# SIGKILL after TORCH_ELASTIC_SHUTDOWN_TIMEOUT (30 s), maybe mid-checkpoint. So torchrun is started with
# SIGUSR1 ignored, and this script sends the signal to torchrun's children, the training processes,
# which save a checkpoint and exit (scripts/pretrain_llama.py stops on SIGTERM, SIGINT and SIGUSR1).
# c10d assigns node ranks at the rendezvous (torchrun's --node-rank only applies to the static backend);
# SLURM_NODEID below is Slurm's index of this node.
set -euo pipefail
: "${NNODES:?}" "${GPUS_PER_NODE:?}" "${MASTER_ADDR:?}" "${MASTER_PORT:?}" "${SLURM_JOB_ID:?}" "${SLURM_NODEID:?}"

torchrun_args=(
    --nnodes "$NNODES"
    --nproc-per-node "$GPUS_PER_NODE"
    --rdzv-backend c10d
    --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT"
    --rdzv-id "$SLURM_JOB_ID"
    --max-restarts 0
)

wait_for() {  # wait for PID $1 although trapped signals arrive meanwhile; return its exit status
    # Poll, and call `wait` only once the process has ended: a trapped signal that interrupts `wait` just as the
    # child exits can make bash lose the child's status (bash 5.2: `wait` then returned -1, exit 255, or the
    # interruption's 138; the dry run's CI flake of 2026-11-27). A trap runs after the poll's sleep, within
    # WAIT_POLL_S.
    while kill -0 "$1" 2>/dev/null; do sleep "$WAIT_POLL_S" || true; done
    wait "$1"   # the child has ended: bash returns the status it kept
}
WAIT_POLL_S=0.5
relay() {  # $1 = signal name
    echo "agoq node ${SLURM_NODEID} (${SLURMD_NODENAME:-$(hostname)}): relaying SIG$1 to the training processes"
    if command -v pkill >/dev/null; then
        pkill -"$1" -P "$TORCHRUN_PID" || true
    else  # no procps: the kernel's list of torchrun's children
        local file kids=() some
        for file in /proc/"$TORCHRUN_PID"/task/*/children; do
            some=()
            [[ -r "$file" ]] && { read -r -a some < "$file" || true; }  # no trailing newline: read says 1
            kids+=("${some[@]}")
        done
        (( ${#kids[@]} == 0 )) || kill -s "$1" "${kids[@]}" 2>/dev/null || true
    fi
}

trap '' USR1   # inherited by torchrun: it must survive SIGUSR1 (training processes install their own handler)
torchrun "${torchrun_args[@]}" scripts/pretrain_llama.py "$@" &
TORCHRUN_PID=$!
trap 'relay USR1' USR1
trap 'relay TERM' TERM
wait_for "$TORCHRUN_PID" && rc=0 || rc=$?
exit "$rc"
