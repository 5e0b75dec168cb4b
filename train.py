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
import fcntl
import importlib
import inspect
import json
import math
import os
import pickle
import platform
import random
import re
import resource
import signal
import sys
import time
import zipfile
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import NamedTuple, Optional

import numpy as np
import torch
import torch.nn.functional as F

from torch.nn.parallel import DistributedDataParallel as DDP

from dynpool import BOUNDARY_MODES, PREDICTOR_MODES, Config, DynamicPoolingLM, ModelOutput

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
RANK = int(os.environ.get('RANK', 0))  # set by torchrun
LOCAL_RANK = int(os.environ.get('LOCAL_RANK', 0))
WORLD = int(os.environ.get('WORLD_SIZE', 1))


# ----------------------------------------------------------------------------- shared helpers
# sample.py and bench.py import these: one device choice, one checkpoint reader, one Config builder.
class UserError(Exception):
    """A user mistake or a fault the user can fix: the script prints it as one `error: ...` line and
    exits with `code` (1; 2 for bad command-line flags, 130 for Ctrl-C)."""

    def __init__(self, msg, code=1):
        super().__init__(msg)
        self.code = code


def pick_device(name=None):
    """'cpu', 'cuda', 'cuda:1', 'mps' → the checked device string; None → cuda if there is one."""
    if name is None:
        return 'cuda' if torch.cuda.is_available() else 'cpu'
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise UserError(f'--device {name} is not a device torch knows (cpu, cuda, cuda:1, '
                        f'mps)') from None
    if dev.type == 'cuda' and not torch.cuda.is_available():
        raise UserError(f'--device {name} but no CUDA GPU is available here (try --device cpu)')
    if dev.type == 'cuda' and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise UserError(f'--device {name}: only {torch.cuda.device_count()} CUDA device(s) here')
    mps = hasattr(torch.backends, 'mps') and torch.backends.mps.is_available()
    if dev.type == 'mps' and not mps:
        raise UserError(f'--device {name} but MPS is not available here (try --device cpu)')
    return str(dev)


def config_from_dict(d):
    """Config from dataclasses.asdict(Config); keys that are not Config fields are ignored, missing
    ones take their defaults (so checkpoints from before a new field was added still load)."""
    if not isinstance(d, dict):
        raise UserError(f'the config is a {type(d).__name__}, expected a dict '
                        f'(dataclasses.asdict(Config))')
    names = {f.name for f in dataclasses.fields(Config)}
    try:
        return Config(**{k: v for k, v in d.items() if k in names})
    except (TypeError, ValueError) as e:
        raise UserError(f'the config is invalid: {e}') from None


def strip_prefixes(state_dict):
    """Drop the prefixes torch.compile ('_orig_mod.') and DDP ('module.') add to parameter names."""
    out = {}
    for k, v in state_dict.items():
        while k.startswith(('_orig_mod.', 'module.')):
            k = k.split('.', 1)[1]
        out[k] = v
    return out


def _numpy_safe_globals():
    """numpy's array reconstruction, allowed for safe loading: checkpoints hold numpy's RNG."""
    core = getattr(np, '_core', None) or np.core  # numpy 2 / numpy 1
    dtypes = [type(np.dtype(t)) for t in (np.uint8, np.uint16, np.uint32, np.int32, np.int64,
                                          np.float32, np.float64, np.bool_)]
    return [core.multiarray._reconstruct, np.ndarray, np.dtype, *dtypes]


def read_checkpoint(path, trust=False):
    """train.py's checkpoint (a file, or a run directory holding ckpt.pt) → its dict, checked to
    hold 'model', 'config' and 'vocab'. Raises UserError, one line, for every way it can be wrong.
    trust=True also unpickles arbitrary Python objects (only for files you trust)."""
    path = Path(path)
    if path.is_dir():
        path = path / 'ckpt.pt'
    if not path.is_file():
        raise UserError(f'no checkpoint at {path}')
    try:
        with torch.serialization.safe_globals(_numpy_safe_globals()):
            ckpt = torch.load(path, map_location='cpu', weights_only=not trust)
    except pickle.UnpicklingError as e:
        found = re.search(r'Unsupported global: GLOBAL (\S+)', str(e))
        if found and not trust:  # a readable file that pickles more than tensors and containers
            raise UserError(f'checkpoint {path} holds a pickled {found.group(1)}, which safe '
                            f'loading refuses; load it only if you trust the file') from None
        raise UserError(f'cannot read checkpoint {path}: corrupt or not a torch '
                        f'checkpoint') from None
    except (RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile, AttributeError,
            ImportError) as e:
        msg = str(e).strip().splitlines()[0].split('. ')[0] if str(e).strip() else type(e).__name__
        raise UserError(f'cannot read checkpoint {path} (corrupt or not a torch checkpoint): '
                        f'{msg}') from None
    if not isinstance(ckpt, dict):
        raise UserError(f'checkpoint {path} holds a {type(ckpt).__name__}, not the dict train.py '
                        f'writes')
    missing = [k for k in ('model', 'config', 'vocab') if k not in ckpt]
    if missing:
        raise UserError(f'checkpoint {path} lacks {", ".join(missing)}: not written by train.py')
    vocab = ckpt['vocab']
    alphabet = vocab.get('alphabet') if isinstance(vocab, dict) else None
    if not isinstance(alphabet, (list, tuple, str)) or not all(isinstance(c, str)
                                                               for c in alphabet):
        raise UserError(f'checkpoint {path}: its vocab needs an alphabet, a list of characters')
    if not isinstance(ckpt['model'], dict):
        raise UserError(f'checkpoint {path}: the model state is a '
                        f'{type(ckpt["model"]).__name__}, not a dict')
    try:
        cfg = config_from_dict(ckpt['config'])
    except UserError as e:
        raise UserError(f'checkpoint {path}: {e}') from None
    if len(alphabet) > cfg.vocab_size:
        raise UserError(f'checkpoint {path}: the alphabet has {len(alphabet)} characters but the '
                        f'model\'s vocab_size is {cfg.vocab_size}')
    ckpt['path'] = str(path)
    return ckpt


def load_weights(model, state, path):
    """Load a (possibly compiled or DDP) state dict into model; UserError when they do not fit."""
    try:
        result = model.load_state_dict(strip_prefixes(state), strict=False)
    except RuntimeError as e:  # shapes that disagree with the config
        lines = str(e).splitlines() or ['']
        detail = next((ln.strip() for ln in lines if 'size mismatch' in ln), lines[0])
        raise UserError(f'checkpoint {path}: the weights do not fit its config: {detail}') from None
    if result.missing_keys or result.unexpected_keys:
        def few(keys):
            return ', '.join(keys[:4]) + (f' (+{len(keys) - 4} more)' if len(keys) > 4 else '')
        parts = ([f'missing {few(result.missing_keys)}'] if result.missing_keys else []) + \
                ([f'unexpected {few(result.unexpected_keys)}'] if result.unexpected_keys else [])
        raise UserError(f'checkpoint {path}: the weights do not fit its config '
                        f'(boundary={model.cfg.boundary!r}, layers={model.cfg.layers}): '
                        f'{"; ".join(parts)}')
    return model


def load_checkpoint(path, device='cpu', trust=False):
    """train.py's checkpoint → (model in eval mode on device, checkpoint dict); the dict's 'vocab'
    holds 'alphabet' (index = token id) and 'space_id'. Raises UserError with one line."""
    ckpt = read_checkpoint(path, trust)
    model = DynamicPoolingLM(config_from_dict(ckpt['config']))
    return load_weights(model, ckpt['model'], ckpt['path']).to(device).eval(), ckpt


# Argument types shared by sample.py and bench.py: argparse turns their error into one line.
def positive_int(s):
    v = int(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f'must be at least 1, got {v}')
    return v


def seed_int(s):
    v = int(s)
    if not 0 <= v < 2 ** 63:
        raise argparse.ArgumentTypeError(f'must be in [0, 2**63), got {v}')
    return v


def thread_count(s):
    v, cores = int(s), os.cpu_count() or 1
    if not 1 <= v <= cores:   # torch would try to start them all (and abort for a huge count)
        raise argparse.ArgumentTypeError(f'must be between 1 and the {cores} cores of this machine, '
                                         f'got {v}')
    return v


def non_negative_int(s):
    v = int(s)
    if v < 0:
        raise argparse.ArgumentTypeError(f'must be at least 0, got {v}')
    return v


def step_flops(cfg, batch, seq_len, n_short=None):
    """Model FLOPs of one training step = 3 x forward (backward = 2 x forward). The forward sums,
    over the stacks (vanilla: all layers at seq_len; else pre and post at seq_len, the shortened
    stack at n_short = 1 + segments positions, the null group included), per layer
        batch*n*2*(3*d*H*dh + H*dh*d + 2*d*d_inner)   qkv, output and feed-forward projections
      + n*2*d*H*dh                                    position projection, once per sequence
      + batch*H*n^2*2*dh*3                            content and position scores, weights x values
    plus batch*seq_len*2*d*V for the logits and the boundary predictor's or router's matmuls.
    Pooling, upsampling, norms and softmax are left out; the attention counts all n^2 terms (the
    usual MFU convention), causal kernels run about half.
    n_short may be a float (1 + seq_len / measured SF) or a tensor, so the sum can stay on a
    device; n_short=None counts every layer at seq_len."""

    d, H, dh, di = cfg.d_model, cfg.n_head, cfg.d_head, cfg.d_inner
    pre, short, post = cfg.layers
    stacks = ([(pre + short + post, seq_len)] if cfg.boundary == 'none' or n_short is None
              else [(pre + post, seq_len), (short, n_short)])
    fwd = batch * seq_len * 2 * d * cfg.vocab_size
    # The boundary source's own matmuls at full length: a predictor MLP d -> d_inner -> 1, or
    # H-Net's router (W_q, W_k) and residual projection, three d x d.
    if cfg.boundary in PREDICTOR_MODES:
        fwd += batch * seq_len * 2 * (d * di + di)
    elif cfg.boundary == 'hnet':
        fwd += batch * seq_len * 2 * 3 * d * d
    for layers, n in stacks:
        fwd = fwd + layers * (batch * n * 2 * (3 * d * H * dh + H * dh * d + 2 * d * di)
                              + n * 2 * d * H * dh + batch * H * n * n * 2 * dh * 3)
    return 3 * fwd


def die(msg, code=1):
    """One clear line on stderr (rank 0) and exit code `code`: never a traceback."""
    if RANK == 0:
        print(f'error: {msg}', file=sys.stderr, flush=True)
    sys.exit(code)


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


def import_optional(module, package, flag):
    """Import a logging package only when its flag asks for it; one line if it is not installed."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(f'{flag} needs the {package} package: pip install {package} '
                        f'(or drop {flag})') from None


# ----------------------------------------------------------------------------- data
def prepare_command(d):
    """The prepare_data.py command that writes dataset directory d."""
    out_dir = '' if d.parent == Path('data') else f' --out-dir {d.parent}'
    name, _, lang = d.name.partition('-')
    if d.name == 'text8':
        return f'python prepare_data.py{out_dir}'
    if name in ('wiki40b', 'cc100') and lang:
        return f'python prepare_data.py --dataset {name} --lang {lang}{out_dir}'
    return f'python prepare_data.py --input FILE --lang LANG --name {d.name}{out_dir}'


def read_meta(d):
    """meta.json of dataset directory d, checked: alphabet, vocab_size, dtype, space_id, sizes."""
    path, remake = d / 'meta.json', f'remake it with: {prepare_command(d)}'
    if not path.is_file():
        raise UserError(f'no dataset at {d} (make it with: {prepare_command(d)})')
    try:
        meta = json.loads(path.read_text(encoding='utf-8'))
    except (ValueError, OSError) as e:
        raise UserError(f'{path} is unreadable ({e}); {remake}') from None
    if not isinstance(meta, dict) or {'alphabet', 'vocab_size', 'dtype'} - meta.keys():
        raise UserError(f'{path} lacks alphabet, vocab_size or dtype; {remake}')
    V, alphabet, space = meta['vocab_size'], meta['alphabet'], meta.get('space_id')
    if meta['dtype'] not in ('uint8', 'uint16'):
        raise UserError(f'{path} gives dtype {meta["dtype"]!r}; token ids are uint8 or uint16; '
                        f'{remake}')
    if type(V) is not int or not 1 <= V <= np.iinfo(meta['dtype']).max + 1:
        raise UserError(f'{path} gives vocab_size {V!r}, not a count of characters that fits '
                        f'{meta["dtype"]}; {remake}')
    if (not isinstance(alphabet, list) or len(alphabet) != V
            or not all(isinstance(c, str) for c in alphabet)):
        raise UserError(f'{path}: the alphabet must be a list of {V} characters (vocab_size); '
                        f'{remake}')
    if space is not None and (type(space) is not int or not 0 <= space < V):
        raise UserError(f'{path} gives space_id {space!r}, not a token id below {V}; {remake}')
    if not isinstance(meta.get('sizes', {}), dict):
        raise UserError(f'{path}: sizes must map split names to lengths; {remake}')
    return meta


def open_ids(path, dtype, n_expected, limit, what, remake):
    """Memmap of a split's token ids (or labels), checked: present, non-empty, the size meta.json
    gives, every value below `limit` (one pass over the file, once at load)."""
    if not path.is_file():
        raise UserError(f'{path} is missing; {remake}')
    size, item = path.stat().st_size, np.dtype(dtype).itemsize
    if size == 0:
        raise UserError(f'{path} is empty; {remake}')
    if size % item or (n_expected is not None and size // item != n_expected):
        expected = f'{n_expected} {what}' if n_expected is not None else f'a multiple of {item}'
        raise UserError(f'{path} holds {size} bytes, not {expected} as {dtype} ({what} from '
                        f'another dataset, or a cut-off copy?); {remake}')
    ids = np.memmap(path, dtype=dtype, mode='r')
    top = int(ids.max())
    if top >= limit:
        raise UserError(f'{path} holds the value {top}, outside [0, {limit}) for {what} (a file '
                        f'from another dataset?); {remake}')
    return ids


def load_data(data_dir, boundary):
    """(meta, {split: token ids}, {split: Unigram labels} or None), all checked once at load."""
    d = Path(data_dir)
    meta = read_meta(d)
    remake, sizes = f'remake the dataset with: {prepare_command(d)}', meta.get('sizes', {})
    splits = {s: open_ids(d / f'{s}.bin', meta['dtype'], sizes.get(s), meta['vocab_size'],
                          'token ids', remake) for s in ('train', 'valid', 'test')}
    for s in ('valid', 'test'):
        if len(splits[s]) < 2:
            raise UserError(f'{d / f"{s}.bin"} holds {len(splits[s])} character: nothing to '
                            f'evaluate; {remake}')
    if boundary == 'whitespace' and meta.get('space_id') is None:
        raise UserError(f'--boundary whitespace needs a space character, and {d} has none')
    labels = None
    if boundary == 'unigram':
        # Labels: 1 where a SentencePiece Unigram piece ends, aligned with the split's characters.
        v = (meta.get('unigram') or {}).get('vocab_size')
        files = {s: d / f'{s}.unigram-{v}.bin' for s in splits}
        if v is None or not all(f.is_file() for f in files.values()):
            raise UserError(f'--boundary unigram needs Unigram labels in {d} '
                            f'(make them with: {prepare_command(d)} --unigram 10000)')
        labels = {s: open_ids(f, 'uint8', len(splits[s]), 2, 'Unigram labels', remake)
                  for s, f in files.items()}
    return meta, splits, labels


def epoch_order(n_chars, seq_len, seed, epoch):
    """Random cyclic shift and chunk permutation of one epoch, a pure function of (seed, epoch)."""
    rng = np.random.default_rng([seed, epoch])
    return int(rng.integers(n_chars)), rng.permutation(n_chars // (seq_len + 1))


def get_chunks(stream, offset, chunk_ids, seq_len):
    """Chunks of seq_len+1 characters of the stream rotated by offset → int64 [..., seq_len+1]."""
    idx = (offset + chunk_ids[..., None] * (seq_len + 1) + np.arange(seq_len + 1)) % len(stream)
    return torch.from_numpy(stream[idx].astype(np.int64))


def to_device(t, device):
    """Host tensor → device; on CUDA through pinned memory without waiting for the copy."""
    if torch.device(device).type == 'cuda':
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


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
def lock_run_dir(out_dir):
    """Create the run directory and take its lock (an advisory flock on <out>/.lock that the OS
    drops when the process dies) → the open lock file; one line if it cannot be used or is taken."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(out_dir / '.lock', os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        files = [p for p in (out_dir, *out_dir.parents) if p.exists() and not p.is_dir()]
        why = f'{files[-1]} is a file, not a directory' if files else (e.strerror or str(e))
        raise UserError(f'cannot use --out {out_dir}: {why}; choose another --out') from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise UserError(f'another train.py is running on {out_dir} (it holds '
                        f'{out_dir / ".lock"}); wait for it to end or choose another '
                        f'--out') from None
    return fd


def save_checkpoint(path, state, saved_step):
    """Write state atomically (temp file, fsync, rename). On any failure the temp file is removed
    and the previous checkpoint (of step saved_step, None if there is none) stays as it was."""
    tmp = path.with_name(path.name + '.tmp')
    try:
        with open(tmp, 'wb') as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename: a power cut leaves no empty ckpt.pt
        os.replace(tmp, path)  # atomic: a crash mid-save never leaves a broken checkpoint
    except (OSError, RuntimeError) as e:  # torch.save reports a failed write as a RuntimeError
        why = getattr(e, 'strerror', None) or (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f'cannot save checkpoint {path}: {why}; {kept(path, saved_step)}') from None
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def interrupts_deferred():
    """Ctrl-C inside the block takes effect at its end. A KeyboardInterrupt raised inside
    torch.save's writer would close the file under it and abort the process (C++ terminate)."""
    # A handler, not a signal mask: torch's worker threads would still take a process-wide SIGINT.
    pending = []
    handler = signal.signal(signal.SIGINT, lambda *_: pending.append(True))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)
    if pending and callable(handler):
        handler(signal.SIGINT, None)  # the usual handler: raises KeyboardInterrupt, now safely


def kept(ckpt_path, saved_step):
    """What a stopped run leaves behind, in words."""
    if saved_step is None:
        return 'no checkpoint was written yet'
    return f'the last good checkpoint is {ckpt_path} (step {saved_step}); continue with --resume'


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
class Logger:
    """Records to stdout and log.jsonl on rank 0, and to TensorBoard / W&B when their flags ask."""

    def __init__(self, out_dir, args, config_record):
        self.path, self.tb, self.wandb = out_dir / 'log.jsonl', None, None
        if RANK != 0:
            return
        if args.tensorboard:
            tensorboard = import_optional('torch.utils.tensorboard', 'tensorboard', '--tensorboard')
            self.tb = tensorboard.SummaryWriter(str(out_dir / 'tensorboard'))
        if args.wandb:
            wandb = import_optional('wandb', 'wandb', '--wandb')
            try:
                self.wandb = wandb.init(project=args.wandb, name=out_dir.name, config=config_record)
            except Exception as e:  # a network or login problem: one line, as for every other fault
                why = (str(e).strip().splitlines() or [type(e).__name__])[0]
                raise UserError(f'--wandb {args.wandb}: cannot start Weights & Biases '
                                f'({why})') from None
        self.log(config_record)

    def log(self, rec):
        if RANK != 0:
            return
        print(' | '.join(f'{k} {v:.4g}' if isinstance(v, float) else f'{k} {v}'
                         for k, v in rec.items() if v is not None), flush=True)
        try:
            with open(self.path, 'a') as f:
                f.write(json.dumps(rec) + '\n')
        except OSError as e:
            raise UserError(f'cannot write {self.path}: {e.strerror}') from None
        if rec['kind'] == 'config':
            return
        group = rec['kind'] if rec['kind'] == 'train' else rec['split']
        scalars = {f'{group}/{k}': v for k, v in rec.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and k != 'step'}
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, rec['step'])
        if self.wandb is not None:
            self.wandb.log(scalars, step=rec['step'])

    def close(self):
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def device_name(device):
    """The GPU's name, or the CPU's model name where the system tells it."""
    if torch.device(device).type == 'cuda':
        return torch.cuda.get_device_name(device)
    try:
        with open('/proc/cpuinfo') as f:
            return next(ln.split(':', 1)[1].strip() for ln in f if ln.startswith('model name'))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def peak_mem_mb(device):
    if torch.device(device).type == 'cuda':
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: kilobytes


def sum_dtype(device):
    """float64 for the running sums, where the device has it."""
    return torch.float32 if torch.device(device).type == 'mps' else torch.float64


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


def setup_precision(amp, device_type):
    """--amp → (resolved name, autocast context, GradScaler): fp16 needs loss scaling, bf16 not."""
    if amp == 'auto' and device_type == 'cuda':
        amp = 'bf16' if torch.cuda.is_bf16_supported() else 'fp16'
    elif amp == 'auto':
        amp = 'off'
    dtype = {'bf16': torch.bfloat16, 'fp16': torch.float16}.get(amp)
    autocast = torch.autocast(device_type, dtype=dtype) if dtype else nullcontext()
    return amp, autocast, torch.amp.GradScaler(device_type, enabled=(amp == 'fp16'))


def wrap_model(model, args):
    """torch.compile and DDP around the model; the bare model stays for evaluation and saving."""
    if args.compile:
        # the default dynamic=None marks a size that changes between calls (the segment count) as
        # dynamic at its first recompile, instead of compiling once per value
        model = torch.compile(model)
    if WORLD > 1:
        # DDP's static graph finds the output's tensors through pytrees; a ModelOutput it cannot
        # look into would leave the first step's gradients un-averaged
        try:
            torch.export.register_dataclass(ModelOutput)
        except ValueError:  # already registered
            pass
        # Every parameter gets a gradient in every mode and each step runs the same graph (not
        # static with --grad-accum > 1: torch's static graph breaks under no_sync, pytorch#143580).
        # The only buffer is the constant Gumbel evaluation noise: no re-broadcast after the start
        # (forward_sync_buffers since torch 2.13, broadcast_buffers before).
        ddp_kw = inspect.signature(DDP.__init__).parameters
        no_sync = ({'forward_sync_buffers': False} if 'forward_sync_buffers' in ddp_kw
                   else {'broadcast_buffers': False})
        device = torch.device(args.device)
        model = DDP(model, device_ids=[device.index] if device.type == 'cuda' else None,
                    find_unused_parameters=False, static_graph=args.grad_accum == 1,
                    gradient_as_bucket_view=True, **no_sync)
    return model


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
    return wrap_model(raw_model, args), raw_model, optimizer, scaler, autocast, amp, state


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


class StepStats:
    """Training statistics summed on the device step after step and read once per log record, the
    loop's only wait for the device. Per micro-step: loss, LM loss, SF, precision, recall, FLOPs;
    per step: the gradient norm (where finite) and how many, steps skipped as non-finite, and a
    time-is-up flag."""
    NAMES = ('loss', 'lm_loss', 'sf', 'precision', 'recall', 'flops', 'grad_norm', 'norms', 'bad',
             'late')

    def __init__(self, cfg, args):
        self.cfg, self.seq_len = cfg, args.seq_len
        self.micro = args.batch_size // (WORLD * args.grad_accum)
        self.sums = torch.zeros(len(self.NAMES), dtype=sum_dtype(args.device), device=args.device)
        self.index = {}  # names → their positions in sums, as a device tensor
        self.present, self.micro_steps, self.host_flops = set(), 0, 0.0
        # --flop-budget: the schedule needs each step's FLOPs on the host (one read per step)
        self.track, self.step_flops = args.flop_budget is not None, 0.0

    def add(self, **vals):
        names = tuple(vals)
        if names not in self.index:
            at = [self.NAMES.index(k) for k in names]
            self.index[names] = torch.tensor(at, device=self.sums.device)
        values = torch.stack([v.to(self.sums.dtype) for v in vals.values()])
        self.sums.index_add_(0, self.index[names], values)

    def add_micro(self, out):
        vals = dict(loss=out.loss, lm_loss=out.lm_loss, sf=out.shortening_factor,
                    precision=out.precision, recall=out.recall)
        vals = {k: v.detach().to(self.sums.dtype) for k, v in vals.items() if v is not None}
        L = self.seq_len
        if 'sf' in vals:  # the shortened stack runs on 1 + L/SF positions, the null group included
            vals['flops'] = step_flops(self.cfg, self.micro, L, 1 + L / vals['sf'])
            if self.track:
                self.step_flops += float(vals['flops'])
        else:
            self.host_flops += step_flops(self.cfg, self.micro, L)
            if self.track:
                self.step_flops += step_flops(self.cfg, self.micro, L)
        self.add(**vals)
        self.present |= vals.keys()
        self.micro_steps += 1

    def take_step_flops(self):
        """This process's FLOPs since the last call (--flop-budget), summed over processes."""
        f, self.step_flops = self.step_flops, 0.0
        if WORLD > 1:
            t = torch.tensor([f], dtype=torch.float64, device=self.sums.device)
            torch.distributed.all_reduce(t)
            f = t.item()
        return f

    def add_step(self, norm, bad):
        finite = torch.isfinite(norm)
        self.add(grad_norm=torch.where(finite, norm, 0.0), norms=finite, bad=bad)

    def read(self, late=False):
        """Sum over processes, read and reset → means since the last read, FLOPs, skipped steps,
        and whether any process is out of time."""
        self.sums[self.NAMES.index('flops')] += self.host_flops
        self.sums[self.NAMES.index('late')] += float(late)
        if WORLD > 1:
            torch.distributed.all_reduce(self.sums)
        v = dict(zip(self.NAMES, self.sums.tolist()))
        n = max(1, self.micro_steps * WORLD)
        r = {k: v[k] / n if k in self.present else None
             for k in ('loss', 'lm_loss', 'sf', 'precision', 'recall')}
        r.update(sf=r['sf'] or 1.0, flops=v['flops'], bad=int(v['bad']), late=v['late'] > 0,
                 grad_norm=v['grad_norm'] / v['norms'] if v['norms'] else None)
        self.sums.zero_()
        self.micro_steps, self.host_flops = 0, 0.0
        return r


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
    logger = Logger(Path(args.out), args, dict(
        kind='config', **{**vars(args), 'amp': amp}, params=raw_model.num_params(),
        device_name=device_name(args.device), world=WORLD, torch=torch.__version__,
        resumed_from=saved))
    stats = StepStats(cfg, args)
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
            leave_process_group(wait=trained)


def leave_process_group(wait):
    """Tear the process group down together. A rank that exits while another still holds or closes
    its gloo connections to it can abort in C++ at exit ("terminate called without an active
    exception"): so every rank passes its last collective, destroys the group, and then waits, on
    the rendezvous store, for the others to have destroyed theirs. Not after an error (`wait`
    False): a rank still training would never arrive."""
    if not wait:
        torch.distributed.destroy_process_group()
        return
    torch.distributed.barrier()
    store = torch.distributed.distributed_c10d._get_default_store()  # outlives the group
    torch.distributed.destroy_process_group()
    key = f'dynpool/left/{os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")}'  # torchrun restarts
    deadline = time.time() + 60
    try:
        store.add(key, 1)
        while store.add(key, 0) < WORLD and time.time() < deadline:
            time.sleep(0.01)
    except RuntimeError:  # the store's host (rank 0) saw everyone leave and exited first
        pass


def main(argv=None):
    """Train; every user mistake or fault ends as one `error: ...` line and its exit code."""
    try:
        run(argv)
    except UserError as e:
        die(str(e), e.code)
    except KeyboardInterrupt:
        die('interrupted before training began; no checkpoint was written or changed', 130)


if __name__ == '__main__':
    main()
