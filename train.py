"""
Train and evaluate a dynamic-pooling Transformer (Nawrot et al., ACL 2023) for character-level LM.

    python prepare_data.py                                # data/text8, once
    python train.py --boundary entropy                    # GPU: the paper's recipe; CPU: a preset
    python train.py --boundary unigram --data data/wiki40b-fi --out out/fi-unigram
    python train.py --boundary gumbel --max-time 540      # a 9-minute slice of a long run ...
    python train.py --out out/text8-gumbel --resume       # ... and the next (flags: checkpoint's)
    torchrun --nproc_per_node=8 train.py --boundary whitespace          # DDP over 8 GPUs (NCCL)
    torchrun --nproc_per_node=2 train.py --device cpu --boundary fixed  # DDP on CPU (gloo)
    python train.py --device cpu --boundary none --max-steps 120 --eval-max-chars 20000  # quick

--boundary: none (vanilla Transformer), fixed, whitespace, unigram, entropy, gumbel, hnet. A run
writes out/<dataset>-<boundary>/ckpt.pt and log.jsonl (or --out); a finished run's last line is
`test bpc <x.xxxx> sf <y.yy>`. See `python train.py --help` for every flag.

Notable:
- Presets are only defaults. On a GPU they are the paper's recipe (batch 8 x 2048 chars, Adam lr
  2.5e-4, 4k warm-up steps then one cosine cycle over 200k steps, grad clip 0.25, dropout 0.1, bf16
  AMP, or fp16 with loss scaling where bf16 is missing); on CPU a small model that learns quickly.
- --batch-size is the global batch: torchrun processes and --grad-accum micro-steps split it, so the
  optimisation is the same whatever the hardware.
- Data: each epoch the character stream is cyclically shifted by a random offset, cut into chunks of
  seq_len+1 chars and shuffled; the order is a pure function of (seed, epoch), so a checkpoint only
  needs (epoch, index) to continue exactly. The data is checked once, when it is loaded.
- Evaluation uses overlapping windows (2048 chars, step 512 on GPU): each window scores its last
  `step` chars (the first window all of them), so every character is scored exactly once with
  >= window-step chars of context where the text has them. BPC = mean nats / ln 2. During training
  the first --eval-subset-chars of the validation split; at the end the full validation and test.
- The step never waits for the device: statistics are summed on it and read once per log record,
  and a step whose loss or gradient is not finite is skipped on the device (Adam's found_inf), so it
  never reaches the weights; the run then stops at the next log record, keeping the last checkpoint.
- Checkpoints are written atomically and hold everything needed to continue (model, optimizer, AMP
  scaler, RNG states, step, data position, config, vocabulary, cumulative characters/FLOPs/time):
  on CPU a stopped-and-resumed run ends with bit-identical weights to one that never stopped.
- log.jsonl holds one JSON object a line: `config` at every (re)start, `train` every --log-interval
  steps, `eval` for every evaluation, with cumulative training characters, FLOPs and seconds.
- User mistakes end with one `error: ...` line and exit code 2 (flags) or 1 (anything else, before
  anything is written); Ctrl-C exits with 130, keeping the last checkpoint.
"""
import argparse
import dataclasses
import math
import os
import random
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import NamedTuple, Optional

import numpy as np
import torch
import torch.nn.functional as F

from dynpool import BOUNDARY_MODES, Config, DynamicPoolingLM
from operations import (Logger, StepStats, UserError, config_from_dict, device_name, die,
                        import_optional, interrupts_deferred, kept, leave_process_group, load_data,
                        load_weights, lock_run_dir, peak_mem_mb, pick_device, read_checkpoint,
                        save_checkpoint, setup_precision, sum_dtype, to_device,
                        torchrun_processes, wrap_model)

# The paper's recipe (appendix) for a GPU ...
GPU_PRESET = dict(d_model=512, n_head=8, d_head=64, d_inner=2048, layers='2,8,2', dropout=0.1,
                  dropatt=0.1, batch_size=8, seq_len=2048, lr=2.5e-4, warmup=4000,
                  max_steps=200_000, eval_interval=5000, eval_window=2048, eval_step=512,
                  eval_subset_chars=300_000, eval_max_chars=0, eval_batch_size=64, log_interval=100)
# ... and a small model for 2 CPU cores: 300 steps take a few minutes. A few hundred steps never see
# a character twice, so dropout would only slow learning down; the eval window shrinks with the
# training length (same 4:1 window:step ratio) and validation during training reads 20k chars.
CPU_PRESET = dict(d_model=128, n_head=2, d_head=64, d_inner=512, layers='1,4,1', dropout=0.0,
                  dropatt=0.0, batch_size=4, seq_len=512, lr=1e-3, warmup=50, max_steps=300,
                  eval_interval=100, eval_window=512, eval_step=128, eval_subset_chars=20_000,
                  eval_max_chars=0, eval_batch_size=8, log_interval=10)
COMMON = dict(data='data/text8', boundary='entropy', grad_accum=1, grad_clip=0.25, seed=1337,
              amp='auto', compile=False, attention='auto', tensorboard=False)
# Flags that define the model or the data order: a resumed run must keep them.
KEPT_ON_RESUME = ('boundary', 'd_model', 'n_head', 'd_head', 'd_inner', 'layers', 'dropout',
                  'dropatt', 'fixed_factor', 'temperature', 'prior', 'entropy_window', 'ratio_target',
                  'ratio_weight', 'double_sigmoid', 'seq_len', 'batch_size', 'seed',
                  'flop_budget')

# Flags of this invocation only: a resumed run does not take them from the checkpoint.
NOT_RESUMED = ('resume', 'device', 'stop_step', 'max_time')
# This process's place among torchrun's processes, set by main() (not read at import time).
RANK, LOCAL_RANK, WORLD = 0, 0, 1


# ----------------------------------------------------------------------------- shared helpers
# sample.py and bench.py import these: one device choice, one checkpoint reader, one Config builder.


# Argument types shared by sample.py and bench.py: argparse turns their error into one line.




# ----------------------------------------------------------------------------- command line
class Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print the usage and the message; we promise one line
        raise UserError(f'{message} (see python train.py --help)', code=2)


def parse_args(argv):
    p = Parser(description='Train a dynamic-pooling Transformer on a prepared character dataset.')
    # Every default is None: the value then comes from the checkpoint (--resume) or from the preset,
    # which lets us tell what the user asked for from what was filled in.
    a = p.add_argument
    a('--data', help='dataset directory written by prepare_data.py (default data/text8)')
    a('--boundary', choices=BOUNDARY_MODES,
      help='segmentation: none (vanilla), fixed, whitespace, unigram, entropy, gumbel, hnet')
    a('--out', help='run directory for checkpoint and log.jsonl (default out/<dataset>-<boundary>)')
    a('--resume', action='store_true', help='continue the run in --out from its checkpoint')
    a('--device', help='cpu, cuda, cuda:1, ... (default cuda if available); picks the GPU or CPU '
                       'preset; under torchrun each process takes the GPU of its LOCAL_RANK')
    a('--seed', type=int, help='seed for initialisation, data order, dropout (default 1337)')
    # model
    a('--d-model', type=int, help='model width (GPU 512, CPU 128)')
    a('--n-head', type=int, help='attention heads (GPU 8, CPU 2)')
    a('--d-head', type=int, help='width of one head (64)')
    a('--d-inner', type=int, help='feed-forward width (GPU 2048, CPU 512)')
    a('--layers', help='pre,shortened,post layer counts (GPU 2,8,2, CPU 1,4,1); vanilla stacks '
                       'all of them at full length')
    a('--dropout', type=float, help='dropout (GPU 0.1, CPU 0)')
    a('--dropatt', type=float, help='attention dropout (GPU 0.1, CPU 0)')
    a('--fixed-factor', type=int, help='segment length k for --boundary fixed (model default)')
    a('--temperature', type=float, help='Gumbel-sigmoid temperature (model default)')
    a('--prior', type=float, help='prior boundary rate for --boundary gumbel (model default)')
    a('--entropy-window', type=int, help='k of the entropy-spike rule (model default)')
    a('--double-sigmoid', action='store_true', default=None,
      help="unigram/entropy: the paper's released predictor loss, BCE-with-logits of sigmoid(logit) "
           "(a sigmoid twice; off: the cross-entropy the paper describes)")
    a('--ratio-target', type=float,
      help='hnet: target compression N of the ratio loss (model default)')
    a('--ratio-weight', type=float, help='hnet: weight of the ratio loss (model default)')
    a('--attention', choices=('auto', 'sdpa', 'blocked'),
      help='attention implementation (auto); speed only, the same values')
    # optimisation
    a('--batch-size', type=int, help='global batch in sequences per step, split over processes and '
                                     '--grad-accum (GPU 8, CPU 4)')
    a('--seq-len', type=int, help='training sequence length in characters (GPU 2048, CPU 512)')
    a('--grad-accum', type=int, help='micro-steps per optimizer step; the global batch stays '
                                     '--batch-size (1)')
    a('--max-steps', type=int, help='optimizer steps; the cosine schedule ends here (GPU 200000, '
                                    'CPU 300)')
    a('--flop-budget', type=float,
      help='train until this many training FLOPs (the step_flops formula, with the measured SF) '
           'instead of a step count: the cosine schedule decays over the FLOPs after warm-up and '
           'the first step that reaches the budget is the last; --max-steps is then only a cap '
           '(default none)')
    a('--stop-step', type=int, help='evaluate, save and exit at this step without finishing (for '
                                    'time-limited jobs); the schedule still follows --max-steps; '
                                    'continue with --resume')
    a('--max-time', type=float, help='wall-clock budget of this invocation in seconds, counted '
                                     'from its start: at the first log step past it, evaluate, '
                                     'save and exit (which takes longer); continue with --resume')
    a('--lr', type=float, help='peak learning rate (GPU 2.5e-4, CPU 1e-3)')
    a('--warmup', type=int, help='linear warm-up steps before the cosine decay (GPU 4000, CPU 50)')
    a('--grad-clip', type=float, help='clip the gradient norm to this (0.25; 0 = off)')
    a('--amp', choices=('auto', 'bf16', 'fp16', 'off'),
      help='mixed precision; auto = bf16 if the GPU has it, else fp16 and loss scaling; CPU: off')
    a('--compile', action='store_true', default=None, help='torch.compile the model for training')
    # evaluation and logging
    a('--eval-interval', type=int, help='validate and checkpoint every N steps (GPU 5000, CPU 100)')
    a('--eval-window', type=int, help='evaluation window in characters (GPU 2048, CPU 512)')
    a('--eval-step', type=int, help='window step: each window scores its last N characters (GPU '
                                    '512, CPU 128)')
    a('--eval-subset-chars', type=int, help='validate on the first N characters during training; '
                                            '0 = all (GPU 300000, CPU 20000)')
    a('--eval-max-chars', type=int, help='cap the final validation and test at N characters; 0 = '
                                         'the full splits (0)')
    a('--eval-batch-size', type=int, help='windows per evaluation batch (GPU 64, CPU 8)')
    a('--log-interval', type=int, help='log training metrics every N steps (GPU 100, CPU 10)')
    a('--tensorboard', action='store_true', default=None,
      help='also log to TensorBoard in <out>/tensorboard (needs the tensorboard package)')
    a('--wandb', metavar='PROJECT',
      help='also log to this Weights & Biases project (needs the wandb package)')
    return p.parse_args(argv)


def resolve_args(args):
    """Fill every flag (from the checkpoint on --resume, then the preset) → (args, device, ckpt)."""
    given = {k for k, v in vars(args).items() if v is not None}
    device = pick_device(args.device)
    if WORLD > 1 and device.startswith('cuda'):
        # torchrun: one GPU per process, whatever --device says
        device = pick_device(f'cuda:{LOCAL_RANK}')
    preset = GPU_PRESET if device.startswith('cuda') else CPU_PRESET
    if args.out is None and args.resume:
        raise UserError('--resume needs --out, the run directory to continue', code=2)
    boundary = args.boundary or COMMON['boundary']
    out_dir = Path(args.out or f'out/{Path(args.data or COMMON["data"]).name}-{boundary}')
    ckpt_path, ckpt = out_dir / 'ckpt.pt', None
    if args.resume:
        if not ckpt_path.is_file():
            raise UserError(f'--resume but there is no checkpoint at {ckpt_path}')
        ckpt = read_checkpoint(ckpt_path)
        if {'args', 'optimizer', 'scaler', 'step', 'epoch', 'pos', 'rng'} - ckpt.keys():
            raise UserError(f'{ckpt_path} lacks the training state to resume from (not written '
                            f'by train.py)')
        for k in KEPT_ON_RESUME:
            if k in given and getattr(args, k) != ckpt['args'].get(k):
                raise UserError(f'--{k.replace("_", "-")} {getattr(args, k)} differs from the '
                                f'checkpoint\'s {ckpt["args"].get(k)} (a resumed run keeps its '
                                f'model and data order)', code=2)
        for k, v in ckpt['args'].items():  # what was not given now comes from the checkpoint
            if k not in given and k not in NOT_RESUMED:
                setattr(args, k, v)
    elif ckpt_path.exists():
        raise UserError(f'{ckpt_path} already exists; pass --resume to continue it or choose '
                        f'another --out')
    if args.flop_budget is not None and args.max_steps is None:
        args.max_steps = 10**9  # the budget decides when the run ends
    for k, v in {**COMMON, **preset}.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    args.out, args.device = str(out_dir), device
    return args, device, ckpt


def bad_flag(args, k, rule):
    """The one-line error for flag k outside its rule (exit code 2)."""
    return UserError(f'--{k.replace("_", "-")} must be {rule}, not {getattr(args, k)}', code=2)


def check_args(args):
    """Every numeric flag in its range, before any work: one line and exit code 2 otherwise."""
    try:
        layers = tuple(int(v) for v in str(args.layers).split(','))
    except ValueError:
        layers = ()
    if len(layers) != 3 or min(layers) < 0:
        raise bad_flag(args, 'layers', 'three counts like 2,8,2')
    # (the last three may be None: not asked for)
    for k in ('seq_len', 'batch_size', 'grad_accum', 'max_steps', 'eval_window', 'eval_step',
              'eval_interval', 'eval_batch_size', 'log_interval', 'd_model', 'n_head', 'd_head',
              'd_inner', 'stop_step', 'fixed_factor', 'entropy_window'):
        if getattr(args, k) is not None and getattr(args, k) < 1:
            raise bad_flag(args, k, 'at least 1')
    # `not x >= 0` also catches nan. A negative --grad-clip would flip the gradient (gradient
    # ascent) and a negative --eval-max-chars would silently slice from the end; the others would
    # crash with a traceback.
    for k in ('warmup', 'eval_max_chars', 'eval_subset_chars', 'grad_clip'):
        if not getattr(args, k) >= 0:
            raise bad_flag(args, k, 'at least 0')
    if not args.lr > 0:
        raise bad_flag(args, 'lr', 'positive')
    if args.flop_budget is not None and not 0 < args.flop_budget < math.inf:
        raise bad_flag(args, 'flop_budget', 'a positive number of FLOPs')
    if args.max_time is not None and not 0 < args.max_time < math.inf:
        raise bad_flag(args, 'max_time', 'a positive number of seconds')
    for k in ('dropout', 'dropatt'):
        if not 0 <= getattr(args, k) < 1:
            raise bad_flag(args, k, 'in [0, 1)')
    if args.temperature is not None and not args.temperature > 0:
        raise bad_flag(args, 'temperature', 'positive (the Gumbel-sigmoid divides by it)')
    if not 0 <= args.seed < 2**32:
        raise bad_flag(args, 'seed', 'in [0, 2**32) (numpy takes no other seeds)')
    if args.wandb is not None and not args.wandb.strip():
        raise bad_flag(args, 'wandb', 'a project name')
    if args.eval_step > args.eval_window:
        raise UserError(f'--eval-step {args.eval_step} is larger than --eval-window '
                        f'{args.eval_window}: characters between windows would never be scored',
                        code=2)
    if args.batch_size % (WORLD * args.grad_accum):
        raise UserError(f'--batch-size {args.batch_size} must split evenly over {WORLD} processes '
                        f'x {args.grad_accum} micro-steps', code=2)
    device_type = torch.device(args.device).type
    if args.amp in ('fp16', 'bf16') and device_type not in ('cuda', 'cpu'):
        raise UserError(f'--amp {args.amp} is supported here on cuda and cpu only', code=2)
    if args.amp == 'fp16' and device_type != 'cuda':
        raise UserError('--amp fp16 needs a CUDA GPU (use bf16 or off on CPU)', code=2)
    return layers


# ----------------------------------------------------------------------------- data


def epoch_order(n_chars, seq_len, seed, epoch):
    """Random cyclic shift and chunk permutation of one epoch, a pure function of (seed, epoch)."""
    rng = np.random.default_rng([seed, epoch])
    return int(rng.integers(n_chars)), rng.permutation(n_chars // (seq_len + 1))


def get_chunks(stream, offset, chunk_ids, seq_len):
    """Chunks of seq_len+1 characters of the stream rotated by offset → int64 [..., seq_len+1]."""
    idx = (offset + chunk_ids[..., None] * (seq_len + 1) + np.arange(seq_len + 1)) % len(stream)
    return torch.from_numpy(stream[idx].astype(np.int64))


class Batch(NamedTuple):
    """One optimizer step's data for this process and where the data stands once it is consumed."""
    epoch: int
    pos: int
    x: torch.Tensor             # [grad_accum, micro, seq_len] inputs
    y: torch.Tensor             # [grad_accum, micro, seq_len] next characters
    b: Optional[torch.Tensor]   # [grad_accum, micro, seq_len] Unigram labels of the inputs, or None


def batches(tokens, labels, args, epoch, pos, device):
    """The training stream from (epoch, pos) on, one Batch per optimizer step, on the device."""
    n_chunks = len(tokens) // (args.seq_len + 1)
    micro = args.batch_size // (WORLD * args.grad_accum)
    while True:
        offset, perm = epoch_order(len(tokens), args.seq_len, args.seed, epoch)
        while pos + args.batch_size <= n_chunks:
            # the step's global batch; this process takes its micro-batches out of it
            ids = perm[pos:pos + args.batch_size].reshape(args.grad_accum, WORLD, micro)[:, RANK]
            pos += args.batch_size
            chunk = get_chunks(tokens, offset, ids, args.seq_len)  # [accum, micro, L+1]
            chunk, b = to_device(chunk, device), None
            if labels is not None:
                b = get_chunks(labels, offset, ids, args.seq_len)[..., :-1]
                b = to_device(b, device).bool()
            yield Batch(epoch, pos, chunk[..., :-1], chunk[..., 1:], b)
        epoch, pos = epoch + 1, 0  # not enough chunks left for a full batch: next epoch


# ----------------------------------------------------------------------------- evaluation
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
        chunk = to_device(torch.from_numpy(tokens[idx].astype(np.int64)), device)
        x, y = chunk[:, :-1], chunk[:, 1:]
        with autocast:
            out = model(x)
        nll = F.cross_entropy(out.logits.float().transpose(1, 2), y, reduction='none')  # [B, W]
        first = to_device(torch.tensor([f - s for s, _, f in group]), device)
        scored = torch.arange(x.size(1), device=device)[None, :] >= first[:, None]
        sums[0] += torch.where(scored, nll, 0.0).sum()  # (not nll * scored: inf * 0 would be nan)
        sums[1] += scored.sum()
        if out.shortening_factor is not None:
            sums[2] += out.shortening_factor * len(group)
            sums[3] += len(group)
        # a slow evaluation shows its progress
        if rank == 0 and (i + batch_size) / len(wins) >= shown + 0.1 and time.time() - t0 > 2:
            shown = (i + batch_size) / len(wins)
            print(f'  {name}: {min(1.0, shown):4.0%} of {len(wins)} windows, '
                  f'{time.time() - t0:.0f}s',
                  file=sys.stderr, flush=True)
    if world > 1:
        torch.distributed.all_reduce(sums)
    nats, chars, sf_sum, sf_n = sums.tolist()
    model.train(was_training)
    return dict(bpc=nats / max(chars, 1) / math.log(2), sf=sf_sum / sf_n if sf_n else 1.0,
                nats=nats, chars=int(chars))


def evaluate_split(model, splits, split, max_chars, args, autocast):
    """evaluate() on the first max_chars characters of a split (0: all of it) → its eval record."""
    tokens = splits[split][:max_chars + 1] if max_chars else splits[split]
    r = evaluate(model, tokens, args.eval_window, args.eval_step, args.eval_batch_size, args.device,
                 autocast, split, RANK, WORLD)
    return dict(split=split, bpc=r['bpc'], sf=r['sf'], eval_chars=r['chars'],
                subset=len(tokens) < len(splits[split]))


# ----------------------------------------------------------------------------- run directory and
# checkpoints


def checkpoint(model, optimizer, scaler, state, cfg, vocab, args):
    """Everything needed to continue exactly: weights, optimizer, scaler, RNG states, position and
    counters."""
    device = torch.device(args.device)
    # this process's GPU only: the states of all of them would not restore on a machine with fewer
    cuda = torch.cuda.get_rng_state(device) if device.type == 'cuda' else None
    rng = dict(torch=torch.get_rng_state(), numpy=np.random.get_state(), python=random.getstate(),
               cuda=cuda)
    return dict(model=model.state_dict(), optimizer=optimizer.state_dict(),
                scaler=scaler.state_dict(), **state, config=dataclasses.asdict(cfg), vocab=vocab,
                args=vars(args), rng=rng,
                schedule=dict(lr=args.lr, warmup=args.warmup, max_steps=args.max_steps,
                              flop_budget=args.flop_budget))


def restore(ckpt, model, optimizer, scaler, args):
    """Load a checkpoint's weights, optimizer, scaler and RNG states → the state to go on from."""
    load_weights(model, ckpt['model'], ckpt['path'])
    optimizer.load_state_dict(ckpt['optimizer'])
    scaler.load_state_dict(ckpt['scaler'])
    torch.set_rng_state(ckpt['rng']['torch'])
    if torch.device(args.device).type == 'cuda' and ckpt['rng']['cuda'] is not None:
        torch.cuda.set_rng_state(ckpt['rng']['cuda'], args.device)
    np.random.set_state(ckpt['rng']['numpy'])
    random.setstate(ckpt['rng']['python'])
    step = ckpt['step']
    # checkpoints from before the counters: characters follow from the steps, FLOPs are unknown
    # (null)
    return dict(step=step, epoch=ckpt['epoch'], pos=ckpt['pos'],
                train_chars=ckpt.get('train_chars', step * args.batch_size * args.seq_len),
                train_flops=ckpt.get('train_flops'), train_time=ckpt.get('train_time', 0.0),
                budget_flops=ckpt.get('budget_flops', 0.0), warmup_flops=ckpt.get('warmup_flops'))


# ----------------------------------------------------------------------------- logging


# ----------------------------------------------------------------------------- set-up
def model_config(args, layers, meta):
    """The model's Config from the flags and the data. Flags left to the model take its defaults,
    which are written back into args so that the log and the checkpoint hold the values in use."""
    kw = dict(vocab_size=meta['vocab_size'], d_model=args.d_model, n_head=args.n_head,
              d_head=args.d_head, d_inner=args.d_inner, dropout=args.dropout,
              dropatt=args.dropatt, layers=layers, boundary=args.boundary,
              whitespace_id=meta.get('space_id'), fixed_factor=args.fixed_factor,
              temperature=args.temperature, prior=args.prior, entropy_window=args.entropy_window,
              ratio_target=args.ratio_target, ratio_weight=args.ratio_weight,
              double_sigmoid=args.double_sigmoid, attention=args.attention)
    try:  # the model checks its own config (e.g. pooling modes need shortened layers)
        cfg = config_from_dict({k: v for k, v in kw.items() if v is not None})
    except UserError as e:
        raise UserError(str(e), code=2) from None
    for k in ('fixed_factor', 'temperature', 'prior', 'entropy_window', 'ratio_target',
              'ratio_weight', 'double_sigmoid'):
        setattr(args, k, getattr(cfg, k))
    return cfg


def check_fits(ckpt, cfg, vocab, data):
    """A resumed run keeps the checkpoint's vocabulary and model (speed-only fields may change)."""
    if ckpt['vocab'] != vocab:
        old, new = ''.join(ckpt['vocab']['alphabet']), ''.join(vocab['alphabet'])
        raise UserError(f'checkpoint {ckpt["path"]} was trained on another vocabulary than {data} '
                        f'(alphabet {old!r} vs {new!r})')
    old = config_from_dict(ckpt['config'])
    diff = [f.name for f in dataclasses.fields(Config) if f.name not in ('attention', 'attn_chunk')
            and getattr(old, f.name) != getattr(cfg, f.name)]
    if diff:
        raise UserError(f'checkpoint {ckpt["path"]} has another model config than these flags and '
                        f'data ({", ".join(diff)})')


def setup(args, cfg, ckpt):
    """Processes, seeds, precision, model and optimizer (restored on --resume) → what the loop
    needs."""
    device_type = torch.device(args.device).type
    if WORLD > 1:
        if device_type == 'cuda':
            torch.cuda.set_device(args.device)  # before the process group: NCCL binds to this GPU
        torch.distributed.init_process_group('nccl' if device_type == 'cuda' else 'gloo')
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)  # same on every rank: identical initial weights
    if device_type == 'cuda':
        torch.backends.cuda.matmul.allow_tf32 = True  # TF32 matmuls: same recipe, much faster
        torch.backends.cudnn.allow_tf32 = True
    amp, autocast, scaler = setup_precision(args.amp, device_type)
    raw_model = DynamicPoolingLM(cfg).to(args.device)  # for evaluation and checkpoints
    # fused: one kernel over all parameters, which can also skip a step on the device (train_step)
    optimizer = torch.optim.Adam(raw_model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8,
                                 fused=True)
    state = dict(step=0, epoch=0, pos=0, train_chars=0, train_flops=0.0, train_time=0.0,
                 budget_flops=0.0, warmup_flops=None)
    if ckpt is not None:
        state = restore(ckpt, raw_model, optimizer, scaler, args)
    if RANK > 0:  # dropout masks should differ between ranks; rank 0 keeps the saved stream
        torch.manual_seed(args.seed + 1000 * RANK + state['step'])
    return wrap_model(raw_model, args, WORLD), raw_model, optimizer, scaler, autocast, amp, state


# ----------------------------------------------------------------------------- training
def lr_at(step, args, state):
    """Linear warm-up, then one cosine cycle that reaches 0 at --max-steps, or with --flop-budget
    at the budget: progress is then the share of the FLOPs after warm-up already spent (for a
    model whose steps all cost the same, e.g. vanilla, the two schedules are the same)."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    if args.flop_budget is not None:
        if state['warmup_flops'] is None:
            state['warmup_flops'] = state['budget_flops']
        spent = state['budget_flops'] - state['warmup_flops']
        progress = min(1.0, spent / max(1.0, args.flop_budget - state['warmup_flops']))
        return args.lr * 0.5 * (1 + math.cos(math.pi * progress))
    progress = min(1.0, (step - args.warmup) / max(1, args.max_steps - args.warmup))
    return args.lr * 0.5 * (1 + math.cos(math.pi * progress))


def train_step(model, optimizer, scaler, batch, stream, stats, args, autocast):
    """Forward and backward over the step's micro-batches, clipping, and an Adam step that the
    device skips where the loss or the gradient is not finite → the next step's batch, fetched
    while the device works."""
    finite = None
    for m in range(args.grad_accum):
        # gradients are all-reduced only on the last micro-step
        sync = model.no_sync() if WORLD > 1 and m < args.grad_accum - 1 else nullcontext()
        b = None if batch.b is None else batch.b[m]
        with sync:
            with autocast:
                out = model(batch.x[m], targets=batch.y[m], boundaries=b)
            scaler.scale(out.loss / args.grad_accum).backward()
        stats.add_micro(out)
        ok = torch.isfinite(out.loss)
        finite = ok if finite is None else finite & ok
    next_batch = next(stream)  # made on the host and copied while the device runs the backward
    scaler.unscale_(optimizer)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip or float('inf'))
    if scaler.is_enabled():  # fp16: the scaler skips steps whose gradients overflowed, as it should
        scaler.step(optimizer)
        scaler.update()
    else:
        finite = finite & torch.isfinite(norm)
        # found_inf: the fused Adam kernel leaves weights and moments untouched where it is 1,
        # without the host reading it (the protocol GradScaler uses for fused optimizers)
        optimizer.found_inf, optimizer.grad_scale = (~finite).float(), None
        optimizer.step()
        del optimizer.found_inf, optimizer.grad_scale
    optimizer.zero_grad(set_to_none=True)
    stats.add_step(norm, ~finite)
    return next_batch


def eval_and_log(logger, model, splits, split, max_chars, args, autocast, state):
    """Evaluate the first max_chars characters of a split (0: all) and log the eval record."""
    r = evaluate_split(model, splits, split, max_chars, args, autocast)
    logger.log(dict(kind='eval', step=state['step'], **r, train_chars=state['train_chars'],
                    train_flops=state['train_flops'], train_time=round(state['train_time'], 3)))
    return r


def train_record(state, r, lr, chars_per_s, device):
    """The `train` record of log.jsonl: the state, and the statistics r read since the last one."""
    return dict(kind='train', step=state['step'], train_chars=state['train_chars'],
                train_flops=state['train_flops'], train_time=round(state['train_time'], 3),
                loss=r['loss'], bpc=r['lm_loss'] / math.log(2), sf=r['sf'],
                precision=r['precision'], recall=r['recall'], chars_per_s=round(chars_per_s), lr=lr,
                grad_norm=r['grad_norm'], mem_mb=round(peak_mem_mb(device)), epoch=state['epoch'])


def train(args, cfg, vocab, splits, labels, ckpt, started):
    """The loop: steps, a log record every --log-interval steps, validation and a checkpoint every
    --eval-interval steps; then the final evaluation, or a note on how to continue. `started`: the
    time.time() this invocation began, which --max-time counts from."""
    model, raw_model, optimizer, scaler, autocast, amp, state = setup(args, cfg, ckpt)
    ckpt_path, saved = Path(args.out) / 'ckpt.pt', (state['step'] if ckpt is not None else None)
    logger = Logger(Path(args.out), args, rank=RANK, config_record=dict(
        kind='config', **{**vars(args), 'amp': amp}, params=raw_model.num_params(),
        device_name=device_name(args.device), world=WORLD, torch=torch.__version__,
        resumed_from=saved))
    stats = StepStats(cfg, args, WORLD)
    train_labels = labels['train'] if labels else None
    stream = batches(splits['train'], train_labels, args, state['epoch'], state['pos'], args.device)
    stop = min(args.max_steps, args.stop_step or args.max_steps)
    why = f'--stop-step {args.stop_step}'
    try:
        if state['step'] == 0:
            eval_and_log(logger, raw_model, splits, 'valid', args.eval_subset_chars, args, autocast,
                         state)
        batch, read_at, chars_at = next(stream), state['step'], state['train_chars']
        t_last = time.time()
        model.train()
        while state['step'] < stop:
            lr = lr_at(state['step'], args, state)
            for group in optimizer.param_groups:
                group['lr'] = lr
            state['epoch'], state['pos'] = batch.epoch, batch.pos  # the data once this step is done
            batch = train_step(model, optimizer, scaler, batch, stream, stats, args, autocast)
            state['step'] += 1
            state['train_chars'] += args.batch_size * args.seq_len
            step = state['step']
            if args.flop_budget is not None:
                state['budget_flops'] += stats.take_step_flops()
                if state['budget_flops'] >= args.flop_budget * (1 - 1e-9):
                    args.max_steps = stop = step  # the budget is spent: this run is finished
            save = step % args.eval_interval == 0 or step == stop
            if step % args.log_interval == 0 or save:
                late = args.max_time is not None and time.time() - started >= args.max_time
                r = stats.read(late)  # waits for the device
                dt, t_last = time.time() - t_last, time.time()
                if r['bad']:
                    raise UserError(f'non-finite loss or gradient at a step in '
                                    f'{read_at + 1}..{step} (skipped: the weights stayed finite); '
                                    f'stopped, '
                                    f'{kept(ckpt_path, saved)}')
                state['train_time'] += dt
                if state['train_flops'] is not None:
                    state['train_flops'] += r['flops']
                chars_per_s = (state['train_chars'] - chars_at) / dt
                logger.log(train_record(state, r, lr, chars_per_s, args.device))
                read_at, chars_at = step, state['train_chars']
                if r['late'] and step < stop:
                    stop, why, save = step, f'--max-time {args.max_time:g}s', True
            if save:
                if step < args.max_steps:  # (a finished run is evaluated in full below)
                    eval_and_log(logger, raw_model, splits, 'valid', args.eval_subset_chars, args,
                                 autocast, state)
                with interrupts_deferred():  # the checkpoint and the step it holds, together
                    if RANK == 0:
                        save_checkpoint(ckpt_path, checkpoint(raw_model, optimizer, scaler, state,
                                                              cfg, vocab, args), saved)
                    saved = step
                t_last = time.time()  # evaluating and saving are not training time
        finish(logger, raw_model, splits, args, autocast, state, why)
    except KeyboardInterrupt:
        raise UserError(f'interrupted at step {state["step"]}; {kept(ckpt_path, saved)}',
                        code=130) from None
    finally:
        logger.close()


def finish(logger, model, splits, args, autocast, state, why):
    """A finished run: the full validation and test splits; an early stop: how to continue."""
    if state['step'] < args.max_steps:
        if RANK == 0:
            print(f'stopped at step {state["step"]} of {args.max_steps} ({why}); continue with: '
                  f'python train.py --out {args.out} --resume', flush=True)
        return
    eval_and_log(logger, model, splits, 'valid', args.eval_max_chars, args, autocast, state)
    r = eval_and_log(logger, model, splits, 'test', args.eval_max_chars, args, autocast, state)
    if RANK == 0:
        print(f'test bpc {r["bpc"]:.4f} sf {r["sf"]:.2f}', flush=True)


def run(argv=None):
    """Flags, data and model config are checked before anything is written; then the run directory
    is locked and training starts."""
    started = time.time()
    args, device, ckpt = resolve_args(parse_args(argv))
    layers = check_args(args)
    # the logging packages are imported only when asked for, and checked before anything is written
    for flag, module, package in (('tensorboard', 'torch.utils.tensorboard', 'tensorboard'),
                                  ('wandb', 'wandb', 'wandb')):
        if getattr(args, flag) and RANK == 0:
            import_optional(module, package, f'--{flag}')
    meta, splits, labels = load_data(args.data, args.boundary)
    if len(splits['train']) < args.batch_size * (args.seq_len + 1):
        raise UserError(f'{args.data}/train.bin has {len(splits["train"])} chars, fewer than one '
                        f'batch ({args.batch_size} x {args.seq_len + 1})')
    vocab = dict(alphabet=meta['alphabet'], vocab_size=meta['vocab_size'],
                 space_id=meta.get('space_id'))
    cfg = model_config(args, layers, meta)
    if ckpt is not None:
        check_fits(ckpt, cfg, vocab, args.data)
    lock = lock_run_dir(Path(args.out)) if RANK == 0 else None
    trained = False
    try:
        train(args, cfg, vocab, splits, labels, ckpt, started)
        trained = True
    finally:
        if lock is not None:
            os.close(lock)  # (the OS drops the lock of a killed process by itself)
        if WORLD > 1 and torch.distributed.is_initialized():
            leave_process_group(wait=trained, world=WORLD)


def main(argv=None):
    """Train; every user mistake or fault ends as one `error: ...` line and its exit code."""
    global RANK, LOCAL_RANK, WORLD
    RANK, LOCAL_RANK, WORLD = torchrun_processes()
    try:
        run(argv)
    except UserError as e:
        die(str(e), e.code, RANK)
    except KeyboardInterrupt:
        die('interrupted before training began; no checkpoint was written or changed', 130, RANK)


if __name__ == '__main__':
    main()
