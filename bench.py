"""bench.py: speed, memory and MFU of a dynpool training step (vanilla, fixed and
dynamic pooling), and cached against recomputed generation (docs/performance.md).

    python bench.py                   # CPU sizes: d 256, L 512, batch 4, 12 configs
    python bench.py --preset paper    # GPU: the paper's model (Config()), L 2048, batch 8
    python bench.py --data data/wiki40b-he-bytes --import my_source.py --configs vanilla,mine
    python bench.py --configs vanilla,ws5.5,ws5.5+compile,ws5.5+blocked
    python bench.py --generate                       # cached vs recomputed generation
"""
import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import checkpoint
import common
import dynpool
import flags
from common import UserError, nonblank
from dataset import read_meta
from dynpool import DynamicPoolingLM, step_flops
from runtime import (AMP_DTYPES, Processes, generation_bytes, peak_mem_mb, pick_device,
                     proc_bytes, require_memory, setup_device, setup_precision,
                     start_processes)

DEFAULT_CONFIGS = 'vanilla,fixed2,fixed3,fixed4,ws2,ws3,ws4,ws5,ws5.5,ws6,ws7,ws8'
# --preset paper: these, then every registered source that takes no K (vanilla first)
PAPER_K = 'fixed2,fixed4,ws2,ws3,ws4,ws5,ws5.5,ws6,ws7,ws8,unigram5.5'
# added to the paper preset's on a GPU
GPU_EXTRA = ',vanilla+compile,ws5.5+compile,vanilla+blocked,ws5.5+blocked'
# The paper preset's model is Config()'s: the sizes it leaves unset keep Config's
# defaults. Its batch and length are those of train.py's GPU recipe (flags.GPU_PRESET).
PRESETS = {
    'cpu': dict(d_model=256, n_head=4, d_head=64, d_inner=1024, seq_len=512, batch=4,
                configs=DEFAULT_CONFIGS),
    'paper': dict(seq_len=flags.GPU_PRESET['seq_len'],
                  batch=flags.GPU_PRESET['batch_size']),
}
# The flags whose default depends on the device: a GPU step is short and steady (on
# CPU no --timeout).
GPU_DEFAULTS = dict(steps=10, warmup=3, rounds=1, peak_n=8192, timeout=300.0)
CPU_DEFAULTS = dict(steps=3, warmup=1, rounds=2, peak_n=2048)
# A configuration's name: the boundary mode ('vanilla' for none, 'ws' for whitespace,
# any other registered source by its name, an --import'ed one too), and K where K sets
# the boundaries: fixed's segment length, ws's and unigram's boundary rate 1/K. The
# predicted sources pool where their untrained predictor decides (the SF column).
SHORT_NAMES = {'none': 'vanilla', 'whitespace': 'ws'}
WITH_K = ('fixed', 'ws', 'unigram')
SUFFIXES = ('compile', 'auto', 'sdpa', 'blocked')
GENERATED = ('vanilla', 'ws5.5')   # the models --generate times
PAPER_FILE = Path('out/bench-paper.json')   # --preset paper's FLOP/s, for study.sh


def config_names():
    """{configuration name without K: boundary mode} of the sources registered now."""
    return {SHORT_NAMES.get(mode, mode): mode for mode in dynpool.BOUNDARY_MODES}


def forms():
    """The configurations' forms, in words."""
    names = [name + 'K' * (name in WITH_K) for name in config_names()]
    return f'{", ".join(names)}, each optionally +{", +".join(SUFFIXES)}'


def paper_configs():
    """--preset paper's configurations: vanilla, PAPER_K, then the other sources."""
    names = [name for name in config_names() if name not in WITH_K]
    return ','.join([names[0], PAPER_K, *names[1:]])


def parser():
    """The flags; model_flags and measuring_flags add most of them."""
    p = common.Parser(prog='bench.py', description=__doc__.split('\n\n')[0])
    p.add_argument('--preset', choices=PRESETS, default='cpu',
                   help="sizes to start from (cpu: d 256, L 512, batch 4; paper: the paper's "
                        'model, L 2048, batch 8); the flags below override single values')
    vocab = p.add_mutually_exclusive_group()
    vocab.add_argument('--data', type=nonblank, metavar='DIR',
                       help="a dataset (prepare_data.py's folder): its meta.json's vocabulary "
                            'and space')
    vocab.add_argument('--vocab', type=common.positive_int, default=27,
                       help="token ids 0..N-1, id 0 standing for the space (27: text8's)")
    flags.add_import_flag(p)
    model_flags(p)
    p.add_argument('--configs',
                   help=f'comma-separated: {forms()} (K: see docs/performance.md, e.g. '
                        "ws5.5; an --import'ed source: its name). Default: "
                        f'{DEFAULT_CONFIGS}; --preset paper: {paper_configs()} (GPU: '
                        f'{GPU_EXTRA[1:]})')
    measuring_flags(p)
    p.add_argument('--generate', action='store_true',
                   help='time cached generation against recomputation')
    # --generate's sizes: {flag: (default, what it counts)}
    generation = {'--context': (1024, 'characters of context'),
                  '--new': (128, 'characters generated with the cache'),
                  '--gen-batch': (1, 'sequences side by side'),
                  '--recompute-steps': (8, 'characters by recomputation')}
    for flag, (default, what) in generation.items():
        p.add_argument(flag, type=common.positive_int, default=default,
                       help=f'--generate: {what}')
    p.add_argument('--beside', action='store_true',
                   help="time the README quick start's training (data/text8) alone, then "
                        'beside a second one, both at their default threads: the ratio')
    p.add_argument('--seed', type=common.seed_int, default=0,
                   help='seed of weights, characters, boundaries')
    p.add_argument('--one', metavar='CONFIG', help=argparse.SUPPRESS)   # a child's
    return p


def model_flags(p):
    """The model's sizes and Config fields (unset: the Config's default); train.py's
    flags of the model and its sources (flags.add_model_flags)."""
    # unset: Config's, the paper's (model_config passes only the flags that are set; the
    # cpu preset sets the widths)
    flags.add_size_flags(p)
    sizes = {'--seq-len': 'characters per sequence (L)', '--batch': 'sequences per step',
             '--attn-chunk': 'queries per attention block'}
    for flag, what in sizes.items():
        p.add_argument(flag, type=common.positive_int, help=what)
    flags.add_model_flags(p)


def measuring_flags(p):
    """How a step is run and timed."""
    size = common.positive_int
    p.add_argument('--steps', type=size, help='timed steps per config, round (3; GPU 10)')
    p.add_argument('--warmup', type=common.non_negative_int,
                   help='untimed steps first (1; 3 on a GPU)')
    p.add_argument('--rounds', type=size, help='rounds over the configs (2; GPU 1)')
    flags.add_device_flag(p)
    flags.add_amp_flag(p)
    p.set_defaults(amp='auto')
    p.add_argument('--peak-n', type=size,
                   help='n of the n^3 matmul that measures the peak (2048; 8192 cuda)')
    p.add_argument('--no-pieces', action='store_true', help='no effect: old commands')
    p.add_argument('--timeout', type=common.positive_float,
                   help="seconds a configuration's process may take (default: none; GPU "
                        '300)')


def parse_args(argv=None):
    """The flags, with what the preset and the device decide filled in. Every
    configuration that will run is built once as a Config, so a bad one is one UserError
    (exit 2) before any run."""
    if argv is None:
        argv = sys.argv[1:]
    flags.import_sources(argv)
    args = parser().parse_args(argv)
    args.argv = argv   # the children are started with the parent's own flags
    args.device = pick_device(args.device)
    args.cuda = args.device.startswith('cuda')
    if args.device == 'mps':
        raise UserError(f'--device {args.device}: bench.py runs on cpu or cuda', code=2)
    defaults = dict(PRESETS[args.preset], **(GPU_DEFAULTS if args.cuda else CPU_DEFAULTS))
    if args.preset == 'paper':
        defaults['configs'] = paper_configs()
        if args.cuda:
            defaults['configs'] += GPU_EXTRA
    args.space_id = 0
    if args.data:
        meta = read_meta(args.data)
        args.vocab = meta['vocab_size']
        args.space_id = meta['space_id']
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.amp, args.autocast, args.scaler = setup_precision(args.amp, torch.device(args.device).type)
    # '' is an unknown configuration
    args.names = list(dict.fromkeys(args.configs.split(',')))
    if args.one:
        args.names = [args.one]
    if args.generate:
        args.names = GENERATED
    for name in args.names:
        model_config(args, name)
    threads = setup_device(args.device, args.threads)
    args.where = f'CPU, {threads} threads'
    if args.cuda:
        args.where = torch.cuda.get_device_name(args.device)
    return args


# -----------------------------------------------------------------------------
# configurations
def model_config(args, name):
    """'ws5.5+compile+blocked' → (its Config, K or None, compiled?); a bad name or
    Config's own refusal is one UserError (exit 2)."""
    base, *suffixes = name.split('+')
    k = None
    match = re.fullmatch(rf'({"|".join(WITH_K)})(\d+(?:\.\d*)?)', base)
    if match:
        base = match[1]
        k = float(match[2])
    boundary = config_names().get(base)
    known = boundary and (k is not None) == (base in WITH_K)
    if not known or not set(suffixes) <= set(SUFFIXES):
        raise UserError(f'unknown configuration {name!r}: use {forms()}', code=2)
    if k is not None and not (1 <= k <= args.seq_len and (base != 'fixed' or k.is_integer())):
        raise UserError(f'configuration {name}: K must lie in [1, --seq-len {args.seq_len}] '
                        '(an integer for fixed)', code=2)
    # the flags that are set (config_from_dict keeps Config's fields)
    fields = {key: value for key, value in vars(args).items() if value is not None}
    if boundary == 'fixed':
        fields['fixed_factor'] = int(k)
    # an attention suffix (the last, where several) sets Config.attention
    for suffix in suffixes:
        if suffix != 'compile':
            fields['attention'] = suffix
    try:
        cfg = checkpoint.config_from_dict(fields, vocab_size=args.vocab,
                                          boundary=boundary, whitespace_id=args.space_id)
    except UserError as e:
        raise UserError(f'configuration {name}: {e}', code=2) from None
    return cfg, k, 'compile' in suffixes


def shape(args):
    """The model every configuration shares, and the device, in words."""
    cfg = model_config(args, 'vanilla')[0]
    return (f'd {cfg.d_model}, heads {cfg.n_head}×{cfg.d_head}, d_inner {cfg.d_inner}, layers '
            f'{cfg.layers}, dropout {cfg.dropout}/{cfg.dropatt}, vocab {cfg.vocab_size}, '
            f'{args.where}')


def prepared(args, name):
    """(model, step(), outs, (x, y, b)): the seeded model of `name`, training; a step
    (compiled if asked) with Adam at learning rate 0 (an update's arithmetic, weights
    unchanged, so every step pools alike), its output in outs[0]; x, y [B, L] random
    characters and the next ones; b [B, L] round(L/K) random boundaries per row for wsK
    (unigramK's targets), else None."""
    torch.manual_seed(args.seed)
    cfg, k, compiled = model_config(args, name)
    model = DynamicPoolingLM(cfg).to(args.device)
    gen = torch.Generator().manual_seed(args.seed)
    B, L = args.batch, args.seq_len
    chars = torch.randint(0, args.vocab, (B, L + 1), generator=gen).to(args.device)
    x = chars[:, :-1]
    y = chars[:, 1:]
    b = None
    if cfg.boundary in ('whitespace', 'unigram'):
        # each row's positions in a random order (the ranks of uniform numbers): the
        # first round(L/K) of them are its boundaries
        order = torch.rand(B, L, generator=gen).argsort(-1)
        b = (order < max(1, round(L / k))).float().to(args.device)
    opt = torch.optim.Adam(model.parameters(), lr=0.0, fused=True)
    run = torch.compile(model) if compiled else model
    outs = [None]

    def step():
        opt.zero_grad()
        with args.autocast:
            outs[0] = run(x, targets=y, boundaries=b)
        args.scaler.scale(outs[0].loss).backward()
        args.scaler.step(opt)
        args.scaler.update()
    return model, step, outs, (x, y, b)


# ----------------------------------------------------------------------------- timing,
# memory
def time_calls(fn, n, args):
    """Seconds of each of n calls of fn(), on a GPU until its work is
    done."""
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        if args.cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def matmul_peak(args):
    """FLOP/s of the best of a few n×n×n matmuls in the training dtype:
    the machine's own peak (the best: the first calls warm up, a GPU's clocks rise)."""
    n = args.peak_n
    # the dtype runtime.setup_precision's autocast computes in (amp off: float32)
    dtype = AMP_DTYPES.get(args.amp, torch.float32)
    a = torch.randn(n, n, device=args.device, dtype=dtype)
    calls = 30 if args.cuda else 6
    return 2 * n ** 3 / min(time_calls(lambda: torch.mm(a, a), calls, args))


# ----------------------------------------------------------------------------- the table
def resident(field):
    """This process's resident set (VmRSS) or its peak since the last reset (VmHWM) in
    bytes; without /proc, the peak over the whole process."""
    return proc_bytes('/proc/self/status', field, peak_mem_mb('cpu') * 2**20)


def run_one(args, name):
    """The child: warm up, time args.steps steps, print one JSON line. Memory: the peak
    over the timed steps (compilation and autotuning are not in it); step mem: that peak
    minus the use before the warm-up (gradients, Adam moments count)."""
    step, outs = prepared(args, name)[1:3]
    base = torch.cuda.memory_allocated() if args.cuda else resident('VmRSS')
    time_calls(step, args.warmup, args)
    if args.cuda:
        torch.cuda.reset_peak_memory_stats()
    else:   # VmHWM restarts at the resident set of now (Linux; elsewhere: the peak stays)
        with contextlib.suppress(OSError):
            Path('/proc/self/clear_refs').write_text('5')
    times = time_calls(step, args.steps, args)
    peak = torch.cuda.max_memory_allocated() if args.cuda else resident('VmHWM')
    sf = outs[0].shortening_factor
    sf = 1.0 if sf is None else float(sf)
    print(json.dumps(dict(name=name, times=times, peak=peak, step_mem=peak - base, sf=sf)),
          flush=True)


def last_words(stderr, returncode):
    """Why a process failed: its last line on stderr (without 'error: '), else its exit
    status."""
    said = (stderr.strip().splitlines() or [f'exit status {returncode}'])[-1]
    return said.removeprefix('error: ')


def spawn(args, name):
    """Configuration `name` in a fresh process (so its peak memory
    cannot hide behind another's, and --timeout can stop it) → (its
    record, None) or (None, why it failed). """
    cmd = [sys.executable, os.path.abspath(__file__), *args.argv, '--one', name]
    try:
        child = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return None, f'took over {args.timeout:g} s (--timeout)'
    if child.returncode == 0:
        return json.loads(child.stdout.splitlines()[-1]), None
    why = last_words(child.stderr, child.returncode)
    if child.returncode < 0:
        why += ' (killed: out of memory?)'
    return None, why


def measure(args):
    """Every configuration in interleaved rounds (a noisy neighbour slows all alike),
    the matmul peak before each → ({name: row}, {name: why it failed}, peak). A row: the
    median step over all rounds, peak and step memory, SF, model FLOPs."""
    print(f'dynpool training step: {shape(args)}, L {args.seq_len}, batch {args.batch}, amp '
          f'{args.amp}, torch {torch.__version__}')
    print(f'{args.rounds} rounds × {len(args.names)} configurations, each a fresh process: '
          f'{args.warmup} warm-up + {args.steps} timed steps')
    width = max(map(len, args.names))
    runs = {name: [] for name in args.names}   # a failed configuration leaves it
    failed = {}
    peaks = []
    for round_number in range(args.rounds):
        peaks.append(matmul_peak(args))
        torch.cuda.empty_cache()   # the matrices' memory to the children (no-op on CPU)
        for name in list(runs):
            record, why = spawn(args, name)
            if record:
                runs[name].append(record)
                said = f'{statistics.median(record["times"]) * 1e3:9.0f} ms'
            else:
                failed[name] = why
                del runs[name]
                said = f'failed: {why}'
            print(f'  round {round_number + 1}: {name:{width}s} {said}', flush=True)
    print(f'\nmatmul peak: {max(peaks) / 1e9:.1f} GFLOP/s ({args.peak_n}^3, amp {args.amp}, best '
          f'of {len(peaks)})')
    return summarise(args, runs), failed, max(peaks)


def summarise(args, runs):
    """{name: [records]} → {name: row} (see measure): the boundary mode, SF, the median
    step in seconds, chars/s, model FLOPs of a step, FLOP/s, peak and step memory in
    bytes. PAPER_FILE keeps these rows."""
    table = {}
    for name, records in runs.items():
        sf = records[0]['sf']
        cfg = model_config(args, name)[0]
        step_s = statistics.median(t for record in records for t in record['times'])
        # (vanilla has no shortened stage: step_flops ignores it)
        flops = step_flops(cfg, args.batch, args.seq_len,
                           dynpool.shortened_length(args.seq_len, sf))
        peak_bytes = max(record['peak'] for record in records)
        step_mem_bytes = statistics.median(record['step_mem'] for record in records)
        table[name] = dict(boundary=cfg.boundary, sf=sf, step_s=step_s,
                           chars_per_s=args.batch * args.seq_len / step_s, flops=flops,
                           flops_per_s=flops / step_s, peak_bytes=peak_bytes,
                           step_mem_bytes=step_mem_bytes)
    return table


def print_table(args, table, peak):
    """The FLOP formula, then the table: speed-up and memory ratio against vanilla with
    the same +suffixes (or plain vanilla), if measured."""
    print('model FLOPs: dynpool.step_flops, the shortened stage at 1 + L/SF '
          '(dynpool.shortened_length), SF measured in the step')
    w = max(8, *map(len, table))
    mem = 'peak alloc MiB' if args.cuda else 'peak RSS MiB'
    print(f'\n{"config":{w}s} {"SF":>6s} {"step ms":>9s} {"chars/s":>9s} {"speed-up":>8s} '
          f'{mem:>14s} {"step mem MiB":>13s} {"mem ratio":>9s} {"GFLOP":>8s} {"GFLOP/s":>8s} '
          f'{"MFU":>6s}')
    for name, row in table.items():
        suffixes = name[len(name.split('+')[0]):]
        van = table.get('vanilla' + suffixes) or table.get('vanilla')
        speed = f'{"-":>8s}'
        ratio = f'{"-":>9s}'
        if van:
            speed = f'{van["step_s"] / row["step_s"]:7.2f}×'
        if van and van['step_mem_bytes'] > 0:
            ratio = f'{row["step_mem_bytes"] / van["step_mem_bytes"]:9.2f}'
        print(f'{name:{w}s} {row["sf"]:6.2f} {row["step_s"] * 1e3:9.0f} {row["chars_per_s"]:9.0f} '
              f'{speed} {row["peak_bytes"] / 2**20:14.0f} {row["step_mem_bytes"] / 2**20:13.0f} '
              f'{ratio} {row["flops"] / 1e9:8.1f} {row["flops_per_s"] / 1e9:8.1f} '
              f'{100 * row["flops_per_s"] / peak:5.0f}%')
    print("speed-up: vanilla step time / this one; mem ratio: step mem / vanilla's; SF: "
          f'characters / complete segments; MFU against the matmul peak, {peak / 1e9:.1f} GFLOP/s')


def record_paper(args, table):
    """--preset paper: this device's measurements merged into PAPER_FILE under its name
    (study.sh prices runs with them), other devices' kept: the median model FLOP/s over
    the configurations, what was measured how, and each configuration's row (summarise)."""
    entries = {}
    if PAPER_FILE.exists():
        try:
            entries = json.loads(PAPER_FILE.read_text())
        except ValueError:
            entries = None
        if not isinstance(entries, dict):
            raise UserError(f'{PAPER_FILE} is not a JSON object of measurements: move it '
                            'away')
    flops_per_s = statistics.median(row['flops_per_s'] for row in table.values())
    entries[args.where] = dict(flops_per_s=flops_per_s, device=args.where,
                               date=str(datetime.date.today()), torch=torch.__version__,
                               amp=args.amp, batch=args.batch, seq_len=args.seq_len,
                               vocab=args.vocab,
                               model=dataclasses.asdict(model_config(args, 'vanilla')[0]),
                               configs=table)
    PAPER_FILE.parent.mkdir(exist_ok=True)
    common.write_atomic(PAPER_FILE, json.dumps(entries, indent=1) + '\n')
    print(f'{flops_per_s / 1e9:.1f} GFLOP/s on {args.where} recorded in {PAPER_FILE}')


# -----------------------------------------------------------------------------
# generation
def bench_generate(args):
    """Characters/s of model.generate (cached, prefill included)
    against recomputing the whole sequence for each character, both
    greedy from the same text-like prompt x [B, C]."""
    n = args.new
    m = args.recompute_steps
    for name in GENERATED:   # priced before any tensor of that size is made
        need = generation_bytes(model_config(args, name)[0], args.gen_batch, args.context,
                                max(n, m))
        require_memory(need, f'generating with {name}', args.device,
                       'lower --gen-batch, --context or --new')
    gen = torch.Generator().manual_seed(args.seed)
    x = torch.randint(0, args.vocab, (args.gen_batch, args.context), generator=gen)
    # spaces: word-like segments for ws5.5
    x[torch.rand(x.shape, generator=gen) < 1 / 5.5] = args.space_id
    x = x.to(args.device)
    print(f'generation: {shape(args)}, context {args.context}, batch {args.gen_batch}; both '
          'methods greedy from the same prompt')
    print(f'  {"model":10s} {"method":36s} {"chars/s":>9s} {"speed-up":>9s}')
    for name in GENERATED:
        torch.manual_seed(args.seed)
        # (eval: no dropout)
        model = DynamicPoolingLM(model_config(args, name)[0]).to(args.device).eval()

        def recompute():
            seq = x
            for _ in range(m):
                seq = torch.cat([seq, model(seq).logits[:, -1:].argmax(-1)], 1)
        with torch.no_grad():   # a short warm-up generation, then the two timed
            model.generate(x, min(4, n), greedy=True)
            cached_s = time_calls(lambda: model.generate(x, n, greedy=True), 1, args)[0]
            cached_rate = args.gen_batch * n / cached_s
            full_rate = args.gen_batch * m / time_calls(recompute, 1, args)[0]
        print(f'  {name:10s} {"model.generate (prefill included)":36s} {cached_rate:9.1f} '
              f'{cached_rate / full_rate:8.1f}×')
        print(f'  {name:10s} {"full recomputation":36s} {full_rate:9.1f} {1:8.1f}×')


# ----------------------------------------------------------------------------- main
def run(argv):
    args = parse_args(argv)
    start_processes(args.device, Processes())   # (CUDA's device set, as train.py's)
    if args.generate:
        return bench_generate(args)
    if args.beside:
        return bench_beside(args)
    if args.one:
        return run_one(args, args.one)
    table, failed, peak = measure(args)
    if table:
        print_table(args, table, peak)
        if args.preset == 'paper':
            record_paper(args, table)
    if failed:
        reasons = '; '.join(f'{name}: {why}' for name, why in failed.items())
        raise UserError(f'{len(failed)} of {len(args.names)} configurations failed (left '
                        f'out of the table): {reasons}')



def main(argv=None):
    return common.main(lambda: run(argv))


# --beside: the steps a run is timed over, and those of the second run, which covers them
BESIDE_STEPS = 40


def bench_beside(args):
    """The quick start's training (train.py --boundary whitespace --device cpu, at its
    defaults) alone, then with a second identical one started beside it: seconds a step,
    from train_time and step in each run's log.jsonl (steps 10 to BESIDE_STEPS), and
    their ratio. --threads passes on to both; else the environment's OMP_NUM_THREADS is
    left out, so that each takes train.py's default."""
    env = dict(os.environ)
    env.pop('OMP_NUM_THREADS', None)
    command = [sys.executable, 'train.py', '--boundary', 'whitespace', '--device', 'cpu']
    if args.threads:
        command += ['--threads', str(args.threads)]
    with tempfile.TemporaryDirectory() as folder:

        def start(name, steps):
            """train.py into folder/name, stopped after `steps` steps."""
            run_flags = ['--out', f'{folder}/{name}', '--stop-step', str(steps)]
            return subprocess.Popen(command + run_flags, env=env, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, text=True)

        def seconds_a_step(name, run):
            """When `run` has ended: (seconds a step, threads) from its log."""
            err = run.communicate()[1]
            if run.returncode != 0:
                said = last_words(err, run.returncode)
                raise UserError(f'--beside: the training failed: {said}')
            lines = Path(folder, name, 'log.jsonl').read_text().splitlines()
            records = [json.loads(line) for line in lines]
            steps = [record for record in records if record['kind'] == 'train']
            seconds = steps[-1]['train_time'] - steps[0]['train_time']
            return seconds / (steps[-1]['step'] - steps[0]['step']), records[0]['threads']

        alone, threads = seconds_a_step('alone', start('alone', BESIDE_STEPS))
        # the second one runs longer, so that every timed step has it beside
        second = start('second', 3 * BESIDE_STEPS)
        beside = seconds_a_step('first', start('first', BESIDE_STEPS))[0]
        second.terminate()   # (it saves and exits 75)
        second.communicate()
    print(f"the quick start's training, steps 10 to {BESIDE_STEPS}, {threads} thread(s) "
          'each:')
    print(f'  alone            {1000 * alone:8.0f} ms/step')
    print(f'  beside another   {1000 * beside:8.0f} ms/step')
    print(f'  ratio            {beside / alone:8.2f}')


if __name__ == '__main__':
    sys.exit(main())
