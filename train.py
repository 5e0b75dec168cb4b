"""
Train a dynamic-pooling Transformer (Nawrot et al., ACL 2023) as a character-level language model.

    python prepare_data.py                                    # data/text8, once
    python train.py --boundary entropy                        # GPU: the paper's recipe; CPU: small
    python train.py --boundary unigram --data data/wiki40b-fi --out out/fi-unigram
    python train.py --boundary gumbel --max-time 540          # a 9-minute slice of a long run ...
    python train.py --out out/text8-gumbel --resume           # ... and the next (same flags)
    python train.py --boundary whitespace --flop-budget vanilla:200000  # vanilla's compute
    torchrun --nproc_per_node=8 train.py --boundary whitespace          # DDP over 8 GPUs (NCCL)

A run writes <out>/ckpt.pt and <out>/log.jsonl; the terminal ends with `test bpc <x> sf <y>`.
"""
import argparse
import dataclasses
import math
import platform
import random
import shlex
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple, Optional

import numpy as np
import torch
import torch.nn.functional as F

import common
import hnet  # noqa: F401  (registers boundary='hnet' before BOUNDARY_MODES is read)
import runtime as rt
from checkpoint import (check_resumable, config_from_dict, kept, read_checkpoint,
                        restore_training, save_checkpoint, training_state)
from common import (UserError, float_range, fraction, int_range, nonblank, non_negative_float,
                    non_negative_int, positive_float, positive_int, probability, seed_int)
from dataset import dataset_defaults, fingerprint, is_number, label_set, load_data
from dynpool import BOUNDARY_MODES, Config, DynamicPoolingLM, step_flops

# ------------------------------------------------------------------------------------ presets
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
               'ratio_weight', 'double_sigmoid', 'pooling')
MODEL_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Config)}
# Flags that define the model or the data order: a resumed run must keep them.
KEPT_ON_RESUME = ('boundary', 'unigram', 'd_model', 'n_head', 'd_head', 'd_inner', 'layers',
                  'dropout', 'dropatt', 'seq_len', 'batch_size', 'seed') + MODEL_FLAGS
# Flags of this invocation only: a resumed run does not take them from the checkpoint.
NOT_RESUMED = ('resume', 'device', 'stop_step', 'max_time')


# ------------------------------------------------------------------------------------- flags
def layer_counts(s):
    """Argument type: pre,shortened,post layer counts like 2,8,2 (each 0 to 1000)."""
    counts = str(s).split(',')
    if len(counts) != 3 or not all(n.strip().isdigit() and int(n) <= 1000 for n in counts):
        raise argparse.ArgumentTypeError(f'must be three counts like 2,8,2 (each 0 to 1000), '
                                         f'got {s!r}')
    return ','.join(str(int(n)) for n in counts)


def flop_budget(s):
    """Argument type: FLOPs, or vanilla:N (N vanilla steps of the run's shape: model_config)."""
    s = str(s).strip()
    return f'vanilla:{positive_int(s[8:])}' if s.startswith('vanilla:') else positive_float(s)


FLAGS = [  # (flag, type or choices, help); --help adds the default where it does not say it
    ('--data', nonblank, 'dataset directory written by prepare_data.py'),
    ('--boundary', BOUNDARY_MODES, 'where segments end (none: a vanilla Transformer)'),
    ('--out', nonblank, 'run directory: ckpt.pt, log.jsonl (default out/<dataset>-<boundary>)'),
    ('--resume', None, 'continue the run in --out from its checkpoint'),
    ('--device', nonblank, 'cpu, cuda, cuda:1 or mps; sets the preset (default cuda if any)'),
    ('--seed', seed_int, 'seed of initialisation, data order and dropout'),
    ('--d-model', positive_int, 'model width'),
    ('--n-head', positive_int, 'attention heads'),
    ('--d-head', positive_int, 'width of one head'),
    ('--d-inner', positive_int, 'feed-forward width'),
    ('--layers', layer_counts, 'pre,shortened,post layer counts (vanilla: all at full length)'),
    ('--dropout', fraction, 'dropout'),
    ('--dropatt', fraction, 'attention dropout'),
    ('--pooling', ('mean', 'last'), "a segment's mean, or its last token (Table 2's sub-sampling)"),
    ('--fixed-factor', int_range(1, 2**20), 'fixed: segment length k'),
    ('--temperature', positive_float, 'gumbel: Gumbel-sigmoid temperature'),
    ('--prior', probability, "gumbel: prior boundary rate (default the dataset's, else 0.2)"),
    ('--entropy-window', int_range(1, 2**20), 'entropy: k of the spike rule'),
    ('--unigram', positive_int, "unigram: the label set of vocabulary size V (default the "
     "dataset's default set)"),
    ('--double-sigmoid', None, "unigram/entropy: the released code's loss, BCE of sigmoid(logit)"),
    ('--ratio-target', float_range(1, lo_open=True), 'hnet: target compression of the ratio loss'),
    ('--ratio-weight', non_negative_float, 'hnet: weight of the ratio loss'),
    ('--attention', ('auto', 'sdpa', 'blocked'), 'attention kernels, speed only'),
    ('--batch-size', positive_int, 'global batch: sequences a step over processes, --grad-accum'),
    ('--seq-len', positive_int, 'training sequence length in characters'),
    ('--grad-accum', positive_int, 'micro-steps per optimizer step'),
    ('--max-steps', positive_int, 'optimizer steps; the cosine ends here'),
    ('--flop-budget', flop_budget, 'train to this many FLOPs (dynpool.step_flops, measured SF) '
     'or vanilla:N, those of N vanilla steps of this shape: the cosine decays over the FLOPs after '
     'warm-up, the first step reaching it is the last, --max-steps only caps (default none)'),
    ('--stop-step', positive_int, 'save and exit here, unfinished, for --resume (default none)'),
    ('--max-time', positive_float, 'seconds to train, then save and exit (default none)'),
    ('--lr', positive_float, 'peak learning rate'),
    ('--warmup', non_negative_int, 'linear warm-up steps before the cosine'),
    ('--grad-clip', non_negative_float, 'gradient norm clip, 0 = off'),
    ('--amp', ('auto', 'bf16', 'fp16', 'off'), 'auto: bf16 where the GPU has it, else fp16'),
    ('--compile', None, 'torch.compile the model for training'),
    ('--eval-interval', positive_int, 'validate and save every N steps'),
    ('--eval-window', positive_int, 'evaluation window in characters'),
    ('--eval-step', positive_int, 'each window scores its last N characters'),
    ('--eval-subset-chars', non_negative_int, 'validate on the first N chars in training, 0 = all'),
    ('--eval-max-chars', non_negative_int, 'cap the final validation and test at N chars, 0 = all'),
    ('--eval-batch-size', positive_int, 'windows per evaluation batch'),
    ('--log-interval', positive_int, 'a train record every N steps'),
    ('--tensorboard', None, 'also log to TensorBoard in <out>/tensorboard (needs tensorboard)'),
    ('--wandb', nonblank, 'also log to this Weights & Biases project (needs wandb; default off)'),
]


def parser():
    """FLAGS as argparse: type None is a switch (None when not given: a resumed run can tell), a
    tuple the choices; the help adds the preset's (GPU, CPU) or model's default."""
    p = common.Parser(prog='train.py', description=__doc__.split('\n')[1])
    for flag, kind, words in FLAGS:
        k = flag[2:].replace('-', '_')
        v = {**MODEL_DEFAULTS, **GPU_PRESET, **COMMON}.get(k, False)
        default = (f'default GPU {v}, CPU {CPU_PRESET[k]}' if v != CPU_PRESET.get(k, v)
                   else f'default {"off" if v is False else v}')
        words += '' if 'default' in words else f' ({default})'
        how = (dict(action='store_true', default=None) if kind is None else
               {'choices' if isinstance(kind, tuple) else 'type': kind})
        p.add_argument(flag, help=words, **how)
    return p


def resolve_args(argv, procs=rt.Processes()):
    """Flags → (args with every flag filled in, checkpoint or None): the device (this process's
    GPU under torchrun), --out, on --resume the checkpoint's flags, then the defaults."""
    args = parser().parse_args(argv)
    given = {k for k, v in vars(args).items() if v is not None}
    device = rt.pick_device(args.device, procs.local_rank if procs.world > 1 else None)
    if args.out is None and args.resume:
        raise UserError('--resume needs --out, the run directory to continue', code=2)
    data = args.data or COMMON['data']
    out = Path(args.out or f'out/{Path(data).name}-{args.boundary or COMMON["boundary"]}')
    ckpt, taken = None, {}
    if args.resume:
        ckpt = read_checkpoint(out / 'ckpt.pt')
        if {'args', 'optimizer', 'scaler', 'step', 'epoch', 'pos', 'rng'} - ckpt.keys():
            raise UserError(f'{out / "ckpt.pt"} lacks the training state to resume from')
        for k in sorted(given & set(KEPT_ON_RESUME)):
            if getattr(args, k) != ckpt['args'].get(k):
                raise UserError(f'--{k.replace("_", "-")} {getattr(args, k)} differs from the '
                                f'checkpoint\'s {ckpt["args"].get(k)} (a resumed run keeps its '
                                f'model and data order)', code=2)
        taken = {k: v for k, v in ckpt['args'].items() if k not in given | set(NOT_RESUMED)}
    elif (out / 'ckpt.pt').exists():
        raise UserError(f'{out / "ckpt.pt"} already exists; pass --resume to continue it or '
                        f'choose another --out')
    vars(args).update({**taken, 'out': str(out), 'device': device})
    model = {**MODEL_DEFAULTS, **dataset_defaults(args.data or COMMON['data'], MODEL_FLAGS)}
    defaults = {**COMMON, **(GPU_PRESET if device.startswith('cuda') else CPU_PRESET),
                **({'max_steps': 10**9} if args.flop_budget is not None else {}),  # budget ends it
                **{k: model[k] for k in MODEL_FLAGS}}
    vars(args).update({k: v for k, v in defaults.items() if getattr(args, k, None) is None})
    return args, ckpt


def model_config(args, meta, world=1):
    """The rules between flags (each flag's own range is its type's), then the model's Config
    (it checks itself; exit 2); a --flop-budget of vanilla:N becomes N vanilla steps' FLOPs."""
    if args.eval_step > args.eval_window:
        raise UserError(f'--eval-step {args.eval_step} is larger than --eval-window '
                        f'{args.eval_window}: characters between windows would never be scored',
                        code=2)
    if args.batch_size % (world * args.grad_accum):
        raise UserError(f'--batch-size {args.batch_size} must split evenly over {world} '
                        f'processes x {args.grad_accum} micro-steps', code=2)
    cfg = config_from_dict({k: getattr(args, k) for k in MODEL_FLAGS + (
        'd_model', 'n_head', 'd_head', 'd_inner', 'dropout', 'dropatt', 'boundary', 'attention')},
        vocab_size=meta['vocab_size'], whitespace_id=meta.get('space_id'),
        layers=tuple(int(n) for n in args.layers.split(',')))
    if isinstance(args.flop_budget, str):
        vanilla = dataclasses.replace(cfg, boundary='none')
        args.flop_budget = int(args.flop_budget[8:]) * step_flops(vanilla, args.batch_size,
                                                                  args.seq_len)
    return cfg


def check_run(args, ckpt, train_tokens, done):
    """Before anything is written: one batch of data, and on --resume steps left to train (done:
    finished()'s verdict on the checkpoint's state)."""
    if len(train_tokens) < args.batch_size * (args.seq_len + 1):
        raise UserError(f'{args.data}/train.bin has {len(train_tokens)} chars, fewer than one '
                        f'batch ({args.batch_size} x {args.seq_len + 1})')
    if ckpt is None:
        return
    # (at --max-steps exactly it resumes: a run stopped in its final evaluation redoes it)
    for flag, at in (('--max-steps', args.max_steps), ('--stop-step', args.stop_step)):
        if at is not None and (at < ckpt['step'] or flag == '--stop-step' and at == ckpt['step']):
            raise UserError(f'{flag} {at} is not after the checkpoint\'s step {ckpt["step"]}: '
                            f'nothing would be trained', code=2)
    log = Path(args.out) / 'log.jsonl'
    for r in map(rt.record, log.read_bytes().splitlines(True) if done and log.exists() else []):
        if r and (r.get('kind'), r.get('split'), r.get('step')) == ('eval', 'test', ckpt['step']):
            raise UserError(f'the run in {args.out} is finished (step {ckpt["step"]}, test bpc '
                            f'{r.get("bpc"):.4f} in its log): nothing to resume; a larger '
                            f'--max-steps or --flop-budget trains it further', code=2)


def recipe_warnings(args, world):
    """Settings that run but are probably not what was meant: one line each."""
    warn = []
    if args.warmup >= args.max_steps:
        warn.append(f'--warmup {args.warmup} is not shorter than --max-steps {args.max_steps}: the '
                    f'learning rate never reaches its peak --lr {args.lr:g}')
    if args.batch_size == world * args.grad_accum and args.device.startswith('cuda'):
        warn.append(f'one sequence per process and micro-step ({world} process(es), --batch-size '
                    f'{args.batch_size}, --grad-accum {args.grad_accum}) keeps a GPU waiting on '
                    f'kernel launches; raise --batch-size, and --lr with it')
    return warn


# -------------------------------------------------------------------------------- data stream
def epoch_order(n_chars, seq_len, seed, epoch):
    """Random cyclic shift and chunk permutation of one epoch, a pure function of (seed, epoch)."""
    rng = np.random.default_rng([seed, epoch])
    return int(rng.integers(n_chars)), rng.permutation(n_chars // (seq_len + 1))


def get_chunks(stream, offset, chunk_ids, seq_len):
    """Chunks of seq_len+1 characters of the stream rotated by offset → int64 [..., seq_len+1]."""
    idx = (offset + chunk_ids[..., None] * (seq_len + 1) + np.arange(seq_len + 1)) % len(stream)
    return torch.from_numpy(stream[idx].astype(np.int64))


def segment_counts(cfg, x):
    """Complete segments per row of host tokens x [..., L] where no network decides, else None."""
    if cfg.boundary == 'fixed':
        return np.full(x.shape[:-1], x.shape[-1] // cfg.fixed_factor)
    return (x == cfg.whitespace_id).sum(-1) if cfg.boundary == 'whitespace' else None


class Batch(NamedTuple):
    """One step's data for this process and the data position after it. x, y (next characters),
    b (Unigram labels or None): [grad_accum, micro, seq_len]; segments: complete segments per row
    of the global batch, [grad_accum, world, micro], where the host counts them."""
    epoch: int
    pos: int
    x: torch.Tensor
    y: torch.Tensor
    b: Optional[torch.Tensor]
    segments: Optional[np.ndarray] = None


def batches(tokens, labels, args, cfg, state, procs):
    """The training stream from the state's (epoch, pos) on: one Batch per optimizer step."""
    L, epoch, pos = args.seq_len, state.epoch, state.pos
    micro = args.batch_size // (procs.world * args.grad_accum)
    while True:
        offset, perm = epoch_order(len(tokens), L, args.seed, epoch)
        while pos + args.batch_size <= len(perm):
            # the step's global batch; this process takes its micro-batches out of it
            ids = perm[pos:pos + args.batch_size].reshape(args.grad_accum, procs.world, micro)
            pos += args.batch_size
            chunks = get_chunks(tokens, offset, ids, L)               # [accum, world, micro, L+1]
            chunk = rt.to_device(chunks[:, procs.rank], args.device)  # [accum, micro, L+1]
            b = None if labels is None else rt.to_device(
                get_chunks(labels, offset, ids[:, procs.rank], L)[..., :-1], args.device).bool()
            yield Batch(epoch, pos, chunk[..., :-1], chunk[..., 1:], b,
                        segment_counts(cfg, chunks[..., :-1].numpy()))
        epoch, pos = epoch + 1, 0  # not enough chunks left for a full batch: next epoch


# ------------------------------------------------------------------------ schedule and step
@dataclasses.dataclass
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


def reseed_rank(seed, rank, step):
    """Only rank 0's random state is saved: the others (their own dropout and Gumbel noise) restart
    their streams at every checkpoint's step, as a resumed run does, so DDP resumes bit-exactly."""
    if rank > 0:
        torch.manual_seed(seed + 1000 * rank + step)


def finished(state, args):
    """--max-steps done, or the first step whose FLOPs reach the --flop-budget."""
    spent = args.flop_budget is not None and state.budget_flops >= args.flop_budget * (1 - 1e-9)
    return state.step >= args.max_steps or spent


def lr_at(step, args, state):
    """Linear warm-up, then one cosine cycle to 0 at --max-steps; with --flop-budget, progress is
    the share of the FLOPs after warm-up spent (the same where every step costs the same)."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    if args.flop_budget is not None:
        spent = state.budget_flops - state.warmup_flops
        progress = min(1.0, spent / max(1.0, args.flop_budget - state.warmup_flops))
    else:
        progress = min(1.0, (step - args.warmup) / max(1, args.max_steps - args.warmup))
    return args.lr * 0.5 * (1 + math.cos(math.pi * progress))


def train_step(t, batch, args):
    """Forward and backward over the step's micro-batches, clipping, and an Adam step that the
    device skips where the loss or the gradient is not finite. Nothing here waits for the device."""
    finite = torch.ones((), dtype=torch.bool, device=batch.x.device)
    for m in range(args.grad_accum):
        # gradients are all-reduced only on the last micro-step
        sync = t.model.no_sync() if t.procs.world > 1 and m < args.grad_accum - 1 else nullcontext()
        # S, the most segments of a row, known on the host: the model need not read the device
        known = {} if batch.segments is None else dict(
            n_segments=int(batch.segments[m, t.procs.rank].max()))
        with sync:
            with t.autocast:
                out = t.model(batch.x[m], targets=batch.y[m],
                              boundaries=None if batch.b is None else batch.b[m], **known)
            t.scaler.scale(out.loss / args.grad_accum).backward()
        t.stats.add_micro(out)
        finite = finite & torch.isfinite(out.loss)
    t.scaler.unscale_(t.optimizer)
    norm = torch.nn.utils.clip_grad_norm_(t.model.parameters(), args.grad_clip or float('inf'))
    if t.scaler.is_enabled():  # fp16: the scaler skips a step whose gradients overflowed
        t.scaler.step(t.optimizer)
        t.scaler.update()
    else:  # skipped by the fused Adam where found_inf is set, unread by the host: GradScaler's
        finite = finite & torch.isfinite(norm)  # protocol (grad_scale None: nothing to unscale)
        t.optimizer.found_inf, t.optimizer.grad_scale = (~finite).float(), None
        try:
            t.optimizer.step()
        finally:
            del t.optimizer.found_inf, t.optimizer.grad_scale
    t.optimizer.zero_grad(set_to_none=True)
    t.stats.add_step(norm, ~finite, batch.segments)


# --------------------------------------------------------------------------------- evaluation
def eval_windows(n, window, step):
    """Windows (start, end, first_scored) over n positions: the first scores all its positions,
    each later one its last `step` (>= window-step of context), a last one ending at n the tail."""
    if n <= window:
        return [(0, n, 0)]
    wins = [(0, window, 0)] + [(s, s + window, s + window - step)
                               for s in range(step, n - window + 1, step)]
    return wins + ([(n - window, n, wins[-1][1])] if wins[-1][1] < n else [])


@torch.inference_mode()
def evaluate(model, tokens, window, step, batch_size, device, autocast=nullcontext(), name='eval',
             rank=0, world=1):
    """BPC over overlapping windows, the mean SF and a predictor's mean p; one device read."""
    wins = eval_windows(len(tokens) - 1, window, step)[rank::world]  # this process's share
    was_training = model.training
    model.eval()
    sums = torch.zeros(5, dtype=rt.sum_dtype(device), device=device)  # nats, chars, SF sum, n, p
    t0, shown = time.time(), 0.0
    for i in range(0, len(wins), batch_size):
        group = wins[i:i + batch_size]  # all windows have the same length, so they stack
        idx = np.array([[s] for s, _, _ in group]) + np.arange(group[0][1] - group[0][0] + 1)
        ids = tokens[idx]  # [windows, W+1], read from the memmap once
        counts = segment_counts(model.cfg, ids[:, :-1])  # (known: no device read for S)
        chunk = rt.to_device(torch.from_numpy(ids.astype(np.int64)), device)
        x, y = chunk[:, :-1], chunk[:, 1:]
        with autocast:
            out = model(x, **({} if counts is None else dict(n_segments=int(counts.max()))))
        nll = F.cross_entropy(out.logits.float().transpose(1, 2), y, reduction='none')  # [B, W]
        first = rt.to_device(torch.tensor([f - s for s, _, f in group]), device)
        scored = torch.arange(x.size(1), device=device)[None, :] >= first[:, None]
        sums[0] += torch.where(scored, nll, 0.0).sum()  # (not nll * scored: inf * 0 would be nan)
        sums[1] += scored.sum()
        if out.shortening_factor is not None:
            sums[2] += out.shortening_factor * len(group)
            sums[3] += len(group)
        if out.boundary_logits is not None:  # a predictor's p = σ(logit)
            sums[4] += torch.where(scored, torch.sigmoid(out.boundary_logits.float()), 0.0).sum()
        done, spent = min(1.0, (i + batch_size) / len(wins)), time.time() - t0
        if rank == 0 and shown + 0.1 <= done < 1 and spent > 2:  # a slow evaluation shows progress
            print(f'  {name}: {done:4.0%} of {len(wins)} windows, {rt.duration(spent)}, eta '
                  f'{rt.duration(spent * (1 - done) / done)}', flush=True)
            shown = done
    if world > 1:
        torch.distributed.all_reduce(sums)
    nats, chars, sf_sum, sf_n, p_sum = sums.tolist()
    model.train(was_training)
    return dict(bpc=nats / max(chars, 1) / math.log(2), sf=sf_sum / sf_n if sf_n else 1.0,
                chars=int(chars), boundary_p=p_sum / max(chars, 1) if
                hasattr(model.source, 'predictor') else None)


def eval_and_log(t, args, splits, split, max_chars, state):
    """Evaluate the first max_chars characters of a split (0: all); log and show it → the record."""
    tokens = splits[split][:max_chars + 1] if max_chars else splits[split]
    t0, _ = time.time(), rt.peak_mem_mb(args.device)  # (a reset: mem_mb is the evaluation's peak)
    r = evaluate(t.raw_model, tokens, args.eval_window, args.eval_step, args.eval_batch_size,
                 args.device, t.autocast, split, t.procs.rank, t.procs.world)
    p, subset = r['boundary_p'] and round(r['boundary_p'], 5), len(tokens) < len(splits[split])
    rec = dict(kind='eval', step=state.step, split=split, bpc=r['bpc'], sf=r['sf'], boundary_p=p,
               eval_chars=r['chars'], subset=subset, train_chars=state.train_chars,
               train_flops=state.train_flops, train_time=round(state.train_time, 3),
               mem_mb=round(rt.peak_mem_mb(args.device)))
    t.logger.log(rec)
    t.say(f'step {state.step} | {split} bpc {r["bpc"]:.4f} | sf {r["sf"]:.2f} | '
          + ('' if p is None else f'mean p {p:.3f} | ') + f'{r["chars"]:,} chars'
          + f'{" (a subset)" if subset else ""} | {rt.duration(time.time() - t0)}')
    return rec


# ----------------------------------------------------------------------------------- the run
def run(argv, procs):
    """Check flags, data and model before anything is written; then lock the run folder, train."""
    started = time.time()
    args, ckpt = resolve_args(argv, procs)
    for flag, module in (('tensorboard', 'torch.utils.tensorboard'), ('wandb', 'wandb')):
        if getattr(args, flag) and procs.rank == 0:  # (before anything is written)
            rt.import_optional(module, f'--{flag}')
    meta, splits, labels = load_data(args.data, args.boundary, args.unigram)
    source = dict(vocab={k: meta.get(k) for k in ('alphabet', 'vocab_size', 'space_id')},
                  dataset=dict(path=args.data, fingerprint=fingerprint(splits)))
    cfg = model_config(args, meta, procs.world)
    amp, autocast, scaler = rt.setup_precision(args.amp, torch.device(args.device).type)
    state = RunState()
    if ckpt is not None:  # (one from before the counters: characters from the steps, FLOPs None)
        state = RunState(**{'train_chars': ckpt['step'] * args.batch_size * args.seq_len,
                            'train_flops': None, **{k: ckpt[k] for k in vars(state) if k in ckpt},
                            'saved': ckpt['step']})
        check_resumable(ckpt, cfg, source, args.data)
    check_run(args, ckpt, splits['train'], finished(state, args))
    rt.check_model_memory(cfg, args.device)
    for line in recipe_warnings(args, procs.world) if procs.rank == 0 else ():
        print(f'warning: {line}', file=sys.stderr, flush=True)
    say = (lambda line: print(line, flush=True)) if procs.rank == 0 else (lambda line: None)
    with rt.run_guard(Path(args.out), procs, lambda: f'interrupted at step {state.step}; '
                      f'{kept(Path(args.out) / "ckpt.pt", state.saved)}'):
        rt.start_processes(args.device, procs)
        random.seed(args.seed)
        np.random.seed(args.seed)
        torch.manual_seed(args.seed)  # same on every rank: identical initial weights
        model = DynamicPoolingLM(cfg).to(args.device)
        # fused: one kernel over all parameters, which can also skip a step on the device
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, fused=True)
        if ckpt is not None:
            restore_training(ckpt, model, optimizer, scaler, args.device)
        reseed_rank(args.seed, procs.rank, state.step)
        params, cap = model.num_params(), args.max_steps < 10**9
        end = (f'to step {args.max_steps}' if args.flop_budget is None else
               f'until {args.flop_budget:.3g} FLOPs' + cap * f' (at most {args.max_steps} steps)')
        say(f'{args.boundary} on {args.data} -> {args.out}' + ('' if ckpt is None else
            f' (resumed at step {state.step})') + f'\n  model: {params / 1e6:.2f}M parameters, '
            f'layers {args.layers}, d_model {args.d_model}, {args.n_head} heads x {args.d_head}, '
            f'd_inner {args.d_inner}; {args.device}, amp {amp}, {procs.world} process(es)\n'
            f'  training: {args.batch_size} x {args.seq_len} chars a step, lr {args.lr:g}, '
            f'{args.warmup} warm-up steps, then a cosine {end}')
        gpu = args.device.startswith('cuda') and torch.cuda.get_device_name(args.device)
        logger = rt.Logger(Path(args.out), args, rank=procs.rank, resumed_from=state.saved,
                           config_record=dict(kind='config', **{**vars(args), 'amp': amp},
                                              params=params, world=procs.world,
                                              device_name=gpu or platform.machine(),
                                              torch=torch.__version__, resumed_from=state.saved))
        t = SimpleNamespace(model=rt.wrap_model(model, args, procs.world), raw_model=model,
                            optimizer=optimizer, scaler=scaler, autocast=autocast, procs=procs,
                            stats=rt.StepStats(cfg, args, procs.world), logger=logger, say=say)
        try:
            why = train(args, cfg, source, splits, labels, state, t, started)
            finish(t, args, splits, meta, state, why)
        finally:
            logger.close()


def train(args, cfg, source, splits, labels, state, t, started):
    """Steps, train records, validations, checkpoints → why the run stopped early, or None."""
    stop, why = min(args.max_steps, args.stop_step or args.max_steps), None
    budget = args.flop_budget is not None
    stream = batches(splits['train'], labels and labels['train'], args, cfg, state, t.procs)
    if state.step == 0:
        eval_and_log(t, args, splits, 'valid', args.eval_subset_chars, state)
    batch = next(stream)  # the clock: training time (not evaluating, saving) and the pace so far
    clock = SimpleNamespace(last=time.time(), step=state.step, spent=0.0,
                            work=state.budget_flops if budget else state.step)
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
        state.budget_flops += t.stats.take_step_flops() if budget else 0.0
        end = state.step >= stop or finished(state, args)
        save = state.step % args.eval_interval == 0 or end
        if (state.step % args.log_interval == 0 or save) and log_train(
                t, args, state, clock, lr, stop, started) and not end:
            stop, why, save = state.step, f'--max-time {args.max_time:g}s', True
        if not save:
            continue
        if not finished(state, args):  # (a finished run is evaluated in full by finish)
            eval_and_log(t, args, splits, 'valid', args.eval_subset_chars, state)
        with rt.interrupts_deferred():  # the checkpoint and the step it holds, together
            if t.procs.rank == 0:
                counters = {k: v for k, v in vars(state).items() if k != 'saved'}
                save_checkpoint(Path(args.out) / 'ckpt.pt', training_state(
                    t.raw_model, t.optimizer, t.scaler, counters, cfg, source, args), state.saved)
            state.saved = state.step
            reseed_rank(args.seed, t.procs.rank, state.step)  # as a resumed run would
        clock.last = time.time()  # evaluating and saving are not training time
    return None if finished(state, args) else why or f'--stop-step {args.stop_step}'


def log_train(t, args, state, clock, lr, stop, started):
    """Read the statistics since the last record, log and show them → whether --max-time is up."""
    r = t.stats.read(args.max_time is not None and time.time() - started >= args.max_time)
    dt, steps = time.time() - clock.last, state.step - clock.step
    clock.last, clock.step, clock.spent = clock.last + dt, state.step, clock.spent + dt
    if r['bad']:
        raise UserError(f'non-finite loss or gradient at a step in {state.step - steps + 1}..'
                        f'{state.step} (skipped: the weights stayed finite); stopped, '
                        f'{kept(Path(args.out) / "ckpt.pt", state.saved)}')
    state.train_time += dt
    if state.train_flops is not None:
        state.train_flops += r['flops']
    speed, bpc = steps * args.batch_size * args.seq_len / dt, r['lm_loss'] / math.log(2)
    t.logger.log(dict(kind='train', step=state.step, train_chars=state.train_chars,
                      train_flops=state.train_flops, train_time=round(state.train_time, 3),
                      loss=r['loss'], bpc=bpc, sf=r['sf'], precision=r['precision'],
                      recall=r['recall'], chars_per_s=round(speed), lr=lr,
                      grad_norm=r['grad_norm'], mem_mb=round(rt.peak_mem_mb(args.device)),
                      epoch=state.epoch))
    where, work, total = f'step {state.step}/{stop}', state.step, stop
    if args.flop_budget is not None:
        work, total = state.budget_flops, args.flop_budget
        where = f'step {state.step} | {work:.3g}/{total:.3g} FLOPs'
    eta = (total - work) * clock.spent / (work - clock.work) if work > clock.work else None
    t.say(f'{where} | loss {r["loss"]:.3f} | bpc {bpc:.3f} | sf {r["sf"]:.2f} | '
          f'{1000 * dt / max(1, steps):.0f} ms/step | {speed:,.0f} chars/s | '
          f'eta {rt.duration(eta)}')
    return r['late']


def finish(t, args, splits, meta, state, why):
    """Finished: the full validation and test, and how to sample; stopped: how to continue."""
    if why is not None:
        total = f'{args.flop_budget:.3g} FLOPs' if args.flop_budget else args.max_steps
        return t.say(f'stopped at step {state.step} of {total} ({why}); continue with: '
                     f'python train.py --out {shlex.quote(args.out)} --resume')
    eval_and_log(t, args, splits, 'valid', args.eval_max_chars, state)
    r = eval_and_log(t, args, splits, 'test', args.eval_max_chars, state)
    u = label_set(meta, args.unigram) if args.boundary == 'unigram' else None
    if u:  # the predictor's SF beside its labels' and the left-context ceiling's
        labels = (u.get('shortening_factor') or {}).get('test')
        ceiling = u.get('left_context_ceiling') or {}
        t.say(f'unigram-{u["vocab_size"]}: the predictor pools at SF {r["sf"]:.2f} on test'
              + (f', its labels at {labels:.2f}' if is_number(labels) else '')
              + (f'; the left-context ceiling is SF {ceiling["shortening_factor"]:.2f} on '
                 f'{ceiling.get("split")}' if is_number(ceiling.get('shortening_factor')) else ''))
    text = ''.join(meta['alphabet'][i] for i in splits['test'][:40]).split('\n')[0]
    prompt = text.rsplit(' ', 1)[0] if ' ' in text.strip() else text  # whole words
    t.say(f'checkpoint {Path(args.out) / "ckpt.pt"}, log {Path(args.out) / "log.jsonl"}; sample '
          f'with: python sample.py --ckpt {shlex.quote(args.out)} --prompt {shlex.quote(prompt)}'
          f'\ntest bpc {r["bpc"]:.4f} sf {r["sf"]:.2f}')


def main(argv=None):
    """Train → the exit code; every mistake or fault is one `error: ...` line (rank 0 says it)."""
    procs = rt.Processes.of_torchrun()
    return common.main(lambda: run(argv, procs), procs.rank)


if __name__ == '__main__':
    sys.exit(main())
