#!/usr/bin/env bash
# The studies of dynpool: the paper's experiments as parts, each a grid of train.py runs
# over seeds, then report.py's tables (paired t-tests against vanilla and fixed pooling)
# and plots.
#
#   bash study.sh --part table2 --dry-run          # the plan and its cost, nothing run
#   bash study.sh --part table2 --steps 200 --jobs 2 -- --layers 2,4,2
#                                              # (flags after -- go to every train.py)
#   bash study.sh --part table1 --device cuda --dry-run   # the paper's Table 1 on GPUs
#   bash study.sh --part table1 --gpus 0,1,2,3     # one run per GPU at a time
#   bash study.sh --part table1 --device cuda --emit jobs.txt   # jobs for a scheduler
#
# Parts (runs shared between parts, e.g. vanilla at seed 1337, run once):
#   seeds      the seven sources on the text8 slice: none, fixed2, whitespace,
#              unigram (V=10000), entropy, gumbel (alpha 0.2), hnet
#   all        seeds and pareto
#   pareto     at --pareto-seeds: Unigram V = 200 500 1000 3000 5000 10000,
#              Gumbel alpha = 0.20 0.25 0.30 0.37 0.45, fixed k = 1 (vanilla) 2 3 4 5 6;
#              one panel per --langs (default text8: the slice; fi he vi: the shared
#              raw text of --raw-dir)
#   languages  --langs x --modes x --seeds, each pooled mode twice: at --steps (equal
#              steps) and at the FLOP budget of the vanilla run of the same shape
#              (<run>-flops)
#   table1     the paper's Table 1: text8, wiki40b en fi he vi, cc-100 en
#              (prepare_data.py downloads them) x none, fixed2 fixed3 fixed4, gumbel,
#              entropy, unigram, whitespace; the paper's recipe where --device is a GPU
#              (train.py's GPU preset), --steps 200000
#   table2     the paper's Table 2: fixed2, entropy, whitespace, each pooled by the
#              segment mean and by its last token (--pooling last, sub-sampling), on the
#              text8 slice
#   scaling    total layers (--scaling-layers, default 8 12 16 20), a row each:
#              2 + 2 outer layers and the shortened stage grown, for --modes (default
#              none whitespace)
#   (table2 and scaling with a GPU --device: the whole text8 and --steps 200000)
# Modes by name: none, fixedK (any K), whitespace, unigram, entropy, gumbel, hnet.
# The paper's settings per language: Unigram V = 10000 for English and Vietnamese, 200
# for Finnish and Hebrew; Gumbel alpha = 0.2, 0.37 for Finnish.
#
# Data first: each dataset of the part is prepared once (prepare_data.py) before any
# run; one whose meta.json exists is used as it is. Runs land in --out (default
# runs/study-<steps>), one folder each. A finished run (its log has a test evaluation)
# is skipped, one with a checkpoint is resumed, so the same command picks up where an
# interrupted study stopped. Keep the flags after -- the same for one --out.
# --jobs N runs N at a time, each with OMP_NUM_THREADS=1 (on a 2-core machine two
# one-thread runs train faster than one two-thread run after the other), each one's
# output in <out>/<run>.log.
# --gpus 0,1,2,3 runs one at a time on each GPU (CUDA_VISIBLE_DEVICES, --device cuda).
# --nproc N runs each under torchrun on N GPUs (with --gpus: N of the list each).
# --emit FILE prepares the data, then writes the runs left to do to FILE, one command a
# line that runs from any directory (for a scheduler: docs/slurm-array.sh), and exits.
# A run that train.py stopped to be resumed (exit 75: SIGTERM or SIGUSR1) is named at
# the end, and the study exits 75: run the same command again to resume it.
# At the end: report.py over the part's runs, the tables in <out>/<part>.md, the plots
# in <out>/<part>.png (languages, table1 and pareto: one of each per language too,
# <out>/<part>-<lang>.*).
# --dry-run prints every command that would run, data preparation first, each run with
# its FLOPs (dynpool.step_flops at the preset's shape; fixed k at SF k, the other
# sources at --assume-sf) and their cost: at the speed that bench.py --preset paper
# measured on this device (--bench FILE, default out/bench-paper.json), else for a GPU
# in GPU-hours at --mfu of --peak-tflops, labelled "assumed".
# Needs bash 5.1 or newer.
set -u

part=seeds
steps=
out=
seeds="1337 2 3"
pareto_seeds=1337
dry=0
jobs=1
gpus=
nproc=
emit=
device=cpu
# Paths are the user's, relative to the working directory; the project's own files are
# found beside this script, so it runs from anywhere.
here=$(cd "$(dirname "$0")" && pwd)
at=$here/
[ "$here" = "$PWD" ] && at=
input=${at}../shared/data/text8-head.txt
data_dir=${at}data
raw_dir=${at}../shared/data/raw
langs=
modes=
scaling_layers="8 12 16 20"
assume_sf=4.5
mfu=0.4
peak_tflops=989
bench=${at}out/bench-paper.json
die() { echo "error: $*" >&2; exit "${code:-1}"; }
while [ $# -gt 0 ]; do
  case $1 in
    # a flag with a value sets the variable of its name (- as _)
    --part|--steps|--out|--seeds|--pareto-seeds|--input|--data-dir|--raw-dir|--langs|--modes|\
    --scaling-layers|--device|--assume-sf|--mfu|--peak-tflops|--bench|--jobs|--gpus|--nproc|\
    --emit)
      flag=${1#--}
      printf -v "${flag//-/_}" %s "${2-}"
      shift ;;
    --dry-run) dry=1 ;;
    # the usage: the comment at the top
    -h|--help) sed -n '2,/^set -u/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    --) shift; break ;;
    *) code=2 die "unknown flag $1 (train.py flags go after --)" ;;
  esac
  shift
done
train_flags=("$@")
[ -n "$gpus" ] && device=cuda
# On a GPU, table2 and scaling run at the paper's scale too: the whole text8, 200k steps.
paper_scale=0
[[ $device == cuda* && $part =~ ^(table2|scaling)$ ]] && paper_scale=1
[ $paper_scale = 1 ] && steps=${steps:-200000}
# Each part's languages and modes (and table1's steps) where the flags leave them open.
case $part in
  seeds|pareto|all) ;;
  languages)
    langs=${langs:-text8 fi he vi}
    modes=${modes:-none fixed2 whitespace unigram entropy gumbel hnet} ;;
  table1)
    steps=${steps:-200000}
    langs=${langs:-text8 wiki40b-en wiki40b-fi wiki40b-he wiki40b-vi cc100-en}
    modes=${modes:-none fixed2 fixed3 fixed4 gumbel entropy unigram whitespace} ;;
  table2) modes=${modes:-fixed2 entropy whitespace} ;;
  scaling) modes=${modes:-none whitespace} ;;
  *) code=2 die "--part must be seeds, pareto, all, languages, table1, table2" \
                "or scaling, not '$part'" ;;
esac
steps=${steps:-1000}
langs=${langs:-text8}
for flag in steps jobs nproc; do
  [[ ${!flag:-1} =~ ^[1-9][0-9]*$ ]] ||
    code=2 die "--$flag must be a positive whole number, not '${!flag}'"
done
for flag in assume_sf mfu peak_tflops; do
  [[ ${!flag} =~ ^[0-9]*\.?[0-9]+$ && ! ${!flag} =~ ^[0.]+$ ]] ||
    code=2 die "--${flag//_/-} must be a positive number, not '${!flag}'"
done
per_run=${nproc:-1}
[[ $gpus =~ ^([0-9]+(,[0-9]+)*)?$ ]] || code=2 die "--gpus must be ids like 0,1,2,3"
for n in $scaling_layers; do
  [[ $n =~ ^[0-9]+$ && $n -ge 5 ]] || code=2 die "--scaling-layers are totals >= 5, not '$n'"
done
# Where runs go, one run a slot at a time: a GPU (or --nproc of them), or a CPU job.
slots=()
cpu_env=
[ "$jobs" -gt 1 ] && cpu_env=OMP_NUM_THREADS=1
if [ -n "$gpus" ]; then
  IFS=, read -ra ids <<< "$gpus"
  [ $((${#ids[@]} % per_run)) = 0 ] || code=2 die "--gpus $gpus do not split into --nproc $nproc"
  for ((i = 0; i < ${#ids[@]}; i += per_run)); do
    slots+=("CUDA_VISIBLE_DEVICES=$(IFS=,; echo "${ids[*]:i:per_run}")")
  done
else
  for ((i = 0; i < jobs; i++)); do
    slots+=("$cpu_env")
  done
fi
[ -n "$seeds$pareto_seeds" ] || code=2 die "no seeds given"
out=${out:-${at}runs/study-$steps}

# train.py flags of a mode by name (fixedK: any k); $1 the mode, $2 the language (for
# Gumbel's prior). Any other name is a --boundary, which train.py's parser checks below,
# before anything runs.
mode_flags() {
  case $1 in
    fixed[0-9]*) echo "--boundary fixed --fixed-factor ${1#fixed}" ;;
    gumbel)
      local a=0.20
      [[ $2 == *fi ]] && a=0.37
      echo "--boundary gumbel --prior $a" ;;
    *) echo "--boundary $1" ;;
  esac
}
# The dataset of a language: the text8 slice with Unigram V=10000 labels (at the paper's
# scale the whole text8), else its own name.
dataset() {
  if [ "$1" != text8 ]; then
    echo "$1${2:+-u$2}"
  elif [ $paper_scale = 1 ]; then
    echo text8
  else
    echo "text8-head-u${2:-10000}"
  fi
}
# The plan: one line per run, "name data train.py-flags", names unique per experiment;
# add gives a run the seed $s of the loop it is in.
plan=()
add() {
  local p
  for p in "${plan[@]}"; do
    [ "${p%% *}" = "$1" ] && return
  done
  plan+=("$* --seed $s")
}
for s in $seeds; do
  case $part in
    # names as the pareto part's, so the runs both parts have run once
    seeds|all)
      for m in none fixed2 whitespace unigram-u10000 entropy gumbel-a0.20 hnet; do
        add "$m-s$s" "$(dataset text8)" $(mode_flags ${m%%-*} text8)
      done ;;
    languages|table1)
      for l in $langs; do
        d=$(dataset "$l")
        [ "$part" = table1 ] && d=$l
        for m in $modes; do
          add "$l-$m-s$s" "$d" $(mode_flags "$m" "$l")
          [[ $part == languages && $m != none ]] && add "$l-$m-flops-s$s" "$d" \
            $(mode_flags "$m" "$l") --flop-budget "vanilla:$steps"
        done
      done ;;
    table2)
      for m in $modes; do
        for pool in mean last; do
          add "$m-$pool-s$s" "$(dataset text8)" $(mode_flags $m text8) --pooling $pool
        done
      done ;;
    scaling)
      for n in $scaling_layers; do
        for m in $modes; do
          add "$m-l$n-s$s" "$(dataset text8)" $(mode_flags $m text8) \
            --layers "2,$((n - 4)),2"
        done
      done ;;
  esac
done
if [[ $part =~ ^(pareto|all)$ ]]; then
  for s in $pareto_seeds; do
    for l in $langs; do
      # the text8 slice's runs keep their names of part seeds
      r=$l-
      [ "$l" = text8 ] && r=
      for v in 200 500 1000 3000 5000 10000; do
        add "${r}unigram-u$v-s$s" "$(dataset "$l" $v)" --boundary unigram
      done
      for a in 0.20 0.25 0.30 0.37 0.45; do
        add "${r}gumbel-a$a-s$s" "$(dataset "$l")" --boundary gumbel --prior $a
      done
      # fixed k = 1 is vanilla
      add "${r}none-s$s" "$(dataset "$l")" --boundary none
      for k in 2 3 4 5 6; do
        add "${r}fixed$k-s$s" "$(dataset "$l")" $(mode_flags fixed$k "$l")
      done
    done
  done
fi

finished() { grep -q '"split": "test"' "$1/log.jsonl" 2>/dev/null; }
# The datasets of the plan, each once, in the order the runs need them.
datasets=()
for p in "${plan[@]}"; do
  rest=${p#* }
  [[ " ${datasets[*]} " == *" ${rest%% *} "* ]] || datasets+=("${rest%% *}")
done
# A command as the shell reads it: a word with other than these characters in single
# quotes (printf %q would also escape the commas of --layers 2,4,2).
plain='^[-A-Za-z0-9_./:=,@%+]+$'
quoted() {
  local word line=
  for word in "$@"; do
    [[ $word =~ $plain ]] || word="'${word//\'/\'\\\'\'}'"
    line+=" $word"
  done
  echo "${line# }"
}
# prepare_data.py's command for a dataset ($1: its name), in cmd. One dataset per Unigram
# size (name-uV): the same text, only the boundary labels differ.
prep_cmd() {
  local name=$1 lang=${1%%-u*} v=${1##*-u}
  # without -uV the paper's V: 200 for Finnish and Hebrew, else 10000
  if [ "$v" = "$name" ]; then
    v=10000
    [[ $name =~ (fi|he)$ ]] && v=200
  fi
  case $name in
    text8-head-u*) cmd=(--input "$input" --dataset text8) ;;
    # the whole text8, downloaded
    text8) cmd=(--dataset text8) ;;
    wiki40b-*|cc100-*) cmd=(--dataset "${name%%-*}" --lang "${name#*-}") ;;
    *) cmd=(--input "$raw_dir/$lang.txt" --lang "$lang") ;;
  esac
  cmd=(python "${at}prepare_data.py" "${cmd[@]}" --unigram "$v" --out-dir "$data_dir"
       --name "$name")
}
# train.py's command for a plan entry ($@: run, dataset, flags), in cmd: both --dry-run
# and the runner use it, so what is printed is what runs.
train_cmd() {
  local run=$1 data=$2
  shift 2
  cmd=(python "${at}train.py")
  [ -n "$nproc" ] && cmd=(torchrun --standalone "--nproc_per_node=$nproc" "${at}train.py")
  cmd+=(--data "$data_dir/$data" "$@" --device "$device")
  # a run with a FLOP budget ends there, not at --max-steps
  [[ " $* " == *" --flop-budget "* ]] || cmd+=(--max-steps "$steps")
  cmd+=(--out "$out/$run")
  [ -f "$out/$run/ckpt.pt" ] && cmd+=(--resume)
  cmd+=("${train_flags[@]}")
}
# The study in one line: its runs, and how many are done.
header() {
  local p n=${#plan[@]} n_done=0 n_resume=0
  for p in "${plan[@]}"; do
    if finished "$out/${p%% *}"; then
      ((++n_done))
    elif [ -f "$out/${p%% *}/ckpt.pt" ]; then
      ((++n_resume))
    fi
  done
  echo "# study: part $part, $n runs x $steps steps in $out: $n_done finished," \
       "$n_resume to resume, $((n - n_done - n_resume)) to start"
}
# Every command of the study in order, data first; what is done already as a comment.
commands() {
  local p
  header
  for name in "${datasets[@]}"; do
    if [ -f "$data_dir/$name/meta.json" ]; then
      echo "# $data_dir/$name: prepared, used as it is"
    else
      prep_cmd "$name"
      quoted "${cmd[@]}"
    fi
  done
  for p in "${plan[@]}"; do
    if finished "$out/${p%% *}"; then
      echo "# $out/${p%% *}: finished, skipped"
    else
      # shellcheck disable=SC2086  # an entry is a list of words
      train_cmd $p
      quoted "${cmd[@]}"
    fi
  done
}
# Reads the commands: checks every train.py command with train.py's own parser (exit 2,
# one line) and counts its FLOPs; with --dry-run prints them all, the total and its cost.
plan_py=$(cat <<'PY'
import json
import shlex
import sys

import torch

import common
import presets
from dynpool import step_flops


def run_flops(argv, preset, assume_sf):
    # the FLOPs of one train.py command at its preset's shape
    args = presets.parser().parse_args(argv)
    given = {k: v for k, v in vars(args).items() if v is not None}
    a = {**preset, **given}
    cfg = presets.config_from_dict(a, vocab_size=27, whitespace_id=0)
    # the budget, not the steps, ends such a run
    if args.flop_budget:
        return presets.budget_flops(args.flop_budget, cfg, a['batch_size'], a['seq_len'])
    sf = {'none': 1, 'fixed': cfg.fixed_factor}.get(cfg.boundary, assume_sf)
    kept = 1 + a['seq_len'] / sf
    return a['max_steps'] * step_flops(cfg, a['batch_size'], a['seq_len'], kept)


def cost(total, device, mfu, peak, bench):
    # what the FLOPs cost: at bench.py's measured speed on this device, else assumed
    name = None
    if device.startswith('cuda') and torch.cuda.is_available():
        name = torch.cuda.get_device_name(device)
    elif device == 'cpu':
        name = f'CPU, {torch.get_num_threads()} threads'
    try:
        with open(bench) as f:
            measured = json.load(f).get(name) or {}
    except (OSError, ValueError, AttributeError):
        measured = {}
    speed = measured.get('flops_per_s')
    if speed:
        hours = total / speed / 3600
        return (f'; about {hours:,.1f} hours on {name} at {speed:.3g} FLOP/s (measured '
                f"{measured.get('date')})")
    if not device.startswith('cuda'):
        return ''
    hours = total / (mfu * peak * 1e12) / 3600
    return f'; about {hours:,.0f} GPU-hours at {mfu:.0%} MFU of {peak:g} TFLOP/s (assumed)'


def plan():
    dry = sys.argv[1] == '1'
    device = sys.argv[2]
    assume_sf = float(sys.argv[3])
    mfu = float(sys.argv[4])
    peak = float(sys.argv[5])
    preset = presets.CPU_PRESET
    if device.startswith('cuda'):
        preset = presets.GPU_PRESET
    said = []
    total = 0
    for line in sys.stdin.read().splitlines():
        words = shlex.split(line, comments=True)
        script = [w.endswith('train.py') for w in words]
        if any(script):
            flops = run_flops(words[script.index(True) + 1:], preset, assume_sf)
            total += flops
            line = f'{line}    # {flops:.2e} FLOPs'
        said.append(line)
    if dry:
        print('\n'.join(said))
        print(f'total: {total:.2e} FLOPs' + cost(total, device, mfu, peak, sys.argv[6]))


sys.exit(common.main(plan))
PY
)
# The check (and with --dry-run, the plan) before anything is prepared or run; train.py's
# modules are read from this script's folder.
command -v python >/dev/null || die "python is not on PATH"
export PYTHONPATH=$here${PYTHONPATH:+:$PYTHONPATH}
# shellcheck disable=SC2086  # an empty $cpu_env is no word
commands | env $cpu_env python -c "$plan_py" "$dry" "$device" "$assume_sf" "$mfu" \
  "$peak_tflops" "$bench" || exit
[ $dry = 1 ] && exit 0
header

# Ctrl-C (exit 130) or SIGTERM (exit 75, as train.py: stopped to be resumed).
interrupted() {
  # background runs ignore SIGINT (bash starts them so): stop them, train.py saves first
  trap '' INT TERM
  for pid in $(jobs -rp); do
    pkill -TERM -P "$pid" 2>/dev/null
  done
  wait
  code=$1 die "interrupted; run the same command to resume"
}
trap 'interrupted 130' INT
trap 'interrupted 75' TERM

for name in "${datasets[@]}"; do
  [ -f "$data_dir/$name/meta.json" ] && continue
  prep_cmd "$name"
  echo "preparing $data_dir/$name: $(quoted "${cmd[@]}")"
  # prepare_data.py says what went wrong, in its one error line
  "${cmd[@]}" || exit
done

mkdir -p "$out" || die "cannot make $out"
if [ -n "$emit" ]; then
  for p in "${plan[@]}"; do
    finished "$out/${p%% *}" && continue
    # shellcheck disable=SC2086  # an entry is a list of words
    train_cmd $p
    echo "cd $(quoted "$PWD") && $(quoted "${cmd[@]}")"
  done > "$emit.tmp" && mv "$emit.tmp" "$emit" || die "cannot write $emit"
  echo "$(wc -l < "$emit") runs in $emit"
  exit 0
fi

# One run in the background in its slot; with several slots, its output in
# <out>/<run>.log. Its end is recorded as a file (a background job cannot append to a
# list): failed, or stopped to be resumed (train.py's exit 75).
start() {
  local run=$1 slot=$2
  [ ${#slots[@]} -gt 1 ] && exec > "$out/$run.log" 2>&1
  # shellcheck disable=SC2086  # an empty slot is no word
  env $slot "${cmd[@]}"
  case $? in
    0) ;;
    75) touch "$out/.stopped-$run" ;;
    *) touch "$out/.failed-$run" ;;
  esac
}
rm -f "$out"/.failed-* "$out"/.stopped-*
declare -A slot_of
free=("${slots[@]}")
for p in "${plan[@]}"; do
  run=${p%% *}
  if finished "$out/$run"; then
    echo "== $run: finished, skipped"
    continue
  fi
  if [ ${#free[@]} = 0 ]; then
    wait -n -p done_pid
    free+=("${slot_of[$done_pid]}")
  fi
  slot=${free[0]}
  free=("${free[@]:1}")
  # shellcheck disable=SC2086  # an entry is a list of words
  train_cmd $p
  log=
  [ ${#slots[@]} -gt 1 ] && log=" (output in $out/$run.log)"
  echo "== $run: ${slot:+$slot }$(quoted "${cmd[@]}")$log"
  start "$run" "$slot" &
  slot_of[$!]=$slot
done
wait
shopt -s nullglob
failed=("$out"/.failed-*)
stopped=("$out"/.stopped-*)
rm -f "${failed[@]}" "${stopped[@]}"
failed=("${failed[@]##*/.failed-}")
stopped=("${stopped[@]##*/.stopped-}")

# report.py's Markdown (its flags after the name) in <out>/<name>.md, written whole or
# not at all.
write_md() {
  local md=$out/$1.md
  shift
  if python "${at}report.py" "$@" --markdown > "$md.tmp"; then
    mv "$md.tmp" "$md" && echo "tables: $md"
  else
    rm -f "$md.tmp"
    failed+=(report.py)
  fi
}
# report.py over some of the runs: the tables printed, and as Markdown in <out>/<name>.md
# with the plots in <out>/<name>.png.
report() {
  local name=$1
  shift
  if python "${at}report.py" "$@"; then
    write_md "$name" "$@" --plot "$out/$name.png"
  else
    failed+=(report.py)
  fi
}
dirs=()
for p in "${plan[@]}"; do
  [ -f "$out/${p%% *}/log.jsonl" ] && dirs+=("$out/${p%% *}")
done
if [[ $part =~ ^(languages|table1)$ || ( $part == pareto && $langs != text8 ) ]]; then
  # one table and one plot per language, then all side by side
  for l in $langs; do
    ldirs=()
    # a run's language is its name's prefix; none: the text8 slice
    for d in "${dirs[@]}"; do
      r=${d##*/}
      r=${r%%-*}
      [[ " $langs " == *" $r "* ]] || r=text8
      [ "$r" = "$l" ] && ldirs+=("$d")
    done
    ((${#ldirs[@]})) && report "$part-$l" "${ldirs[@]}"
  done
  # all of them: the last table has a column per language, the plot a panel each
  ((${#dirs[@]})) && write_md "$part" "${dirs[@]}" --by-data --plot-sf "$out/$part.png"
elif ((${#dirs[@]})); then
  report "$part" "${dirs[@]}"
fi
# A failure first; runs stopped to be resumed are no failure, but the study is unfinished.
((${#failed[@]})) && die "failed: ${failed[*]}" \
  "${stopped[*]:+(stopped to be resumed: ${stopped[*]}) }(see <run>.log in $out); run the" \
  "same command to retry"
if ((${#stopped[@]})); then
  code=75 die "stopped to be resumed: ${stopped[*]}; run the same command again"
fi
