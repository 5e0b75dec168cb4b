"""The studies of dynpool (study.sh runs this file): the paper's experiments as parts, each
a grid of train.py runs over seeds, its data prepared first, then report.py's tables and
plots. The flags are read by one parser; the plan is checked with train.py's own parser
before anything is prepared or run.

    bash study.sh --part table2 --dry-run          # the plan and its cost, nothing run
    bash study.sh --part table2 --steps 200 --jobs 2 -- --layers 2,4,2   # after --: train.py's
    bash study.sh --part table1 --device cuda --dry-run   # the paper's Table 1 on GPUs
    bash study.sh --part table1 --gpus 0,1,2,3     # one run per GPU at a time
    bash study.sh --part table1 --device cuda --emit jobs.txt   # jobs for a scheduler
"""
import json
import os
import shlex
import signal
import subprocess
import sys
from argparse import ArgumentTypeError
from itertools import product
from pathlib import Path

import torch

import common
import dataset
import dynpool
import checkpoint
import flags
from cleaning import LANGS
from common import (UserError, float_range, int_range, non_negative_int, nonblank,
                    positive_float, positive_int, seed_int)

# The project's scripts are beside this file; paths are the user's, relative to the
# working directory (the scripts by their path where that is another folder).
HERE = Path(__file__).resolve().parent
AT = f'{HERE}/'
if HERE == Path.cwd().resolve():
    AT = ''
TRAIN = f'{AT}train.py'
PARTS = dict(
    seeds='the seven sources on the text8 slice, over --seeds',
    pareto='Unigram V = 200 ... 10000, Gumbel alpha = 0.20 ... 0.45, fixed k = 1 ... 6, '
           'at --pareto-seeds, a front per --langs',
    all='seeds and pareto',
    languages='--langs x --modes x --seeds, each pooled mode at --steps and at the FLOPs of '
              'vanilla of its shape (<run>-flops)',
    table1="the paper's Table 1: text8, wiki40b en fi he vi, cc-100 en x 8 sources",
    table2="the paper's Table 2: fixed2, entropy, whitespace pooled by the mean and by the "
           'last token',
    scaling='total layers (--scaling-layers): 2 + 2 outer layers, the shortened stage grown',
)
# Each part's languages and modes where the flags leave them open (steps: 1000, the
# paper's 200000 in the parts at its scale).
PART_DEFAULTS = dict(
    languages=dict(langs='text8 fi he vi', modes='none fixed2 whitespace unigram entropy gumbel '
                   'hnet'),
    table1=dict(langs='text8 wiki40b-en wiki40b-fi wiki40b-he wiki40b-vi cc100-en',
                modes='none fixed2 fixed3 fixed4 gumbel entropy unigram whitespace'),
    table2=dict(modes='fixed2 entropy whitespace'),
    scaling=dict(modes='none whitespace'),
)
# Part seeds' seven sources, named as the pareto part's runs: a run both parts have is
# run once.
SEED_MODES = ('none', 'fixed2', 'whitespace', 'unigram-u10000', 'entropy', 'gumbel-a0.20',
              'hnet')
# The pareto part's fronts: Unigram V, Gumbel alpha, fixed k (fixed k = 1 is vanilla).
PARETO_MODES = ('unigram-u200', 'unigram-u500', 'unigram-u1000', 'unigram-u3000',
                'unigram-u5000', 'unigram-u10000', 'gumbel-a0.20', 'gumbel-a0.25',
                'gumbel-a0.30', 'gumbel-a0.37', 'gumbel-a0.45', 'none', 'fixed2', 'fixed3',
                'fixed4', 'fixed5', 'fixed6')
# The exit code of a study stopped by a signal: Ctrl-C's 130, SIGTERM's 75 (as train.py's:
# stopped to be resumed).
STOP_CODES = {signal.SIGINT: 130, signal.SIGTERM: 75}


def listed(kind):
    """Argument type: words of `kind` apart by spaces or commas, at least one, none
    twice → a list."""
    def parse(s):
        items = [kind(word) for word in s.replace(',', ' ').split()]
        if not items:
            raise ArgumentTypeError(f'must name at least one, got {s!r}')
        if len(set(items)) < len(items):
            raise ArgumentTypeError(f'must name each once, got {s!r}')
        return items
    return parse


def mode(name):
    """Argument type: a mode by name: fixedK (any k >= 1), or a --boundary (a source
    that --import registered too)."""
    k = name.removeprefix('fixed')
    if name in dynpool.BOUNDARY_MODES or (k != name and k.isdigit() and int(k) >= 1):
        return name
    raise ArgumentTypeError(f'{name!r} is no mode: choose fixedK or one of '
                            f'{", ".join(dynpool.BOUNDARY_MODES)}')


def language(name):
    """Argument type: text8, wiki40b-L, cc100-L, or L (raw text in --raw-dir), L a
    language cleaning.py knows."""
    kind, _, code = name.rpartition('-')
    if name == 'text8' or (kind in ('', 'wiki40b', 'cc100') and code in LANGS):
        return name
    raise ArgumentTypeError(f'{name!r} is no language: text8, or L, wiki40b-L or '
                            f'cc100-L with L one of {", ".join(LANGS)}')


def output_file(s):
    """Argument type: a path a file can be written at: no folder, in a folder that
    exists."""
    path = Path(nonblank(s))
    if (path.exists() and not path.is_file()) or not path.parent.is_dir():
        raise ArgumentTypeError(f'must be a file in a folder that exists, got {s!r}')
    return s


def mfu_range(s):
    """Argument type: a model FLOPs utilisation, or a range of two like 0.2-0.4 → [lo,
    hi] (or [utilisation])."""
    ends = [float_range(0, 1, lo_open=True)(x) for x in s.split('-', 1)]
    if ends != sorted(ends):
        raise ArgumentTypeError(f'must be a range low-high, got {s!r}')
    return ends


class Parser(common.Parser):
    """common.Parser, whose mistakes name the command the user typed."""

    def error(self, message):
        raise UserError(f'{message} (see bash study.sh --help)', code=2)


def parser():
    """study.sh's flags; list flags take words apart by spaces or commas."""
    p = Parser(prog='study.sh', description=__doc__.split('\n\n')[0],
               epilog='parts: ' + '; '.join(f'{k}: {v}' for k, v in PARTS.items()))
    p.add_argument('--part', choices=PARTS, default='seeds', help='the experiment')
    p.add_argument('--steps', type=positive_int,
                   help='steps a run (default 1000; table1, and table2 and scaling on a GPU, '
                   '200000)')
    p.add_argument('--seeds', type=listed(seed_int), default='1337 2 3',
                   help='seeds of each run (default "1337 2 3")')
    p.add_argument('--pareto-seeds', type=listed(seed_int), default='1337',
                   help='seeds of the pareto runs (default 1337)')
    p.add_argument('--langs', type=listed(language),
                   help='text8 (the slice; whole for the paper), fi he vi (--raw-dir), wiki40b-L, '
                   'cc100-L')
    p.add_argument('--modes', type=listed(mode), help='none, fixedK, whitespace, unigram, ...')
    p.add_argument('--scaling-layers', type=listed(int_range(5)), default='8 12 16 20',
                   help='total layers of the scaling runs (default "8 12 16 20")')
    p.add_argument('--out', type=nonblank, help='runs/study-<steps>: a folder a run')
    p.add_argument('--data-dir', type=nonblank, default=f'{AT}data',
                   help='where datasets are prepared (default data)')
    p.add_argument('--input', type=nonblank, default=f'{AT}../shared/data/text8-head.txt',
                   help="the text8 slice's text")
    p.add_argument('--raw-dir', type=nonblank, default=f'{AT}../shared/data/raw',
                   help="a language's raw text: <L>.txt")
    # as train.py's, passed on to every run
    flags.add_import_flag(p)
    p.add_argument('--device', type=nonblank, default='cpu',
                   help="cpu (default), cuda: the GPU preset, the paper's recipe")
    p.add_argument('--jobs', type=positive_int, default=1, help='CPU runs at a time')
    p.add_argument('--gpus', type=listed(non_negative_int),
                   help='GPU ids like 0,1,2,3: one run on each at a time (--device cuda)')
    p.add_argument('--nproc', type=positive_int, help='each run under torchrun on N GPUs')
    p.add_argument('--emit', type=output_file, metavar='FILE',
                   help='prepare the data, write the runs left to FILE (for a scheduler), '
                   'exit')
    p.add_argument('--dry-run', action='store_true', help='print the plan and its cost only')
    p.add_argument('--assume-sf', type=float_range(1), default=4.5,
                   help='the SF of runs whose SF no target or data says (entropy)')
    p.add_argument('--mfu', type=mfu_range, default='0.2-0.4',
                   help='GPU FLOPs utilisation assumed where bench.py has not measured the '
                   'GPU')
    p.add_argument('--peak-tflops', type=positive_float, default=989,
                   help="the GPU's dense bf16 peak (989: an H100's)")
    p.add_argument('--bench', default=f'{AT}out/bench-paper.json',
                   help="bench.py --preset paper's measured speeds")
    return p


def parse(argv):
    """Flags → args, with each part's defaults, the slots runs go to and train.py's
    flags (after --); the --import files imported first, so that their modes are
    known."""
    cut = (argv + ['--']).index('--')
    flags.import_sources(argv[:cut])
    args = parser().parse_args(argv[:cut])
    args.train_flags = argv[cut + 1:]
    # Where runs go, one at a time each: a GPU (or --nproc of them), or a CPU job.
    per_run = args.nproc or 1
    args.slots = [None] * args.jobs
    if args.gpus:
        args.device = 'cuda'
        if len(args.gpus) % per_run:
            raise UserError(f'--gpus: {len(args.gpus)} GPUs do not split into --nproc '
                            f'{per_run}', code=2)
        args.slots = [','.join(map(str, args.gpus[i:i + per_run]))
                      for i in range(0, len(args.gpus), per_run)]
    # the machine's cores split between the runs at a time
    args.threads = max(1, len(os.sched_getaffinity(0)) // len(args.slots))
    args.cuda = args.device.startswith('cuda')
    # On a GPU, table2 and scaling run at the paper's scale too: the whole text8, 200k steps.
    args.paper = args.part == 'table1' or (args.cuda and args.part in ('table2', 'scaling'))
    defaults = PART_DEFAULTS.get(args.part, {})
    args.langs = args.langs or defaults.get('langs', 'text8').split()
    args.modes = args.modes or defaults.get('modes', '').split()
    if not args.steps:
        args.steps = 1000
        if args.paper:
            args.steps = 200_000
    args.out = args.out or f'{AT}runs/study-{args.steps}'
    return args


def lang_code(lang):
    """A language's code in cleaning.LANGS (text8 is English)."""
    if lang == 'text8':
        return 'en'
    return lang.rpartition('-')[2]


def mode_flags(name, lang):
    """train.py's flags of a mode by name: fixedK any k, gumbel at its language's prior
    (the pareto runs' gumbel-aP at prior P)."""
    if name.startswith('fixed') and name != 'fixed':
        return ['--boundary', 'fixed', '--fixed-factor', name[5:]]
    if name == 'gumbel':
        name = f"gumbel-a{LANGS[lang_code(lang)]['prior']:.2f}"
    if name.startswith('gumbel-a'):
        return ['--boundary', 'gumbel', '--prior', name[8:]]
    return ['--boundary', name]


def dataset_of(args, lang, V=None):
    """The dataset of a language with the Unigram labels of V pieces (default: the
    language's) → its name; the prepare_data.py command that makes it kept in
    args.datasets. text8 is the slice of --input, the whole text8 in the paper's parts;
    L is --raw-dir's L.txt."""
    code = lang_code(lang)
    kind = lang.rpartition('-')[0]
    name = lang
    if V:
        name = f'{lang}-u{V}'
    words = ['--input', f'{args.raw_dir}/{code}.txt', '--lang', code]
    if lang == 'text8' and args.paper:
        words = ['--dataset', 'text8']
    elif lang == 'text8':
        name = f"text8-head-u{V or LANGS['en']['unigram']}"
        words = ['--input', args.input, '--dataset', 'text8']
    elif kind:
        words = ['--dataset', kind, '--lang', code]
    cmd = dataset.prepare_command(*words, '--unigram', V or LANGS[code]['unigram'],
                                  '--out-dir', args.data_dir, '--name', name)
    # this project's prepare_data.py, by its path
    args.datasets[name] = ['python', f'{AT}prepare_data.py', *shlex.split(cmd)[2:]]
    return name


def plan(args):
    """The part's runs → {name: (language, dataset, train.py flags)} in order; a run that
    two parts share (vanilla at seed 1337 in seeds and pareto) is planned once."""
    runs = {}

    def add(name, lang, m, *flags):
        # unigram-uV: on a dataset of its own, with the labels of V pieces
        V = None
        if m.startswith('unigram-u'):
            V = int(m[9:])
            m = 'unigram'
        flags = [*mode_flags(m, lang), *flags, '--seed', str(seed)]
        runs.setdefault(f'{name}-s{seed}', (lang, dataset_of(args, lang, V), flags))
    for seed in args.seeds:
        if args.part in ('seeds', 'all'):
            for m in SEED_MODES:
                add(m, 'text8', m)
        if args.part in ('languages', 'table1'):
            for lang, m in product(args.langs, args.modes):
                add(f'{lang}-{m}', lang, m)
                if args.part == 'languages' and m != 'none':
                    add(f'{lang}-{m}-flops', lang, m, '--flop-budget', f'vanilla:{args.steps}')
        if args.part == 'table2':
            for m, pool in product(args.modes, ('mean', 'last')):
                add(f'{m}-{pool}', 'text8', m, '--pooling', pool)
        if args.part == 'scaling':
            for n, m in product(args.scaling_layers, args.modes):
                add(f'{m}-l{n}', 'text8', m, '--layers', f'2,{n - 4},2')
    if args.part in ('pareto', 'all'):
        for seed, lang, m in product(args.pareto_seeds, args.langs, PARETO_MODES):
            # the text8 slice's runs keep their names of part seeds
            name = f'{lang}-{m}'
            if lang == 'text8':
                name = m
            add(name, lang, m)
    return runs


def train_command(args, run, threads=None):
    """train.py's command for a run of the plan (args.runs): the dry run prints, --emit
    writes and the runner starts this one. threads: each run's --threads (None: the
    machine's that runs it decides)."""
    _, data, flags = args.runs[run]
    cmd = ['python', TRAIN]
    if args.nproc:
        cmd = ['torchrun', '--standalone', f'--nproc_per_node={args.nproc}', TRAIN]
    cmd += ['--data', f'{args.data_dir}/{data}', *flags, '--device', args.device, '--out',
            f'{args.out}/{run}']
    # a run with a FLOP budget ends there, not at --max-steps
    if '--flop-budget' not in flags:
        cmd += ['--max-steps', str(args.steps)]
    if Path(args.out, run, 'ckpt.pt').exists():
        cmd.append('--resume')
    for name in args.imports or []:
        cmd += ['--import', name]
    if threads:
        cmd += ['--threads', str(threads)]
    return cmd + args.train_flags


def finished(args, run):
    """Whether a run's log holds its test evaluation."""
    try:
        return '"split": "test"' in Path(args.out, run, 'log.jsonl').read_text()
    except (OSError, ValueError):
        return False


def read_meta(args, name):
    """A prepared dataset's meta.json as a dict, or None where it is not prepared ({}
    where it is unreadable or broken: train.py will say why)."""
    folder = Path(args.data_dir, name)
    if not (folder / 'meta.json').exists():
        return None
    try:
        return dataset.read_meta(folder)
    except (UserError, OSError):
        return {}


def shortening(a, meta, assume_sf):
    """The SF a run's FLOPs are priced at (a: its flags, filled in) → (SF, whether
    assumed): fixed k; gumbel 1 / its prior; hnet its ratio_target; whitespace and
    unigram the SF of the training split that meta.json records (whitespace:
    "whitespace_shortening_factor" {split: SF}; unigram: its label set's in
    "unigram_sets", else the default "unigram"); else (entropy, a source of one's own,
    data not prepared yet) assume_sf."""
    sets = meta.get('unigram_sets') or {}
    labels = sets.get(str(a.get('unigram'))) or meta.get('unigram') or {}
    # each mode's SF: by its flags, or the training split's that its data records
    known = dict(none=1, fixed=a['fixed_factor'], gumbel=1 / a['prior'], hnet=a['ratio_target'],
                 whitespace=(meta.get('whitespace_shortening_factor') or {}).get('train'),
                 unigram=(labels.get('shortening_factor') or {}).get('train'))
    sf = known.get(a['boundary'])
    if sf is None:
        return assume_sf, True
    return sf, False


def run_flops(args, cmd, meta):
    """A train.py command's training FLOPs at its preset's shape (dynpool.step_flops),
    its words read by train.py's parser (one error line, exit 2), whose defaults are the
    preset's (check) → (FLOPs, ' at SF x.xx' or '' for a FLOP budget, whether the SF
    is assumed)."""
    a = vars(args.train_parser.parse_args(cmd[cmd.index(TRAIN) + 1:]))
    cfg = checkpoint.config_from_dict(a, vocab_size=meta.get('vocab_size', 27), whitespace_id=0)
    if a['flop_budget']:
        budget = flags.budget_flops(a['flop_budget'], cfg, a['batch_size'], a['seq_len'])
        return budget, '', False
    sf, assumed = shortening(a, meta, args.assume_sf)
    n_short = dynpool.shortened_length(a['seq_len'], sf)
    step = dynpool.step_flops(cfg, a['batch_size'], a['seq_len'], n_short)
    return a['max_steps'] * step, f' at SF {sf:.2f}', assumed


def last_end(flops, slots):
    """The FLOPs of the slot that ends last, each run started in order on the first slot
    free."""
    ends = [0] * slots
    for f in flops:
        ends[ends.index(min(ends))] += f
    return max(ends)


def span(values, spec=',.1f'):
    """'12.3', or '8.1-16.2' for the range of several values (each written by `spec`)."""
    texts = [format(v, spec) for v in sorted(values)]
    return '-'.join(dict.fromkeys([texts[0], texts[-1]]))


def cost(args, flops):
    """What runs of these FLOPs cost: hours at the speed bench.py --preset paper
    measured on the device they run on (--bench), else for a GPU a range at --mfu of
    --peak-tflops, assumed; with several slots, the wall-clock time too."""
    device = f'CPU, {args.threads} threads'
    unit = 'hours'
    if args.cuda:
        device = torch.cuda.is_available() and torch.cuda.get_device_name(args.device)
        unit = 'GPU-hours'
    try:
        measured = json.loads(Path(args.bench).read_text()).get(device) or {}
    except (OSError, ValueError, AttributeError):
        measured = {}
    speed = measured.get('flops_per_s')
    if speed:
        speeds = [speed]
        how = f"on {device} at {speed:.3g} FLOP/s (measured {measured.get('date')})"
    elif args.cuda:
        speeds = [m * args.peak_tflops * 1e12 for m in args.mfu]
        how = (f'at {span(args.mfu, ".0%")} MFU of {args.peak_tflops:g} TFLOP/s (assumed: '
               'bench.py --preset paper has not measured this GPU)')
    else:
        return f'; no speed measured on {device} (bench.py --preset paper)'
    said = f'; about {span(sum(flops) / s / 3600 for s in speeds)} {unit} {how}'
    if len(args.slots) > 1:
        # a run on --nproc GPUs runs as many times as fast
        wall = last_end(flops, len(args.slots)) / 3600 / (args.nproc or 1)
        where = f'{args.jobs} jobs'
        if args.gpus:
            where = f'{len(args.gpus)} GPUs'
        said += f'; {span(wall / s for s in speeds)} hours on {where}'
    return said


def check(args):
    """The plan as the dry run prints it, all checked before anything is prepared or run:
    each dataset's command to prepare it, or a comment for a prepared one (the paper's
    parts refuse data that is not the paper's, in dataset.paper_data_problem's one line;
    the others name it so); each train.py command read by train.py's parser, with its
    FLOPs and SF; then the total and its cost → (lines, {run to do: its FLOPs})."""
    lines = []
    for name, cmd in args.datasets.items():
        path = Path(args.data_dir, name)
        if read_meta(args, name) is None:
            lines.append(shlex.join(cmd))
            continue
        problem = dataset.paper_data_problem(path)
        if problem and args.paper:
            raise UserError(problem)
        note = ''
        if problem:
            note = f" (not the paper's data: {problem})"
        lines.append(f'# {path}: prepared, used as it is{note}')
    # train.py's parser, its defaults those it takes on this device (its preset's)
    preset = flags.CPU_PRESET
    if args.cuda:
        preset = flags.GPU_PRESET
    args.train_parser = flags.parser()
    args.train_parser.set_defaults(**{**flags.COMMON, **flags.model_defaults(), **preset})
    # {run to do: its FLOPs}
    todo = {}
    n_assumed = 0
    n_resume = 0
    for run, (_, data, _) in args.runs.items():
        if finished(args, run):
            lines.append(f'# {args.out}/{run}: finished, skipped')
            continue
        cmd = train_command(args, run, args.threads)
        run_cost, note, assumed = run_flops(args, cmd, read_meta(args, data) or {})
        todo[run] = run_cost
        if '--resume' in cmd:
            n_resume += 1
        if assumed:
            note += ' (assumed: --assume-sf)'
            n_assumed += 1
        lines.append(f'{shlex.join(cmd)}    # {run_cost:.2e} FLOPs{note}')
    lines.insert(0, f'# study: part {args.part}, {len(args.runs)} runs x {args.steps} steps in '
                 f'{args.out}: {len(args.runs) - len(todo)} finished, {n_resume} to resume, '
                 f'{len(todo) - n_resume} to start')
    total = f'total: {sum(todo.values()):.2e} FLOPs'
    if n_assumed:
        total += f', {n_assumed} runs at an assumed SF {args.assume_sf:g}'
    lines.append(total + cost(args, todo.values()))
    return lines, todo


def prepare(args):
    """Each dataset of the plan not yet prepared, made by prepare_data.py, which says in
    its one error line what went wrong (its exit code is the study's)."""
    for name, cmd in args.datasets.items():
        if read_meta(args, name) is not None:
            continue
        print(f'preparing {args.data_dir}/{name}: {shlex.join(cmd)}', flush=True)
        code = subprocess.run(cmd).returncode
        if code:
            sys.exit(code)


def emit(args, todo):
    """The runs to do written to --emit, one command a line that runs from any directory
    (for a scheduler: docs/slurm-array.sh), without --threads: the machine that runs it
    decides."""
    cd = f'cd {shlex.quote(os.getcwd())} && '
    lines = [cd + shlex.join(train_command(args, run)) + '\n' for run in todo]
    common.write_atomic(args.emit, ''.join(lines))
    print(f'{len(lines)} runs in {args.emit}')


def interrupted(signum, frame):
    """Ctrl-C (exit 130) or SIGTERM (exit 75, as train.py's: stopped to be resumed)."""
    raise UserError('interrupted; run the same command to resume', code=STOP_CODES[signum])


def run_all(args, todo):
    """Each run to do started on the first free slot, its output in <out>/<run>.log
    where several run at a time, in a session of its own: Ctrl-C and SIGTERM reach the
    study, which stops every run with SIGTERM (train.py saves, then exits 75) and then
    itself → (failed, stopped: the runs that ended so)."""
    free = list(args.slots)
    running = {}
    failed = []
    stopped = []

    def wait_one():
        pid, status = os.wait()
        proc, run, slot = running.pop(pid)
        proc.returncode = os.waitstatus_to_exitcode(status)
        free.append(slot)
        if proc.returncode == 75:
            stopped.append(run)
        elif proc.returncode:
            failed.append(run)
    for signum in STOP_CODES:
        signal.signal(signum, interrupted)
    try:
        for run in todo:
            if not free:
                wait_one()
            slot = free.pop(0)
            cmd = train_command(args, run, args.threads)
            env = dict(os.environ)
            said = ''
            if slot is not None:
                env['CUDA_VISIBLE_DEVICES'] = slot
                said = f'CUDA_VISIBLE_DEVICES={slot} '
            log = None
            where = ''
            if len(args.slots) > 1:
                log = open(f'{args.out}/{run}.log', 'w')
                where = f' (output in {log.name})'
            print(f'== {run}: {said}{shlex.join(cmd)}{where}', flush=True)
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            running[proc.pid] = (proc, run, slot)
            if log:
                log.close()
        while running:
            wait_one()
    except BaseException:
        # interrupted (or unable to start a run): every run started is stopped first
        for signum in STOP_CODES:
            signal.signal(signum, signal.SIG_IGN)
        for pid in running:
            os.kill(pid, signal.SIGTERM)
        while running:
            wait_one()
        raise
    return failed, stopped


def write_report(args, name, dirs, *flags):
    """report.py's tables over run folders printed, and as Markdown in <out>/<name>.md
    (written whole or not at all) → the names of what failed: [] or ['report.py']."""
    tables = subprocess.run(['python', f'{AT}report.py', *dirs, '--markdown', *flags],
                            stdout=subprocess.PIPE, text=True)
    if tables.returncode:
        return ['report.py']
    print(tables.stdout)
    common.write_atomic(f'{args.out}/{name}.md', tables.stdout)
    print(f'tables: {args.out}/{name}.md')
    return []


def plot_scaling(dirs, path):
    """The scaling study's figure: test BPC (the mean over seeds) against the layers in
    all and against the training FLOPs, a line per mode and budget (equal steps, FLOP
    budget)."""
    # report.py's reading of runs (imported here: only this part draws a plot of them)
    import report
    groups = report.group_seeds([report.summarize(Path(d)) for d in dirs])
    # {label: [(layers in all, training FLOPs, test BPC)]}
    lines = {}
    for g in groups:
        budget = g['budget']
        if g['flop_budget']:
            budget = 'FLOP budget'
        if g['test_bpc']:
            point = (sum(g['config']['layers']), g['train_flops'][0], g['test_bpc'][0])
            lines.setdefault(f"{g['mode']}, {budget}", []).append(point)
    if not lines:
        return
    plt = common.import_pyplot('the scaling plot')
    fig, (by_layers, by_flops) = plt.subplots(1, 2, figsize=(10, 4))
    for label, points in lines.items():
        # by depth (a tie keeps the groups' order)
        layers, train_flops, bpc = zip(*sorted(points, key=lambda point: point[0]))
        by_layers.plot(layers, bpc, 'o-', label=label)
        by_flops.plot(train_flops, bpc, 'o-', label=label)
    bits = groups[0]['bits']
    by_layers.set(xlabel='layers in all', ylabel=f'test {bits} (mean over seeds)')
    by_flops.set(xlabel='training FLOPs', xscale='log')
    by_layers.legend(fontsize=8)
    fig.tight_layout()
    common.write_atomic(path, lambda tmp: fig.savefig(tmp, format='png', dpi=120))
    print(f'plot: {path} (test {bits} against the layers and the training FLOPs)')


def report_part(args):
    """report.py over the part's runs that have a log: the tables and the plot of the
    part (<out>/<part>.md, .png); languages, table1 and pareto over several languages
    one of each per language too (<out>/<part>-<lang>.*) → what failed."""
    done = [run for run in args.runs if Path(args.out, run, 'log.jsonl').exists()]
    dirs = [f'{args.out}/{run}' for run in done]
    png = f'{args.out}/{args.part}.png'
    failed = []
    if not dirs:
        return failed
    several = args.part == 'pareto' and args.langs != ['text8']
    if args.part in ('languages', 'table1') or several:
        for lang in args.langs:
            mine = [f'{args.out}/{run}' for run in done if args.runs[run][0] == lang]
            if mine:
                failed += write_report(args, f'{args.part}-{lang}', mine, '--plot',
                                       f'{args.out}/{args.part}-{lang}.png')
        return failed + write_report(args, args.part, dirs, '--by-data', '--plot-sf', png)
    if args.part == 'scaling':
        plot_scaling(dirs, png)
        return write_report(args, args.part, dirs)
    return write_report(args, args.part, dirs, '--plot', png)


def run(argv):
    """The study: the plan checked; printed (--dry-run), or its data prepared and its
    runs written to --emit or run, then reported."""
    args = parse(argv)
    args.datasets = {}
    args.runs = plan(args)
    lines, todo = check(args)
    if args.dry_run:
        print('\n'.join(lines))
        return
    print('\n'.join(line for line in lines if line.startswith('#')), flush=True)
    prepare(args)
    if args.emit:
        emit(args, todo)
        return
    common.make_folder(args.out)
    failed, stopped = run_all(args, todo)
    failed += report_part(args)
    resume = ''
    if stopped:
        resume = f"(stopped to be resumed: {' '.join(stopped)}) "
    if failed:
        raise UserError(f"failed: {' '.join(failed)} {resume}(see <run>.log in {args.out}); "
                        'run the same command to retry')
    if stopped:
        raise UserError(f"stopped to be resumed: {' '.join(stopped)}; run the same command "
                        'again', code=75)


if __name__ == '__main__':
    sys.exit(common.main(lambda: run(sys.argv[1:])))
