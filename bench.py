"""
bench.py: speed and memory of a dynpool training step (vanilla vs fixed vs dynamic pooling),
the cost of each piece of a step, and cached vs recomputed generation.

A training step is forward + backward + Adam step on random characters, timed after warm-up; the
figure is the median over all timed steps. Every configuration runs in a fresh process of its own
(`bench.py --one CONFIG`, spawned by the parent), so that its peak memory cannot hide behind
another's; the rounds interleave the configurations, so a noisy neighbour slows them all alike.
Dynamic pooling at mean segment length k is whitespace-mode pooling with external boundaries:
each row gets exactly round(L / k) boundaries at uniformly random positions (word-like segments of
mean length k), so the shortened stack runs on 1 + L/k positions. The predictor modes (unigramK,
entropyK, gumbelK) run their boundary predictor and its loss in the step and pool with its own
decisions; its logits are shifted once, before timing, so that about 1/k of the tokens close a
segment (a random predictor would pool at whatever rate its initial weights give). hnetK runs H-Net's
router, its ratio loss and chunk pooling (selection down, EMA up), its start probabilities shifted
once the same way, so that about 1/k of the tokens start a chunk. Adam runs at
learning rate 0 (every step does all the arithmetic of an update and leaves the weights as they
were), so that every timed step pools alike.

    python bench.py                                   # CPU defaults, about three minutes on 2 idle cores:
                                                      #   d 256, 4 heads, d_inner 1024, L 512, batch 4, 12 configs
    python bench.py --threads 1 --clock cpu           # the same on 1 thread, timed in CPU seconds: steady
                                                      #   figures on a CPU that other jobs share
    python bench.py --preset paper --device cpu --batch 1 --configs vanilla,fixed2,fixed4,ws5.5 --rounds 2 --steps 1
                                                      # d 512, L 2048 on CPU, batch 1 (about five minutes)
    python bench.py --preset paper                    # on a GPU: d 512, L 2048, batch 8, bf16; vanilla, fixed,
                                                      #   ws2..ws8, the predictor modes, hnet5.5, vanilla/ws5.5
                                                      #   compiled and with blocked attention (README)
    python bench.py --configs vanilla,ws5.5,ws5.5+compile,ws5.5+blocked
                                                      # +compile: torch.compile; +sdpa/+blocked/+auto: Config.attention
    python bench.py --plot bench.png                  # also plot time and memory against shortening factor
    python bench.py --profile ws5.5 [--trace t.json]  # torch.profiler table of one step's top ops (and kernels,
                                                      #   host syncs and GPU idle time on a GPU)
    python bench.py --generate [--gen-batch 4]        # cached vs recomputed generation, 1,024 characters of context

Timing: on a GPU, CUDA events around each step (no synchronisation between the timed steps, so a
step that waits for the CPU to launch its kernels is timed with that wait); on CPU, the wall clock
(or the process's CPU time with --clock cpu).
Memory: the peak is taken over the timed steps only (it is reset after the warm-up, so compilation
and autotuning do not count), and "step mem" is that peak minus what was in use before the warm-up
(activations, gradients, Adam moments, temporaries); ratios use the latter. On GPU the peak is
torch.cuda.max_memory_allocated; on CPU the child's peak resident set (Python, the torch libraries,
the model, and everything the steps allocate: Linux's VmHWM, reset through /proc/self/clear_refs;
where that cannot be reset, getrusage's ru_maxrss over the whole process).
MFU: model FLOPs per second (the formula is printed) over the peak of a large matmul in the training
dtype (bf16 on a GPU; fp32 matmuls run as TF32 on a GPU, as train.py trains), measured in the same run.
Errors: one line `error: ...` on stderr; exit 2 for a bad flag, 1 otherwise, 130 on Ctrl-C.
"""

import argparse
import errno
import inspect
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
import warnings

import torch
import torch.nn.functional as F

from dynpool import (PREDICTOR_MODES, BoundaryPredictor, Config, DynamicPoolingLM, Routing, sinusoids,
                     step_flops)
from operations import (UserError, fraction, non_negative_int, pick_device, positive_float, positive_int,
                        seed_int, thread_count, user_path)

PRESETS = {
    'cpu': dict(d_model=256, n_head=4, d_head=64, d_inner=1024, seq_len=512, batch=4),
    'paper': dict(d_model=512, n_head=8, d_head=64, d_inner=2048, seq_len=2048, batch=8),
}
DEFAULT_CONFIGS = 'vanilla,fixed2,fixed3,fixed4,ws2,ws3,ws4,ws5,ws5.5,ws6,ws7,ws8'
PAPER_CONFIGS = 'vanilla,fixed2,fixed4,ws2,ws3,ws4,ws5,ws5.5,ws6,ws7,ws8,unigram5.5,entropy5.5,gumbel5.5,hnet5.5'
# on a GPU the paper preset adds compiled and blocked-attention rows for two configurations
GPU_VARIANTS = 'vanilla+compile,ws5.5+compile'
BLOCKED_VARIANTS = 'vanilla+blocked,ws5.5+blocked'
FAMILIES = (('vanilla', 'none'), ('fixed', 'fixed'), ('ws', 'whitespace'), ('unigram', 'unigram'),
            ('entropy', 'entropy'), ('gumbel', 'gumbel'), ('hnet', 'hnet'))
ATTENTION_PATHS = ('auto', 'sdpa', 'blocked')
VOCAB = 27


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, like every other mistake (argparse would add the usage)
        self.exit(2, f'error: {message} (see --help)\n')


def fail(message):
    """A fault that is not a bad flag: one line, exit 1."""
    print(f'error: {message}', file=sys.stderr)
    sys.exit(1)


def parse_args(argv=None):
    p = Parser(description=__doc__.split('\n\n')[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a('--preset', choices=PRESETS, default='cpu', help='model and batch sizes to start from (cpu: d 256 '
      'L 512 B 4; paper: d 512 L 2048 B 8); the flags below override single values')
    a('--d-model', type=positive_int, help='model width')
    a('--n-head', type=positive_int, help='attention heads')
    a('--d-head', type=positive_int, help='width of one head')
    a('--d-inner', type=positive_int, help='feed-forward width')
    a('--seq-len', type=positive_int, help='characters per sequence (context length L)')
    a('--batch', type=positive_int, help='sequences per step')
    a('--layers', default='2,8,2',
      help='pre,shortened,post layers of the pooled models; vanilla runs their sum at full length')
    a('--dropout', type=fraction, default=0.1, help='residual dropout in [0, 1) (0.1, as the paper trains)')
    a('--dropatt', type=fraction, default=0.1, help='attention dropout in [0, 1) (0.1, as the paper trains)')
    a('--attn-chunk', type=positive_int, default=None,
      help='queries per attention block (Config.attn_chunk; default: the model\'s)')
    a('--attention', choices=ATTENTION_PATHS, default=None, help='Config.attention for every configuration '
      '(default: the model\'s own); a +sdpa/+blocked/+auto suffix on a configuration overrides it')
    a('--configs', default=None, help='comma-separated: vanilla, fixedK (fixed pooling, factor K), wsK '
      '(dynamic pooling, external word-like boundaries of mean segment length K, e.g. ws5.5), '
      'unigramK/entropyK/gumbelK (the predictor modes, pooling at mean length about K), hnetK (H-Net\'s '
      'router and chunk pooling, chunks of mean length about K); each optionally '
      'followed by +compile and/or +sdpa, +blocked, +auto. Default: the twelve of the cpu preset; the '
      f'paper preset: {PAPER_CONFIGS}, on a GPU also {GPU_VARIANTS},{BLOCKED_VARIANTS}')
    a('--steps', type=positive_int, default=None,
      help='timed training steps per configuration per round (3; 10 on a GPU)')
    a('--warmup', type=non_negative_int, default=None,
      help='untimed steps first (allocator, Adam state, caches, compilation; 1; 3 on a GPU)')
    a('--rounds', type=positive_int, default=None, help='rounds over all configurations, each '
      'configuration in a fresh process per round (2; 1 on a GPU)')
    a('--device', default='cuda' if torch.cuda.is_available() else 'cpu', help='cpu or cuda')
    a('--amp', choices=['auto', 'off', 'bf16'], default='auto',
      help='bf16 autocast; auto: on for cuda, off for cpu')
    a('--threads', type=thread_count, default=None,
      help='torch.set_num_threads for every process (default: torch\'s choice)')
    a('--clock', choices=['wall', 'cpu'], default='wall', help='wall: elapsed time; cpu: this process\'s '
      'CPU time, which on a CPU shared with other jobs still reads what an idle core would take '
      '(use with --threads 1)')
    a('--adam', choices=['fused', 'foreach', 'loop'], default='fused', help='Adam implementation (fused: '
      'one kernel over all parameters, ~3× faster than loop on CPU; loop is torch.optim.Adam\'s CPU default)')
    a('--compile', action='store_true', help='torch.compile every configuration (as a +compile suffix '
      'does for one; warm-up then includes compilation)')
    a('--peak-n', type=positive_int, default=None,
      help='size n of the n×n×n matmul that measures the peak (default 2048 cpu, 8192 cuda)')
    a('--no-pieces', action='store_true',
      help='skip timing attention, feed-forward, pooling and predictor separately')
    a('--plot', metavar='FILE', type=user_path('new-file'),
      help='write a PNG of step time and memory against shortening factor (needs matplotlib)')
    a('--profile', metavar='CONFIG',
      help='print the torch.profiler table of one training step of CONFIG and exit')
    a('--trace', metavar='FILE', type=user_path('new-file'),
      help='--profile: also write the Chrome trace (chrome://tracing, Perfetto) to FILE')
    a('--generate', action='store_true',
      help='benchmark cached generation against full recomputation instead of training')
    a('--context', type=positive_int, default=1024, help='--generate: characters of context before generating')
    a('--new', type=positive_int, default=128, help='--generate: characters generated by the cached model')
    a('--gen-batch', type=positive_int, default=1, help='--generate: sequences generated side by side')
    a('--recompute-steps', type=positive_int, default=8,
      help='--generate: characters generated by full recomputation (slow)')
    a('--timeout', type=positive_float, default=None, help='seconds one configuration\'s process may take before it '
      'is left out of the table (default: no limit on CPU, 300 on a GPU, where a compilation can run long)')
    a('--seed', type=seed_int, default=0, help='random seed of weights, characters and boundaries')
    a('--one', metavar='CONFIG', help=argparse.SUPPRESS)  # child process: one configuration, prints a JSON line
    args = p.parse_args(argv)
    resolve_defaults(args)
    try:
        check_args(args)
    except ValueError as e:   # bad values stop here in one line, not with a traceback from a child process
        p.error(str(e))
    return args


def resolve_defaults(args):
    """Fill what the preset and the device decide: sizes, configurations, steps, rounds, dtype."""
    for k, v in PRESETS[args.preset].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    cuda = args.device.startswith('cuda')
    if args.configs is None:
        args.configs = DEFAULT_CONFIGS if args.preset == 'cpu' else PAPER_CONFIGS
        if args.preset == 'paper' and cuda:
            args.configs += ',' + GPU_VARIANTS + ',' + BLOCKED_VARIANTS
    # a GPU step is short and steady: more steps, one round; compilation needs a few warm-up steps
    for name, cpu_value, gpu_value in (('steps', 3, 10), ('warmup', 1, 3), ('rounds', 2, 1)):
        if getattr(args, name) is None:
            setattr(args, name, gpu_value if cuda else cpu_value)
    if args.amp == 'auto':
        args.amp = 'bf16' if cuda else 'off'
    if args.peak_n is None:
        args.peak_n = 8192 if cuda else 2048
    if args.timeout is None and cuda:
        args.timeout = 300.0


def check_args(args):
    """ValueError naming the flag for every value that cannot run."""
    try:
        args.layers = tuple(int(n) for n in args.layers.split(','))
    except ValueError:
        raise ValueError(f'--layers takes pre,shortened,post counts such as 2,8,2, got {args.layers!r}') from None
    names = [n for n in args.configs.split(',') if n]
    if not names:
        raise ValueError('--configs is empty: name at least one configuration, e.g. vanilla,ws5.5')
    for name in names + [n for n in (args.profile, args.one) if n]:
        model_config(args, name)  # Config's own checks: layers, factors, sizes, attention
    if len(set(names)) < len(names):
        raise ValueError(f'--configs names a configuration twice: {args.configs}')
    args.configs = ','.join(names)
    try:
        device = torch.device(pick_device(args.device))
    except UserError as e:
        raise ValueError(str(e)) from None
    if device.type not in ('cpu', 'cuda'):
        raise ValueError(f'--device {args.device}: bench.py runs on cpu or cuda')
    if args.clock == 'cpu' and device.type != 'cpu':
        raise ValueError('--clock cpu times CPU work only: use it with --device cpu')
    if args.trace and not args.profile:
        raise ValueError('--trace writes the trace of --profile CONFIG: give --profile too')
    if args.plot and (args.profile or args.generate):
        raise ValueError(f'--plot draws the training table, which --{"profile" if args.profile else "generate"} '
                         f'does not make: drop one of them')


# -----------------------------------------------------------------------------
# Configurations, inputs and the FLOP count


def parse_config(name, args):
    """'vanilla' | 'fixedK' | 'wsK' | 'unigramK' | 'entropyK' | 'gumbelK' | 'hnetK', then '+compile' and/or
    '+sdpa' | '+blocked' | '+auto' → (boundary mode, factor or None, compile?, attention or None)."""
    base, *mods = name.split('+')
    compiled, attention = args.compile, args.attention
    for m in mods:
        if m == 'compile':
            compiled = True
        elif m in ATTENTION_PATHS:
            attention = m
        else:
            raise ValueError(f'configuration {name}: unknown suffix +{m} (use +compile, +sdpa, +blocked, +auto)')
    for prefix, mode in FAMILIES:
        if not base.startswith(prefix):
            continue
        if mode == 'none':
            if base != 'vanilla':
                break
            return mode, None, compiled, attention
        try:
            k = float(base[len(prefix):])
        except ValueError:
            break
        if not 1 <= k < float('inf') or (mode == 'fixed' and not k.is_integer()):
            raise ValueError(f'configuration {name}: the factor must be at least 1 (an integer for fixed)')
        if k > args.seq_len:
            raise ValueError(f'configuration {name}: the factor must be at most the sequence length '
                             f'(--seq-len {args.seq_len})')
        return mode, k, compiled, attention
    raise ValueError(f'unknown configuration {name!r}: use vanilla, fixedK, wsK, unigramK, entropyK, gumbelK or '
                     f'hnetK (e.g. fixed2, ws5.5, gumbel5.5, hnet5.5), optionally with +compile, +sdpa, +blocked')


def model_config(args, name):
    mode, k, _, attention = parse_config(name, args)
    kw = dict(vocab_size=VOCAB, d_model=args.d_model, n_head=args.n_head, d_head=args.d_head, d_inner=args.d_inner,
              dropout=args.dropout, dropatt=args.dropatt, layers=args.layers, boundary=mode, whitespace_id=0,
              fixed_factor=int(k) if mode == 'fixed' else 2)
    if args.attn_chunk:
        kw['attn_chunk'] = args.attn_chunk
    if attention is not None:
        kw['attention'] = attention
    return Config(**kw)


def build(args, name):
    mode, k, _, _ = parse_config(name, args)
    return DynamicPoolingLM(model_config(args, name)).to(args.device), mode, k


def setup(args, name):
    """The seeded model of configuration `name` in training mode, and its batch (x, y, b)."""
    torch.manual_seed(args.seed)
    model, mode, k = build(args, name)
    batch = make_batch(args, mode, k, torch.Generator().manual_seed(args.seed))
    if mode in PREDICTOR_MODES:
        calibrate_predictor(model, batch[0], k)
    elif mode == 'hnet':
        calibrate_router(model, batch[0], k)
    return model.train(), mode, k, batch


def n_segments(L, mode, k):
    """Complete segments per row: L // k for fixedK; wsK places exactly round(L / k) boundaries."""
    return L // int(k) if mode == 'fixed' else max(1, round(L / k))


def make_batch(args, mode, k, gen):
    """Random characters, next-character targets and, for wsK (and as unigramK's training targets),
    exactly round(L/k) boundaries per row."""
    B, L = args.batch, args.seq_len
    x = torch.randint(0, VOCAB, (B, L + 1), generator=gen)
    b = None
    if mode in ('whitespace', 'unigram'):
        n = n_segments(L, mode, k)
        b = torch.zeros(B, L)
        for row in b:
            row[torch.randperm(L, generator=gen)[:n]] = 1
    dev = args.device
    return x[:, :-1].to(dev), x[:, 1:].to(dev), None if b is None else b.to(dev)


def predictor_of(model):
    return next(m for m in model.modules() if isinstance(m, BoundaryPredictor))


def calibrate_predictor(model, x, k):
    """Shift the predictor's logits (a forward hook, kept for the timed steps) so that about 1/k of
    the tokens of x close a segment."""
    pred, seen = predictor_of(model), []
    hook = pred.register_forward_hook(lambda m, inputs, out: seen.append(out.detach().float().flatten()))
    with torch.no_grad():
        model.train()(x)
    hook.remove()
    logits = seen[0]
    if model.cfg.boundary == 'gumbel':
        # The hard Gumbel-sigmoid decision is 1 with probability sigmoid(logit): bisect on the mean.
        lo, hi = -30.0, 30.0
        for _ in range(50):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if torch.sigmoid(logits + mid).mean() < 1 / k else (lo, mid)
        shift = (lo + hi) / 2
    else:
        # sigmoid(logit) > threshold: put the threshold at the (1 - 1/k) quantile of the logits.
        t = model.cfg.threshold
        shift = math.log(t / (1 - t)) - torch.quantile(logits, 1 - 1 / k).item()
    pred.register_forward_hook(lambda m, inputs, out: out + shift)


def calibrate_router(model, x, k):
    """Shift H-Net's start probabilities (a forward hook on the router, kept for the timed steps) so
    that about 1/k of the tokens of x start a chunk; p_0 = 1 stays a start."""
    router, seen = model.source, []
    hook = router.register_forward_hook(lambda m, inputs, out: seen.append(out.p.detach().float()))
    with torch.no_grad():
        model.train()(x)
    hook.remove()
    # p_t > ½ starts a chunk: put ½ at the quantile that leaves L/k - 1 starts after t = 0 per row.
    p, L = seen[0][:, 1:].flatten(), x.size(1)
    shift = 0.5 - torch.quantile(p, 1 - max(L / k - 1, 0) / (L - 1)).item() if L > 1 else 0.0
    router.register_forward_hook(lambda m, inputs, out: m.route(
        F.pad((out.p[:, 1:] + shift).clamp(0, 1), (1, 0), value=1.0)))


def stack_lengths(args, mode, sf):
    """[(layers, sequence length)] of the stacks a configuration runs; the shortened stack's length
    is 1 + L/SF (the null group and the complete segments), SF the measured shortening factor."""
    L, (pre, short, post) = args.seq_len, args.layers
    if mode == 'none':
        return [(pre + short + post, L)]
    return [(pre, L), (short, 1 + L / sf), (post, L)]


def flop_formula():
    """The FLOP count in words: dynpool.step_flops's own docstring."""
    doc = '\n'.join('  ' + line for line in inspect.cleandoc(step_flops.__doc__).splitlines())
    return f'model FLOPs (dynpool.step_flops, n_short = 1 + L/SF with the SF measured in the step):\n{doc}'


def config_flops(args, name, sf):
    """Model FLOPs of one training step of configuration `name` at the measured SF."""
    cfg = model_config(args, name)
    return step_flops(cfg, args.batch, args.seq_len, None if cfg.boundary == 'none' else 1 + args.seq_len / sf)


clock = time.perf_counter  # --clock cpu switches every CPU timing here to time.process_time


def sync(device):
    if device.startswith('cuda'):
        torch.cuda.synchronize()


def time_calls(fn, n, device):
    """Seconds of each of n calls of fn(). On a GPU: CUDA events around each call, one synchronisation
    at the end, so the time is the GPU's, idle gaps included (a launch-bound step is timed as such)."""
    if device.startswith('cuda'):
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return [start.elapsed_time(end) / 1e3 for start, end in events]   # elapsed_time: milliseconds
    times = []
    for _ in range(n):
        t = clock()
        fn()
        times.append(clock() - t)
    return times


def matmul_peak(args, repeats=5):
    """FLOP/s of the best of a few n×n×n matmuls in the training dtype: the machine's own peak."""
    n, dev = args.peak_n, args.device
    dtype = torch.bfloat16 if args.amp == 'bf16' else torch.float32
    a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
    out = torch.empty(n, n, device=dev, dtype=dtype)
    cuda = dev.startswith('cuda')
    for _ in range(10 if cuda else 1):   # a GPU raises its clocks under load
        torch.mm(a, b, out=out)
    sync(dev)
    best = min(time_calls(lambda: torch.mm(a, b, out=out), 4 * repeats if cuda else repeats, dev))
    return 2 * n ** 3 / best


# -----------------------------------------------------------------------------
# One configuration in its own process


def rss_now():
    """Current resident set in bytes (Linux /proc), 0 where unavailable."""
    try:
        with open('/proc/self/statm') as f:
            return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE')
    except (OSError, ValueError):
        return 0


def reset_peak_rss():
    """Start the peak resident set afresh at the current one (Linux: VmHWM through clear_refs);
    False where the system does not allow it."""
    try:
        with open('/proc/self/clear_refs', 'w') as f:
            f.write('5')
        return True
    except OSError:
        return False


def peak_rss(since_reset=False):
    """Peak resident set in bytes: since reset_peak_rss (VmHWM), or over the whole process."""
    if since_reset:
        try:
            with open('/proc/self/status') as f:
                return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith('VmHWM:'))
        except (OSError, StopIteration, ValueError):
            pass
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == 'darwin' else r * 1024  # bytes on macOS, KiB on Linux


def make_adam(args, model):
    """Adam at learning rate 0: all the arithmetic of an update, weights left where they are."""
    # Every timed step then pools alike: a predictor's decisions (and with them S) drift within a few
    # real updates, as its loss trains it and the pre stack (README, Performance).
    impl = {'fused': dict(fused=True), 'foreach': dict(foreach=True), 'loop': dict(foreach=False)}[args.adam]
    return torch.optim.Adam(model.parameters(), lr=0.0, **impl)


def train_step(model, opt, x, y, b, amp):
    opt.zero_grad(set_to_none=True)
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=amp == 'bf16'):
        out = model(x, targets=y, boundaries=b)
    out.loss.backward()
    opt.step()
    return out


def prepared(args, name):
    """Model (compiled where asked), its Adam and a step function for configuration `name`."""
    model, mode, k, (x, y, b) = setup(args, name)
    opt = make_adam(args, model)
    if parse_config(name, args)[2]:
        model = torch.compile(model)
    outs = []

    def step():
        outs[:] = [train_step(model, opt, x, y, b, args.amp)]
    return model, step, outs


def run_one(args, name):
    """Warm up, time args.steps steps, print one JSON line for the parent."""
    model, step, outs = prepared(args, name)
    cuda = args.device.startswith('cuda')
    # step mem counts from before the warm-up, so that it holds the gradients and Adam moments the
    # warm-up makes; the peak starts after it, so compilation and autotuning are not in it
    base = torch.cuda.memory_allocated() if cuda else rss_now()
    for _ in range(args.warmup):
        step()
    sync(args.device)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    else:
        fresh = reset_peak_rss()
    times = time_calls(step, args.steps, args.device)
    out = outs[0]
    sf = float(out.shortening_factor) if out.shortening_factor is not None else 1.0
    peak = torch.cuda.max_memory_allocated() if cuda else peak_rss(since_reset=fresh)
    step_mem = peak - base
    print(json.dumps(dict(name=name, times=times, peak=peak, step_mem=step_mem, sf=sf,
                          params=sum(p.numel() for p in model.parameters()))), flush=True)


def child_cmd(args, name):
    cmd = [sys.executable, os.path.abspath(__file__), '--one', name, '--configs', name]
    for flag in ('preset', 'd_model', 'n_head', 'd_head', 'd_inner', 'seq_len', 'batch', 'dropout', 'dropatt',
                 'attn_chunk', 'attention', 'steps', 'warmup', 'device', 'amp', 'threads', 'clock', 'adam', 'seed'):
        v = getattr(args, flag)
        if v is not None:
            cmd += ['--' + flag.replace('_', '-'), str(v)]
    cmd += ['--layers', ','.join(map(str, args.layers))]
    return cmd + (['--compile'] if args.compile else [])


def spawn(args, name):
    """Configuration `name` in a fresh process → (its record, None) or (None, why it failed)."""
    try:
        r = subprocess.run(child_cmd(args, name), capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return None, f'took over {args.timeout:g} s (--timeout)'
    if r.returncode < 0:   # SIGKILL: most often the kernel's out-of-memory killer
        return None, f'killed by signal {-r.returncode}' + (' (out of memory?)' if r.returncode == -9 else '')
    if r.returncode != 0:
        lines = [ln.strip() for ln in r.stderr.splitlines() if ln.strip()]
        return None, (lines[-1] if lines else f'exit status {r.returncode}').removeprefix('error: ')
    return json.loads(r.stdout.strip().splitlines()[-1]), None


# -----------------------------------------------------------------------------
# Pieces of a step, timed alone (forward + backward)


def time_fn(fn, device, repeats=5):
    fn()
    sync(device)
    return statistics.median(time_calls(fn, repeats, device))


POOL, PRED = 'pooling + upsampling (B-matrix mean, gather)', 'boundary predictor'
# hnet's pieces under their own names, counted as POOL and PRED in the share
HNET_POOL = 'selection + upsampling (EMA, confidence, residual)'
HNET_PRED = 'router (W_q, W_k, ratio loss)'


def stages(model):
    """The model's stages of layers in data-flow order: pre, shortened, post (vanilla: one)."""
    return [getattr(model, n) for n in model.stage_names]


def time_pieces(args, name, step_time):
    """Forward + backward time of each piece of configuration `name`, times how often a step runs it."""
    model, mode, k, (x, y, b) = setup(args, name)
    B, L, D, dev = args.batch, args.seq_len, args.d_model, args.device
    layer = stages(model)[0].layers[0]
    rows = []

    def fwd_bwd(f, *inputs):
        def run():
            xs = [t.detach().requires_grad_() for t in inputs]
            with torch.autocast(torch.device(dev).type, dtype=torch.bfloat16, enabled=args.amp == 'bf16'):
                out = f(*xs)
            out.float().sum().backward()
        return run

    for layers, n in stack_lengths(args, mode, L / n_segments(L, mode, k) if k else 1.0):
        if layers == 0:
            continue
        n = round(n)
        h = torch.randn(B, n, D, device=dev)
        pos = sinusoids(torch.arange(n - 1, -1, -1, device=dev), D)
        rows.append((f'attention, n={n} ×{layers}', layers * time_fn(fwd_bwd(
            lambda h: layer.attn(h, pos, model.u, model.v), h), dev)))
        rows.append((f'feed-forward, n={n} ×{layers}', layers * time_fn(fwd_bwd(layer.ff, h), dev)))
    h = torch.randn(B, L, D, device=dev)
    if mode == 'hnet':
        rows += hnet_pieces(model, x, h, fwd_bwd, dev)
    elif mode != 'none':
        with torch.no_grad():
            bb = model(x, boundaries=b).boundaries.detach().float()   # the boundaries the step pools with
        r = Routing(bb)
        rows.append((POOL, time_fn(fwd_bwd(
            lambda h: model.pooling.up(model.pooling.down(h, r), r, h), h), dev)))
        own = mode in PREDICTOR_MODES
        pred = predictor_of(model) if own else BoundaryPredictor(model.cfg).to(dev)
        rows.append((PRED + ('' if own else ' (unigram/entropy/gumbel only; not in ws)'), time_fn(fwd_bwd(
            lambda h: F.binary_cross_entropy_with_logits(pred(h).float(), bb), h), dev)))
    rows.append(('embedding + logits + loss', time_fn(fwd_bwd(
        lambda e: F.cross_entropy(model.lm_head(e + model.embed(x)).flatten(0, 1).float(), y.flatten()),
        torch.zeros(B, L, D, device=dev)), dev)))
    opt = make_adam(args, model)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    rows.append(('Adam step', time_fn(opt.step, dev)))
    print(f'\npieces of a {name} step, each timed alone (forward + backward, median of 5), '
          f'against its measured step of {step_time * 1e3:.0f} ms:')
    print(f'  {"piece":62s} {"ms":>9s} {"share":>7s}')
    for piece, t in rows:
        print(f'  {piece:62s} {t * 1e3:9.1f} {100 * t / step_time:6.1f}%')
    total = sum(t for _, t in rows)
    print(f'  {"sum of pieces (the rest: norms, dropout, residuals, overheads)":62s} {total * 1e3:9.1f} '
          f'{100 * total / step_time:6.1f}%')
    names = {HNET_POOL: POOL, HNET_PRED: PRED}
    return {names.get(piece, piece.split(' (unigram')[0]): t for piece, t in rows}


def hnet_pieces(model, x, h, fwd_bwd, dev):
    """hnet's router and its chunk pooling (down and up), with the model's own units and chunks."""
    router, pooling, seen = model.source, model.pooling, []
    hook = router.register_forward_hook(lambda m, inputs, out: seen.append(out))
    with torch.no_grad():
        model(x)                                  # the chunks the step pools with (calibrated)
    hook.remove()
    r = seen[0]

    def pool(h, p):
        # p as an input, so the backward runs through the EMA rates and the confidence
        rp = type(r)(b=r.b, p=p, start=r.start)
        return pooling.up(pooling.down(h, rp), rp, h)
    return [(HNET_POOL, time_fn(fwd_bwd(pool, h, r.p), dev)),
            (HNET_PRED, time_fn(fwd_bwd(lambda h: router.loss(router(h, x), None, x, None)[0], h), dev))]


def report_pieces(args, names, table):
    """Pieces of vanilla and of a pooled step (ws5.5 or the first pooled one, the first predictor
    and the first hnet configuration) → {configuration: share of pooling + upsampling + predictor
    (hnet: router) in its step}."""
    van = table.get('vanilla')
    if van:
        time_pieces(args, 'vanilla', van['time'])
    plain = [n for n in names if '+' not in n]
    pooled = [n for n in plain if n != 'vanilla']
    with_pred = [n for n in pooled if parse_config(n, args)[0] in PREDICTOR_MODES]
    with_router = [n for n in pooled if parse_config(n, args)[0] == 'hnet']
    picks = (['ws5.5' if 'ws5.5' in pooled else (pooled[0] if pooled else None)] + with_pred[:1]
             + with_router[:1])
    shares = {}
    for pick in dict.fromkeys(p for p in picks if p):
        step_time = table[pick]['time']
        pieces = time_pieces(args, pick, step_time)
        pool, pred = pieces[POOL], pieces[PRED]
        own = pick in with_pred + with_router   # else a predictor of the same size is added
        shares[pick] = (pool + pred) / (step_time + (0 if own else pred))
        what = 'router + selection + upsampling' if pick in with_router else \
            'pooling + upsampling + boundary predictor'
        print(f'  {what}: {100 * shares[pick]:.1f}% of a {pick} step'
              + ('' if own else ' with a predictor added'))
    return shares


# -----------------------------------------------------------------------------
# Profile


def profile_step(args, name):
    """torch.profiler table of one training step after warm-up; on a GPU also the kernels, how long
    they kept the GPU busy within the step, and the host synchronisations the step makes."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    cuda = args.device.startswith('cuda')
    _, step, _ = prepared(args, name)
    for _ in range(max(1, args.warmup)):
        step()
    sync(args.device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        step_time = time_calls(step, 1, args.device)[0]
    events = prof.key_averages()
    print(events.table(sort_by='self_device_time_total' if cuda else 'self_cpu_time_total', row_limit=25))
    ops = [e for e in prof.events() if e.name.startswith('aten::') and e.device_type == DeviceType.CPU]
    top = [e for e in ops if not (e.cpu_parent and e.cpu_parent.name.startswith('aten::'))]
    print(f'one {name} step under the profiler: {step_time * 1e3:.1f} ms, {len(top)} aten ops dispatched '
          f'({len(ops)} counting nested ones)')
    if cuda:
        kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
        busy = sum(e.time_range.elapsed_us() for e in kernels) / 1e6   # one stream: no overlap
        print(f'  {len(kernels)} GPU kernels/copies, busy {busy * 1e3:.1f} ms of the step '
              f'({100 * busy / step_time:.0f}%); the rest the GPU waits for the CPU (launches, host syncs)')
        report_host_syncs(step, name)
    if args.trace:
        write_atomic(args.trace, '--trace', lambda tmp: export_trace(prof, tmp))
        print(f'trace written to {args.trace}')


def report_host_syncs(step, name):
    """Count the synchronising CUDA operations of one step (torch.cuda.set_sync_debug_mode) and say
    which lines made them."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        torch.cuda.set_sync_debug_mode('warn')
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode('default')
        torch.cuda.synchronize()
    syncs = [w for w in caught if 'synchroniz' in str(w.message)]
    where = statistics_of(f'{os.path.basename(w.filename)}:{w.lineno}' for w in syncs)
    print(f'  host synchronisations in one {name} step: {len(syncs)}'
          + (f' ({where})' if syncs else ''))


def statistics_of(items):
    """'a ×2, b' for the items in order of first appearance."""
    counts = {}
    for it in items:
        counts[it] = counts.get(it, 0) + 1
    return ', '.join(k + (f' ×{n}' if n > 1 else '') for k, n in counts.items())


def export_trace(prof, path):
    """prof's Chrome trace to path; OSError where the file did not come out whole: the profiler's
    writer reports no failed write (a full disk leaves a cut trace and no error)."""
    prof.export_chrome_trace(path)
    if path.endswith('.gz'):   # written by Python's gzip, which raises on a failed write itself
        return
    with open(path, 'rb') as f:
        f.seek(max(0, os.path.getsize(path) - 64))
        whole = f.read().rstrip().endswith((b'}', b']'))
    if not whole:
        st = os.statvfs(os.path.dirname(os.path.abspath(path)))
        full = st.f_bavail * st.f_frsize < 2 ** 20
        raise OSError(errno.ENOSPC if full else errno.EIO, 'No space left on device' if full else
                      'the profiler wrote an incomplete trace')


def write_atomic(path, flag, write):
    """write(tmp) beside `path`, then rename it onto `path`: nothing half-written is left behind."""
    folder, base = os.path.split(os.path.abspath(path))
    stem, ext = os.path.splitext(base)
    tmp = os.path.join(folder, f'.{stem[:200]}.tmp{ext[:20]}')   # a name the file system takes too
    try:
        write(tmp)
        os.replace(tmp, path)
    except (OSError, ValueError, RuntimeError) as e:   # RuntimeError: the profiler's own writer
        why = getattr(e, 'strerror', None) or (str(e).strip().splitlines() or [type(e).__name__])[0]
        fail(f'cannot write {flag} {path}: {why}')
    finally:
        if os.path.lexists(tmp):
            os.remove(tmp)

# -----------------------------------------------------------------------------
# Generation


def bench_generate(args):
    """Characters/s of cached decoding against recomputing the whole sequence for every character."""
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    C, n, dev = args.context, args.new, args.device
    # Text-like tokens: spaces (id 0) with probability 1/5.5, so segments are word-like on average.
    total = C + max(n, args.recompute_steps) + 1
    x = torch.randint(1, VOCAB, (args.gen_batch, total), generator=gen)
    x[torch.rand(x.shape, generator=gen) < 1 / 5.5] = 0
    x = x.to(dev)
    print(f'generation: context {C} characters, batch {x.size(0)}, d {args.d_model}, layers {args.layers}, '
          f'{torch.get_num_threads()} threads, {args.device}; the characters fed are fixed text-like ones '
          f'(space rate 1/5.5), so every method does the same work')
    print(f'  {"model":12s} {"method":36s} {"chars/s":>9s} {"speed-up":>9s}')
    for name in ('vanilla', 'ws5.5'):
        args_ = argparse.Namespace(**vars(args))
        args_.dropout = args_.dropatt = 0.0
        model, mode, k = build(args_, name)
        model.eval()
        with torch.no_grad():
            # Cached: prefill the context once, then one decode call per character.
            stack_time = [0.0, 0.0, 0.0]
            for i, stack in enumerate(stages(model)):
                def timed(*a, _step=stack.step, _i=i, **kw):
                    sync(dev)
                    t = clock()
                    r = _step(*a, **kw)
                    sync(dev)
                    stack_time[_i] += clock() - t
                    return r
                stack.step = timed
            _, state = model.prefill(x[:, :C], capacity=C + n)
            for t in range(C, C + min(4, n)):  # warm-up, within the capacity of the caches
                model.decode(x[:, t], state)
            _, state = model.prefill(x[:, :C], capacity=C + n)
            stack_time[:] = [0.0, 0.0, 0.0]
            sync(dev)
            t0 = clock()
            for t in range(C, C + n):
                model.decode(x[:, t], state)
            sync(dev)
            cached = clock() - t0
            for stack in stages(model):
                del stack.step
            # model.generate end to end (prefill included, sampling its own characters).
            sync(dev)
            t0 = clock()
            model.generate(x[:, :C], n, top_k=5)
            sync(dev)
            generate = clock() - t0
            # Full recomputation: model(x) on the growing sequence, once per character.
            model(x[:, :C])
            m = args.recompute_steps
            sync(dev)
            t0 = clock()
            for t in range(C, C + m):
                model(x[:, :t + 1]).logits[:, -1].argmax(-1)
            sync(dev)
            full = clock() - t0
        B = x.size(0)
        rate_c, rate_f = B * n / cached, B * m / full
        print(f'  {name:12s} {"cached decode (prefill excluded)":36s} {rate_c:9.1f} {rate_c / rate_f:8.1f}×')
        print(f'  {name:12s} {"model.generate (prefill included)":36s} {B * n / generate:9.1f} '
              f'{B * n / generate / rate_f:8.1f}×')
        print(f'  {name:12s} {"full recomputation":36s} {rate_f:9.1f} {1.0:8.1f}×')
        names = ['all layers'] if name == 'vanilla' else ['pre stack', 'shortened stack', 'post stack']
        shares = ', '.join(f'{nm} {100 * t / cached:.0f}%' for nm, t in zip(names, stack_time) if t)
        print(f'  {"":12s} share of cached decode time: {shares}, the rest (embedding, boundary, '
              f'logits) {100 * (1 - sum(stack_time) / cached):.0f}%')


# -----------------------------------------------------------------------------
# Main


def fmt_bytes(n):
    return f'{n / 2 ** 20:8.0f}'


def device_name(args):
    if args.device.startswith('cuda'):
        name = torch.cuda.get_device_name(torch.device(args.device))
    else:
        name = f'CPU, {torch.get_num_threads()} threads'
    return name + (', CPU-time clock' if args.clock == 'cpu' else '')


def precision(args):
    """The arithmetic of the steps and the peak matmul, in words."""
    if args.amp == 'bf16':
        return 'bf16 autocast'
    return 'fp32 (TF32 matmuls)' if args.device.startswith('cuda') else 'fp32'


def measure(args, names):
    """Every configuration in its own process, in interleaved rounds, with the matmul peak measured
    before each round and after the last → (results per name, peak FLOP/s)."""
    attention = args.attention or Config.attention
    print(f'dynpool training step: d {args.d_model}, heads {args.n_head}×{args.d_head}, d_inner {args.d_inner}, '
          f'L {args.seq_len}, batch {args.batch}, layers {args.layers} (vanilla {sum(args.layers)}), '
          f'dropout {args.dropout}/{args.dropatt}, {precision(args)}, {args.adam} Adam, '
          f'{device_name(args)}, torch {torch.__version__}'
          + f', attention {attention}' + (', compiled' if args.compile else ''))
    timing = 'CUDA events' if args.device.startswith('cuda') else ('CPU time' if args.clock == 'cpu' else 'wall clock')
    print(f'{args.rounds} rounds × {len(names)} configurations interleaved, each a fresh process: '
          f'{args.warmup} warm-up + {args.steps} timed steps; median of the {args.rounds * args.steps} timed steps'
          + ('' if timing == 'wall clock' else f' ({timing})'))
    width = max(8, *map(len, names))
    results, failed, peaks = {n: [] for n in names}, {}, []
    for r in range(args.rounds):
        peaks.append(matmul_peak(args))
        if args.device.startswith('cuda'):
            torch.cuda.empty_cache()   # the children get the GPU memory the matrices held
        for n in (n for n in names if n not in failed):
            record, failed[n] = spawn(args, n)
            if record is None:
                print(f'  round {r + 1}: {n:{width}s} failed: {failed[n]}', flush=True)
                continue
            del failed[n]
            results[n].append(record)
            print(f'  round {r + 1}: {n:{width}s} {statistics.median(record["times"]) * 1e3:9.0f} ms', flush=True)
    peaks.append(matmul_peak(args))
    peak = max(peaks)
    print(f'\nmatmul peak: {peak / 1e9:.1f} GFLOP/s ({args.peak_n}³ {precision(args)} '
          f'matmul, best of {20 if args.device.startswith("cuda") else 5}, highest of {len(peaks)} measurements '
          f'spread over the run; all: {", ".join(f"{p / 1e9:.0f}" for p in peaks)})')
    return {n: runs for n, runs in results.items() if n not in failed}, failed, peak


def failures(failed):
    """One line for the configurations that failed."""
    if len(failed) == 1:
        (name, why), = failed.items()
        return f'configuration {name} failed: {why}'
    return (f'{len(failed)} configurations failed and are left out of the table: '
            + '; '.join(f'{n} ({why})' for n, why in failed.items()))


def summarise(args, names, results):
    """Median step time, peak and step memory, SF and model FLOPs per configuration."""
    table = {}
    for n in names:
        runs = results[n]
        sf = runs[0]['sf']
        table[n] = dict(time=statistics.median([x for run in runs for x in run['times']]),
                        peak=max(run['peak'] for run in runs),
                        mem=statistics.median(run['step_mem'] for run in runs), sf=sf,
                        flops=config_flops(args, n, sf))
    return table


def reference(name, table):
    """The vanilla row a configuration is compared with: vanilla with the same suffixes if measured."""
    suffix = name[len(name.split('+')[0]):]
    return table.get('vanilla' + suffix) or table.get('vanilla')


def print_table(args, names, table, peak):
    print(flop_formula())
    cuda = args.device.startswith('cuda')
    width = max(8, *map(len, names))
    mem_label = 'peak alloc' if cuda else 'peak RSS'
    print(f'\n{"config":{width}s} {"factor":>6s} {"step ms":>9s} {"chars/s":>9s} {"speed-up":>8s} '
          f'{mem_label + " MiB":>14s} {"step mem MiB":>13s} {"mem ratio":>9s} {"GFLOP":>8s} {"GFLOP/s":>8s} {"MFU":>6s}')
    for n in names:
        row, van = table[n], reference(n, table)
        speed = f'{van["time"] / row["time"]:7.2f}×' if van else '       -'
        memr = f'{row["mem"] / van["mem"]:9.2f}' if van and van['mem'] > 0 else '        -'
        fps = row['flops'] / row['time']
        print(f'{n:{width}s} {row["sf"]:6.2f} {row["time"] * 1e3:9.0f} {args.batch * args.seq_len / row["time"]:9.0f} '
              f'{speed} {fmt_bytes(row["peak"]):>14s} {fmt_bytes(row["mem"]):>13s} {memr} {row["flops"] / 1e9:8.1f} '
              f'{fps / 1e9:8.1f} {100 * fps / peak:5.0f}%')
    if 'vanilla' in table:
        print('speed-up: vanilla step time / this step time; mem ratio: step mem / vanilla step mem; '
              'factor: characters / complete segments'
              + ('; a row with +suffixes is compared with vanilla+suffixes where that was measured'
                 if any('+' in n for n in names) else ''))


def import_pyplot():
    """matplotlib's pyplot without a display; one line where the optional extra is not installed."""
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        fail('--plot needs matplotlib: pip install matplotlib (or drop --plot)')
    return plt


def plot(args, names, table, plt):
    """Step time and step memory against shortening factor, fixed and dynamic, vanilla as a line."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for prefix, label, marker in (('fixed', 'fixed pooling', 's'), ('ws', 'dynamic (word-like) pooling', 'o')):
        ns = sorted((n for n in names if n.startswith(prefix) and '+' not in n), key=lambda n: table[n]['sf'])
        if ns:
            ax1.plot([table[n]['sf'] for n in ns], [table[n]['time'] * 1e3 for n in ns], marker=marker, label=label)
            ax2.plot([table[n]['sf'] for n in ns], [table[n]['mem'] / 2 ** 20 for n in ns], marker=marker, label=label)
    van = table.get('vanilla')
    if van:
        ax1.axhline(van['time'] * 1e3, color='k', ls='--', label='vanilla')
        ax2.axhline(van['mem'] / 2 ** 20, color='k', ls='--', label='vanilla')
    ax1.set(xlabel='shortening factor', ylabel='training step (ms)', ylim=(0, None))
    ax2.set(xlabel='shortening factor', ylabel='step memory (MiB)', ylim=(0, None))
    ax1.legend()
    fig.suptitle(f'd {args.d_model}, L {args.seq_len}, batch {args.batch}, {device_name(args)}')
    fig.tight_layout()
    write_atomic(args.plot, '--plot', lambda tmp: fig.savefig(tmp, dpi=120, format='png'))
    print(f'plot written to {args.plot}')


def setup_device(args):
    """Threads, the CUDA device and its TF32 matmuls (as train.py trains), the clock."""
    global clock
    if args.clock == 'cpu':
        clock = time.process_time
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device.startswith('cuda'):
        if torch.device(args.device).index is not None:   # cuda:1: events, memory stats and sync there
            torch.cuda.set_device(torch.device(args.device))
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def run(args):
    """The child's one configuration, the generation or profile benchmark, or the whole table."""
    setup_device(args)
    if args.one:
        return run_one(args, args.one)
    if args.generate:
        return bench_generate(args)
    if args.profile:
        return profile_step(args, args.profile)
    plt = import_pyplot() if args.plot else None   # before minutes of measuring, not after
    results, failed, peak = measure(args, args.configs.split(','))
    names = list(results)   # the configurations that ran, in the order given
    if not names:
        fail(failures(failed))
    table = summarise(args, names, results)
    print_table(args, names, table, peak)
    if not args.no_pieces:
        report_pieces(args, names, table)
    if plt:
        plot(args, names, table, plt)
    if failed:
        fail(failures(failed))


def out_of_memory(e):
    return isinstance(e, (MemoryError, torch.OutOfMemoryError)) or (
        isinstance(e, RuntimeError) and ("can't allocate memory" in str(e) or 'out of memory' in str(e)))


def memory_flags(args):
    """The flags that set what this run allocates, in words."""
    if args.generate:
        return '--gen-batch, --context or --new'
    if args.one or args.profile:
        return '--batch or --seq-len'
    return '--batch, --seq-len or --peak-n'


def main(argv=None):
    """The command line's promises: exit 2 and one line for a bad flag, 1 and one line for a fault
    (out of memory included), 130 on Ctrl-C."""
    args = parse_args(argv)
    try:
        run(args)
    except KeyboardInterrupt:
        print('error: interrupted (Ctrl-C); no file written', file=sys.stderr)
        sys.exit(130)
    except (MemoryError, RuntimeError) as e:
        if not out_of_memory(e):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        fail(f'out of memory: {first}; try a smaller {memory_flags(args)}')


if __name__ == '__main__':
    main()
