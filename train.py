"""
Train and evaluate a dynamic-pooling Transformer (Nawrot et al., ACL 2023) for character-level LM.

    python prepare_data.py                                   # data/text8, once
    python train.py --boundary entropy                       # GPU: the paper's recipe; CPU: a small preset
    python train.py --boundary unigram --data data/wiki40b-fi --out out/fi-unigram
    python train.py --boundary gumbel --stop-step 50000      # stop early (time-limited job, 200k-step schedule) ...
    python train.py --out out/text8-gumbel --resume          # ... and continue: the flags come from the checkpoint
    torchrun --nproc_per_node=8 train.py --boundary whitespace            # DDP over 8 GPUs (NCCL)
    torchrun --nproc_per_node=2 train.py --device cpu --boundary fixed    # DDP on CPU (gloo)
    python train.py --device cpu --boundary none --max-steps 120 --eval-max-chars 20000   # a quick CPU run

--boundary: none (vanilla Transformer), fixed, whitespace, unigram, entropy, gumbel. A run writes
out/<dataset>-<boundary>/ckpt.pt and log.jsonl (or --out); a finished run's last line is
`test bpc <x.xxxx> sf <y.yy>`. See `python train.py --help` for every flag.

Notable:
- Presets are only defaults. On a GPU they are the paper's recipe (batch 8 x 2048 chars, Adam lr 2.5e-4,
  4k warm-up steps then one cosine cycle over 200k steps, grad clip 0.25, dropout 0.1, bf16 AMP, or fp16
  with loss scaling where bf16 is missing); on CPU a small model that learns in minutes on 2 cores.
- --batch-size is the global batch: torchrun processes and --grad-accum micro-steps split it, so the
  optimisation is the same whatever the hardware.
- Data: each epoch the character stream is cyclically shifted by a random offset, cut into chunks of
  seq_len+1 chars and shuffled; the order is a pure function of (seed, epoch), so a checkpoint only needs
  (epoch, index) to continue exactly.
- Evaluation uses overlapping windows (2048 chars, step 512 on GPU): each window scores only its last
  `step` chars (the first window all of them), so every character is scored exactly once with
  >= window-step chars of context where the text has them. BPC = mean nats / ln 2.
- Checkpoints are written atomically and hold everything needed to continue (model, optimizer, AMP scaler,
  all RNG states, step, data position, config, vocabulary): on CPU a stopped-and-resumed run ends with
  bit-identical weights to one that never stopped. A non-finite loss stops the run before it reaches them.
- User mistakes (missing data, wrong flags, a checkpoint that does not fit) end with one `error: ...` line
  and exit code 1, before anything is written.
"""
import argparse
import dataclasses
import json
import math
import os
import pickle
import random
import re
import resource
import sys
import time
import zipfile
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from dynpool import BOUNDARY_MODES, Config, DynamicPoolingLM

# The paper's recipe (appendix) for a GPU ...
GPU_PRESET = dict(d_model=512, n_head=8, d_head=64, d_inner=2048, layers='2,8,2', dropout=0.1, dropatt=0.1,
                  batch_size=8, seq_len=2048, lr=2.5e-4, warmup=4000, max_steps=200_000,
                  eval_interval=5000, eval_window=2048, eval_step=512, eval_max_chars=0, eval_batch_size=16,
                  log_interval=100)
# ... and a small model for 2 CPU cores (~2-4k chars/s): 300 steps take a few minutes. A few hundred steps
# never see a character twice, so dropout would only slow learning down; the eval window shrinks with the
# training length (same 4:1 window:step ratio) and evaluation reads only the first 20k chars of a split.
CPU_PRESET = dict(d_model=128, n_head=2, d_head=64, d_inner=512, layers='1,4,1', dropout=0.0, dropatt=0.0,
                  batch_size=4, seq_len=512, lr=1e-3, warmup=50, max_steps=300,
                  eval_interval=100, eval_window=512, eval_step=128, eval_max_chars=20_000, eval_batch_size=8,
                  log_interval=10)
COMMON = dict(data='data/text8', boundary='entropy', grad_accum=1, grad_clip=0.25, seed=1337, amp='auto',
              compile=False)
# Flags that define the model or the data order: a resumed run must keep them.
KEPT_ON_RESUME = ('boundary', 'd_model', 'n_head', 'd_head', 'd_inner', 'layers', 'dropout', 'dropatt',
                  'fixed_factor', 'temperature', 'prior', 'entropy_window', 'seq_len', 'batch_size', 'seed')
RANK = int(os.environ.get('RANK', 0))  # set by torchrun
WORLD = int(os.environ.get('WORLD_SIZE', 1))


def die(msg):
    """One clear line and a non-zero exit code: for user mistakes and failed runs, never a traceback."""
    if RANK == 0:
        print(f'error: {msg}', file=sys.stderr, flush=True)
    sys.exit(1)


# ----------------------------------------------------------------------------- shared helpers
# sample.py and bench.py import these: one device choice, one checkpoint reader, one Config builder.
class UserError(Exception):
    """A user mistake or a fault the user can fix: the script prints it as one `error: ...` line."""


def pick_device(name=None):
    """'cpu', 'cuda', 'cuda:1', 'mps' → the checked device string; None → cuda if available, else cpu."""
    if name is None:
        return 'cuda' if torch.cuda.is_available() else 'cpu'
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise UserError(f'--device {name} is not a device torch knows (cpu, cuda, cuda:1, mps)') from None
    if dev.type == 'cuda' and not torch.cuda.is_available():
        raise UserError(f'--device {name} but no CUDA GPU is available here (try --device cpu)')
    if dev.type == 'cuda' and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise UserError(f'--device {name}: only {torch.cuda.device_count()} CUDA device(s) here')
    if dev.type == 'mps' and not (hasattr(torch.backends, 'mps') and torch.backends.mps.is_available()):
        raise UserError(f'--device {name} but MPS is not available here (try --device cpu)')
    return str(dev)


def config_from_dict(d):
    """Config from dataclasses.asdict(Config); keys that are not Config fields are ignored, missing
    ones take their defaults (so checkpoints from before a new field was added still load)."""
    if not isinstance(d, dict):
        raise UserError(f'the config is a {type(d).__name__}, expected a dict (dataclasses.asdict(Config))')
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
    """numpy's array reconstruction, allowed for safe loading: checkpoints hold numpy's RNG state."""
    core = getattr(np, '_core', None) or np.core  # numpy 2 / numpy 1
    dtypes = [type(np.dtype(t)) for t in (np.uint8, np.uint16, np.uint32, np.int32, np.int64, np.float32,
                                          np.float64, np.bool_)]
    return [core.multiarray._reconstruct, np.ndarray, np.dtype, *dtypes]


def read_checkpoint(path, trust=False):
    """train.py's checkpoint (a file, or a run directory holding ckpt.pt) → its dict, checked to hold
    'model', 'config' and 'vocab'. Raises UserError with one line for every way it can be wrong.
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
        if found and not trust:  # a readable file that pickles an object beyond tensors and containers
            raise UserError(f'checkpoint {path} holds a pickled {found.group(1)}, which safe loading '
                            f'refuses; load it only if you trust the file') from None
        raise UserError(f'cannot read checkpoint {path}: corrupt or not a torch checkpoint') from None
    except (RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile, AttributeError,
            ImportError) as e:
        msg = str(e).strip().splitlines()[0].split('. ')[0] if str(e).strip() else type(e).__name__
        raise UserError(f'cannot read checkpoint {path} (corrupt or not a torch checkpoint): {msg}') from None
    if not isinstance(ckpt, dict):
        raise UserError(f'checkpoint {path} holds a {type(ckpt).__name__}, not the dict train.py writes')
    missing = [k for k in ('model', 'config', 'vocab') if k not in ckpt]
    if missing:
        raise UserError(f'checkpoint {path} lacks {", ".join(missing)}: it was not written by train.py')
    vocab = ckpt['vocab']
    alphabet = vocab.get('alphabet') if isinstance(vocab, dict) else None
    if not isinstance(alphabet, (list, tuple, str)) or not all(isinstance(c, str) for c in alphabet):
        raise UserError(f'checkpoint {path}: its vocab needs an alphabet, a list of characters')
    if not isinstance(ckpt['model'], dict):
        raise UserError(f'checkpoint {path}: the model state is a {type(ckpt["model"]).__name__}, not a dict')
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
        lines = str(e).splitlines()
        detail = next((ln.strip() for ln in lines if 'size mismatch' in ln), lines[0] if lines else '')
        raise UserError(f'checkpoint {path}: the weights do not fit its config: {detail}') from None
    if result.missing_keys or result.unexpected_keys:
        def few(keys):
            return ', '.join(keys[:4]) + (f' (+{len(keys) - 4} more)' if len(keys) > 4 else '')
        parts = ([f'missing {few(result.missing_keys)}'] if result.missing_keys else []) + \
                ([f'unexpected {few(result.unexpected_keys)}'] if result.unexpected_keys else [])
        raise UserError(f'checkpoint {path}: the weights do not fit its config '
                        f'(boundary={model.cfg.boundary!r}, layers={model.cfg.layers}): {"; ".join(parts)}')
    return model


def load_checkpoint(path, device='cpu', trust=False):
    """train.py's checkpoint → (model in eval mode on device, checkpoint dict); the dict's 'vocab'
    holds 'alphabet' (index = token id) and 'space_id'. Raises UserError with one line."""
    ckpt = read_checkpoint(path, trust)
    model = load_weights(DynamicPoolingLM(config_from_dict(ckpt['config'])), ckpt['model'], ckpt['path'])
    return model.to(device).eval(), ckpt


def step_flops(cfg, batch, seq_len, n_short=None):
    """Model FLOPs of one training step = 3 x forward (backward = 2 x forward). The forward sums, over
    the stacks (vanilla: all layers at seq_len; else pre and post at seq_len, the shortened stack at
    n_short = 1 + segments positions, the null group included), per layer
        batch*n*2*(3*d*H*dh + H*dh*d + 2*d*d_inner)   qkv, output and feed-forward projections
      + n*2*d*H*dh                                    position projection, once per sequence
      + batch*H*n^2*2*dh*3                            content and position scores, weights x values
    plus batch*seq_len*2*d*V for the logits. Pooling, upsampling, norms and softmax are left out; the
    attention counts all n^2 terms (the usual MFU convention), causal kernels execute about half.
    n_short may be a float (1 + seq_len / measured SF) or a tensor, so the sum can stay on a device."""
    d, H, dh, di = cfg.d_model, cfg.n_head, cfg.d_head, cfg.d_inner
    pre, short, post = cfg.layers
    stacks = ([(pre + short + post, seq_len)] if cfg.boundary == 'none' or n_short is None
              else [(pre + post, seq_len), (short, n_short)])
    fwd = batch * seq_len * 2 * d * cfg.vocab_size
    for layers, n in stacks:
        fwd = fwd + layers * (batch * n * 2 * (3 * d * H * dh + H * dh * d + 2 * d * di)
                              + n * 2 * d * H * dh + batch * H * n * n * 2 * dh * 3)
    return 3 * fwd


class Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print usage + message; we promise one line
        die(message)


def parse_args(argv):
    p = Parser(description='Train a dynamic-pooling Transformer on a prepared character dataset.')
    # Every default is None: the value then comes from the checkpoint (--resume) or from the preset,
    # which lets us tell what the user asked for from what was filled in.
    a = p.add_argument
    a('--data', help='dataset directory written by prepare_data.py (default data/text8)')
    a('--boundary', choices=BOUNDARY_MODES, help='segmentation: none (vanilla), fixed, whitespace, unigram, entropy, gumbel')
    a('--out', help='run directory for checkpoint and log.jsonl (default out/<dataset>-<boundary>)')
    a('--resume', action='store_true', help='continue the run in --out from its checkpoint')
    a('--device', help='cpu, cuda, cuda:1, ... (default cuda if available); picks the GPU or CPU preset')
    a('--seed', type=int, help='seed for initialisation, data order, dropout (default 1337)')
    # model
    a('--d-model', type=int, help='model width (GPU 512, CPU 128)')
    a('--n-head', type=int, help='attention heads (GPU 8, CPU 2)')
    a('--d-head', type=int, help='width of one head (64)')
    a('--d-inner', type=int, help='feed-forward width (GPU 2048, CPU 512)')
    a('--layers', help='pre,shortened,post layer counts (GPU 2,8,2, CPU 1,4,1); vanilla stacks all at full length')
    a('--dropout', type=float, help='dropout (GPU 0.1, CPU 0)')
    a('--dropatt', type=float, help='attention dropout (GPU 0.1, CPU 0)')
    a('--fixed-factor', type=int, help='segment length k for --boundary fixed (model default)')
    a('--temperature', type=float, help='Gumbel-sigmoid temperature for the boundary predictor (model default)')
    a('--prior', type=float, help='prior boundary rate for --boundary gumbel (model default)')
    a('--entropy-window', type=int, help='k of the entropy-spike rule for --boundary entropy (model default)')
    # optimisation
    a('--batch-size', type=int,
      help='global batch in sequences per step, split over processes and --grad-accum (GPU 8, CPU 4)')
    a('--seq-len', type=int, help='training sequence length in characters (GPU 2048, CPU 512)')
    a('--grad-accum', type=int, help='micro-steps per optimizer step; the global batch stays --batch-size (1)')
    a('--max-steps', type=int, help='optimizer steps; the cosine schedule ends here (GPU 200000, CPU 300)')
    a('--stop-step', type=int, help='save and exit at this step without finishing (for time-limited jobs); '
                                    'the schedule still follows --max-steps; continue with --resume')
    a('--lr', type=float, help='peak learning rate (GPU 2.5e-4, CPU 1e-3)')
    a('--warmup', type=int, help='linear warm-up steps before the cosine decay (GPU 4000, CPU 50)')
    a('--grad-clip', type=float, help='clip the gradient norm to this (0.25; 0 = off)')
    a('--amp', choices=('auto', 'bf16', 'fp16', 'off'), help='mixed precision; auto = bf16 if the GPU has it, '
                                                              'else fp16 with loss scaling; off on CPU')
    a('--compile', action='store_true', default=None, help='torch.compile the model for training')
    # evaluation and logging
    a('--eval-interval', type=int, help='validate (and checkpoint) every N steps (GPU 5000, CPU 100)')
    a('--eval-window', type=int, help='evaluation window in characters (GPU 2048, CPU 512)')
    a('--eval-step', type=int, help='window step: each window scores its last N characters (GPU 512, CPU 128)')
    a('--eval-max-chars', type=int, help='evaluate only the first N characters of a split; 0 = all (GPU 0, CPU 20000)')
    a('--eval-batch-size', type=int, help='windows per evaluation batch (GPU 16, CPU 8)')
    a('--log-interval', type=int, help='log training metrics every N steps (GPU 100, CPU 10)')
    return p.parse_args(argv)


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


def load_data(data_dir, boundary):
    d = Path(data_dir)
    if not (d / 'meta.json').is_file():
        die(f'no dataset at {d} (make it with: {prepare_command(d)})')
    try:
        meta = json.loads((d / 'meta.json').read_text())
    except ValueError as e:
        die(f'{d / "meta.json"} is unreadable ({e}); remake it with: {prepare_command(d)}')
    if not isinstance(meta, dict) or {'alphabet', 'vocab_size', 'dtype'} - meta.keys():
        die(f'{d / "meta.json"} lacks alphabet, vocab_size or dtype; remake it with: {prepare_command(d)}')
    splits, labels = {}, None
    for s in ('train', 'valid', 'test'):
        if not (d / f'{s}.bin').is_file():
            die(f'{d / f"{s}.bin"} is missing (remake the dataset with: {prepare_command(d)})')
        splits[s] = np.memmap(d / f'{s}.bin', dtype=meta['dtype'], mode='r')
    if boundary == 'whitespace' and meta.get('space_id') is None:
        die(f'--boundary whitespace needs a space character, and {d} has none')
    if boundary == 'unigram':
        # Labels: 1 where a SentencePiece Unigram piece ends, aligned with the split's characters.
        v = (meta.get('unigram') or {}).get('vocab_size')
        files = {s: d / f'{s}.unigram-{v}.bin' for s in splits}
        if v is None or not all(f.is_file() for f in files.values()):
            die(f'--boundary unigram needs Unigram labels in {d} '
                f'(make them with: {prepare_command(d)} --unigram 10000)')
        labels = {s: np.memmap(f, dtype=np.uint8, mode='r') for s, f in files.items()}
        if any(len(labels[s]) != len(splits[s]) for s in splits):
            die(f'Unigram labels in {d} do not match the length of the splits; remake them')
    return meta, splits, labels


def epoch_order(n_chars, seq_len, seed, epoch):
    """Random cyclic shift and chunk permutation of one epoch, a pure function of (seed, epoch)."""
    rng = np.random.default_rng([seed, epoch])
    return int(rng.integers(n_chars)), rng.permutation(n_chars // (seq_len + 1))


def get_chunks(stream, offset, chunk_ids, seq_len):
    """Chunks of seq_len+1 characters of the stream rotated by offset, as an int64 tensor [B, seq_len+1]."""
    idx = (offset + chunk_ids[:, None] * (seq_len + 1) + np.arange(seq_len + 1)) % len(stream)
    return torch.from_numpy(stream[idx].astype(np.int64))


# ----------------------------------------------------------------------------- evaluation
def eval_windows(n, window, step):
    """Windows (start, end, first_scored) over n positions: the first window scores all of its positions,
    every later one only its last `step`, so each position is scored once with >= window-step positions of
    context where the text has them. The tail gets one more window ending at n that scores what is left."""
    if n <= window:
        return [(0, n, 0)]
    wins, start = [(0, window, 0)], step
    while start + window <= n:
        wins.append((start, start + window, start + window - step))
        start += step
    if wins[-1][1] < n:
        wins.append((n - window, n, wins[-1][1]))
    return wins


@torch.no_grad()
def evaluate(model, tokens, window, step, batch_size, device, autocast=nullcontext(), name='eval', rank=0, world=1):
    """Bits per character over a token stream with overlapping windows, and the mean shortening factor."""
    n = len(tokens) - 1  # positions that have a next character to predict
    wins = eval_windows(n, window, step)[rank::world]  # each process takes its share of the windows
    was_training = model.training
    model.eval()
    nats, chars, sf_sum, sf_n = 0.0, 0, 0.0, 0
    t0, shown = time.time(), 0.0
    for i in range(0, len(wins), batch_size):
        group = wins[i:i + batch_size]  # all windows have the same length, so they stack
        starts = np.array([s for s, _, _ in group])
        chunk = torch.from_numpy(tokens[starts[:, None] + np.arange(group[0][1] - group[0][0] + 1)].astype(np.int64))
        x, y = chunk[:, :-1].to(device), chunk[:, 1:].to(device)
        with autocast:
            out = model(x)
        nll = F.cross_entropy(out.logits.float().transpose(1, 2), y, reduction='none')  # [B, W]
        first = torch.tensor([f - s for s, _, f in group], device=device)
        scored = torch.arange(x.size(1), device=device)[None, :] >= first[:, None]
        nats += torch.where(scored, nll, 0.0).sum().item()  # (not nll * scored: inf * 0 would be nan)
        chars += int(scored.sum())
        if out.shortening_factor is not None:
            sf_sum, sf_n = sf_sum + float(out.shortening_factor) * len(group), sf_n + len(group)
        if rank == 0 and (i + batch_size) / len(wins) >= shown + 0.1 and time.time() - t0 > 2:  # slow: show progress
            shown = (i + batch_size) / len(wins)
            print(f'  {name}: {min(1.0, shown):4.0%} of {len(wins)} windows, {time.time() - t0:.0f}s',
                  file=sys.stderr, flush=True)
    if world > 1:
        t = torch.tensor([nats, chars, sf_sum, sf_n], dtype=torch.float64, device=device)
        torch.distributed.all_reduce(t)
        nats, chars, sf_sum, sf_n = t.tolist()
    model.train(was_training)
    return dict(bpc=nats / max(chars, 1) / math.log(2), sf=sf_sum / sf_n if sf_n else 1.0, nats=nats, chars=int(chars))


# ----------------------------------------------------------------------------- training
def main(argv=None):
    """Train; every UserError ends as one `error: ...` line."""
    try:
        run(argv)
    except UserError as e:
        die(str(e))


def run(argv=None):
    args = parse_args(argv)
    given = {k for k, v in vars(args).items() if v is not None}
    ddp = WORLD > 1
    try:
        device = pick_device(args.device)
    except UserError as e:
        die(str(e))
    device_type = torch.device(device).type
    if device == 'cuda':  # one GPU per torchrun process
        device = f'cuda:{os.environ.get("LOCAL_RANK", 0)}'
    preset_name, preset = ('gpu', GPU_PRESET) if device_type == 'cuda' else ('cpu', CPU_PRESET)

    # --- run directory and checkpoint: settle them before touching anything on disk
    if args.out is None and args.resume:
        die('--resume needs --out, the run directory to continue')
    boundary = args.boundary or COMMON['boundary']
    out_dir = Path(args.out or f'out/{Path(args.data or COMMON["data"]).name}-{boundary}')
    ckpt_path = out_dir / 'ckpt.pt'
    ckpt = None
    if args.resume:
        if not ckpt_path.is_file():
            die(f'--resume but there is no checkpoint at {ckpt_path}')
        try:
            ckpt = read_checkpoint(ckpt_path)
        except UserError as e:
            die(str(e))
        if {'args', 'optimizer', 'scaler', 'step', 'epoch', 'pos', 'rng'} - ckpt.keys():
            die(f'{ckpt_path} lacks the training state to resume from (not written by train.py)')
        for k in KEPT_ON_RESUME:
            if k in given and getattr(args, k) != ckpt['args'].get(k):
                die(f'--{k.replace("_", "-")} {getattr(args, k)} differs from the checkpoint\'s '
                    f'{ckpt["args"].get(k)} (a resumed run keeps its model and data order)')
        for k, v in ckpt['args'].items():  # what was not given now comes from the checkpoint
            if k not in given and k not in ('resume', 'device', 'stop_step'):
                setattr(args, k, v)
    elif ckpt_path.exists():
        die(f'{ckpt_path} already exists; pass --resume to continue it or choose another --out')
    for k, v in {**COMMON, **preset}.items():
        if getattr(args, k) is None:
            setattr(args, k, v)

    # --- check the flags before any work
    try:
        layers = tuple(int(v) for v in str(args.layers).split(','))
    except ValueError:
        layers = ()
    if len(layers) != 3 or min(layers) < 0:
        die(f'--layers must be three counts like 2,8,2, not {args.layers}')

    def bad(k, rule):
        die(f'--{k.replace("_", "-")} must be {rule}, not {getattr(args, k)}')
    for k in ('seq_len', 'batch_size', 'grad_accum', 'max_steps', 'eval_window', 'eval_step', 'eval_interval',
              'eval_batch_size', 'log_interval', 'd_model', 'n_head', 'd_head', 'd_inner',
              'stop_step', 'fixed_factor', 'entropy_window'):  # (the last three may be None: not asked for)
        if getattr(args, k) is not None and getattr(args, k) < 1:
            bad(k, 'at least 1')
    # `not x >= 0` also catches nan. A negative --grad-clip would flip the gradient (gradient ascent) and a
    # negative --eval-max-chars would silently slice from the end; the others would crash with a traceback.
    for k in ('warmup', 'eval_max_chars', 'grad_clip'):
        if not getattr(args, k) >= 0:
            bad(k, 'at least 0')
    if not args.lr > 0:
        bad('lr', 'positive')
    for k in ('dropout', 'dropatt'):
        if not 0 <= getattr(args, k) < 1:
            bad(k, 'in [0, 1)')
    if args.temperature is not None and not args.temperature > 0:
        bad('temperature', 'positive (the Gumbel-sigmoid divides by it)')
    if not 0 <= args.seed < 2**32:
        bad('seed', 'in [0, 2**32) (numpy takes no other seeds)')
    if args.eval_step > args.eval_window:
        die(f'--eval-step {args.eval_step} is larger than --eval-window {args.eval_window}: '
            f'characters between windows would never be scored')
    if args.batch_size % (WORLD * args.grad_accum):
        die(f'--batch-size {args.batch_size} must split evenly over {WORLD} processes x {args.grad_accum} micro-steps')
    if args.amp in ('fp16', 'bf16') and device_type not in ('cuda', 'cpu'):
        die(f'--amp {args.amp} is supported here on cuda and cpu only')
    if args.amp == 'fp16' and device_type != 'cuda':
        die('--amp fp16 needs a CUDA GPU (use bf16 or off on CPU)')

    meta, splits, labels = load_data(args.data, args.boundary)
    if len(splits['train']) < args.batch_size * (args.seq_len + 1):
        die(f'{args.data}/train.bin has {len(splits["train"])} chars, fewer than one batch '
            f'({args.batch_size} x {args.seq_len + 1})')
    for s in ('valid', 'test'):
        if len(splits[s]) < 2:
            die(f'{args.data}/{s}.bin is empty')
    vocab = dict(alphabet=meta['alphabet'], vocab_size=meta['vocab_size'], space_id=meta.get('space_id'))

    model_kw = dict(vocab_size=meta['vocab_size'], d_model=args.d_model, n_head=args.n_head, d_head=args.d_head,
                    d_inner=args.d_inner, dropout=args.dropout, dropatt=args.dropatt, layers=layers,
                    boundary=args.boundary, whitespace_id=meta.get('space_id'), fixed_factor=args.fixed_factor,
                    temperature=args.temperature, prior=args.prior, entropy_window=args.entropy_window)
    try:  # the model checks its own config (e.g. pooling modes need shortened layers)
        cfg = config_from_dict({k: v for k, v in model_kw.items() if v is not None})
    except UserError as e:
        die(str(e))
    if ckpt is not None:
        if ckpt['vocab'] != vocab:
            die(f'checkpoint {ckpt_path} was trained on another vocabulary than {args.data} '
                f'(alphabet {"".join(ckpt["vocab"]["alphabet"])!r} vs {"".join(vocab["alphabet"])!r})')
        if cfg != config_from_dict(ckpt['config']):
            diff = [k for k, v in dataclasses.asdict(cfg).items()
                    if getattr(config_from_dict(ckpt['config']), k) != v]
            die(f'checkpoint {ckpt_path} has another model config than these flags and data ({", ".join(diff)})')

    # --- processes, seeds, precision
    if ddp:
        backend = 'nccl' if device_type == 'cuda' else 'gloo'
        torch.distributed.init_process_group(backend)
        if device_type == 'cuda':
            torch.cuda.set_device(device)
    master = RANK == 0
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)  # same on every rank: identical initial weights
    if device_type == 'cuda':
        torch.backends.cuda.matmul.allow_tf32 = True  # TF32 matmuls: same recipe, much faster on Ampere+
        torch.backends.cudnn.allow_tf32 = True
    amp = args.amp
    if amp == 'auto':
        amp = ('bf16' if torch.cuda.is_bf16_supported() else 'fp16') if device_type == 'cuda' else 'off'
    amp_dtype = {'bf16': torch.bfloat16, 'fp16': torch.float16}.get(amp)
    autocast = torch.autocast(device_type, dtype=amp_dtype) if amp_dtype else nullcontext()
    scaler = torch.amp.GradScaler(device_type, enabled=(amp == 'fp16'))  # fp16 needs loss scaling, bf16 not

    # --- model and optimizer
    model = DynamicPoolingLM(cfg).to(device)
    # fused: one kernel over all parameters, ~3x cheaper than the default on CPU (bench.py --adam)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8, fused=True)
    step, epoch, pos = 0, 0, 0
    if ckpt is not None:
        load_weights(model, ckpt['model'], ckpt_path)
        optimizer.load_state_dict(ckpt['optimizer'])
        scaler.load_state_dict(ckpt['scaler'])
        step, epoch, pos = ckpt['step'], ckpt['epoch'], ckpt['pos']
        torch.set_rng_state(ckpt['rng']['torch'])
        if device_type == 'cuda' and ckpt['rng']['cuda'] is not None:
            torch.cuda.set_rng_state(ckpt['rng']['cuda'], device)
        np.random.set_state(ckpt['rng']['numpy'])
        random.setstate(ckpt['rng']['python'])
    if RANK > 0:  # dropout masks should differ between ranks; rank 0 keeps the saved stream
        torch.manual_seed(args.seed + 1000 * RANK + step)
    raw_model = model  # for evaluation and checkpoints
    micro = args.batch_size // (WORLD * args.grad_accum)
    train, train_labels = splits['train'], (labels['train'] if labels else None)
    n_chunks = len(train) // (args.seq_len + 1)

    def batch_of(offset, ids):
        """(x, targets, boundary labels or None) on the device for the chunk ids."""
        chunk = get_chunks(train, offset, ids, args.seq_len)
        b = None
        if train_labels is not None:  # labels of the input characters
            b = get_chunks(train_labels, offset, ids, args.seq_len)[:, :-1].bool().to(device)
        return chunk[:, :-1].to(device), chunk[:, 1:].to(device), b

    if ddp:
        # In some modes not every parameter gets a gradient (e.g. a predictor that the loss does not reach);
        # DDP must then be told to look for them, which costs a graph traversal per step, so probe first.
        with torch.random.fork_rng(devices=[device] if device_type == 'cuda' else []):
            x, y, b = batch_of(0, np.arange(1))
            with autocast:
                model(x, targets=y, boundaries=b).loss.backward()
        unused = any(p.requires_grad and p.grad is None for p in model.parameters())
        model.zero_grad(set_to_none=True)
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[torch.device(device).index] if device_type == 'cuda' else None,
            find_unused_parameters=unused)
    if args.compile:
        model = torch.compile(model)

    def lr_at(s):
        """Linear warm-up, then one cosine cycle that reaches 0 at --max-steps."""
        if s < args.warmup:
            return args.lr * (s + 1) / args.warmup
        progress = min(1.0, (s - args.warmup) / max(1, args.max_steps - args.warmup))
        return args.lr * 0.5 * (1 + math.cos(math.pi * progress))

    def log(rec):
        if master:
            print(' | '.join(f'{k} {v:.4g}' if isinstance(v, float) else f'{k} {v}' for k, v in rec.items()
                             if v is not None), flush=True)
            with open(out_dir / 'log.jsonl', 'a') as f:
                f.write(json.dumps(rec) + '\n')

    def peak_mem_mb():
        if device_type == 'cuda':
            return torch.cuda.max_memory_allocated(device) / 2**20
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: kilobytes

    def save():
        if not master:
            return
        state = dict(model=raw_model.state_dict(), optimizer=optimizer.state_dict(), scaler=scaler.state_dict(),
                     step=step, epoch=epoch, pos=pos, config=dataclasses.asdict(cfg), vocab=vocab, args=vars(args),
                     schedule=dict(lr=args.lr, warmup=args.warmup, max_steps=args.max_steps),
                     rng=dict(torch=torch.get_rng_state(), numpy=np.random.get_state(), python=random.getstate(),
                              # this process's GPU only: all of them would not restore on a machine with fewer
                              cuda=torch.cuda.get_rng_state(device) if device_type == 'cuda' else None))
        tmp = ckpt_path.with_suffix('.tmp')
        with open(tmp, 'wb') as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename, or a power cut could leave an empty ckpt.pt
        os.replace(tmp, ckpt_path)  # atomic: a crash mid-save never leaves a broken checkpoint

    def kept():
        return f'the last good checkpoint is {ckpt_path}' if ckpt_path.exists() else 'no checkpoint was written yet'

    def run_eval(split):
        tokens = splits[split]
        if args.eval_max_chars:
            tokens = tokens[:args.eval_max_chars + 1]
        r = evaluate(raw_model, tokens, args.eval_window, args.eval_step, args.eval_batch_size, device,
                     autocast, split, RANK, WORLD)
        log(dict(step=step, split=split, bpc=r['bpc'], sf=r['sf'], chars=r['chars']))
        return r

    if master:
        out_dir.mkdir(parents=True, exist_ok=True)
    log(dict(preset=preset_name, device=device, world=WORLD, amp=amp, boundary=args.boundary,
             params=raw_model.num_params(), layers=args.layers, d_model=args.d_model, seq_len=args.seq_len,
             batch_size=args.batch_size, max_steps=args.max_steps, lr=args.lr,
             resumed_from=step if ckpt is not None else None, data=str(args.data), out=str(out_dir)))
    del ckpt

    # --- the loop
    stop = min(args.max_steps, args.stop_step or args.max_steps)
    if step == 0:
        run_eval('valid')
    order_epoch, offset, perm = None, 0, None
    t0, chars_done = time.time(), 0
    model.train()
    while step < stop:
        if pos + args.batch_size > n_chunks:  # not enough chunks left for a full batch: next epoch
            epoch, pos = epoch + 1, 0
        if order_epoch != epoch:
            (offset, perm), order_epoch = epoch_order(len(train), args.seq_len, args.seed, epoch), epoch
        # this step's global batch; this process takes its micro-batches out of it
        ids = perm[pos:pos + args.batch_size].reshape(args.grad_accum, WORLD, micro)
        pos += args.batch_size
        lr = lr_at(step)
        for group in optimizer.param_groups:
            group['lr'] = lr
        stats = torch.zeros(5, dtype=torch.float64, device=device)  # loss, lm_loss, sf, precision, recall
        for m in range(args.grad_accum):
            x, y, b = batch_of(offset, ids[m, RANK])
            # gradients are all-reduced only on the last micro-step
            sync = nullcontext() if not ddp or m == args.grad_accum - 1 else model.no_sync()
            with sync:
                with autocast:
                    out = model(x, targets=y, boundaries=b)
                scaler.scale(out.loss / args.grad_accum).backward()
            stats += torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device).detach() if v is not None
                                  else torch.tensor(float('nan'), dtype=torch.float64, device=device)
                                  for v in (out.loss, out.lm_loss, out.shortening_factor, out.precision, out.recall)])
        if ddp:
            torch.distributed.all_reduce(stats)
        stats = (stats / (args.grad_accum * WORLD)).tolist()
        # Stop before a non-finite loss or gradient reaches the weights, so the last checkpoint stays good.
        if not math.isfinite(stats[0]):
            die(f'non-finite loss ({stats[0]}) at step {step}; stopped, {kept()}')
        scaler.unscale_(optimizer)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip or float('inf'))
        if not scaler.is_enabled() and not torch.isfinite(norm):  # (with fp16 the scaler skips such steps)
            die(f'non-finite gradient at step {step}; stopped, {kept()}')
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        chars_done += args.batch_size * args.seq_len

        if step % args.log_interval == 0 or step == stop:
            dt, t0 = time.time() - t0, time.time()
            nan_none = lambda v: None if math.isnan(v) else v
            log(dict(step=step, loss=stats[0], bpc=stats[1] / math.log(2), sf=nan_none(stats[2]),
                     precision=nan_none(stats[3]), recall=nan_none(stats[4]), chars_per_s=round(chars_done / dt),
                     lr=lr, grad_norm=float(norm), mem_mb=round(peak_mem_mb()), epoch=epoch))
            chars_done = 0
        if step % args.eval_interval == 0 or step == stop:
            if step % args.eval_interval == 0:
                run_eval('valid')
            save()
            t0, chars_done = time.time(), 0  # evaluation time is not training speed

    if step < args.max_steps:
        if master:
            print(f'stopped at step {step} of {args.max_steps}; continue with: '
                  f'python train.py --out {out_dir} --resume', flush=True)
    else:
        r = run_eval('test')
        if master:
            print(f'test bpc {r["bpc"]:.4f} sf {r["sf"]:.2f}', flush=True)
    if ddp:
        torch.distributed.destroy_process_group()


if __name__ == '__main__':
    try:
        main()
    except KeyboardInterrupt:
        die('interrupted; the last checkpoint (if any) is kept, continue with --resume')
