#!/usr/bin/env bash
# The CPU study of dynpool: every mode over seeds, and the Pareto front, on the shared
# text8 slice at train.py's CPU preset, then report.py's tables and plots.
#
#   bash study.sh --dry-run                      # the plan and its cost, nothing run
#   bash study.sh                                # both parts, 1000 steps a run
#   bash study.sh --part seeds --steps 2000      # one part, another budget
#   bash study.sh --steps 3 -- --d-model 32 --layers 1,1,1   # flags after -- go to every train.py
#   bash study.sh --part pareto --jobs 2         # two runs at a time, one thread each
#
# Parts (the runs they share, e.g. vanilla and fixed k=2 at seed 1337, run once):
#   seeds   all seven modes x --seeds (1337 2): none, fixed k=2, whitespace, unigram (V=10000),
#           entropy, gumbel (alpha 0.2), hnet
#   pareto  at --pareto-seeds (1337): Unigram V = 200 500 1000 3000 5000 10000 (one dataset each),
#           Gumbel prior alpha = 0.20 0.25 0.30 0.37 0.45, fixed k = 1 (vanilla) 2 3 4 5 6
#   languages  --langs (text8 fi he vi) x --modes x --seeds, each pooled mode twice: at --steps
#           (equal steps) and at the FLOP budget of the vanilla run of the same shape (equal
#           compute, <run>-flops); text8 is the shared slice, fi/he/vi the shared raw text
#           (--raw-dir), prepared with the paper's cleaning; Gumbel's prior 0.37 for Finnish
# Runs land in --out (default runs/study-<steps>), one folder each. A finished run (its log has a
# test evaluation) is skipped, one with a checkpoint is resumed, so the same command picks up
# where an interrupted study stopped. Keep the flags after -- the same for one --out.
# --jobs N runs N at a time, each with OMP_NUM_THREADS=1 (on a 2-core machine two one-thread runs
# train faster than one two-thread run after the other); its output goes to <out>/<run>.log.
# At the end: report.py over the part's runs, the tables in <out>/<part>.md, the plots in
# <out>/<part>.png (languages: one of each per language, <out>/languages-<lang>.md and .png, and
# <out>/languages.md ending in a table with a column per language, <out>/languages.png a panel each).
set -u

part=all steps=1000 out= seeds="1337 2" pareto_seeds=1337 dry=0 jobs=1
input=../shared/data/text8-head.txt data_dir=data raw_dir=../shared/data/raw
langs="text8 fi he vi" modes="none fixed2 whitespace unigram entropy gumbel hnet"
die() { echo "error: $*" >&2; exit "${code:-1}"; }
usage() { sed -n '2,/^set -u/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case $1 in
    --part) part=${2-}; shift ;;
    --steps) steps=${2-}; shift ;;
    --out) out=${2-}; shift ;;
    --seeds) seeds=${2-}; shift ;;
    --pareto-seeds) pareto_seeds=${2-}; shift ;;
    --input) input=${2-}; shift ;;
    --data-dir) data_dir=${2-}; shift ;;
    --raw-dir) raw_dir=${2-}; shift ;;
    --langs) langs=${2-}; shift ;;
    --modes) modes=${2-}; shift ;;
    --jobs) jobs=${2-}; shift ;;
    --dry-run) dry=1 ;;
    -h|--help) usage; exit 0 ;;
    --) shift; break ;;
    *) code=2 die "unknown flag $1 (see bash study.sh --help; train.py flags go after --)" ;;
  esac
  shift
done
train_flags=("$@")
case $part in
  seeds|pareto|all|languages) ;;
  *) code=2 die "--part must be seeds, pareto, languages or all, not '$part'" ;;
esac
[[ $steps =~ ^[1-9][0-9]*$ ]] || code=2 die "--steps must be a positive whole number, not '$steps'"
[[ $jobs =~ ^[1-9][0-9]*$ ]] || code=2 die "--jobs must be a positive whole number, not '$jobs'"
for s in $seeds $pareto_seeds; do
  [[ $s =~ ^[0-9]+$ ]] || code=2 die "seeds must be whole numbers separated by spaces, not '$s'"
done
[ -n "$seeds$pareto_seeds" ] || code=2 die "no seeds given"
out=${out:-runs/study-$steps}

# The plan: one line per run, "name data train.py-flags", names unique per experiment.
plan=()
add() { local n=$1; for p in "${plan[@]}"; do [ "${p%% *}" = "$n" ] && return; done; plan+=("$*"); }
if [ "$part" = languages ]; then
  for s in $seeds; do
    for l in $langs; do
      for m in $modes; do
        case $m in
          fixed2) f="--boundary fixed --fixed-factor 2" ;;
          unigram) f="--boundary unigram" ;;
          gumbel) a=0.20; [ "$l" = fi ] && a=0.37; f="--boundary gumbel --prior $a" ;;
          *) f="--boundary $m" ;;
        esac
        add "$l-$m-s$s" "$l" $f --seed "$s"
        [ "$m" = none ] || add "$l-$m-flops-s$s" "$l" $f --seed "$s" --flop-budget "vanilla:$steps"
      done
    done
  done
elif [ "$part" != pareto ]; then
  for s in $seeds; do
    add none-s$s          text8-head-u10000 --boundary none --seed $s
    add fixed2-s$s        text8-head-u10000 --boundary fixed --fixed-factor 2 --seed $s
    add whitespace-s$s    text8-head-u10000 --boundary whitespace --seed $s
    add unigram-u10000-s$s text8-head-u10000 --boundary unigram --seed $s
    add entropy-s$s       text8-head-u10000 --boundary entropy --seed $s
    add gumbel-a0.20-s$s  text8-head-u10000 --boundary gumbel --prior 0.20 --seed $s
    add hnet-s$s          text8-head-u10000 --boundary hnet --seed $s
  done
fi
if [ "$part" = pareto ] || [ "$part" = all ]; then
  for s in $pareto_seeds; do
    for v in 200 500 1000 3000 5000 10000; do
      add unigram-u$v-s$s text8-head-u$v --boundary unigram --seed $s
    done
    for a in 0.20 0.25 0.30 0.37 0.45; do
      add gumbel-a$a-s$s text8-head-u10000 --boundary gumbel --prior $a --seed $s
    done
    add none-s$s text8-head-u10000 --boundary none --seed $s     # fixed k = 1 is vanilla
    for k in 2 3 4 5 6; do
      add fixed$k-s$s text8-head-u10000 --boundary fixed --fixed-factor $k --seed $s
    done
  done
fi

finished() { grep -q '"split": "test"' "$1/log.jsonl" 2>/dev/null; }
n_done=0 n_resume=0
for p in "${plan[@]}"; do
  d=$out/${p%% *}
  if finished "$d"; then
    n_done=$((n_done + 1))
  elif [ -f "$d/ckpt.pt" ]; then
    n_resume=$((n_resume + 1))
  fi
done
n=${#plan[@]}
echo "study: part $part, $n runs x $steps steps = $((n * steps)) training steps in $out" \
     "($n_done finished and skipped, $n_resume to resume, $((n - n_done - n_resume)) to start)"
echo "train.py flags: --device cpu --max-steps $steps ${train_flags[*]}"
for p in "${plan[@]}"; do echo "  ${p%% *}: $data_dir/${p#* }"; done
[ $dry = 1 ] && exit 0

interrupted() {
  # background runs ignore SIGINT (bash starts them so): stop them; their checkpoints are atomic
  local pid
  for pid in $(jobs -rp); do pkill -TERM -P "$pid"; kill "$pid"; done 2>/dev/null
  echo "error: interrupted; finished runs and checkpoints in $out are kept," \
       "run the same command to resume" >&2
  exit 130
}
trap interrupted INT
command -v python >/dev/null || die "python is not on PATH"

# One dataset per Unigram size: the same text, only the boundary labels differ.
for p in "${plan[@]}"; do
  rest=${p#* }; name=${rest%% *}
  [ -f "$data_dir/$name/meta.json" ] && continue
  echo "preparing $data_dir/$name"
  case $name in
    text8-head-u*)
      [ -f "$input" ] || die "$input is missing (the first 4M characters of text8; pass --input FILE)"
      prep=(--input "$input" --dataset text8 --unigram "${name##*-u}") ;;
    text8) prep=(--input "$input" --dataset text8) ;;
    *) [ -f "$raw_dir/$name.txt" ] || die "$raw_dir/$name.txt is missing (pass --raw-dir DIR)"
       prep=(--input "$raw_dir/$name.txt" --lang "$name") ;;
  esac
  python prepare_data.py "${prep[@]}" --out-dir "$data_dir" --name "$name" \
      || die "preparing $data_dir/$name failed (see above)"
done

# One run; with --jobs > 1 in the background, one thread, its output in <out>/<run>.log and its
# failure recorded as a file (a background job cannot append to the failed list).
train_one() {
  local run=$1 name=$2 flags=$3 d=$out/$1 resume=()
  [ -f "$d/ckpt.pt" ] && resume=(--resume)
  # shellcheck disable=SC2086  # $flags is a list of flags
  local steps_flag=(--max-steps "$steps")
  [[ $flags == *--flop-budget* ]] && steps_flag=()
  python train.py --data "$data_dir/$name" $flags --device cpu "${steps_flag[@]}" --out "$d" \
      "${resume[@]}" "${train_flags[@]}" || touch "$out/.failed-$run"
}
failed=()
mkdir -p "$out" && rm -f "$out"/.failed-*
for p in "${plan[@]}"; do
  run=${p%% *} rest=${p#* }; d=$out/$run
  if finished "$d"; then echo "== $run: finished, skipped"; continue; fi
  read -r name flags <<< "$rest"
  if [ "$jobs" = 1 ]; then
    echo "== $run"
    train_one "$run" "$name" "$flags"
  else
    while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n; done
    echo "== $run (started $(date +%H:%M:%S), output in $out/$run.log)"
    OMP_NUM_THREADS=1 train_one "$run" "$name" "$flags" > "$out/$run.log" 2>&1 &
  fi
done
wait
for f in "$out"/.failed-*; do [ -e "$f" ] && failed+=("${f##*/.failed-}") && rm -f "$f"; done

# report.py's Markdown (its flags after the name) in <out>/<name>.md, written whole or not at all.
write_md() {
  local md=$out/$1.md; shift
  if python report.py "$@" --markdown > "$md.tmp"; then
    mv "$md.tmp" "$md" && echo "tables: $md"
  else
    rm -f "$md.tmp"; failed+=(report.py)
  fi
}
# report.py over some of the runs: the tables printed, and as Markdown in <out>/<name>.md with the
# plots in <out>/<name>.png.
report() {
  local name=$1 budgets=(--at-chars min); shift
  # Equal budgets: characters always; FLOPs where train.py logs them (older logs lack them).
  grep -q '"train_flops": [0-9]' "$1/log.jsonl" && budgets+=(--at-flops min)
  python report.py "$@" "${budgets[@]}" || { failed+=(report.py); return; }
  write_md "$name" "$@" "${budgets[@]}" --plot "$out/$name.png"
}
dirs=()
for p in "${plan[@]}"; do [ -f "$out/${p%% *}/log.jsonl" ] && dirs+=("$out/${p%% *}"); done
if [ "$part" = languages ]; then  # one table and one plot per language, then all side by side
  for l in $langs; do
    ldirs=()
    for d in "${dirs[@]}"; do [[ ${d##*/} == "$l"-* ]] && ldirs+=("$d"); done
    [ ${#ldirs[@]} -gt 0 ] && report "languages-$l" "${ldirs[@]}"
  done
  # all of them: the last table has a column per language, the plot a panel each
  [ ${#dirs[@]} -gt 0 ] && write_md languages "${dirs[@]}" --by-data --plot-sf "$out/languages.png"
elif [ ${#dirs[@]} -gt 0 ]; then
  report "$part" "${dirs[@]}"
fi
[ ${#failed[@]} -eq 0 ] || die "failed: ${failed[*]} (see the output above, or <run>.log in $out);" \
  "run the same command again to retry"
