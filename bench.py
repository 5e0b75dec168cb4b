"""bench.py: speed, memory and MFU of a dynpool training step (vanilla, fixed and dynamic pooling),
and cached against recomputed generation (docs/performance.md).

    python bench.py                                  # CPU sizes: d 256, L 512, batch 4, 12 configs
    python bench.py --preset paper                   # GPU: d 512, L 2048, batch 8, bf16
    python bench.py --configs vanilla,ws5.5,ws5.5+compile,ws5.5+blocked --plot bench.png
    python bench.py --generate                       # cached vs recomputed generation
"""
import argparse
import contextlib
import inspect
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time

import torch

import common
import hnet  # noqa: F401  (registers boundary='hnet' before dynpool's lists are read)
from common import UserError
from dynpool import Config, DynamicPoolingLM, step_flops
from runtime import pick_device, use_tf32
from presets import layer_counts

PRESETS = {
    'cpu': dict(d_model=256, n_head=4, d_head=64, d_inner=1024, seq_len=512, batch=4),
    'paper': dict(d_model=512, n_head=8, d_head=64, d_inner=2048, seq_len=2048, batch=8),
}
DEFAULT_CONFIGS = 'vanilla,fixed2,fixed3,fixed4,ws2,ws3,ws4,ws5,ws5.5,ws6,ws7,ws8'
PAPER_CONFIGS = ('vanilla,fixed2,fixed4,ws2,ws3,ws4,ws5,ws5.5,ws6,ws7,ws8,unigram5.5,entropy5.5,'
                 'gumbel5.5,hnet5.5')
GPU_EXTRA = 'vanilla+compile,ws5.5+compile,vanilla+blocked,ws5.5+blocked'  # paper preset on a GPU
CONFIG = re.compile(r'vanilla|(fixed|ws|unigram|entropy|gumbel|hnet)(\d+(?:\.\d*)?)')
ATTENTION = ('auto', 'sdpa', 'blocked')
VOCAB = 27   # text8's alphabet; id 0 is the space
CLOCKS = {'wall': time.perf_counter, 'cpu': time.process_time}


def parse_args(argv=None):
    """The flags, with what the preset and the device decide filled in. Every configuration that
    will run is built once as a Config, so a bad one is one UserError (exit 2) before any run."""
    p = common.Parser(prog='bench.py', description=__doc__.split('\n\n')[0],
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    a, size = p.add_argument, common.positive_int
    a('--preset', choices=PRESETS, default='cpu', help='sizes to start from (cpu: d 256, L 512, '
      'batch 4; paper: d 512, L 2048, batch 8); the flags below override single values')
    for flag, what in (('d-model', 'model width'), ('n-head', 'attention heads'),
                       ('d-head', 'width of one head'), ('d-inner', 'feed-forward width'),
                       ('seq-len', 'characters per sequence (L)'), ('batch', 'sequences per step')):
        a('--' + flag, type=size, help=what)
    a('--layers', type=layer_counts, default='2,8,2', help='pre,shortened,post (vanilla: the sum)')
    a('--dropout', type=common.fraction, default=0.1, help='residual dropout (0.1, as the paper)')
    a('--dropatt', type=common.fraction, default=0.1, help='attention dropout (0.1)')
    a('--attn-chunk', type=size, help='queries per attention block (Config.attn_chunk)')
    a('--attention', choices=ATTENTION, help='Config.attention of every configuration')
    a('--configs', help='comma-separated: vanilla, fixedK, wsK (K: mean segment length, e.g. '
      'ws5.5), unigramK, entropyK, gumbelK, hnetK; each optionally +compile, +sdpa, +blocked, '
      f'+auto. Default: {DEFAULT_CONFIGS}; --preset paper: {PAPER_CONFIGS} (GPU: +{GPU_EXTRA})')
    a('--steps', type=size, help='timed steps per configuration and round (3; 10 on a GPU)')
    a('--warmup', type=common.non_negative_int, help='untimed steps first (1; 3 on a GPU)')
    a('--rounds', type=size, help='rounds over the configurations (2; 1 on a GPU)')
    a('--device', help='cpu, cuda or cuda:N (default: cuda if there is one)')
    a('--amp', choices=['auto', 'off', 'bf16'], default='auto', help='bf16 autocast (auto: cuda)')
    a('--threads', type=common.int_range(1, os.cpu_count() or 1), help='torch.set_num_threads')
    a('--clock', choices=CLOCKS, default='wall', help="cpu: the process's CPU time, steady on a "
      'CPU other jobs share (with --threads 1; CPU only)')
    a('--adam', choices=['fused', 'foreach', 'loop'], default='fused', help='Adam implementation')
    a('--compile', action='store_true', help='torch.compile every configuration (as +compile)')
    a('--peak-n', type=size, help='n of the n^3 matmul that measures the peak (2048; 8192 cuda)')
    a('--peak-flops', type=common.positive_float, help="MFU against this FLOP/s (e.g. a GPU's "
      'nominal bf16 peak) instead of the measured peak')
    a('--no-pieces', action='store_true', help='no effect (the part timing is gone): old commands')
    a('--timeout', type=common.positive_float, help="seconds a configuration's process may take "
      '(default: none; 300 on a GPU)')
    a('--plot', metavar='FILE', help='PNG of step time and memory against shortening factor')
    a('--profile', metavar='CONFIG', help='print the torch.profiler table of one step of CONFIG')
    a('--generate', action='store_true', help='time cached generation against recomputation')
    a('--context', type=size, default=1024, help='--generate: characters of context')
    a('--new', type=size, default=128, help='--generate: characters generated with the cache')
    a('--gen-batch', type=size, default=1, help='--generate: sequences side by side')
    a('--recompute-steps', type=size, default=8, help='--generate: characters by recomputation')
    a('--seed', type=common.seed_int, default=0, help='seed of weights, characters, boundaries')
    a('--one', metavar='CONFIG', help=argparse.SUPPRESS)   # the child: one configuration → JSON
    args = p.parse_args(argv)
    args.device = pick_device(args.device)
    cuda = args.device.startswith('cuda')
    if args.device.startswith('mps') or args.clock == 'cpu' and cuda:
        raise UserError(f'--device {args.device}: bench.py runs on cpu or cuda, and with --clock '
                        'cpu on cpu only', code=2)
    if args.plot and (args.generate or args.profile):
        raise UserError('--plot draws the table, which --generate and --profile do not make', 2)
    default = dict(PRESETS[args.preset], steps=10 if cuda else 3, warmup=3 if cuda else 1,
                   rounds=1 if cuda else 2, peak_n=8192 if cuda else 2048,
                   timeout=300.0 if cuda else None,   # a GPU step is short and steady
                   configs=DEFAULT_CONFIGS if args.preset == 'cpu' else PAPER_CONFIGS + (
                       f',{GPU_EXTRA}' if cuda else ''))
    args.__dict__.update({k: v for k, v in default.items() if getattr(args, k) is None})
    args.amp = ('bf16' if cuda else 'off') if args.amp == 'auto' else args.amp
    args.layers = tuple(int(n) for n in args.layers.split(','))
    args.names = list(dict.fromkeys(args.configs.split(',')))   # '' is an unknown configuration
    single = args.one or args.profile
    for name in ('vanilla', 'ws5.5') if args.generate else [single] if single else args.names:
        model_config(args, name)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.where = (torch.cuda.get_device_name(args.device) if cuda else f'CPU, '
                  f'{torch.get_num_threads()} threads' + ', CPU time' * (args.clock == 'cpu'))
    return args


# ----------------------------------------------------------------------------- configurations
def model_config(args, name, **override):
    """'ws5.5+compile+blocked' → (its Config, K or None, compiled?); a bad name or Config's own
    refusal is one UserError (exit 2)."""
    base, *mods = name.split('+')
    m = CONFIG.fullmatch(base)
    if not m or not set(mods) <= {'compile', *ATTENTION}:
        raise UserError(f'unknown configuration {name!r}: use vanilla, fixedK, wsK, unigramK, '
                        'entropyK, gumbelK or hnetK, each optionally +compile, +sdpa, +blocked, '
                        '+auto', code=2)
    k = None if base == 'vanilla' else float(m[2])
    if k is not None and not (1 <= k <= args.seq_len and (m[1] != 'fixed' or k.is_integer())):
        raise UserError(f'configuration {name}: K must lie in [1, --seq-len {args.seq_len}] (an '
                        f'integer for fixed)', code=2)
    kw = dict(vocab_size=VOCAB, d_model=args.d_model, n_head=args.n_head, d_head=args.d_head,
              d_inner=args.d_inner, dropout=args.dropout, dropatt=args.dropatt,
              layers=args.layers, boundary={'ws': 'whitespace', None: 'none'}.get(m[1], m[1]),
              whitespace_id=0, fixed_factor=int(k) if m[1] == 'fixed' else 2)
    attention = next((a for a in reversed(mods) if a != 'compile'), args.attention)
    kw.update({f: v for f, v in (('attn_chunk', args.attn_chunk), ('attention', attention)) if v})
    try:
        return Config(**{**kw, **override}), k, args.compile or 'compile' in mods
    except ValueError as e:
        raise UserError(f'configuration {name}: {e}', code=2) from None


def prepared(args, name):
    """(model, step(), outs, (x, y, b)): the seeded model of `name`, training; a step (compiled if
    asked) with Adam at learning rate 0 (an update's arithmetic, weights unchanged, so every step
    pools alike), its output in outs[0]; x, y [B, L] random characters and the next ones; b [B, L]
    round(L/K) random boundaries per row for wsK (unigramK's targets), else None."""
    torch.manual_seed(args.seed)
    cfg, k, compiled = model_config(args, name)
    model = DynamicPoolingLM(cfg).to(args.device).train()
    gen = torch.Generator().manual_seed(args.seed)
    B, L = args.batch, args.seq_len
    x = torch.randint(0, VOCAB, (B, L + 1), generator=gen)
    b = None if cfg.boundary not in ('whitespace', 'unigram') else torch.stack([
        torch.randperm(L, generator=gen) < max(1, round(L / k)) for _ in range(B)]).float()
    x, y, b = (t if t is None else t.to(args.device) for t in (x[:, :-1], x[:, 1:], b))
    impl = {'fused': dict(fused=True), 'foreach': dict(foreach=True), 'loop': dict(foreach=False)}
    opt = torch.optim.Adam(model.parameters(), lr=0.0, **impl[args.adam])
    run, outs = torch.compile(model) if compiled else model, [None]

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=args.amp == 'bf16'):
            outs[0] = run(x, targets=y, boundaries=b)
        outs[0].loss.backward()
        opt.step()
    return model, step, outs, (x, y, b)


# ----------------------------------------------------------------------------- timing, memory
def time_calls(fn, n, args):
    """Seconds of each of n calls of fn() by args.clock, on a GPU until its work is done."""
    clock, times = CLOCKS[args.clock], []
    for _ in range(n):
        t = clock()
        fn()
        if args.device.startswith('cuda'):
            torch.cuda.synchronize()
        times.append(clock() - t)
    return times


def matmul_peak(args):
    """FLOP/s of the best of a few n×n×n matmuls in the training dtype: the machine's own peak."""
    n, cuda = args.peak_n, args.device.startswith('cuda')
    dtype = torch.bfloat16 if args.amp == 'bf16' else torch.float32
    a, b = (torch.randn(n, n, device=args.device, dtype=dtype) for _ in 'ab')
    time_calls(lambda: torch.mm(a, b), 10 if cuda else 1, args)   # warm-up: GPU clocks rise
    return 2 * n ** 3 / min(time_calls(lambda: torch.mm(a, b), 20 if cuda else 5, args))


def resident(field):
    """This process's resident set (VmRSS) or its peak since the last reset (VmHWM) in bytes;
    without Linux's /proc, the peak over the whole process (getrusage)."""
    try:
        with open('/proc/self/status') as f:
            return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith(field + ':'))
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (
            1 if sys.platform == 'darwin' else 1024)


# ----------------------------------------------------------------------------- the table
def run_one(args, name):
    """The child: warm up, time args.steps steps, print one JSON line (--profile: the profiler's
    table of one step). Memory: the peak over the timed steps (compilation and autotuning are not
    in it); step mem: that peak minus the use before the warm-up (gradients, Adam moments count)."""
    step, outs = prepared(args, name)[1:3]
    cuda = args.device.startswith('cuda')
    base = torch.cuda.memory_allocated() if cuda else resident('VmRSS')
    time_calls(step, max(args.warmup, bool(args.profile)), args)
    if args.profile:
        with torch.profiler.profile() as prof:   # CPU, and CUDA where there is one
            time_calls(step, 1, args)
        sort = f'self_{"device" if cuda else "cpu"}_time_total'
        return print(prof.key_averages().table(row_limit=25, sort_by=sort))
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    else:   # restart VmHWM at the resident set of now (Linux; elsewhere the process's peak stays)
        with contextlib.suppress(OSError), open('/proc/self/clear_refs', 'w') as f:
            f.write('5')
    times = time_calls(step, args.steps, args)
    peak = torch.cuda.max_memory_allocated() if cuda else resident('VmHWM')
    sf = outs[0].shortening_factor
    print(json.dumps(dict(name=name, times=times, peak=peak, step_mem=peak - base,
                          sf=1.0 if sf is None else float(sf))), flush=True)


def spawn(args, name):
    """Configuration `name` in a fresh process (so its peak memory cannot hide behind another's,
    and --timeout can stop it) → (its record, None) or (None, why it failed)."""
    cmd = [sys.executable, os.path.abspath(__file__), *args.argv, '--one', name]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return None, f'took over {args.timeout:g} s (--timeout)'
    if r.returncode:
        why = (r.stderr.strip().splitlines() or [f'exit status {r.returncode}'])[-1]
        return None, why.removeprefix('error: ') + ' (killed: out of memory?)' * (r.returncode < 0)
    return json.loads(r.stdout.strip().splitlines()[-1]), None


def measure(args):
    """Every configuration in interleaved rounds (a noisy neighbour slows all alike), the matmul
    peak before each → ({name: row}, {name: why it failed}, peak). A row: the median step over
    all rounds, peak and step memory, SF, model FLOPs."""
    dtype = 'bf16 autocast' if args.amp == 'bf16' else 'fp32' + ' (TF32 matmuls)' * (
        args.device.startswith('cuda'))
    print(f'dynpool training step: d {args.d_model}, heads {args.n_head}×{args.d_head}, d_inner '
          f'{args.d_inner}, L {args.seq_len}, batch {args.batch}, layers {args.layers}, dropout '
          f'{args.dropout}/{args.dropatt}, {dtype}, {args.adam} Adam, {args.where}, torch '
          f'{torch.__version__}\n{args.rounds} rounds × {len(args.names)} configurations, each a '
          f'fresh process: {args.warmup} warm-up + {args.steps} timed steps')
    width = max(map(len, args.names))
    runs, failed, peaks = {n: [] for n in args.names}, {}, []
    for r in range(args.rounds):
        peaks.append(matmul_peak(args))
        torch.cuda.empty_cache()   # the children get the memory the matrices held (no-op on CPU)
        for n in [n for n in args.names if n not in failed]:
            record, why = spawn(args, n)
            if record:
                runs[n].append(record)
                why = f'{statistics.median(record["times"]) * 1e3:9.0f} ms'
            else:
                failed[n], why = why, f'failed: {why}'
            print(f'  round {r + 1}: {n:{width}s} {why}', flush=True)
    print(f'\nmatmul peak: {max(peaks) / 1e9:.1f} GFLOP/s ({args.peak_n}^3 {dtype}, best of '
          f'{len(peaks)})')
    return summarise(args, {n: v for n, v in runs.items() if n not in failed}), failed, max(peaks)


def summarise(args, runs):
    """{name: [records]} → {name: row} (see measure)."""
    table = {}
    for n, rs in runs.items():
        sf, cfg = rs[0]['sf'], model_config(args, n)[0]
        n_short = None if cfg.boundary == 'none' else 1 + args.seq_len / sf
        table[n] = dict(time=statistics.median(t for r in rs for t in r['times']), sf=sf,
                        peak=max(r['peak'] for r in rs),
                        mem=statistics.median(r['step_mem'] for r in rs),
                        flops=step_flops(cfg, args.batch, args.seq_len, n_short))
    return table


def print_table(args, table, peak):
    """The FLOP formula, then the table: speed-up and memory ratio against vanilla with the same
    +suffixes (or plain vanilla), if measured."""
    doc = '\n'.join('  ' + ln for ln in inspect.cleandoc(step_flops.__doc__).splitlines())
    print(f'model FLOPs (dynpool.step_flops, n_short = 1 + L/SF, SF measured in the step):\n{doc}')
    w = max(8, *map(len, table))
    mem = 'peak alloc MiB' if args.device.startswith('cuda') else 'peak RSS MiB'
    print(f'\n{"config":{w}s} {"SF":>6s} {"step ms":>9s} {"chars/s":>9s} {"speed-up":>8s} '
          f'{mem:>14s} {"step mem MiB":>13s} {"mem ratio":>9s} {"GFLOP":>8s} {"GFLOP/s":>8s} '
          f'{"MFU":>6s}')
    for n, row in table.items():
        van = table.get('vanilla' + n[len(n.split('+')[0]):]) or table.get('vanilla')
        speed = f'{van["time"] / row["time"]:7.2f}×' if van else f'{"-":>8s}'
        ratio = f'{row["mem"] / van["mem"]:9.2f}' if van and van['mem'] > 0 else f'{"-":>9s}'
        fps = row['flops'] / row['time']
        print(f'{n:{w}s} {row["sf"]:6.2f} {row["time"] * 1e3:9.0f} '
              f'{args.batch * args.seq_len / row["time"]:9.0f} {speed} {row["peak"] / 2**20:14.0f} '
              f'{row["mem"] / 2**20:13.0f} {ratio} {row["flops"] / 1e9:8.1f} {fps / 1e9:8.1f} '
              f'{100 * fps / peak:5.0f}%')
    print(f"speed-up: vanilla step time / this one; mem ratio: step mem / vanilla's; SF: "
          f'characters / complete segments; MFU against {peak / 1e9:.1f} GFLOP/s'
          + (' (--peak-flops)' if args.peak_flops else ' (the matmul peak)'))


def plot(args, table, plt):
    """Step time and step memory against SF, fixed and ws, vanilla as a line."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, scale, label in ((axes[0], 'time', 1e3, 'training step (ms)'),
                                  (axes[1], 'mem', 2 ** -20, 'step memory (MiB)')):
        for prefix, what, marker in (('fixed', 'fixed pooling', 's'),
                                     ('ws', 'dynamic (word-like) pooling', 'o')):
            ns = sorted((n for n in table if n.startswith(prefix) and '+' not in n),
                        key=lambda n: table[n]['sf'])
            ax.plot([table[n]['sf'] for n in ns], [table[n][key] * scale for n in ns],
                    marker=marker, label=what)
        if 'vanilla' in table:
            ax.axhline(table['vanilla'][key] * scale, color='k', ls='--', label='vanilla')
        ax.set(xlabel='shortening factor', ylabel=label, ylim=(0, None))
    axes[0].legend()
    fig.suptitle(f'd {args.d_model}, L {args.seq_len}, batch {args.batch}, {args.where}')
    fig.tight_layout()
    common.write_atomic(args.plot, lambda tmp: fig.savefig(tmp, dpi=120, format='png'))
    print(f'plot written to {args.plot}')


# ----------------------------------------------------------------------------- generation
def bench_generate(args):
    """Characters/s of model.generate (cached, prefill included) against recomputing the whole
    sequence for each character, both greedy from the same text-like prompt x [B, C]."""
    gen = torch.Generator().manual_seed(args.seed)
    x = torch.randint(1, VOCAB, (args.gen_batch, args.context), generator=gen)
    x[torch.rand(x.shape, generator=gen) < 1 / 5.5] = 0   # spaces: word-like segments for ws5.5
    x, n, m = x.to(args.device), args.new, args.recompute_steps
    print(f'generation: context {args.context}, batch {args.gen_batch}, d {args.d_model}, layers '
          f'{args.layers}, {args.where}; both methods greedy from the same prompt\n'
          f'  {"model":10s} {"method":36s} {"chars/s":>9s} {"speed-up":>9s}')

    def recompute(model, seq):
        for _ in range(m):
            seq = torch.cat([seq, model(seq).logits[:, -1:].argmax(-1)], 1)
    for name in ('vanilla', 'ws5.5'):
        torch.manual_seed(args.seed)
        model = DynamicPoolingLM(model_config(args, name, dropout=0.0, dropatt=0.0)[0])
        model = model.to(args.device).eval()
        with torch.no_grad():
            time_calls(lambda: model.generate(x, min(4, n), greedy=True), 1, args)   # warm-up
            rates = [args.gen_batch * k / time_calls(fn, 1, args)[0] for k, fn in (
                (n, lambda: model.generate(x, n, greedy=True)), (m, lambda: recompute(model, x)))]
        for method, r in zip(('model.generate (prefill included)', 'full recomputation'), rates):
            print(f'  {name:10s} {method:36s} {r:9.1f} {r / rates[1]:8.1f}×')


# ----------------------------------------------------------------------------- main
def run(argv):
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    args = parse_args(argv)
    args.argv = argv   # the children are started with the parent's own flags
    if args.device.startswith('cuda'):
        torch.cuda.set_device(torch.device(args.device))
    use_tf32(args.device)   # as train.py trains
    if args.one or args.generate or args.profile:
        return bench_generate(args) if args.generate else run_one(args, args.one or args.profile)
    plt = common.import_pyplot('--plot') if args.plot else None   # before minutes of measuring
    table, failed, peak = measure(args)
    if table:
        print_table(args, table, args.peak_flops or peak)
        if plt:
            plot(args, table, plt)
    if failed:
        raise UserError(f'{len(failed)} of {len(args.names)} configurations failed (left out of '
                        f'the table): ' + '; '.join(f'{n}: {why}' for n, why in failed.items()))


def main(argv=None):
    return common.main(lambda: run(argv))


if __name__ == '__main__':
    sys.exit(main())
