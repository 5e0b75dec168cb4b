"""
Train a dynamic-pooling Transformer (Nawrot et al., ACL 2023) as a character-level language model.

    python prepare_data.py                                    # data/text8, once
    python train.py --boundary entropy                        # GPU: the paper's recipe; CPU: small
    python train.py --boundary unigram --data data/wiki40b-fi --out out/fi-unigram
    python train.py --boundary gumbel --max-time 540          # a 9-minute slice of a long run ...
    python train.py --out out/text8-gumbel --resume           # ... and the next (flags: checkpoint's)
    python train.py --boundary whitespace --flop-budget 3e15  # a FLOP budget, not a step count
    torchrun --nproc_per_node=8 train.py --boundary whitespace          # DDP over 8 GPUs (NCCL)
    torchrun --nproc_per_node=2 train.py --device cpu --boundary fixed  # DDP on CPU (gloo)

A run writes <out>/ckpt.pt and <out>/log.jsonl (config, train and eval records, one JSON object a
line); the terminal gets one line per --log-interval steps, and a finished run's last line is
`test bpc <x.xxxx> sf <y.yy>`. `python train.py --help` shows every flag and its default.
"""
import dataclasses
import math
import random
import shlex
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Optional

import numpy as np
import torch
import torch.nn.functional as F

from dynpool import BOUNDARY_MODES, Config, DynamicPoolingLM, step_flops
from operations import (Clock, Logger, Processes, StepStats, UserError, adam_step_skipping,
                        check_model_memory, check_path, check_resumable, config_from_dict,
                        dataset_defaults, device_name, die, duration, flag_parser, float_range,
                        fraction, import_optional, interrupts_deferred, kept, layer_counts,
                        load_data, non_negative_float, non_negative_int, nonblank, numpy_seed,
                        peak_mem_mb, pick_device, positive_float, positive_int, probability,
                        restore_training, resume_flags, run_guard, run_summary, save_checkpoint,
                        setup_precision, short_count, start_processes, sum_dtype, to_device,
                        torchrun_processes, training_checkpoint, wrap_model)

# ----------------------------------------------------------------------------------- presets
# The paper's recipe (appendix) for a GPU: batch 8 x 2048 chars, Adam 2.5e-4, 4k warm-up steps,
# one cosine cycle over 200k, grad clip 0.25, dropout 0.1; bf16 (fp16 and loss scaling without it).
GPU_PRESET = dict(d_model=512, n_head=8, d_head=64, d_inner=2048, layers='2,8,2', dropout=0.1,
                  dropatt=0.1, batch_size=8, seq_len=2048, lr=2.5e-4, warmup=4000,
                  max_steps=200_000, eval_interval=5000, eval_window=2048, eval_step=512,
                  eval_subset_chars=300_000, eval_max_chars=0, eval_batch_size=64, log_interval=100)
# A small model for 2 CPU cores that learns in a few hundred steps, which never see a character
# twice (so no dropout); the eval window keeps the 4:1 window:step ratio.
CPU_PRESET = dict(d_model=128, n_head=2, d_head=64, d_inner=512, layers='1,4,1', dropout=0.0,
                  dropatt=0.0, batch_size=4, seq_len=512, lr=1e-3, warmup=50, max_steps=300,
                  eval_interval=100, eval_window=512, eval_step=128, eval_subset_chars=20_000,
                  eval_max_chars=0, eval_batch_size=8, log_interval=10)
COMMON = dict(data='data/text8', boundary='entropy', grad_accum=1, grad_clip=0.25, seed=1337,
              amp='auto', compile=False, attention='auto', tensorboard=False)
# Flags whose default is the model's (the Gumbel prior: the dataset's, where meta.json has one).
MODEL_FLAGS = ('fixed_factor', 'temperature', 'prior', 'entropy_window', 'ratio_target',
               'ratio_weight', 'double_sigmoid')
MODEL_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Config)}
# Flags that define the model or the data order: a resumed run must keep them.
KEPT_ON_RESUME = ('boundary', 'd_model', 'n_head', 'd_head', 'd_inner', 'layers', 'dropout',
                  'dropatt', 'seq_len', 'batch_size', 'seed', 'flop_budget') + MODEL_FLAGS
# Flags of this invocation only: a resumed run does not take them from the checkpoint.
NOT_RESUMED = ('resume', 'device', 'stop_step', 'max_time')


# --------------------------------------------------------------------------------- arguments
DEFAULTS = {**MODEL_DEFAULTS, **GPU_PRESET, **COMMON}


def default(k):
    """A flag's default for --help: the preset's (GPU and CPU where they differ) or the model's."""
    if k in GPU_PRESET and GPU_PRESET[k] != CPU_PRESET[k]:
        return f'default GPU {GPU_PRESET[k]}, CPU {CPU_PRESET[k]}'
    return f'default {DEFAULTS[k]}' if k in DEFAULTS else 'default off'


FLAGS = [  # (flag, type, help); --help adds the preset's or the model's default where there is one
    ('--data', nonblank, 'dataset directory written by prepare_data.py'),
    ('--out', nonblank, 'run directory: ckpt.pt, log.jsonl (default out/<dataset>-<boundary>)'),
    ('--device', nonblank, 'cpu, cuda, cuda:1, mps: picks the GPU or CPU preset (default cuda if '
     'there is one, else cpu); under torchrun each process takes its own GPU'),
    ('--seed', numpy_seed, 'seed of initialisation, data order and dropout'),
    ('--d-model', positive_int, 'model width'),
    ('--n-head', positive_int, 'attention heads'),
    ('--d-head', positive_int, 'width of one head'),
    ('--d-inner', positive_int, 'feed-forward width'),
    ('--layers', layer_counts, 'pre,shortened,post layer counts (vanilla: all at full length)'),
    ('--dropout', fraction, 'dropout'),
    ('--dropatt', fraction, 'attention dropout'),
    ('--fixed-factor', positive_int, 'fixed: segment length k'),
    ('--temperature', positive_float, 'gumbel: Gumbel-sigmoid temperature'),
    ('--prior', probability, 'gumbel: prior boundary rate (default: the dataset\'s, meta.json '
     f'"defaults", e.g. 0.37 for Finnish; else {MODEL_DEFAULTS["prior"]})'),
    ('--entropy-window', positive_int, 'entropy: k of the spike rule'),
    ('--ratio-target', float_range(1, lo_open=True), 'hnet: target compression N of the ratio loss'),
    ('--ratio-weight', non_negative_float, 'hnet: weight of the ratio loss'),
    ('--batch-size', positive_int, 'global batch, sequences a step over processes and --grad-accum'),
    ('--seq-len', positive_int, 'training sequence length in characters'),
    ('--grad-accum', positive_int, 'micro-steps per optimizer step'),
    ('--max-steps', positive_int, 'optimizer steps; the cosine ends here'),
    ('--flop-budget', positive_float, 'train to this many FLOPs (step_flops with the measured SF): '
     'the cosine decays over the FLOPs after warm-up, the first step to reach the budget is the '
     'last, --max-steps only caps it (default none)'),
    ('--stop-step', positive_int, 'evaluate, save and exit at this step, unfinished (the schedule '
     'still runs to --max-steps); continue with --resume (default none)'),
    ('--max-time', positive_float, 'seconds this invocation may train: at the first log step past '
     'them, evaluate, save and exit; continue with --resume (default none)'),
    ('--lr', positive_float, 'peak learning rate'),
    ('--warmup', non_negative_int, 'linear warm-up steps before the cosine'),
    ('--grad-clip', non_negative_float, 'gradient norm clip, 0 = off'),
    ('--eval-interval', positive_int, 'validate and save every N steps'),
    ('--eval-window', positive_int, 'evaluation window in characters'),
    ('--eval-step', positive_int, 'each window scores its last N characters'),
    ('--eval-subset-chars', non_negative_int, 'validate on the first N characters while training, '
     '0 = all'),
    ('--eval-max-chars', non_negative_int, 'cap the final validation and test at N chars, 0 = all'),
    ('--eval-batch-size', positive_int, 'windows per evaluation batch'),
    ('--log-interval', positive_int, 'a train record every N steps'),
    ('--wandb', nonblank, 'also log to this Weights & Biases project (needs wandb; default off)'),
    ('--resume', None, 'continue the run in --out from its checkpoint'),
    ('--double-sigmoid', None, "unigram/entropy: the released code's predictor loss, BCE-with-"
     'logits of sigmoid(logit) (off: the cross-entropy the paper describes)'),
    ('--compile', None, 'torch.compile the model for training'),
    ('--tensorboard', None, 'also log to TensorBoard in <out>/tensorboard (needs tensorboard)'),
    ('--boundary', BOUNDARY_MODES, 'segmentation: none (vanilla), fixed, whitespace, unigram, '
     'entropy, gumbel, hnet'),
    ('--attention', ('auto', 'sdpa', 'blocked'), 'attention kernels, speed only'),
    ('--amp', ('auto', 'bf16', 'fp16', 'off'), 'mixed precision: bf16 where the GPU has it '
     'natively, else fp16 with loss scaling; off on CPU'),
]


def parse_args(argv):
    """Flags → Namespace; a flag not given is None (resolve_args fills it in)."""
    return flag_parser(FLAGS, 'Train a dynamic-pooling Transformer on a prepared character '
                       'dataset.', default).parse_args(argv)


def resolve_args(args, procs=Processes()):
    """Fill every flag not given, once: from the checkpoint on --resume, the preset, the model's
    and the dataset's defaults → (args, checkpoint or None)."""
    given = {k for k, v in vars(args).items() if v is not None}
    device = pick_device(args.device, procs.local_rank if procs.world > 1 else None)
    if args.out is None and args.resume:
        raise UserError('--resume needs --out, the run directory to continue', code=2)
    out = check_path(args.out or f'out/{Path(args.data or COMMON["data"]).name}-'
                     f'{args.boundary or COMMON["boundary"]}', 'new-dir', '--out', code=2)
    ckpt, taken = None, {}
    if args.resume:
        ckpt, taken = resume_flags(out / 'ckpt.pt', args, given, KEPT_ON_RESUME, NOT_RESUMED)
    elif (out / 'ckpt.pt').exists():
        raise UserError(f'{out / "ckpt.pt"} already exists; pass --resume to continue it or '
                        f'choose another --out')
    vars(args).update(taken)  # on --resume: what was not given now is the checkpoint's
    model = {**MODEL_DEFAULTS, **dataset_defaults(args.data or COMMON['data'], MODEL_FLAGS)}
    fill = {**COMMON, **(GPU_PRESET if device.startswith('cuda') else CPU_PRESET),
            **({'max_steps': 10**9} if args.flop_budget is not None else {}),  # the budget ends it
            **{k: model[k] for k in MODEL_FLAGS}}
    vars(args).update({k: v for k, v in fill.items() if getattr(args, k, None) is None})
    args.out, args.device = str(out), device
    return args, ckpt


def check_args(args, procs=Processes()):
    """The rules between flags (each flag's own range is its type's) → the layer counts."""
    if args.eval_step > args.eval_window:
        raise UserError(f'--eval-step {args.eval_step} is larger than --eval-window '
                        f'{args.eval_window}: characters between windows would never be scored',
                        code=2)
    if args.batch_size % (procs.world * args.grad_accum):
        raise UserError(f'--batch-size {args.batch_size} must split evenly over {procs.world} '
                        f'processes x {args.grad_accum} micro-steps', code=2)
    on = torch.device(args.device).type
    if args.amp in ('fp16', 'bf16') and on not in ('cuda', 'cpu'):
        raise UserError(f'--amp {args.amp} is supported here on cuda and cpu only', code=2)
    if args.amp == 'fp16' and on != 'cuda':
        raise UserError('--amp fp16 needs a CUDA GPU (use bf16 or off on CPU)', code=2)
    return tuple(int(n) for n in layer_counts(args.layers).split(','))


def startup_warnings(args, procs):
    """Settings that run but are probably not what was meant, one line each."""
    warn = []
    if args.warmup >= args.max_steps:
        warn.append(f'--warmup {args.warmup} is not shorter than --max-steps {args.max_steps}: the '
                    f'learning rate never reaches its peak --lr {args.lr:g}')
    if args.batch_size == procs.world * args.grad_accum and args.device.startswith('cuda'):
        warn.append(f'one sequence per process and micro-step ({procs.world} processes, --batch-'
                    f'size {args.batch_size}, --grad-accum {args.grad_accum}) keeps a GPU waiting '
                    f'on kernel launches; raise --batch-size, and --lr with it')
    return warn


def model_config(args, layers, meta):
    """The model's Config from the flags and the dataset's vocabulary (exit 2 if invalid)."""
    kw = {k: getattr(args, k) for k in ('d_model', 'n_head', 'd_head', 'd_inner', 'dropout',
                                        'dropatt', 'boundary', 'attention') + MODEL_FLAGS}
    try:  # the model checks its own config (e.g. pooling modes need shortened layers)
        return config_from_dict(dict(kw, vocab_size=meta['vocab_size'], layers=layers,
                                     whitespace_id=meta.get('space_id')))
    except UserError as e:
        raise UserError(str(e), code=2) from None


# ------------------------------------------------------------------------------- data stream
def epoch_order(n_chars, seq_len, seed, epoch):
    """Random cyclic shift and chunk permutation of one epoch, a pure function of (seed, epoch)."""
    rng = np.random.default_rng([seed, epoch])
    return int(rng.integers(n_chars)), rng.permutation(n_chars // (seq_len + 1))


def get_chunks(stream, offset, chunk_ids, seq_len):
    """Chunks of seq_len+1 characters of the stream rotated by offset → int64 [..., seq_len+1]."""
    idx = (offset + chunk_ids[..., None] * (seq_len + 1) + np.arange(seq_len + 1)) % len(stream)
    return torch.from_numpy(stream[idx].astype(np.int64))


def segment_counts(cfg, x):
    """Complete segments per row of host tokens x [..., L] where no network decides them (fixed,
    whitespace) → int64 [...]; None where the device decides."""
    if cfg.boundary == 'fixed':
        return torch.full(x.shape[:-1], x.size(-1) // cfg.fixed_factor)
    return (x == cfg.whitespace_id).sum(-1) if cfg.boundary == 'whitespace' else None


class Batch(NamedTuple):
    """One optimizer step's data for this process and where the data stands once it is consumed."""
    epoch: int
    pos: int
    x: torch.Tensor                    # [grad_accum, micro, seq_len] inputs
    y: torch.Tensor                    # [grad_accum, micro, seq_len] next characters
    b: Optional[torch.Tensor]          # [grad_accum, micro, seq_len] Unigram labels, or None
    n_segments: Optional[list] = None  # per micro-step, the most segments of a row (host-known)
    flops: Optional[float] = None      # all processes' FLOPs of the step, where the host knows them


def batches(tokens, labels, args, cfg, state, procs):
    """The training stream from the state's (epoch, pos) on: one Batch per optimizer step."""
    L, n_chunks, epoch, pos = args.seq_len, len(tokens) // (args.seq_len + 1), state.epoch, state.pos
    micro = args.batch_size // (procs.world * args.grad_accum)
    while True:
        offset, perm = epoch_order(len(tokens), L, args.seed, epoch)
        while pos + args.batch_size <= n_chunks:
            # the step's global batch; this process takes its micro-batches out of it
            ids = perm[pos:pos + args.batch_size].reshape(args.grad_accum, procs.world, micro)
            pos += args.batch_size
            chunks = get_chunks(tokens, offset, ids, L)             # [accum, world, micro, L+1]
            counts = segment_counts(cfg, chunks[..., :-1])          # [accum, world, micro]
            # the shortened stack runs on 1 + segments positions, the null group included
            n_short = ([None] * (ids.size // micro) if cfg.boundary == 'none' else None
                       if counts is None else (1 + counts.sum(-1) / micro).flatten().tolist())
            flops = None if n_short is None else sum(step_flops(cfg, micro, L, n) for n in n_short)
            chunk, b = to_device(chunks[:, procs.rank], args.device), None  # [accum, micro, L+1]
            if labels is not None:
                b = get_chunks(labels, offset, ids[:, procs.rank], L)[..., :-1]
                b = to_device(b, args.device).bool()
            n_seg = None if counts is None else counts[:, procs.rank].amax(-1).tolist()
            yield Batch(epoch, pos, chunk[..., :-1], chunk[..., 1:], b, n_seg, flops)
        epoch, pos = epoch + 1, 0  # not enough chunks left for a full batch: next epoch


# ----------------------------------------------------------------------- model and optimizer
@dataclass
class RunState:
    """Where the run stands; all but `saved` goes into the checkpoint."""
    step: int = 0
    epoch: int = 0                        # the data position once `step` steps are done: the
    pos: int = 0                          # epoch, and the sequences of it consumed
    train_chars: int = 0                  # cumulative over every invocation of the run
    train_flops: Optional[float] = 0.0    # None: a run begun before FLOPs were counted
    train_time: float = 0.0               # seconds of training (evaluating and saving left out)
    budget_flops: float = 0.0             # --flop-budget: FLOPs spent, counted step by step
    warmup_flops: Optional[float] = None  # --flop-budget: budget_flops when warm-up ended
    saved: Optional[int] = None           # the step of the checkpoint on disk


def resumed_state(ckpt, args):
    """A checkpoint's RunState; one from before the counters: characters follow from the steps,
    FLOPs are unknown (None)."""
    get, step = ckpt.get, ckpt['step']
    return RunState(step, ckpt['epoch'], ckpt['pos'],
                    get('train_chars', step * args.batch_size * args.seq_len),
                    get('train_flops'), get('train_time', 0.0), get('budget_flops', 0.0),
                    get('warmup_flops'), saved=step)


class Training(NamedTuple):
    """The run's machinery: what steps, evaluations and records need besides the data."""
    model: torch.nn.Module          # compiled and/or DDP-wrapped, for training
    raw_model: DynamicPoolingLM     # the bare model, for evaluation and checkpoints
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    autocast: object
    amp: str
    stats: StepStats
    logger: Logger
    procs: Processes


def setup(args, cfg, ckpt, state, procs):
    """Processes, seeds, precision, model, optimizer (restored on --resume), logger → Training."""
    start_processes(args.device, procs)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)  # same on every rank: identical initial weights
    amp, autocast, scaler = setup_precision(args.amp, torch.device(args.device).type)
    raw_model = DynamicPoolingLM(cfg).to(args.device)
    # fused: one kernel over all parameters, which can also skip a step on the device (train_step)
    optimizer = torch.optim.Adam(raw_model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8,
                                 fused=True)
    if ckpt is not None:
        restore_training(ckpt, raw_model, optimizer, scaler, args.device)
    if procs.rank > 0:  # dropout masks should differ between ranks; rank 0 keeps the saved stream
        torch.manual_seed(args.seed + 1000 * procs.rank + state.step)
    logger = Logger(Path(args.out), args, rank=procs.rank, config_record=dict(
        kind='config', **{**vars(args), 'amp': amp}, params=raw_model.num_params(),
        device_name=device_name(args.device), world=procs.world, torch=torch.__version__,
        resumed_from=state.saved))
    return Training(wrap_model(raw_model, args, procs.world), raw_model, optimizer, scaler,
                    autocast, amp, StepStats(cfg, args, procs.world), logger, procs)


# ---------------------------------------------------------------------------------- schedule
def finished(state, args):
    """--max-steps reached, or the first step whose FLOPs reach the --flop-budget done."""
    spent = args.flop_budget is not None and state.budget_flops >= args.flop_budget * (1 - 1e-9)
    return state.step >= args.max_steps or spent


def lr_at(step, args, state):
    """Linear warm-up, then one cosine cycle that reaches 0 at --max-steps, or with --flop-budget
    at the budget: progress is then the share of the FLOPs after warm-up already spent (for a
    model whose steps all cost the same, e.g. vanilla, the two schedules are the same)."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    if args.flop_budget is not None:
        spent = state.budget_flops - state.warmup_flops
        progress = min(1.0, spent / max(1.0, args.flop_budget - state.warmup_flops))
    else:
        progress = min(1.0, (step - args.warmup) / max(1, args.max_steps - args.warmup))
    return args.lr * 0.5 * (1 + math.cos(math.pi * progress))


# -------------------------------------------------------------------------------- train step
def train_step(t, batch, args):
    """Forward and backward over the step's micro-batches, clipping, and an Adam step that the
    device skips where the loss or the gradient is not finite: nothing here waits for the device."""
    finite = None
    for m in range(args.grad_accum):
        # gradients are all-reduced only on the last micro-step
        sync = t.model.no_sync() if t.procs.world > 1 and m < args.grad_accum - 1 else nullcontext()
        known = {} if batch.n_segments is None else dict(n_segments=batch.n_segments[m])
        with sync:
            with t.autocast:
                out = t.model(batch.x[m], targets=batch.y[m],
                              boundaries=None if batch.b is None else batch.b[m], **known)
            t.scaler.scale(out.loss / args.grad_accum).backward()
        t.stats.add_micro(out, device_flops=batch.flops is None)
        finite = torch.isfinite(out.loss) if finite is None else finite & torch.isfinite(out.loss)
    t.scaler.unscale_(t.optimizer)
    norm = torch.nn.utils.clip_grad_norm_(t.model.parameters(), args.grad_clip or float('inf'))
    if t.scaler.is_enabled():  # fp16: the scaler skips steps whose gradients overflowed, as it should
        t.scaler.step(t.optimizer)
        t.scaler.update()
    else:
        finite = finite & torch.isfinite(norm)
        adam_step_skipping(t.optimizer, ~finite)
    t.optimizer.zero_grad(set_to_none=True)
    t.stats.add_step(norm, ~finite, batch.flops)


# ---------------------------------------------------------------------------------- the loop
def train(args, cfg, vocab, splits, labels, state, t, started):
    """The steps, a train record every --log-interval steps, validation and a checkpoint every
    --eval-interval; → why the run stopped before it finished, or None."""
    stop, why = min(args.max_steps, args.stop_step or args.max_steps), f'--stop-step {args.stop_step}'
    budget = args.flop_budget is not None
    stream = batches(splits['train'], labels and labels['train'], args, cfg, state, t.procs)
    if state.step == 0:
        eval_and_log(t, args, splits, 'valid', args.eval_subset_chars, state)
    batch, clock = next(stream), Clock(state.step, state.budget_flops if budget else state.step)
    t.model.train()
    while state.step < stop and not finished(state, args):
        if budget and state.step >= args.warmup and state.warmup_flops is None:
            state.warmup_flops = state.budget_flops  # the cosine decays over the FLOPs from here
        lr = lr_at(state.step, args, state)
        for group in t.optimizer.param_groups:
            group['lr'] = lr
        train_step(t, batch, args)
        state.step, state.epoch, state.pos = state.step + 1, batch.epoch, batch.pos
        state.train_chars += args.batch_size * args.seq_len
        batch = next(stream)  # cut and copied on the host while the device runs the step
        if budget:
            state.budget_flops += t.stats.take_step_flops()
        end = state.step >= stop or finished(state, args)
        save = state.step % args.eval_interval == 0 or end
        if state.step % args.log_interval == 0 or save:
            late = log_train(t, args, state, clock, lr, stop, started)
            if late and not end:
                stop, why, save = state.step, f'--max-time {args.max_time:g}s', True
        if save:
            if not finished(state, args):  # (a finished run is evaluated in full by finish)
                eval_and_log(t, args, splits, 'valid', args.eval_subset_chars, state)
            with interrupts_deferred():  # the checkpoint and the step it holds, together
                if t.procs.rank == 0:
                    counters = {k: v for k, v in vars(state).items() if k != 'saved'}
                    save_checkpoint(Path(args.out) / 'ckpt.pt', training_checkpoint(
                        t.raw_model, t.optimizer, t.scaler, counters, cfg, vocab, args), state.saved)
                state.saved = state.step
            clock.pause_ended()  # evaluating and saving are not training time
    return None if finished(state, args) else why


def log_train(t, args, state, clock, lr, stop, started):
    """Read the statistics since the last record (the loop's one wait for the device), log them
    and print the progress line → whether --max-time is up on any process."""
    r = t.stats.read(args.max_time is not None and time.time() - started >= args.max_time)
    dt, steps = clock.lap(state.step)
    if r['bad']:
        raise UserError(f'non-finite loss or gradient at a step in {state.step - steps + 1}..'
                        f'{state.step} (skipped: the weights stayed finite); stopped, '
                        f'{kept(Path(args.out) / "ckpt.pt", state.saved)}')
    state.train_time += dt
    if state.train_flops is not None:
        state.train_flops += r['flops']
    chars_per_s = steps * args.batch_size * args.seq_len / dt
    t.logger.log(dict(kind='train', step=state.step, train_chars=state.train_chars,
                      train_flops=state.train_flops, train_time=round(state.train_time, 3),
                      loss=r['loss'], bpc=r['lm_loss'] / math.log(2), sf=r['sf'],
                      precision=r['precision'], recall=r['recall'], chars_per_s=round(chars_per_s),
                      lr=lr, grad_norm=r['grad_norm'], mem_mb=round(peak_mem_mb(args.device)),
                      epoch=state.epoch))
    if args.flop_budget is not None:
        where = f'step {state.step} | {state.budget_flops:.3g}/{args.flop_budget:.3g} FLOPs'
        eta = clock.eta(state.budget_flops, args.flop_budget)
    else:
        where, eta = f'step {state.step}/{stop}', clock.eta(state.step, stop)
    if t.procs.rank == 0:
        print(f'{where} | loss {r["loss"]:.3f} | bpc {r["lm_loss"] / math.log(2):.3f} | sf '
              f'{r["sf"]:.2f} | {1000 * dt / steps:.0f} ms/step | {short_count(chars_per_s)} '
              f'chars/s | eta {duration(eta)}', flush=True)
    return r['late']


# -------------------------------------------------------------------------------- evaluation
def eval_windows(n, window, step):
    """Windows (start, end, first_scored) over n positions: the first window scores all of its
    positions, every later one only its last `step`, so each position is scored once with
    >= window-step positions of context where the text has them. The tail gets one more window
    ending at n that scores what is left."""
    if n <= window:
        return [(0, n, 0)]
    wins, start = [(0, window, 0)], step
    while start + window <= n:
        wins.append((start, start + window, start + window - step))
        start += step
    if wins[-1][1] < n:
        wins.append((n - window, n, wins[-1][1]))
    return wins


@torch.inference_mode()
def evaluate(model, tokens, window, step, batch_size, device, autocast=nullcontext(), name='eval',
             rank=0, world=1):
    """Bits per character over a token stream with overlapping windows, and the mean shortening
    factor. The sums stay on the device and are read once at the end."""
    n = len(tokens) - 1  # positions that have a next character to predict
    wins = eval_windows(n, window, step)[rank::world]  # each process takes its share of the windows
    was_training = model.training
    model.eval()
    # nats, scored characters, sum of SF x windows, windows with an SF
    sums = torch.zeros(4, dtype=sum_dtype(device), device=device)
    t0, shown = time.time(), 0.0
    for i in range(0, len(wins), batch_size):
        group = wins[i:i + batch_size]  # all windows have the same length, so they stack
        starts = np.array([s for s, _, _ in group])
        idx = starts[:, None] + np.arange(group[0][1] - group[0][0] + 1)  # [windows, W+1]
        chunk = torch.from_numpy(tokens[idx].astype(np.int64))
        counts = segment_counts(model.cfg, chunk[:, :-1])  # (known here: no device read for S)
        known = {} if counts is None else dict(n_segments=int(counts.max()))
        chunk = to_device(chunk, device)
        x, y = chunk[:, :-1], chunk[:, 1:]
        with autocast:
            out = model(x, **known)
        nll = F.cross_entropy(out.logits.float().transpose(1, 2), y, reduction='none')  # [B, W]
        first = to_device(torch.tensor([f - s for s, _, f in group]), device)
        scored = torch.arange(x.size(1), device=device)[None, :] >= first[:, None]
        sums[0] += torch.where(scored, nll, 0.0).sum()  # (not nll * scored: inf * 0 would be nan)
        sums[1] += scored.sum()
        if out.shortening_factor is not None:
            sums[2] += out.shortening_factor * len(group)
            sums[3] += len(group)
        done, spent = min(1.0, (i + batch_size) / len(wins)), time.time() - t0
        if rank == 0 and shown + 0.1 <= done < 1 and spent > 2:  # a slow evaluation shows progress
            shown = done
            print(f'  {name}: {done:4.0%} of {len(wins)} windows, {duration(spent)}, eta '
                  f'{duration(spent * (1 - done) / done)}', flush=True)
    if world > 1:
        torch.distributed.all_reduce(sums)
    nats, chars, sf_sum, sf_n = sums.tolist()
    model.train(was_training)
    return dict(bpc=nats / max(chars, 1) / math.log(2), sf=sf_sum / sf_n if sf_n else 1.0,
                nats=nats, chars=int(chars))


def eval_and_log(t, args, splits, split, max_chars, state):
    """Evaluate the first max_chars characters of a split (0: all) → its eval record, logged."""
    tokens = splits[split][:max_chars + 1] if max_chars else splits[split]
    t0, _ = time.time(), peak_mem_mb(args.device)  # (a reset: mem_mb is the evaluation's peak)
    r = evaluate(t.raw_model, tokens, args.eval_window, args.eval_step, args.eval_batch_size,
                 args.device, t.autocast, split, t.procs.rank, t.procs.world)
    rec = dict(kind='eval', step=state.step, split=split, bpc=r['bpc'], sf=r['sf'],
               eval_chars=r['chars'], subset=len(tokens) < len(splits[split]),
               train_chars=state.train_chars, train_flops=state.train_flops,
               train_time=round(state.train_time, 3), mem_mb=round(peak_mem_mb(args.device)))
    t.logger.log(rec)
    if t.procs.rank == 0:
        print(f'step {state.step} | {split} bpc {r["bpc"]:.4f} | sf {r["sf"]:.2f} | '
              f'{short_count(r["chars"])} chars{" (a subset)" if rec["subset"] else ""} | '
              f'{duration(time.time() - t0)}', flush=True)
    return rec


# ------------------------------------------------------------------------------ final report
def finish(t, args, splits, vocab, state, why):
    """A finished run: the full validation and test splits, where the checkpoint is and how to
    sample from it; a run stopped early: how to continue it."""
    out = shlex.quote(args.out)
    if why is not None:
        if t.procs.rank == 0:
            print(f'stopped at step {state.step} of {args.max_steps} ({why}); continue with: '
                  f'python train.py --out {out} --resume', flush=True)
        return
    eval_and_log(t, args, splits, 'valid', args.eval_max_chars, state)
    r = eval_and_log(t, args, splits, 'test', args.eval_max_chars, state)
    if t.procs.rank == 0:
        text = ''.join(vocab['alphabet'][i] for i in splits['test'][:40]).split('\n')[0]
        prompt = text.rsplit(' ', 1)[0] if ' ' in text.strip() else text  # whole words
        print(f'checkpoint {Path(args.out) / "ckpt.pt"}, log {Path(args.out) / "log.jsonl"}; '
              f'sample with: python sample.py --ckpt {out} --prompt {shlex.quote(prompt)}\n'
              f'test bpc {r["bpc"]:.4f} sf {r["sf"]:.2f}', flush=True)


def run(argv, procs):
    """Flags, data and model are checked before anything is written; then, with the run folder
    locked, set-up, training and the final report."""
    started = time.time()
    args, ckpt = resolve_args(parse_args(argv), procs)
    layers = check_args(args, procs)
    # the logging packages are imported only when asked for, and checked before anything is written
    for flag, module, package in (('tensorboard', 'torch.utils.tensorboard', 'tensorboard'),
                                  ('wandb', 'wandb', 'wandb')):
        if getattr(args, flag) and procs.rank == 0:
            import_optional(module, package, f'--{flag}')
    meta, splits, labels = load_data(args.data, args.boundary)
    if len(splits['train']) < args.batch_size * (args.seq_len + 1):
        raise UserError(f'{args.data}/train.bin has {len(splits["train"])} chars, fewer than one '
                        f'batch ({args.batch_size} x {args.seq_len + 1})')
    vocab = dict(alphabet=meta['alphabet'], vocab_size=meta['vocab_size'],
                 space_id=meta.get('space_id'))
    cfg = model_config(args, layers, meta)
    check_model_memory(cfg, args.device)
    if ckpt is not None:
        check_resumable(ckpt, cfg, vocab, args.data)
    state = RunState() if ckpt is None else resumed_state(ckpt, args)
    for line in startup_warnings(args, procs) if procs.rank == 0 else ():
        print(f'warning: {line}', file=sys.stderr, flush=True)
    ckpt_path = Path(args.out) / 'ckpt.pt'
    with run_guard(Path(args.out), procs,
                   lambda: f'interrupted at step {state.step}; {kept(ckpt_path, state.saved)}'):
        t = setup(args, cfg, ckpt, state, procs)
        try:
            if procs.rank == 0:
                print(run_summary(args, t.raw_model.num_params(), t.amp, procs.world, state.saved))
            why = train(args, cfg, vocab, splits, labels, state, t, started)
            finish(t, args, splits, vocab, state, why)
        finally:
            t.logger.close()


def main(argv=None):
    """Train; every user mistake or fault ends as one `error: ...` line and its exit code."""
    procs = torchrun_processes()
    try:
        run(argv, procs)
    except UserError as e:
        die(str(e), e.code, procs.rank)
    except KeyboardInterrupt:
        die('interrupted before training began; no checkpoint was written or changed', 130,
            procs.rank)


if __name__ == '__main__':
    main()
