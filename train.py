"""Train a dynamic-pooling Transformer (Nawrot et al., ACL 2023), a character-level LM.

    python train.py --boundary entropy                        # GPU: the paper's recipe; CPU: small
    python train.py --boundary unigram --data data/wiki40b-fi --out out/fi-unigram
    python train.py --out out/text8-entropy --resume --max-time 540   # 9 more minutes of it
    python train.py --boundary whitespace --flop-budget vanilla:200000  # vanilla's compute
    torchrun --nproc_per_node=8 train.py --boundary whitespace          # DDP over 8 GPUs (NCCL)

A run writes <out>/ckpt.pt and <out>/log.jsonl; the terminal ends with `test bpc <x> sf <y>`.
"""
import dataclasses
import math
import platform
import shlex
import sys
import time
from collections import namedtuple
from contextlib import closing, nullcontext
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

import common
import hnet  # noqa: F401  (registers boundary='hnet' before BOUNDARY_MODES is read)
import runtime as rt
from checkpoint import (check_resumable, kept, restore_training, save_checkpoint,
                        training_state)
from common import UserError
from dataset import fingerprint, load_data
from dynpool import DynamicPoolingLM
from presets import model_config, resolve_args


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


# One step's data and the data position after it. x, y (next characters), b (Unigram labels or
# None): [grad_accum, micro, seq_len]; segments: [grad_accum, world, micro] where the host counts.
Batch = namedtuple('Batch', 'epoch pos x y b segments', defaults=[None])


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


@dataclasses.dataclass
class RunState:
    """Where the run stands; all but `saved` goes into the checkpoint."""
    step: int = 0
    epoch: int = 0                        # the data position once `step` steps are done: the
    pos: int = 0                          # epoch, and the sequences of it consumed
    train_chars: int = 0                  # cumulative over every invocation of the run, as are
    train_flops: float = 0.0              # the FLOPs (dynpool.step_flops at each step's SF) and
    train_time: float = 0.0               # the seconds of training (not evaluating, saving)
    warmup_flops: Optional[float] = None  # --flop-budget: train_flops when warm-up ended
    saved: Optional[int] = None           # the step of the checkpoint on disk


def reseed_rank(seed, rank, step):
    """Only rank 0's random state is saved: the others (their own dropout and Gumbel noise) restart
    their streams at every checkpoint's step, as a resumed run does, so DDP resumes bit-exactly."""
    if rank > 0:
        torch.manual_seed(seed + 1000 * rank + step)


def finished(state, args):
    """--max-steps done, or the first step whose FLOPs reach the --flop-budget."""
    spent = args.flop_budget is not None and state.train_flops >= args.flop_budget * (1 - 1e-9)
    return state.step >= args.max_steps or spent


def lr_at(step, args, state):
    """Linear warm-up, then one cosine cycle to 0 at --max-steps; with --flop-budget, progress is
    the share of the FLOPs after warm-up spent (the same where every step costs the same)."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    if args.flop_budget is None:
        progress = (step - args.warmup) / max(1, args.max_steps - args.warmup)
    else:
        spent, left = state.train_flops - state.warmup_flops, args.flop_budget - state.warmup_flops
        progress = spent / max(1.0, left)
    return args.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def train_step(t, batch, args):
    """Forward and backward over the micro-batches, clipping, an Adam step that the device skips
    where the loss or the gradient is not finite. Nothing here waits for the device."""
    finite = torch.ones((), dtype=torch.bool, device=batch.x.device)
    for m in range(args.grad_accum):
        # gradients all-reduced on the last micro-step; S, segments a row, known: no device read
        sync = t.model.no_sync() if t.procs.world > 1 and m < args.grad_accum - 1 else nullcontext()
        segments = None if batch.segments is None else batch.segments[m, t.procs.rank]
        known = {} if segments is None else dict(n_segments=int(segments.max()))
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


def eval_windows(n, window, step):
    """Windows (start, end, first_scored) over n positions: the first scores all its positions,
    each later one its last `step` (>= window-step of context), a last one ending at n the tail."""
    if n <= window:
        return [(0, n, 0)]
    wins = [(0, window, 0)] + [(s, s + window, s + window - step)
                               for s in range(step, n - window + 1, step)]
    return wins + ([(n - window, n, wins[-1][1])] if wins[-1][1] < n else [])


@torch.inference_mode()
def evaluate(model, tokens, window, step, batch_size, device, autocast=nullcontext(),
             procs=rt.Processes()):
    """BPC over overlapping windows, the mean SF and a predictor's mean p; one device read."""
    wins = eval_windows(len(tokens) - 1, window, step)[procs.rank::procs.world]  # this one's share
    was_training = model.training
    model.eval()
    sums = torch.zeros(5, dtype=rt.sum_dtype(device), device=device)  # nats, chars, SF sum, n, p
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
    if procs.world > 1:
        torch.distributed.all_reduce(sums)
    nats, chars, sf_sum, sf_n, p_sum = sums.tolist()
    model.train(was_training)
    return dict(bpc=nats / max(chars, 1) / math.log(2), sf=sf_sum / sf_n if sf_n else 1.0,
                chars=int(chars), boundary_p=p_sum / max(chars, 1) if
                hasattr(model.source, 'predictor') else None)


def eval_and_log(t, args, splits, split, max_chars, state):
    """Evaluate the first max_chars characters of a split (0: all); log and show it → the record."""
    tokens, t0 = splits[split][:max_chars + 1] if max_chars else splits[split], time.time()
    rt.peak_mem_mb(args.device)  # (a reset: mem_mb is the evaluation's peak)
    r = evaluate(t.raw_model, tokens, args.eval_window, args.eval_step, args.eval_batch_size,
                 args.device, t.autocast, t.procs)
    p, subset = r['boundary_p'], len(tokens) < len(splits[split])
    rec = dict(kind='eval', step=state.step, split=split, bpc=r['bpc'], sf=r['sf'], boundary_p=p,
               eval_chars=r['chars'], subset=subset, train_chars=state.train_chars,
               train_flops=state.train_flops, train_time=round(state.train_time, 3),
               mem_mb=round(rt.peak_mem_mb(args.device)))
    t.logger.log(rec)
    t.say(f'step {state.step} | {split} bpc {r["bpc"]:.4f} | sf {r["sf"]:.2f} | '
          + ('' if p is None else f'mean p {p:.3f} | ') + f'{r["chars"]:,} chars'
          + f'{" (a subset)" if subset else ""} | {time.time() - t0:.1f}s')
    return rec


def run(argv, procs):
    """Check flags, data and model before anything is written; lock the run folder, train, test."""
    started = time.time()
    args, ckpt = resolve_args(argv, procs)
    meta, splits, labels = load_data(args.data, args.boundary, args.unigram)
    cleaning = {k: (meta.get('cleaning') or {}).get(k) for k in ('lang', 'fold_accents')}
    source = dict(vocab={**{k: meta.get(k) for k in ('alphabet', 'vocab_size', 'space_id')},
                         'cleaning': cleaning},   # sample.py cleans a prompt as the data was
                  dataset=dict(path=args.data, fingerprint=fingerprint(splits)))
    cfg = model_config(args, meta, procs.world)
    amp, autocast, scaler = rt.setup_precision(args.amp, torch.device(args.device).type)
    if len(splits['train']) < args.batch_size * (args.seq_len + 1):  # (the stream would hang)
        raise UserError(f'{args.data}/train.bin has {len(splits["train"])} chars, fewer than one '
                        f'batch ({args.batch_size} x {args.seq_len + 1})')
    state = RunState()
    if ckpt is not None:
        state = RunState(**{k: ckpt[k] for k in vars(state) if ckpt.get(k) is not None},
                         saved=ckpt['step'])  # (counters a checkpoint lacks or has null: from 0)
        check_resumable(ckpt, cfg, source, args.data)
    rt.check_model_memory(cfg, args.device)
    say = (lambda line: print(line, flush=True)) if procs.rank == 0 else (lambda line: None)
    with rt.run_guard(Path(args.out), procs, lambda: f'interrupted at step {state.step}; '
                      f'{kept(Path(args.out) / "ckpt.pt", state.saved)}'):
        rt.start_processes(args.device, procs)
        torch.manual_seed(args.seed)  # same on every rank: identical initial weights
        model = DynamicPoolingLM(cfg).to(args.device)
        # fused: one kernel over all parameters, which can also skip a step on the device
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, fused=True)
        if ckpt is not None:
            restore_training(ckpt, model, optimizer, scaler, args.device)
        reseed_rank(args.seed, procs.rank, state.step)
        params = model.num_params()
        say(f'{args.boundary} on {args.data} -> {args.out}' + ('' if ckpt is None else
            f' (resumed at step {state.step})') + f': {params / 1e6:.2f}M parameters, layers '
            f'{args.layers}, {args.device}, amp {amp}, {procs.world} process(es)')
        gpu = args.device.startswith('cuda') and torch.cuda.get_device_name(args.device)
        config = dict(kind='config', **{**vars(args), 'amp': amp}, params=params, world=procs.world,
                      device_name=gpu or platform.machine(), torch=torch.__version__,
                      resumed_from=state.saved)
        logger = rt.Logger(Path(args.out), args, config, procs.rank, state.saved)
        t = SimpleNamespace(model=rt.wrap_model(model, args, procs.world), raw_model=model,
                            optimizer=optimizer, scaler=scaler, autocast=autocast, procs=procs,
                            stats=rt.StepStats(cfg, args, procs.world), logger=logger, say=say)
        with closing(logger):
            why = train(args, cfg, source, splits, labels, state, t, started)
            if why is not None:
                total = f'{args.flop_budget:.3g} FLOPs' if args.flop_budget else args.max_steps
                return say(f'stopped at step {state.step} of {total} ({why}); continue with: '
                           f'python train.py --out {shlex.quote(args.out)} --resume')
            eval_and_log(t, args, splits, 'valid', args.eval_max_chars, state)
            r = eval_and_log(t, args, splits, 'test', args.eval_max_chars, state)
    out = shlex.quote(args.out)
    say(f'checkpoint {out}/ckpt.pt, log {out}/log.jsonl; sample with: python sample.py --ckpt '
        f'{out}\ntest bpc {r["bpc"]:.4f} sf {r["sf"]:.2f}')


def train(args, cfg, source, splits, labels, state, t, started):
    """Steps, train records, validations, checkpoints → why the run stopped early, or None."""
    stop, why = min(args.max_steps, args.stop_step or args.max_steps), None
    budget = args.flop_budget is not None
    stream = batches(splits['train'], labels and labels['train'], args, cfg, state, t.procs)
    if state.step == 0:
        eval_and_log(t, args, splits, 'valid', args.eval_subset_chars, state)
    batch = next(stream)
    last, last_step = time.time(), state.step  # training time: not evaluating, not saving
    t.model.train()
    while state.step < stop and not finished(state, args):
        if budget and state.step >= args.warmup and state.warmup_flops is None:
            state.warmup_flops = state.train_flops  # the cosine decays over the FLOPs from here
        lr = lr_at(state.step, args, state)
        for group in t.optimizer.param_groups:
            group['lr'] = lr
        train_step(t, batch, args)
        state.step, state.epoch, state.pos = state.step + 1, batch.epoch, batch.pos
        state.train_chars += args.batch_size * args.seq_len
        batch = next(stream)  # cut and copied on the host while the device runs the step
        if budget:  # counted each step (without a budget, at each record: no wait for the device)
            state.train_flops += t.stats.take_step_flops()
        end = state.step >= stop or finished(state, args)
        save = state.step % args.eval_interval == 0 or end
        if state.step % args.log_interval == 0 or save:  # the statistics since the last record
            r = t.stats.read(args.max_time is not None and time.time() - started >= args.max_time)
            now = time.time()
            dt, steps, last, last_step = now - last, state.step - last_step, now, state.step
            if r['bad']:
                raise UserError(f'non-finite loss or gradient at a step in {state.step - steps + 1}'
                                f'..{state.step} (skipped: the weights stayed finite); stopped, '
                                f'{kept(Path(args.out) / "ckpt.pt", state.saved)}')
            state.train_time += dt
            state.train_flops += 0.0 if budget else r['flops']
            speed, bpc = steps * args.batch_size * args.seq_len / dt, r['lm_loss'] / math.log(2)
            t.logger.log(dict(kind='train', step=state.step, train_chars=state.train_chars,
                              train_flops=state.train_flops, train_time=round(state.train_time, 3),
                              loss=r['loss'], bpc=bpc, sf=r['sf'], precision=r['precision'],
                              recall=r['recall'], chars_per_s=round(speed), lr=lr,
                              grad_norm=r['grad_norm'], mem_mb=round(rt.peak_mem_mb(args.device)),
                              epoch=state.epoch))
            t.say(f'step {state.step}' + (f' | {state.train_flops:.3g}/{args.flop_budget:.3g} '
                  'FLOPs' if budget else f'/{stop}') + f' | loss {r["loss"]:.3f} | bpc {bpc:.3f} | '
                  f'sf {r["sf"]:.2f} | {1000 * dt / steps:.0f} ms/step | {speed:,.0f} chars/s')
            if r['late'] and not end:
                stop, why, save = state.step, f'--max-time {args.max_time:g}s', True
        if not save:
            continue
        if not finished(state, args):  # (a finished run is evaluated in full at the end)
            eval_and_log(t, args, splits, 'valid', args.eval_subset_chars, state)
        with rt.interrupts_deferred():  # the checkpoint and the step it holds, together
            if t.procs.rank == 0:
                counters = {k: v for k, v in vars(state).items() if k != 'saved'}
                save_checkpoint(Path(args.out) / 'ckpt.pt', training_state(
                    t.raw_model, t.optimizer, t.scaler, counters, cfg, source, args), state.saved)
            state.saved = state.step
            reseed_rank(args.seed, t.procs.rank, state.step)  # as a resumed run would
        last = time.time()  # evaluating and saving are not training time
    return None if finished(state, args) else why or f'--stop-step {args.stop_step}'


def main(argv=None):
    """Train → the exit code; every mistake or fault is one `error: ...` line (rank 0 says it)."""
    procs = rt.Processes.of_torchrun()
    return common.main(lambda: run(argv, procs), procs.rank)


if __name__ == '__main__':
    sys.exit(main())
