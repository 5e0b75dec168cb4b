"""
bench.py: speed and memory of a dynpool training step (vanilla vs fixed vs dynamic pooling),
the cost of each piece of a step, and cached vs recomputed generation.

A training step is forward + backward + Adam step on random characters, timed after warm-up; the
figure is the median over all timed steps. Every configuration runs in a fresh process of its own
(`bench.py --one CONFIG`, spawned by the parent), so that its peak memory cannot hide behind
another's; the rounds interleave the configurations, so a noisy neighbour slows them all alike.
Dynamic pooling at mean segment length k is whitespace-mode pooling with external boundaries:
each row gets exactly round(L / k) boundaries at uniformly random positions (word-like segments of
mean length k), so the shortened stack runs on 1 + L/k positions.

    python bench.py                                   # CPU defaults, about three minutes on 2 idle cores:
                                                      #   d 256, 4 heads, d_inner 1024, L 512, batch 4, 12 configs
    python bench.py --threads 1 --clock cpu           # the same on 1 thread, timed in CPU seconds: steady
                                                      #   figures on a CPU that other jobs share
    python bench.py --preset paper --device cpu --batch 1 --configs vanilla,fixed2,fixed4,ws5.5 --rounds 2 --steps 1
                                                      # d 512, L 2048 on CPU, batch 1 (about five minutes)
    python bench.py --preset paper --device cuda      # paper scale on a GPU: d 512, L 2048, batch 8, bf16
    python bench.py --plot bench.png                  # also plot time and memory against shortening factor
    python bench.py --profile ws5.5                   # torch.profiler table of one step's top ops
    python bench.py --generate [--gen-batch 4]        # cached vs recomputed generation, 1,024 characters of context

Memory: on GPU, torch.cuda.max_memory_allocated during the steps minus what was allocated before
them. On CPU, the child's peak resident set (getrusage ru_maxrss: Python, the torch libraries, the
model, and everything the steps allocate) and that peak minus the resident set just before the first
step ("step mem": activations, gradients, Adam moments, temporaries); ratios use the latter.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from dynpool import BoundaryPredictor, Config, DynamicPoolingLM, downsample, sinusoids, upsample

PRESETS = {
    'cpu': dict(d_model=256, n_head=4, d_head=64, d_inner=1024, seq_len=512, batch=4),
    'paper': dict(d_model=512, n_head=8, d_head=64, d_inner=2048, seq_len=2048, batch=8),
}
DEFAULT_CONFIGS = 'vanilla,fixed2,fixed3,fixed4,ws2,ws3,ws4,ws5,ws5.5,ws6,ws7,ws8'
VOCAB = 27


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a('--preset', choices=PRESETS, default='cpu', help='model and batch sizes to start from (cpu: d 256 L 512 B 4; '
      'paper: d 512 L 2048 B 8); the flags below override single values')
    a('--d-model', type=int, help='model width')
    a('--n-head', type=int, help='attention heads')
    a('--d-head', type=int, help='width of one head')
    a('--d-inner', type=int, help='feed-forward width')
    a('--seq-len', type=int, help='characters per sequence (context length L)')
    a('--batch', type=int, help='sequences per step')
    a('--layers', default='2,8,2', help='pre,shortened,post layers of the pooled models; vanilla runs their sum at full length')
    a('--dropout', type=float, default=0.1, help='residual dropout (the paper trains with 0.1)')
    a('--dropatt', type=float, default=0.1, help='attention dropout (the paper trains with 0.1)')
    a('--attn-chunk', type=int, default=None, help='queries per attention block (Config.attn_chunk; default: the model\'s)')
    a('--configs', default=DEFAULT_CONFIGS, help='comma-separated: vanilla, fixedK (fixed pooling, factor K), '
      'wsK (dynamic pooling, external word-like boundaries of mean segment length K, e.g. ws5.5)')
    a('--steps', type=int, default=3, help='timed training steps per configuration per round')
    a('--warmup', type=int, default=1, help='untimed steps first (allocator, Adam state, caches)')
    a('--rounds', type=int, default=2, help='rounds over all configurations, each configuration in a fresh process per round')
    a('--device', default='cuda' if torch.cuda.is_available() else 'cpu', help='cpu or cuda')
    a('--amp', choices=['auto', 'off', 'bf16'], default='auto', help='bf16 autocast; auto: on for cuda, off for cpu')
    a('--threads', type=int, default=None, help='torch.set_num_threads for every process (default: torch\'s choice)')
    a('--clock', choices=['wall', 'cpu'], default='wall', help='wall: elapsed time; cpu: this process\'s CPU time, which '
      'on a CPU shared with other jobs still reads what an idle core would take (use with --threads 1)')
    a('--adam', choices=['fused', 'foreach', 'loop'], default='fused', help='Adam implementation (fused: one kernel '
      'over all parameters, ~3× faster than loop on CPU; loop is torch.optim.Adam\'s CPU default)')
    a('--compile', action='store_true', help='torch.compile the model first (optional; warm-up then includes compilation)')
    a('--peak-n', type=int, default=None, help='size n of the n×n×n matmul that measures the peak (default 2048 cpu, 8192 cuda)')
    a('--no-pieces', action='store_true', help='skip timing attention, feed-forward, pooling and predictor separately')
    a('--plot', metavar='FILE', help='write a PNG of step time and memory against shortening factor (needs matplotlib)')
    a('--profile', metavar='CONFIG', help='print the torch.profiler table of one training step of CONFIG and exit')
    a('--generate', action='store_true', help='benchmark cached generation against full recomputation instead of training')
    a('--context', type=int, default=1024, help='--generate: characters of context before generating')
    a('--new', type=int, default=128, help='--generate: characters generated by the cached model')
    a('--gen-batch', type=int, default=1, help='--generate: sequences generated side by side')
    a('--recompute-steps', type=int, default=8, help='--generate: characters generated by full recomputation (slow)')
    a('--seed', type=int, default=0, help='random seed of weights, characters and boundaries')
    a('--one', metavar='CONFIG', help=argparse.SUPPRESS)  # child process: one configuration, prints a JSON line
    args = p.parse_args(argv)
    for k, v in PRESETS[args.preset].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    # bad values stop here with a usage line, not with a traceback from a child process
    try:
        args.layers = tuple(int(n) for n in args.layers.split(','))
    except ValueError:
        p.error(f'--layers takes pre,shortened,post counts such as 2,8,2, got {args.layers!r}')
    try:
        for name in args.configs.split(',') + ([args.profile] if args.profile else []):
            model_config(args, name)  # Config's own checks: layers, factors, sizes
    except ValueError as e:
        p.error(str(e))
    try:
        device = torch.device(args.device)
    except RuntimeError:
        p.error(f'--device {args.device}: not a torch device (cpu, cuda, cuda:1, ...)')
    if device.type == 'cuda' and not torch.cuda.is_available():
        p.error(f'--device {args.device}: CUDA is not available')
    if args.clock == 'cpu' and device.type != 'cpu':
        p.error('--clock cpu times CPU work only: use it with --device cpu')
    if args.steps < 1 or args.rounds < 1 or args.warmup < 0:
        p.error('--steps and --rounds must be at least 1, --warmup at least 0')
    if args.amp == 'auto':
        args.amp = 'bf16' if args.device.startswith('cuda') else 'off'
    if args.peak_n is None:
        args.peak_n = 8192 if args.device.startswith('cuda') else 2048
    return args


# -----------------------------------------------------------------------------
# Configurations, inputs and the FLOP count


def parse_config(name):
    """'vanilla' | 'fixedK' | 'wsK' → (boundary mode, shortening factor or None); ValueError otherwise."""
    if name == 'vanilla':
        return 'none', None
    for prefix, mode in (('fixed', 'fixed'), ('ws', 'whitespace')):
        if name.startswith(prefix):
            try:
                k = float(name[len(prefix):])
            except ValueError:
                break
            if not k >= 1 or (mode == 'fixed' and not k.is_integer()):
                raise ValueError(f'configuration {name}: the factor must be at least 1 (an integer for fixed)')
            return mode, k
    raise ValueError(f'unknown configuration {name!r}: use vanilla, fixedK or wsK (e.g. fixed2, ws5.5)')


def model_config(args, name):
    mode, k = parse_config(name)
    kw = dict(vocab_size=VOCAB, d_model=args.d_model, n_head=args.n_head, d_head=args.d_head, d_inner=args.d_inner,
              dropout=args.dropout, dropatt=args.dropatt, layers=args.layers, boundary=mode, whitespace_id=0,
              fixed_factor=int(k) if mode == 'fixed' else 2)
    if args.attn_chunk:
        kw['attn_chunk'] = args.attn_chunk
    return Config(**kw)


def build(args, name):
    mode, k = parse_config(name)
    return DynamicPoolingLM(model_config(args, name)).to(args.device), mode, k


def setup(args, name):
    """The seeded model of configuration `name` in training mode, and its batch (x, y, b)."""
    torch.manual_seed(args.seed)
    model, mode, k = build(args, name)
    return model.train(), mode, k, make_batch(args, mode, k, torch.Generator().manual_seed(args.seed))


def n_segments(L, mode, k):
    """Complete segments per row: L // k for fixedK; wsK places exactly round(L / k) boundaries."""
    return L // int(k) if mode == 'fixed' else max(1, round(L / k))


def make_batch(args, mode, k, gen):
    """Random characters, next-character targets and, for wsK, exactly round(L/k) boundaries per row."""
    B, L = args.batch, args.seq_len
    x = torch.randint(0, VOCAB, (B, L + 1), generator=gen)
    b = None
    if mode == 'whitespace':
        n = n_segments(L, mode, k)
        b = torch.zeros(B, L)
        for row in b:
            row[torch.randperm(L, generator=gen)[:n]] = 1
    dev = args.device
    return x[:, :-1].to(dev), x[:, 1:].to(dev), None if b is None else b.to(dev)


def stack_lengths(args, mode, k):
    """[(layers, sequence length)] of the stacks a configuration runs."""
    L, (pre, short, post) = args.seq_len, args.layers
    if mode == 'none':
        return [(pre + short + post, L)]
    return [(pre, L), (short, 1 + n_segments(L, mode, k)), (post, L)]


FLOP_FORMULA = ("model FLOPs of a step = 3 × forward (backward = 2 × forward); forward = Σ over stacks of\n"
                "  layers × [B·n·2·(3·d·H·dh + H·dh·d + 2·d·d_inner)  (qkv, out, feed-forward)\n"
                "          + n·2·d·H·dh                            (position projection r_net, once per sequence)\n"
                "          + B·H·n²·2·dh·3]                        (content and position scores, weights × values: full n²)\n"
                "  + B·L·2·d·V (logits); n = the stack's length (L, or 1 + segments for the shortened stack);\n"
                "  pooling, upsampling, norms and softmax are left out. The attention skips the masked future\n"
                "  blocks, so it executes about half the n² terms counted here (the usual MFU convention).")


def step_flops(args, mode, k):
    d, H, dh, di, B = args.d_model, args.n_head, args.d_head, args.d_inner, args.batch
    fwd = B * args.seq_len * 2 * d * VOCAB
    for layers, n in stack_lengths(args, mode, k):
        fwd += layers * (B * n * 2 * (3 * d * H * dh + H * dh * d + 2 * d * di) + n * 2 * d * H * dh
                         + B * H * n * n * 2 * dh * 3)
    return 3 * fwd


clock = time.perf_counter  # --clock cpu switches every timing here to time.process_time


def sync(device):
    if device.startswith('cuda'):
        torch.cuda.synchronize()


def matmul_peak(args, repeats=5):
    """FLOP/s of the best of a few n×n×n matmuls in the training dtype: the machine's own peak."""
    n, dev = args.peak_n, args.device
    dtype = torch.bfloat16 if args.amp == 'bf16' else torch.float32
    a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
    out = torch.empty(n, n, device=dev, dtype=dtype)
    torch.mm(a, b, out=out)
    best = float('inf')
    for _ in range(repeats):
        sync(dev)
        t = clock()
        torch.mm(a, b, out=out)
        sync(dev)
        best = min(best, clock() - t)
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


def peak_rss():
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == 'darwin' else r * 1024  # bytes on macOS, KiB on Linux


def make_adam(args, model):
    impl = {'fused': dict(fused=True), 'foreach': dict(foreach=True), 'loop': dict(foreach=False)}[args.adam]
    return torch.optim.Adam(model.parameters(), lr=1e-4, **impl)


def train_step(model, opt, x, y, b, amp):
    opt.zero_grad(set_to_none=True)
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=amp == 'bf16'):
        out = model(x, targets=y, boundaries=b)
    out.loss.backward()
    opt.step()
    return out


def run_one(args, name):
    """Warm up, time args.steps steps, print one JSON line for the parent."""
    model, mode, k, (x, y, b) = setup(args, name)
    opt = make_adam(args, model)
    if args.compile:
        model = torch.compile(model)
    cuda = args.device.startswith('cuda')
    base = torch.cuda.memory_allocated() if cuda else rss_now()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for _ in range(args.warmup):
        out = train_step(model, opt, x, y, b, args.amp)
    times = []
    for _ in range(args.steps):
        sync(args.device)
        t = clock()
        out = train_step(model, opt, x, y, b, args.amp)
        sync(args.device)
        times.append(clock() - t)
    sf = float(out.shortening_factor) if out.shortening_factor is not None else 1.0
    if cuda:
        peak, step_mem = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_allocated() - base
    else:
        peak = peak_rss()
        step_mem = peak - base
    print(json.dumps(dict(name=name, times=times, peak=peak, step_mem=step_mem, sf=sf,
                          params=sum(p.numel() for p in model.parameters()))), flush=True)


def child_cmd(args, name):
    cmd = [sys.executable, os.path.abspath(__file__), '--one', name]
    for flag in ('preset', 'd_model', 'n_head', 'd_head', 'd_inner', 'seq_len', 'batch', 'dropout', 'dropatt',
                 'attn_chunk', 'steps', 'warmup', 'device', 'amp', 'threads', 'clock', 'adam', 'seed'):
        v = getattr(args, flag)
        if v is not None:
            cmd += ['--' + flag.replace('_', '-'), str(v)]
    cmd += ['--layers', ','.join(map(str, args.layers))]
    return cmd + (['--compile'] if args.compile else [])


def spawn(args, name):
    r = subprocess.run(child_cmd(args, name), capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f'configuration {name} failed:\n{r.stderr[-3000:]}')
    return json.loads(r.stdout.strip().splitlines()[-1])


# -----------------------------------------------------------------------------
# Pieces of a step, timed alone (forward + backward)


def time_fn(fn, device, repeats=5):
    fn()
    ts = []
    for _ in range(repeats):
        sync(device)
        t = clock()
        fn()
        sync(device)
        ts.append(clock() - t)
    return statistics.median(ts)


def time_pieces(args, name, step_time):
    """Forward + backward time of each piece of configuration `name`, times how often a step runs it."""
    model, mode, k, (x, y, b) = setup(args, name)
    B, L, D, dev = args.batch, args.seq_len, args.d_model, args.device
    layer = model.stacks[0].layers[0]
    rows = []

    def fwd_bwd(f, *inputs):
        def run():
            xs = [t.detach().requires_grad_() for t in inputs]
            with torch.autocast(torch.device(dev).type, dtype=torch.bfloat16, enabled=args.amp == 'bf16'):
                out = f(*xs)
            out.float().sum().backward()
        return run

    for layers, n in stack_lengths(args, mode, k):
        h = torch.randn(B, n, D, device=dev)
        pos = sinusoids(torch.arange(n - 1, -1, -1, device=dev), D)
        rows.append((f'attention, n={n} ×{layers}', layers * time_fn(fwd_bwd(
            lambda h: layer.attn(h, pos, model.u, model.v), h), dev)))
        rows.append((f'feed-forward, n={n} ×{layers}', layers * time_fn(fwd_bwd(layer.ff, h), dev)))
    h = torch.randn(B, L, D, device=dev)
    if mode != 'none':
        bb = model.external_boundaries(x, b)
        rows.append(('pooling + upsampling (B-matrix mean, gather)', time_fn(fwd_bwd(
            lambda h: upsample(model.down_norm(downsample(h, bb, model.null_group)), bb) + h, h), dev)))
        pred = BoundaryPredictor(model.cfg).to(dev)
        rows.append(('boundary predictor (unigram/entropy/gumbel only; not in ws)', time_fn(fwd_bwd(
            lambda h: F.binary_cross_entropy_with_logits(pred(h), bb), h), dev)))
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
    return dict(rows)


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
            for i, stack in enumerate(model.stacks):
                def timed(*a, _step=stack.step, _i=i, **kw):
                    sync(dev)
                    t = clock()
                    r = _step(*a, **kw)
                    sync(dev)
                    stack_time[_i] += clock() - t
                    return r
                stack.step = timed
            _, state = model.prefill(x[:, :C], capacity=C + n)
            for t in range(C, C + 4):  # warm-up
                model.decode(x[:, t], state)
            _, state = model.prefill(x[:, :C], capacity=C + n)
            stack_time[:] = [0.0, 0.0, 0.0]
            sync(dev)
            t0 = clock()
            for t in range(C, C + n):
                model.decode(x[:, t], state)
            sync(dev)
            cached = clock() - t0
            for stack in model.stacks:
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


def main():
    global clock
    args = parse_args()
    if args.clock == 'cpu':
        clock = time.process_time
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.one:
        return run_one(args, args.one)
    if args.generate:
        return bench_generate(args)
    if args.profile:
        from torch.profiler import profile
        model, _, _, (x, y, b) = setup(args, args.profile)
        opt = make_adam(args, model)
        for _ in range(max(1, args.warmup)):
            train_step(model, opt, x, y, b, args.amp)
        with profile() as prof:
            train_step(model, opt, x, y, b, args.amp)
        sort = 'self_cuda_time_total' if args.device.startswith('cuda') else 'self_cpu_time_total'
        print(prof.key_averages().table(sort_by=sort, row_limit=20))
        return

    names = args.configs.split(',')
    cuda = args.device.startswith('cuda')
    dev_name = torch.cuda.get_device_name() if cuda else f'CPU, {torch.get_num_threads()} threads'
    if args.clock == 'cpu':
        dev_name += ', CPU-time clock'
    print(f'dynpool training step: d {args.d_model}, heads {args.n_head}×{args.d_head}, d_inner {args.d_inner}, '
          f'L {args.seq_len}, batch {args.batch}, layers {args.layers} (vanilla {sum(args.layers)}), '
          f'dropout {args.dropout}/{args.dropatt}, {"bf16 autocast" if args.amp == "bf16" else "fp32"}, {args.adam} Adam, '
          f'{dev_name}, torch {torch.__version__}')
    print(f'{args.rounds} rounds × {len(names)} configurations interleaved, each a fresh process: '
          f'{args.warmup} warm-up + {args.steps} timed steps; median of the {args.rounds * args.steps} timed steps')
    results = {n: [] for n in names}
    peaks = []
    for r in range(args.rounds):
        peaks.append(matmul_peak(args))
        for n in names:
            results[n].append(spawn(args, n))
            print(f'  round {r + 1}: {n:8s} {statistics.median(results[n][-1]["times"]) * 1e3:9.0f} ms', flush=True)
    peaks.append(matmul_peak(args))
    peak = max(peaks)
    print(f'\nmatmul peak: {peak / 1e9:.1f} GFLOP/s ({args.peak_n}³ {"bf16" if args.amp == "bf16" else "fp32"} '
          f'matmul, best of 5, highest of {len(peaks)} measurements spread over the run; '
          f'all: {", ".join(f"{p / 1e9:.0f}" for p in peaks)})')
    print(FLOP_FORMULA)
    mem_label = 'peak alloc' if cuda else 'peak RSS'
    header = (f'\n{"config":8s} {"factor":>6s} {"step ms":>9s} {"chars/s":>9s} {"speed-up":>8s} {mem_label + " MiB":>14s} '
              f'{"step mem MiB":>13s} {"mem ratio":>9s} {"GFLOP":>8s} {"GFLOP/s":>8s} {"MFU":>6s}')
    print(header)
    table = {}
    for n in names:
        runs = results[n]
        t = statistics.median([x for run in runs for x in run['times']])
        mode, k = parse_config(n)
        table[n] = dict(time=t, peak=max(run['peak'] for run in runs), mem=statistics.median(run['step_mem'] for run in runs),
                        sf=runs[0]['sf'], flops=step_flops(args, mode, k))
    van = table.get('vanilla')
    for n in names:
        row = table[n]
        speed = f'{van["time"] / row["time"]:7.2f}×' if van else '       -'
        memr = f'{row["mem"] / van["mem"]:9.2f}' if van and van['mem'] > 0 else '        -'
        fps = row['flops'] / row['time']
        print(f'{n:8s} {row["sf"]:6.2f} {row["time"] * 1e3:9.0f} {args.batch * args.seq_len / row["time"]:9.0f} {speed} '
              f'{fmt_bytes(row["peak"]):>14s} {fmt_bytes(row["mem"]):>13s} {memr} {row["flops"] / 1e9:8.1f} '
              f'{fps / 1e9:8.1f} {100 * fps / peak:5.0f}%')
    if van:
        print('speed-up: vanilla step time / this step time; mem ratio: step mem / vanilla step mem; '
              'factor: characters / complete segments')

    if not args.no_pieces:
        pooled = [n for n in names if n != 'vanilla']
        pick = 'ws5.5' if 'ws5.5' in names else (pooled[0] if pooled else None)
        if van:
            time_pieces(args, 'vanilla', van['time'])
        if pick:
            pieces = time_pieces(args, pick, table[pick]['time'])
            pool = pieces['pooling + upsampling (B-matrix mean, gather)']
            pred = pieces['boundary predictor (unigram/entropy/gumbel only; not in ws)']
            print(f'  pooling + upsampling + boundary predictor: {100 * (pool + pred) / (table[pick]["time"] + pred):.1f}% '
                  f'of a {pick} step with a predictor added')

    if args.plot:
        try:
            import matplotlib
            matplotlib.use('Agg')
            import matplotlib.pyplot as plt
        except ImportError:
            print('--plot: matplotlib is not installed; no plot written')
            return
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
        for prefix, label, marker in (('fixed', 'fixed pooling', 's'), ('ws', 'dynamic (word-like) pooling', 'o')):
            ns = sorted((n for n in names if n.startswith(prefix)), key=lambda n: table[n]['sf'])
            if ns:
                ax1.plot([table[n]['sf'] for n in ns], [table[n]['time'] * 1e3 for n in ns], marker=marker, label=label)
                ax2.plot([table[n]['sf'] for n in ns], [table[n]['mem'] / 2 ** 20 for n in ns], marker=marker, label=label)
        if van:
            ax1.axhline(van['time'] * 1e3, color='k', ls='--', label='vanilla')
            ax2.axhline(van['mem'] / 2 ** 20, color='k', ls='--', label='vanilla')
        ax1.set(xlabel='shortening factor', ylabel='training step (ms)', ylim=(0, None))
        ax2.set(xlabel='shortening factor', ylabel='step memory (MiB)', ylim=(0, None))
        ax1.legend()
        fig.suptitle(f'd {args.d_model}, L {args.seq_len}, batch {args.batch}, {dev_name}')
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f'plot written to {args.plot}')


if __name__ == '__main__':
    main()
