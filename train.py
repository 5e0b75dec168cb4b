"""Train a dynamic-pooling Transformer (Nawrot et al., ACL 2023), a character-level LM.

    python train.py --boundary entropy                        # GPU: the paper's recipe; CPU: small
    python train.py --boundary unigram --data data/wiki40b-fi --out out/fi-unigram
    python train.py --out out/text8-entropy --resume --max-time 540   # 9 more minutes of it
    python train.py --boundary whitespace --flop-budget vanilla:200000  # vanilla's compute
    torchrun --nproc_per_node=8 train.py --boundary whitespace          # DDP over 8 GPUs (NCCL)
    python train.py --import every_k.py --boundary every --every 3      # a source of one's own

A run writes <out>/ckpt.pt and <out>/log.jsonl; the terminal ends with `test bpc <x> sf <y>`
(bpb, bits per byte, where the dataset is bytes).
Exit codes: 0 finished (or stopped by --max-time, --stop-step), 1 a fault or a diverged
run, 2 a bad flag, 75 stopped by SIGTERM or SIGUSR1 (the step in flight finished and
saved: --resume continues it), 130 Ctrl-C.
"""
import dataclasses
import math
import platform
import shlex
import signal
import sys
import time
from collections import namedtuple
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm  # (comes with huggingface_hub)

import checkpoint
import common
import runtime as rt
from checkpoint import (check_resumable, config_from_dict, import_flags, kept, path_flag,
                        restore_training, resume_command, save_checkpoint, training_state)
from common import UserError
import dataset
from dataset import fingerprint, load_data
import dynpool
from dynpool import Config, DynamicPoolingLM
from flags import budget_flops, model_config, resolve_args, save_schedule


def epoch_order(n_chars, seq_len, seed, epoch):
    """Random cyclic shift and chunk order of one epoch, from (seed, epoch) alone."""
    rng = np.random.default_rng([seed, epoch])
    return int(rng.integers(n_chars)), rng.permutation(n_chars // (seq_len + 1))


def get_chunks(stream, offset, chunk_ids, seq_len):
    """Chunks of L+1 characters of the stream rotated by offset → int64 [..., L+1]."""
    idx = (offset + chunk_ids[..., None] * (seq_len + 1) + np.arange(seq_len + 1)) % len(stream)
    return torch.from_numpy(stream[idx].astype(np.int64))


def check_pooling(cfg, tokens, seq_len, data):
    """Refuse a source that the text alone decides (fixed, whitespace) where it closes no
    segment in any training sequence: the model would never pool (whitespace on a DNA
    sequence; fixed k > --seq-len). One that pools rarely (short sequences) still trains."""
    # a sample of 4M characters: read fast, in little memory
    sample = tokens[:1 << 22].astype(np.int64)
    rows = len(sample) // seq_len
    counts = dynpool.count_segments(cfg, sample[:rows * seq_len].reshape(rows, seq_len))
    if counts is not None and rows and counts.sum() == 0:
        raise UserError(f'--boundary {cfg.boundary} closes 0 segments in a sequence of '
                        f'--seq-len {seq_len} of {data}/train.bin: the model would never '
                        'pool; choose another --boundary (or --fixed-factor)', code=2)


# One step's data and the data position after it. x, y (next characters), b (Unigram
# labels or None): [grad_accum, micro, seq_len]; segments: [grad_accum, world, micro]
# where the host counts.
Batch = namedtuple('Batch', 'epoch pos x y b segments', defaults=[None])


def batches(tokens, labels, args, cfg, state, procs):
    """The training stream from the state's (epoch, pos) on: a Batch a step."""
    L = args.seq_len
    epoch = state.epoch
    pos = state.pos
    while True:
        offset, perm = epoch_order(len(tokens), L, args.seed, epoch)
        while pos + args.batch_size <= len(perm):
            # the step's global batch; this process takes its micro-batches out of it
            ids = perm[pos:pos + args.batch_size].reshape(args.grad_accum, procs.world, -1)
            pos += args.batch_size
            chunks = get_chunks(tokens, offset, ids, L)  # [accum, world, micro, L+1]
            chunk = rt.to_device(chunks[:, procs.rank], args.device)  # [accum, micro, L+1]
            b = None
            if labels is not None:
                b = get_chunks(labels, offset, ids[:, procs.rank], L)[..., :-1]
                b = rt.to_device(b, args.device).bool()
            segments = dynpool.count_segments(cfg, chunks[..., :-1])
            if segments is not None:   # (read as numpy: no torch scalar read in the step)
                segments = segments.numpy()
            yield Batch(epoch, pos, chunk[..., :-1], chunk[..., 1:], b, segments)
        # not enough chunks left for a full batch: the next epoch
        epoch += 1
        pos = 0


@dataclasses.dataclass
class RunState:
    """Where the run stands; all but `saved` goes into the checkpoint. The data position
    once `step` steps are done is the epoch and the sequences of it consumed; train_chars,
    train_flops (dynpool.step_flops at each step's SF) and train_time (seconds of
    training, not evaluating or saving) are cumulative over every invocation of the run."""
    step: int = 0
    epoch: int = 0
    pos: int = 0
    train_chars: int = 0
    train_flops: float = 0.0
    train_time: float = 0.0
    warmup_flops: float | None = None  # --flop-budget: train_flops when warm-up ended
    saved: int | None = None           # the step of the checkpoint on disk


@dataclasses.dataclass
class Trainer:
    """What the steps, evaluations and saves of one process work with."""
    args: Any
    cfg: Config
    model: torch.nn.Module            # what trains: compiled and DDP-wrapped where asked
    raw_model: DynamicPoolingLM       # the bare model: evaluated and saved
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    stats: rt.StepStats
    autocast: Any = nullcontext()
    procs: rt.Processes = rt.Processes()
    state: RunState = dataclasses.field(default_factory=RunState)
    logger: rt.Logger | None = None
    data_identity: dict | None = None  # the vocabulary and the data's fingerprint
    # the key of the bits per token in records and terminal lines: dataset.BITS
    bits: str | None = None
    stop: list = dataclasses.field(default_factory=list)  # the stop signals received
    eval_rate: float | None = None    # seconds a character took at the last evaluation
    eval_chars: tuple = (0, 0)        # characters a validation, the final evaluation score

    def say(self, line):
        """A line for the user (rank 0 only)."""
        if self.procs.rank == 0:
            print(line, flush=True)


def totals(state):
    """The training so far, as log records give it: characters, FLOPs, seconds."""
    return dict(train_chars=state.train_chars, train_flops=state.train_flops,
                train_time=round(state.train_time, 3))


def reseed_rank(seed, rank, step):
    """Only rank 0's random state is saved: the others (their own dropout and Gumbel
    noise) restart their streams at every checkpoint's step, as a resumed run does, so
    DDP resumes bit-exactly."""
    if rank > 0:
        torch.manual_seed(seed + 1000 * rank + step)


def finished(state, args):
    """The run at its end: checkpoint.finished, the rule sample.py reads too."""
    return checkpoint.finished(state.step, state.train_flops, vars(args))


def lr_at(step, args, state):
    """Linear warm-up, then one cosine cycle to 0 at --max-steps; with --flop-budget,
    progress is the share of the FLOPs after warm-up spent (the same where every step
    costs the same)."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.max_steps - args.warmup)
    if args.flop_budget:
        spent = state.train_flops - state.warmup_flops
        progress = spent / max(1.0, args.flop_budget - state.warmup_flops)
    return args.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def train_step(trainer, batch):
    """Forward and backward over the micro-batches, clipping, an Adam step that the
    device skips where the loss or the gradient is not finite. Nothing here waits for
    the device."""
    args = trainer.args
    model = trainer.model
    optimizer = trainer.optimizer
    scaler = trainer.scaler
    losses = 0   # the micro-steps' losses summed: finite where every one is
    for m in range(args.grad_accum):
        # gradients all-reduced on the last micro-step only (DDP's no_sync)
        sync = nullcontext()
        if trainer.procs.world > 1 and m < args.grad_accum - 1:
            sync = model.no_sync()
        known = {}  # S, the segments a row, where the host counted them: no device read
        if batch.segments is not None:
            known['n_segments'] = int(batch.segments[m, trainer.procs.rank].max())
        if batch.b is not None:
            known['boundaries'] = batch.b[m]
        with sync:
            with trainer.autocast:
                out = model(batch.x[m], targets=batch.y[m], **known)
            scaler.scale(out.loss / args.grad_accum).backward()
        trainer.stats.add_micro(out)
        losses = losses + out.loss.detach()
    finite = torch.isfinite(losses)
    scaler.unscale_(optimizer)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip or float('inf'))
    if scaler.is_enabled():  # fp16: the scaler skips a step whose gradients overflowed
        scaler.step(optimizer)
        scaler.update()
    else:
        # the fused Adam skips the step where found_inf is set, unread by the host:
        # GradScaler's protocol (grad_scale None: nothing to unscale)
        finite = finite & torch.isfinite(norm)
        optimizer.found_inf = (~finite).float()
        optimizer.grad_scale = None
        optimizer.step()
        del optimizer.found_inf, optimizer.grad_scale
    optimizer.zero_grad(set_to_none=True)
    trainer.stats.add_step(norm, ~finite, batch.segments)


def eval_windows(n, window, step):
    """Windows (start, end, first_scored) over n positions: the first scores all its
    positions, each later one its last `step` (>= window-step of context), a last one
    ending at n the tail."""
    if n <= window:
        return [(0, n, 0)]
    wins = [(0, window, 0)]
    wins += [(s, s + window, s + window - step) for s in range(step, n - window + 1, step)]
    if wins[-1][1] < n:
        wins.append((n - window, n, wins[-1][1]))
    return wins


# The released code's evaluation: its test split in 16 columns, the first 500 batches
RELEASED_COLUMNS = 16
RELEASED_BATCHES = 500


def released_windows(n_tokens, window, step):
    """The released code's evaluation of n_tokens tokens → its batches of windows (start,
    end, first_scored): the tokens cut into 16 equal columns (the rest dropped), batch i
    scoring each column's i-th `step` targets after up to window - step tokens of the
    column's own context (so each column starts cold), its first 500 batches."""
    rows = n_tokens // RELEASED_COLUMNS
    groups = []
    for i in range(0, rows - 1, step)[:RELEASED_BATCHES]:
        start = max(0, i - (window - step))
        end = min(i + step, rows - 1)
        groups.append([(c * rows + start, c * rows + end, c * rows + i)
                       for c in range(RELEASED_COLUMNS)])
    return groups


def eval_batches(n_tokens, args, protocol, max_chars=0):
    """The batches of windows that evaluate the first max_chars characters (0: all) of a
    split of n_tokens: --eval-protocol whole scores every target once in one stream
    (eval_windows), released as the released code does (released_windows)."""
    if max_chars:
        n_tokens = min(n_tokens, max_chars + 1)
    if protocol == 'released':
        return released_windows(n_tokens, args.eval_window, args.eval_step)
    windows = eval_windows(n_tokens - 1, args.eval_window, args.eval_step)
    size = args.eval_batch_size
    return [windows[i:i + size] for i in range(0, len(windows), size)]


def scored_chars(groups):
    """The targets a list of batches of windows scores."""
    return sum(end - first for group in groups for _, end, first in group)


@torch.inference_mode()
def evaluate(model, tokens, groups, device, autocast=nullcontext(), procs=rt.Processes(),
             desc='evaluating', stop=()):
    """BPC over batches of windows (start, end, first_scored), all of a batch alike long,
    and the mean SF; one device read. A progress bar on stderr where it is a terminal
    (rank 0). A stop signal ends it at a batch's end (rt.Stopped)."""
    was_training = model.training
    model.eval()
    # the sums of nats and of SFs (a window each; none where nothing pools)
    sums = torch.zeros(2, dtype=rt.sum_dtype(device), device=device)
    # rounds of a batch a process, this process's the rank-th of each: as many rounds on
    # every process, which check the stop signals together
    rounds = range(0, len(groups), procs.world)
    for i in tqdm(rounds, desc=desc, leave=False, disable=None if procs.rank == 0 else True):
        rt.check_stop(stop, procs, device)
        if i + procs.rank >= len(groups):
            continue
        starts, ends, firsts = np.array(groups[i + procs.rank]).T
        width = ends[0] - starts[0]
        # [windows, W+1], read from the memmap once
        chunk = torch.from_numpy(tokens[starts[:, None] + np.arange(width + 1)].astype(np.int64))
        x = chunk[:, :-1]
        # the targets before a window's first scored one are its context: -100, which
        # cross_entropy ignores (whatever the logits there, inf or nan too)
        context = torch.arange(width) < torch.from_numpy(firsts - starts)[:, None]
        y = chunk[:, 1:].masked_fill(context, -100)
        known = {}  # S where the host counts it: no device read
        counts = dynpool.count_segments(model.cfg, x)
        if counts is not None:
            known['n_segments'] = int(counts.max())
        with autocast:
            out = model(rt.to_device(x, device), **known)
        logits = out.logits.float().transpose(1, 2)
        sums[0] += F.cross_entropy(logits, rt.to_device(y, device), reduction='sum')
        if out.shortening_factor is not None:
            sums[1] += out.shortening_factor * len(starts)
    if procs.world > 1:
        torch.distributed.all_reduce(sums)
    nats, sf_sum = sums.tolist()
    model.train(was_training)
    chars = scored_chars(groups)   # (known on the host: every process's)
    scores = dict(bpc=nats / max(chars, 1) / math.log(2), sf=1.0, chars=chars)
    if sf_sum:
        scores['sf'] = sf_sum / sum(map(len, groups))
    return scores


def eval_and_log(trainer, splits, split, max_chars):
    """A split's first max_chars characters (0: all) evaluated, logged, shown → the record.
    Where no progress bar shows (stderr is not a terminal) a line says what it evaluates
    and how long that takes at the last evaluation's speed."""
    args = trainer.args
    state = trainer.state
    groups = eval_batches(len(splits[split]), args, args.eval_protocol, max_chars)
    where = f'step {state.step} | {split}'
    chars = scored_chars(groups)
    if not sys.stderr.isatty():
        line = f'{where}: evaluating {chars:,} chars'
        if trainer.eval_rate is not None:
            line += f' in about {timedelta(seconds=round(trainer.eval_rate * chars))}'
        trainer.say(line)
    started = time.monotonic()
    rt.peak_mem_mb(args.device)  # (a reset: mem_mb is the evaluation's peak)
    scores = evaluate(trainer.raw_model, splits[split], groups, args.device, trainer.autocast,
                      trainer.procs, where, trainer.stop)
    seconds = time.monotonic() - started
    trainer.eval_rate = seconds / max(chars, 1)
    subset = chars < len(splits[split]) - 1
    bits = trainer.bits
    rec = dict(kind='eval', step=state.step, split=split, **{bits: scores['bpc']},
               sf=scores['sf'], eval_chars=chars, subset=subset, **totals(state),
               mem_mb=round(rt.peak_mem_mb(args.device)))
    trainer.logger.log(rec)
    line = f'{where} {bits} {scores["bpc"]:.4f} | sf {scores["sf"]:.2f} | {chars:,} chars'
    if subset:
        line += ' (a subset)'
    trainer.say(f'{line} | {seconds:.1f}s')
    if not math.isfinite(scores['bpc']):
        diverged(trainer, f'non-finite {split} {bits} {scores["bpc"]}')
    return rec


def diverged(trainer, what):
    """Stop a run whose loss or validation is not finite, before it saves: log it, and
    say how to go on from the last finite checkpoint at a lower learning rate."""
    state = trainer.state
    trainer.logger.log(dict(kind='diverged', diverged=True, step=state.step, why=what,
                      checkpoint_step=state.saved))
    left = kept(Path(trainer.args.out) / 'ckpt.pt', state.saved, trainer.args.imports,
                '--lr', f'{trainer.args.lr / 10:g}')
    raise UserError(f'the run diverged at step {state.step} ({what}); {left}')


def identify_data(meta, splits, data):
    """What a checkpoint records of its data: the vocabulary with its encoding and cleaning
    (sample.py encodes a prompt as the data was) and the data's path and fingerprint."""
    vocab = {k: meta.get(k) for k in ('alphabet', 'vocab_size', 'space_id')}
    vocab['encoding'] = meta.get('encoding', 'paper')
    vocab['cleaning'] = {'lang': (meta.get('cleaning') or {}).get('lang')}
    path = str(Path(data).resolve())   # (a resume may start in another folder)
    return dict(vocab=vocab, dataset=dict(path=path, fingerprint=fingerprint(splits)))


def run(argv, procs):
    """Check flags, data and model before anything is written; lock the run folder,
    train, test → the exit code (75: stopped by a signal, to be resumed)."""
    args, ckpt = resolve_args(argv, procs)
    args.threads = rt.setup_device(args.device, args.threads)  # (the config record's)
    if ckpt and args.data == ckpt['args']['data'] and not Path(args.data).exists():
        # a resume from another working directory: the data where the run found it
        args.data = ckpt['dataset']['path']
    meta, splits, labels = load_data(args.data, args.boundary, args.unigram)
    data_identity = identify_data(meta, splits, args.data)
    state = RunState()
    if ckpt:
        # first: data remade from another text is refused as such, not by a check of it
        check_resumable(ckpt, data_identity, args.data)
        counters = {k: ckpt[k] for k in vars(state) if k != 'saved'}
        state = RunState(**counters, saved=ckpt['step'])
    cfg = model_config(args, meta, procs.world)
    if ckpt:
        check_recipe(ckpt, args, cfg, procs.rank)
    # --flop-budget vanilla:N becomes FLOPs here, once, before anything reads it
    if args.flop_budget:
        args.flop_budget = budget_flops(args.flop_budget, cfg, args.batch_size, args.seq_len)
    amp, autocast, scaler = rt.setup_precision(args.amp, torch.device(args.device).type)
    sizes = {s: len(ids) for s, ids in splits.items()}   # (too few: the stream would hang)
    if why := dataset.split_problem(sizes, args.batch_size, args.seq_len):
        raise UserError(f'{args.data}: {why}')
    check_pooling(cfg, splits['train'], args.seq_len, args.data)
    rt.check_model_memory(cfg, args.device)
    out = Path(args.out)

    def interrupted():
        left = kept(out / 'ckpt.pt', state.saved, args.imports)
        return f'interrupted at step {state.step}; {left}'
    with rt.run_guard(out, procs, interrupted) as stop:
        rt.start_processes(args.device, procs)
        torch.manual_seed(args.seed)  # same on every rank: identical initial weights
        model = DynamicPoolingLM(cfg).to(args.device)
        # fused: one kernel over all parameters, which can also skip a step on the device
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, fused=True)
        if ckpt:
            restore_training(ckpt, model, optimizer, scaler, args.device)
        reseed_rank(args.seed, procs.rank, state.step)
        trainer = Trainer(args=args, cfg=cfg, model=rt.wrap_model(model, args, procs.world),
                          raw_model=model, optimizer=optimizer, scaler=scaler,
                          stats=rt.StepStats(cfg, args, procs.world), autocast=autocast,
                          procs=procs, state=state, data_identity=data_identity,
                          bits=dataset.BITS[dataset.unit(meta)], stop=stop)
        start_log(trainer, amp)
        return train_and_test(trainer, splits, labels)


def train_and_test(trainer, splits, labels):
    """Train, then evaluate the whole validation and test splits → the exit code. A stop
    before the end (a signal, --max-time, --stop-step) keeps a checkpoint of the last
    step done and says how to continue; exit code 75 where a signal stopped it."""
    args = trainer.args
    state = trainer.state

    def chars(split, max_chars):
        return scored_chars(eval_batches(len(splits[split]), args, args.eval_protocol, max_chars))
    # for the ETA: the characters a validation, and the final evaluation, score
    final = chars('valid', args.eval_max_chars) + chars('test', args.eval_max_chars)
    trainer.eval_chars = (chars('valid', args.eval_subset_chars), final)
    try:
        why = train(trainer, splits, labels)
        if not why:
            eval_and_log(trainer, splits, 'valid', args.eval_max_chars)
            test_record = eval_and_log(trainer, splits, 'test', args.eval_max_chars)
    except rt.Stopped:
        if not trainer.stop:   # (under DDP, another process's signal)
            trainer.stop.append('a stop signal')
        why = f'{trainer.stop[0]}: stopped to be resumed'
        if state.saved != state.step:
            save_training(trainer)
    out = Path(args.out)
    if why:
        # a clean stop to be resumed, told apart from a crash by report.py
        trainer.logger.log(dict(kind='stopped', step=state.step, why=why))
        total = args.max_steps
        if args.flop_budget:
            total = f'{args.flop_budget:.3g} FLOPs'
        trainer.say(f'stopped at step {state.step} of {total} ({why}); continue with: '
                    f'{resume_command(out, args.imports)}')
        return rt.EXIT_PREEMPTED if trainer.stop else 0
    sample = shlex.join(['python', 'sample.py', *import_flags(args.imports),
                         *path_flag('--ckpt', args.out)])
    trainer.say(f'checkpoint {out / "ckpt.pt"}, log {out / "log.jsonl"}; sample with: {sample}')
    test_bits = test_record[trainer.bits]
    trainer.say(f'test {trainer.bits} {test_bits:.4f} sf {test_record["sf"]:.2f}')
    return 0


def check_recipe(ckpt, args, cfg, rank):
    """A resumed run's model is the checkpoint's: refuse one whose config does not match
    the flags it was saved with (an edited file), naming a field; a note on stderr for
    each flag of the optimisation recipe that a resume changes."""
    saved = vars(config_from_dict(ckpt['config']))
    for name, ours in vars(cfg).items():
        if ours != saved[name]:
            raise UserError(f'checkpoint {ckpt["path"]}: its config has {name} {saved[name]}, '
                            f'its flags {ours}: damaged or edited; use another copy')
    for k in ('lr', 'warmup', 'grad_clip'):
        then = ckpt['args'].get(k)
        if rank == 0 and getattr(args, k) != then:
            print(f'note: --{k.replace("_", "-")} {getattr(args, k)} differs from the '
                  f"checkpoint's {then}: the resumed run continues with it", file=sys.stderr)


def start_log(trainer, amp):
    """The run's first line and config record (run_id: its identity); trainer.logger."""
    args = trainer.args
    saved = trainer.state.saved
    params = trainer.raw_model.num_params()
    line = f'{args.boundary} on {args.data} -> {args.out}'
    if saved is not None:
        line += f' (resumed at step {saved})'
    layers = ','.join(map(str, args.layers))
    trainer.say(f'{line}: {params / 1e6:.2f}M parameters, layers {layers}, {args.device}, '
                f'amp {amp}, {trainer.procs.world} process(es)')
    device_name = platform.machine()   # (a CPU's: its architecture)
    if args.device.startswith('cuda'):
        device_name = torch.cuda.get_device_name(args.device)
    vocab = trainer.data_identity['vocab']
    config = {'kind': 'config', **vars(args), 'amp': amp, 'params': params,
              'world': trainer.procs.world, 'device_name': device_name,
              'torch': torch.__version__, 'resumed_from': saved, 'encoding': vocab['encoding'],
              'unit': dataset.unit(vocab)}
    trainer.logger = rt.Logger(Path(args.out), args, config, trainer.procs.rank, saved)


def train(trainer, splits, labels):
    """Steps, records, validations, saves → why the run stopped early, None at its end."""
    args = trainer.args
    state = trainer.state
    procs = trainer.procs
    stop = min(args.max_steps, args.stop_step or args.max_steps)
    why = None
    save_steps, save_seconds = save_schedule(args.save_interval)
    stream = batches(splits['train'], labels and labels['train'], args, trainer.cfg, state, procs)
    started = time.monotonic()
    if state.step == 0:
        eval_and_log(trainer, splits, 'valid', args.eval_subset_chars)
    batch = next(stream)
    first = dataclasses.replace(state)  # this invocation's start
    # the clock and step of the last record, the training time of the last save
    last_clock = time.monotonic()
    last_step = state.step
    saved_time = state.train_time
    trainer.model.train()
    while state.step < stop and not finished(state, args):
        lr = advance(trainer, batch)
        batch = next(stream)  # cut and copied on the host while the device runs the step
        if args.flop_budget:  # each step (else at a record: no wait)
            state.train_flops += trainer.stats.take_step_flops()
        end = state.step >= stop or finished(state, args)
        validate = state.step % args.eval_interval == 0 or end
        save = validate or (save_steps and state.step % save_steps == 0)
        # a signal ends the step in flight (rt.Stopped); with DDP, all ranks agree at a record
        if state.step % args.log_interval == 0 or save or (trainer.stop and procs.world == 1):
            clock = time.monotonic()
            late = args.max_time is not None and clock - started >= args.max_time
            # the training since the last save
            unsaved = state.train_time + clock - last_clock - saved_time
            due = save_seconds is not None and unsaved >= save_seconds
            stats = trainer.stats.read(late, due)
            now = time.monotonic()
            state.train_time += now - last_clock
            log_train(trainer, stats, lr, state.step - last_step, now - last_clock, stop, first)
            last_clock = now
            last_step = state.step
            rt.check_stop(trainer.stop, procs, args.device)
            save = save or stats['save']
            if stats['late'] and not end:
                stop = state.step
                save = validate = True
                why = f'--max-time {args.max_time:g}s'
        if not save:
            continue
        if validate and not finished(state, args):  # (a finished one: in full, later)
            eval_and_log(trainer, splits, 'valid', args.eval_subset_chars)
        save_training(trainer)
        saved_time = state.train_time
        last_clock = time.monotonic()  # evaluating, saving: not training time
        rt.check_stop(trainer.stop, procs, args.device)
    if finished(state, args):
        return None
    return why or f'--stop-step {args.stop_step}'


def advance(trainer, batch):
    """An optimizer step on the batch at the schedule's learning rate → the rate."""
    args = trainer.args
    state = trainer.state
    # --flop-budget: the cosine decays over the FLOPs spent from the end of warm-up on
    if args.flop_budget and state.step >= args.warmup and state.warmup_flops is None:
        state.warmup_flops = state.train_flops
    lr = lr_at(state.step, args, state)
    for group in trainer.optimizer.param_groups:
        group['lr'] = lr
    train_step(trainer, batch)
    state.step += 1
    state.epoch = batch.epoch
    state.pos = batch.pos
    state.train_chars += args.batch_size * args.seq_len
    return lr


def save_training(trainer):
    """The checkpoint of the run's state, written whole (Ctrl-C waits for it)."""
    state = trainer.state
    with rt.interrupts_deferred():  # the checkpoint and the step it holds, together
        if trainer.procs.rank == 0:
            counters = {k: v for k, v in vars(state).items() if k != 'saved'}
            training = training_state(trainer.raw_model, trainer.optimizer, trainer.scaler,
                                      counters, trainer.cfg, trainer.data_identity, trainer.args)
            save_checkpoint(Path(trainer.args.out) / 'ckpt.pt', training, state.saved)
        state.saved = state.step
        reseed_rank(trainer.args.seed, trainer.procs.rank, state.step)  # as a resumed run would


def log_train(trainer, stats, lr, steps, dt, stop, first):
    """The statistics (stats) of the `steps` steps in `dt` seconds since the last record:
    a run that skipped a step stopped as diverged; their FLOPs counted (without
    --flop-budget: the steps' own); a train record and its line, with the ETA of the whole
    run (eta)."""
    args = trainer.args
    state = trainer.state
    if stats['bad']:
        where = f'a step in {state.step - steps + 1}..{state.step}'
        diverged(trainer, f'non-finite loss or gradient at {where}, skipped: the weights '
                          'stayed finite')
    if not args.flop_budget:
        state.train_flops += stats['flops']
    speed = steps * args.batch_size * args.seq_len / dt
    bits = stats['lm_loss'] / math.log(2)   # the language model's bits per token
    mem_mb = round(rt.peak_mem_mb(args.device))
    trainer.logger.log(dict(kind='train', step=state.step, **totals(state),
                            loss=stats['loss'], **{trainer.bits: bits}, sf=stats['sf'],
                            precision=stats['precision'], recall=stats['recall'],
                            chars_per_s=round(speed), lr=lr, grad_norm=stats['grad_norm'],
                            mem_mb=mem_mb, epoch=state.epoch))
    where = f'{state.step}/{stop}'
    if args.flop_budget:
        where = f'{state.step} | {state.train_flops:.3g}/{args.flop_budget:.3g} FLOPs'
    trainer.say(f'step {where} | loss {stats["loss"]:.3f} | {trainer.bits} {bits:.3f} | '
                f'sf {stats["sf"]:.2f} | {1000 * dt / steps:.0f} ms/step | {speed:,.0f} chars/s | '
                f'ETA {eta(trainer, first)}')


def eta(trainer, first):
    """The time to the run's end: the steps (or FLOPs) left at the rate of those done since
    `first`, the RunState where this invocation started, then the validations left and the
    final evaluation at the last evaluation's speed."""
    args = trainer.args
    state = trainer.state
    done = max(state.step - first.step, 1)
    left = (args.max_steps - state.step) / done   # (in units of the steps done)
    if args.flop_budget:
        spent = state.train_flops - first.train_flops
        left = (args.flop_budget - state.train_flops) / max(spent, 1)
    left = max(left, 0)
    end = state.step + round(left * done)
    validations = max(0, (end - 1) // args.eval_interval - state.step // args.eval_interval)
    validation, final = trainer.eval_chars
    seconds = left * (state.train_time - first.train_time)
    seconds += (trainer.eval_rate or 0) * (validations * validation + final)
    return timedelta(seconds=round(seconds))


def main(argv=None):
    """Train → the exit code; a mistake or fault: one `error: ...` line (from rank 0)."""
    procs = rt.Processes.of_torchrun()
    ctrl_c = signal.getsignal(signal.SIGINT)
    # (argv None: the command line's, as argparse reads it)
    code = common.main(lambda: run(argv, procs), procs.rank)
    # ignored once a run was interrupted: a second Ctrl-C while the process ends would
    # break into torch's exit handlers; an in-process caller gets its handler back else
    if code != 130:
        signal.signal(signal.SIGINT, ctrl_c)
    return code


if __name__ == '__main__':
    sys.exit(main())
