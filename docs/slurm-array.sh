#!/usr/bin/env bash
# A Slurm job array over a study's job list: task i runs line i of the list, one run on one
# GPU. The list comes from study.sh --emit, which prepares the data first (the compute nodes
# need no network) and writes one command a line that runs from any directory:
#
#   bash study.sh --part table1 --device cuda --emit jobs.txt
#   sbatch --array=1-"$(wc -l < jobs.txt)"%16 docs/slurm-array.sh jobs.txt   # 16 at a time
#
# train.py saves a checkpoint and exits 75 on SIGTERM or SIGUSR1, in any phase; Slurm sends
# SIGUSR1 to this script 10 minutes before the time limit (--signal below), which passes it on
# (under torchrun to its workers: the task exits 75 too, with no traceback). Afterwards,
# the same study.sh --emit command writes a new list: finished runs left out, stopped ones
# with --resume; submit that. With --nproc N in the study, ask for N GPUs (--gres=gpu:N).
#SBATCH --job-name=dynpool
#SBATCH --gres=gpu:1
#SBATCH --cpus-per-task=8
#SBATCH --time=48:00:00
#SBATCH --signal=B:USR1@600
#SBATCH --output=slurm-%A_%a.out
set -u
jobs_file=${1:?usage: sbatch --array=1-N docs/slurm-array.sh JOBS_FILE}
line=$(sed -n "${SLURM_ARRAY_TASK_ID:?not in a Slurm job array}p" "$jobs_file")
[ -n "$line" ] || { echo "error: $jobs_file has no line $SLURM_ARRAY_TASK_ID" >&2; exit 2; }
echo "task $SLURM_ARRAY_TASK_ID: $line"
# The line is `cd DIR && COMMAND`: with exec, the process started is train.py's (or
# torchrun's launcher), which Slurm's signal must reach.
cmd=${line#* && }
to_stop=run
# torchrun itself ends with a traceback and exit 1 where a worker exits with anything but 0,
# 75 too, or where it is signalled: its launcher runs through this Python instead, which
# exits with the workers' own code, and the signal goes to the workers (they stop together).
export DYNPOOL_TORCHRUN='import sys
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run
try:
    run(parse_args(sys.argv[1:]))
except ChildFailedError as e:
    # a worker that torchrun ended once another had exited shows its signal, a code < 0
    codes = {failure.exitcode for failure in e.failures.values() if failure.exitcode > 0}
    sys.exit(codes.pop() if len(codes) == 1 else 1)'
case $cmd in
  torchrun\ *) cmd="python -c \"\$DYNPOOL_TORCHRUN\" ${cmd#torchrun }"; to_stop=workers ;;
esac
bash -c "${line%% && *} && exec $cmd" &
run=$!
# Slurm signals this shell only: pass it on as SIGTERM to train.py, or to torchrun's workers.
signalled=0
stop_run() {
  signalled=1
  if [ "$to_stop" = workers ]; then pkill -TERM -P "$run"; else kill -TERM "$run"; fi
}
trap stop_run USR1 TERM
wait "$run"
status=$?
# The signal cut the first wait short; the second waits for train.py to save and exit.
if [ "$signalled" = 1 ]; then
  wait "$run"
  status=$?
fi
exit "$status"
