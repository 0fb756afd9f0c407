#!/bin/sh
# dlshare: Slurm TaskProlog that binds a task to the GPUs dlshare chose for it.
#
# `dlshare slurm` records its placement in the job's AdminComment as
#     dlshare NODE=IDX[,IDX...] [NODE=IDX...]
# (for example "dlshare n1=2" or "dlshare n3=0,1 n4=0,1").  On each node this prints
# `export CUDA_VISIBLE_DEVICES=...` (and DLSHARE_GPUS) for that node's indices; slurmstepd applies the
# exports to the task.  Jobs without such a comment are left as they are.
#
# Install: TaskProlog=/etc/slurm/dlshare-taskprolog.sh in slurm.conf (on every node of the partition).
[ -n "$SLURM_JOB_ID" ] || exit 0
node="${SLURMD_NODENAME:-$(hostname -s)}"
line=$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null | sed -n 's/^[[:space:]]*AdminComment=//p' | head -n 1)
set -- $line
[ "$1" = dlshare ] || exit 0
shift
for tok in "$@"; do
    case "$tok" in
        "$node="*)
            gpus="${tok#*=}"
            case "$gpus" in *[!0-9,]*|"") exit 0 ;; esac
            echo "export CUDA_VISIBLE_DEVICES=$gpus"
            echo "export DLSHARE_GPUS=$gpus"
            ;;
    esac
done
exit 0
