#!/usr/bin/env bash
# The studies of dynpool: the paper's experiments as parts, each a grid of train.py runs over
# seeds, then report.py's tables (paired t-tests against vanilla and fixed pooling) and plots.
#
#   bash study.sh --part table2 --dry-run          # the plan and its cost, nothing run
#   bash study.sh --part table2 --steps 200 --jobs 2 -- --layers 2,4,2   # flags after -- go to
#                                                   # every train.py
#   bash study.sh --part table1 --device cuda --dry-run   # the paper's Table 1 on GPUs
#
# Parts (runs shared between parts, e.g. vanilla at seed 1337, run once):
#   seeds      the seven sources on the text8 slice: none, fixed2, whitespace, unigram (V=10000),
#              entropy, gumbel (alpha 0.2), hnet; all: seeds and pareto
#   pareto     at --pareto-seeds: Unigram V = 200 500 1000 3000 5000 10000, Gumbel alpha = 0.20
#              0.25 0.30 0.37 0.45, fixed k = 1 (vanilla) 2 3 4 5 6; one panel per --langs
#              (default text8: the slice; fi he vi: the shared raw text of --raw-dir)
#   languages  --langs x --modes x --seeds, each pooled mode twice: at --steps (equal steps) and
#              at the FLOP budget of the vanilla run of the same shape (<run>-flops)
#   table1     the paper's Table 1: text8, wiki40b en fi he vi, cc-100 en (prepare_data.py
#              downloads them) x none, fixed2 fixed3 fixed4, gumbel, entropy, unigram, whitespace;
#              the paper's recipe where --device is a GPU (train.py's GPU preset), --steps 200000
#   table2     the paper's Table 2: fixed2, entropy, whitespace, each pooled by the segment mean
#              and by its last token (--pooling last, sub-sampling), on the text8 slice
#   scaling    test BPC against total layers (--scaling-layers, default 8 12 16 20): 2 + 2 outer
#              layers and the shortened stage grown, for --modes (default none whitespace)
#              (table2 and scaling with a GPU --device: the whole text8 and --steps 200000)
# Modes by name: none, fixedK (any K), whitespace, unigram, entropy, gumbel, hnet.
# Runs land in --out (default runs/study-<steps>), one folder each. A finished run (its log has a
# test evaluation) is skipped, one with a checkpoint is resumed, so the same command picks up
# where an interrupted study stopped. Keep the flags after -- the same for one --out.
# --jobs N runs N at a time, each with OMP_NUM_THREADS=1 (on a 2-core machine two one-thread runs
# train faster than one two-thread run after the other); its output goes to <out>/<run>.log.
# At the end: report.py over the part's runs, the tables in <out>/<part>.md, the plots in
# <out>/<part>.png (languages, table1 and pareto: one of each per language too,
# <out>/<part>-<lang>.*; scaling: also <out>/scaling-layers.png, test BPC against layers).
# --dry-run prints every train.py command with its FLOPs (dynpool.step_flops at the preset's shape;
# fixed k at SF k, the other sources at --assume-sf) and, for a GPU, an estimate of GPU-hours at
# --mfu of --peak-tflops (assumptions, printed with the estimate: no GPU run has measured them).
set -u

part=seeds steps= out= seeds="1337 2 3" pareto_seeds=1337 dry=0 jobs=1 device=cpu
input=../shared/data/text8-head.txt data_dir=data raw_dir=../shared/data/raw langs= modes=
scaling_layers="8 12 16 20" assume_sf=4.5 mfu=0.4 peak_tflops=989
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
    --scaling-layers) scaling_layers=${2-}; shift ;;
    --device) device=${2-}; shift ;;
    --assume-sf) assume_sf=${2-}; shift ;;
    --mfu) mfu=${2-}; shift ;;
    --peak-tflops) peak_tflops=${2-}; shift ;;
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
  seeds|pareto|all|languages|table1|table2|scaling) ;;
  *) code=2 die "--part must be seeds, pareto, all, languages, table1, table2 or scaling," \
                "not '$part'" ;;
esac
[ "$part" = table1 ] && steps=${steps:-200000}
# On a GPU, table2 and scaling run at the paper's scale too: the whole text8, 200k steps.
paper_scale=0; [[ $device == cuda* && ( $part == table2 || $part == scaling ) ]] && paper_scale=1
[ $paper_scale = 1 ] && steps=${steps:-200000}
steps=${steps:-1000}
[ "$part" = languages ] && langs=${langs:-text8 fi he vi}
[ "$part" = table1 ] && langs=${langs:-text8 wiki40b-en wiki40b-fi wiki40b-he wiki40b-vi cc100-en}
langs=${langs:-text8}
case $part in
  languages) modes=${modes:-none fixed2 whitespace unigram entropy gumbel hnet} ;;
  table1) modes=${modes:-none fixed2 fixed3 fixed4 gumbel entropy unigram whitespace} ;;
  table2) modes=${modes:-fixed2 entropy whitespace} ;;
  scaling) modes=${modes:-none whitespace} ;;
esac
[[ $steps =~ ^[1-9][0-9]*$ ]] || code=2 die "--steps must be a positive whole number, not '$steps'"
[[ $jobs =~ ^[1-9][0-9]*$ ]] || code=2 die "--jobs must be a positive whole number, not '$jobs'"
for s in $seeds $pareto_seeds; do
  [[ $s =~ ^[0-9]+$ ]] || code=2 die "seeds must be whole numbers separated by spaces, not '$s'"
done
for n in $scaling_layers; do
  [[ $n =~ ^[0-9]+$ && $n -ge 5 ]] || code=2 die "--scaling-layers are totals of at least 5, not '$n'"
done
[ -n "$seeds$pareto_seeds" ] || code=2 die "no seeds given"
out=${out:-runs/study-$steps}

# train.py flags of a mode by name (fixedK: any k); $1 the mode, $2 the language (Gumbel's prior).
mode_flags() {
  case $1 in
    fixed[0-9]*) echo "--boundary fixed --fixed-factor ${1#fixed}" ;;
    gumbel) local a=0.20; [[ $2 == *fi ]] && a=0.37; echo "--boundary gumbel --prior $a" ;;
    none|whitespace|unigram|entropy|hnet) echo "--boundary $1" ;;
    *) code=2 die "unknown mode '$1' (none, fixedK, whitespace, unigram, entropy, gumbel, hnet)" ;;
  esac
}
# The dataset of a language: the text8 slice with Unigram V=10000 labels (at the paper's scale the
# whole text8), else its own name.
dataset() {
  if [ "$1" = text8 ]; then
    if [ $paper_scale = 1 ]; then echo text8; else echo "text8-head-u${2:-10000}"; fi
  else echo "$1${2:+-u$2}"; fi
}

# The plan: one line per run, "name data train.py-flags", names unique per experiment.
plan=()
add() { local n=$1; for p in "${plan[@]}"; do [ "${p%% *}" = "$n" ] && return; done; plan+=("$*"); }
for s in $seeds; do
  case $part in
    seeds|all)   # names as the pareto part's, so the runs both parts have run once
      for m in none fixed2 whitespace unigram-u10000 entropy gumbel-a0.20 hnet; do
        add "$m-s$s" "$(dataset text8)" $(mode_flags ${m%%-*} text8) --seed "$s"
      done ;;
    languages|table1)
      for l in $langs; do
        d=$(dataset "$l"); [ "$part" = table1 ] && d=$l
        for m in $modes; do
          add "$l-$m-s$s" "$d" $(mode_flags "$m" "$l") --seed "$s"
          [ "$part" = languages ] && [ "$m" != none ] && \
            add "$l-$m-flops-s$s" "$d" $(mode_flags "$m" "$l") --seed "$s" --flop-budget "vanilla:$steps"
        done
      done ;;
    table2)
      for m in $modes; do
        for pool in mean last; do
          add "$m-$pool-s$s" "$(dataset text8)" $(mode_flags $m text8) --pooling $pool --seed "$s"
        done
      done ;;
    scaling)
      for n in $scaling_layers; do
        for m in $modes; do
          add "$m-l$n-s$s" "$(dataset text8)" $(mode_flags $m text8) --layers "2,$((n - 4)),2" --seed "$s"
        done
      done ;;
  esac
done
if [ "$part" = pareto ] || [ "$part" = all ]; then
  for s in $pareto_seeds; do
    for l in $langs; do
      r=$l-; [ "$l" = text8 ] && r=    # the text8 slice's runs keep their names of part seeds
      for v in 200 500 1000 3000 5000 10000; do
        add "${r}unigram-u$v-s$s" "$(dataset "$l" $v)" --boundary unigram --seed "$s"
      done
      for a in 0.20 0.25 0.30 0.37 0.45; do
        add "${r}gumbel-a$a-s$s" "$(dataset "$l")" --boundary gumbel --prior $a --seed "$s"
      done
      add "${r}none-s$s" "$(dataset "$l")" --boundary none --seed "$s"   # fixed k = 1 is vanilla
      for k in 2 3 4 5 6; do
        add "${r}fixed$k-s$s" "$(dataset "$l")" $(mode_flags fixed$k "$l") --seed "$s"
      done
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
echo "train.py flags: --device $device --max-steps $steps ${train_flags[*]}"
# The FLOPs of each train.py command read on stdin (the preset's shape), and their total.
flops_py=$(cat <<'PY'
import shlex, sys
import presets as train
from dynpool import Config, step_flops
steps, device, sf, mfu, peak = int(sys.argv[1]), sys.argv[2], *map(float, sys.argv[3:])
preset = train.GPU_PRESET if device.startswith('cuda') else train.CPU_PRESET
total = 0
for line in sys.stdin:
    argv = shlex.split(line)[2:]
    a = vars(train.parser().parse_args(argv))
    a = {k: v if v is not None else preset.get(k, v) for k, v in a.items()}
    layers = tuple(int(n) for n in str(a['layers']).split(','))
    cfg = Config(vocab_size=27, whitespace_id=0, boundary=a['boundary'], layers=layers,
                 fixed_factor=a['fixed_factor'] or 2,
                 **{k: a[k] for k in ('d_model', 'n_head', 'd_head', 'd_inner')})
    run_sf = 1 if cfg.boundary == 'none' else cfg.fixed_factor if cfg.boundary == 'fixed' else sf
    flops = steps * step_flops(cfg, a['batch_size'], a['seq_len'], 1 + a['seq_len'] / run_sf)
    if a['flop_budget'] is not None:  # the budget, not the steps, ends such a run
        flops = train.budget_flops(a['flop_budget'], cfg, a['batch_size'], a['seq_len'])
    total += flops
    print(f'{line.rstrip()}    # {flops:.2e} FLOPs')
hours = total / (mfu * peak * 1e12) / 3600
gpu = f'; about {hours:,.0f} GPU-hours at {mfu:.0%} MFU of {peak:g} TFLOP/s (assumed, not measured)'
print(f'total: {total:.2e} FLOPs{gpu if device.startswith("cuda") else ""}')
PY
)
if [ $dry = 0 ]; then
  for p in "${plan[@]}"; do echo "  ${p%% *}: $data_dir/${p#* }"; done
else  # every command with its FLOPs (train.py's preset for --device), and the total's cost
  for p in "${plan[@]}"; do
    rest=${p#* }
    echo "python train.py --data $data_dir/${rest%% *} ${rest#* } --device $device" \
         "--max-steps $steps --out $out/${p%% *} ${train_flags[*]}"
  done | python -c "$flops_py" "$steps" "$device" "$assume_sf" "$mfu" "$peak_tflops" \
    || die "could not count the FLOPs (see above)"
  exit 0
fi

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
    text8) prep=() ;;                                            # the whole text8, downloaded
    wiki40b-*|cc100-*) prep=(--dataset "${name%%-*}" --lang "${name#*-}" --unigram 10000) ;;
    *) l=${name%%-u*}                            # fi, or fi-u200: fi with Unigram labels V=200
       [ -f "$raw_dir/$l.txt" ] || die "$raw_dir/$l.txt is missing (pass --raw-dir DIR)"
       prep=(--input "$raw_dir/$l.txt" --lang "$l")
       [ "$l" != "$name" ] && prep+=(--unigram "${name##*-u}") ;;
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
  python train.py --data "$data_dir/$name" $flags --device "$device" "${steps_flag[@]}" --out "$d" \
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
if [[ $part == languages || $part == table1 || $part == pareto && $langs != text8 ]]; then
  # one table and one plot per language, then all side by side
  for l in $langs; do
    ldirs=()
    for d in "${dirs[@]}"; do    # a run's language is its name's prefix; none: the text8 slice
      r=${d##*/}; r=${r%%-*}; [[ " $langs " == *" $r "* ]] || r=text8
      [ "$r" = "$l" ] && ldirs+=("$d")
    done
    [ ${#ldirs[@]} -gt 0 ] && report "$part-$l" "${ldirs[@]}"
  done
  # all of them: the last table has a column per language, the plot a panel each
  [ ${#dirs[@]} -gt 0 ] && write_md "$part" "${dirs[@]}" --by-data --plot-sf "$out/$part.png"
elif [ ${#dirs[@]} -gt 0 ]; then
  report "$part" "${dirs[@]}"
  # the paper's scaling figure: test BPC against the total number of layers, a line per source
  [ "$part" = scaling ] && { python report.py "${dirs[@]}" --plot-layers "$out/scaling-layers.png" \
    > /dev/null || failed+=(report.py); }
fi
[ ${#failed[@]} -eq 0 ] || die "failed: ${failed[*]} (see the output above, or <run>.log in $out);" \
  "run the same command again to retry"
