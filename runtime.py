"""
What a training run needs around the method: torchrun's processes, the device and its precision,
torch.compile and DDP, the run's lifetime (folder lock, Ctrl-C, leaving the process group), the
log (log.jsonl, whole lines), the statistics summed on the device, and the clock. Nothing here
reads the environment at import time.
"""
import importlib
import inspect
import json
import math
import os
import platform
import resource
import signal
import sys
import time
from contextlib import contextmanager, nullcontext
from typing import NamedTuple

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import common
from common import UserError
from dynpool import DynamicPoolingLM, ModelOutput, step_flops


class Processes(NamedTuple):
    """This process's place among torchrun's processes."""
    rank: int = 0
    local_rank: int = 0
    world: int = 1


def torchrun_processes():
    """Processes from torchrun's environment (one process without torchrun)."""
    env = os.environ
    return Processes(*(int(env.get(k, d)) for k, d in (('RANK', 0), ('LOCAL_RANK', 0),
                                                        ('WORLD_SIZE', 1))))


# ----------------------------------------------------------------------------- device
def pick_device(name=None, local_rank=None):
    """'cpu', 'cuda', 'cuda:1', 'mps' → the checked device string; None → cuda if there is one.
    local_rank (torchrun's LOCAL_RANK): a CUDA device becomes this process's own GPU."""
    name = name or ('cuda' if torch.cuda.is_available() else 'cpu')
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        dev = None
    if dev is None or dev.type not in ('cpu', 'cuda', 'mps') or dev.type == 'cpu' and dev.index:
        raise UserError(f'--device {name} is not one of cpu, cuda, cuda:N, mps', code=2)
    cuda = torch.cuda.is_available() and torch.cuda.device_count()
    if dev.type == 'cuda' and local_rank is not None and cuda:
        # every GPU of the node visible: the LOCAL_RANK-th; a scheduler that shows each process
        # only its own (CUDA_VISIBLE_DEVICES): that one, whatever LOCAL_RANK says
        if cuda <= local_rank and cuda != 1:
            raise UserError(f'LOCAL_RANK {local_rank} but this process sees {cuda} CUDA devices '
                            f'(one per process, or all of the node\'s, is expected)')
        dev = torch.device('cuda', local_rank if cuda > local_rank else 0)
    if dev.type == 'cuda' and not cuda:
        raise UserError(f'--device {name} but no CUDA GPU is available here (try --device cpu)')
    if dev.type == 'cuda' and dev.index is not None and dev.index >= cuda:
        raise UserError(f'--device {name}: only {cuda} CUDA device(s) here')
    if dev.type == 'mps' and not (hasattr(torch.backends, 'mps')
                                  and torch.backends.mps.is_available()):
        raise UserError(f'--device {name} but MPS is not available here (try --device cpu)')
    return str(dev)


def check_amp(amp, device):
    """--amp against the device: fp16 needs CUDA (loss scaling), bf16 runs on CUDA and CPU."""
    on = torch.device(device).type
    if amp in ('fp16', 'bf16') and on not in ('cuda', 'cpu') or amp == 'fp16' and on != 'cuda':
        raise UserError(f'--amp {amp} needs a CUDA GPU{"" if amp == "fp16" else " or the CPU"} '
                        f'(not {device}); use {"bf16 or " if on == "cpu" else ""}off', code=2)


def setup_precision(amp, device_type):
    """--amp → (resolved name, autocast context, GradScaler): fp16 needs loss scaling, bf16 not."""
    if amp == 'auto' and device_type == 'cuda':
        # native bf16 only: V100 and T4 would emulate it, slower than fp16 with loss scaling
        amp = 'bf16' if torch.cuda.is_bf16_supported(including_emulation=False) else 'fp16'
    elif amp == 'auto':
        amp = 'off'
    dtype = {'bf16': torch.bfloat16, 'fp16': torch.float16}.get(amp)
    autocast = torch.autocast(device_type, dtype=dtype) if dtype else nullcontext()
    return amp, autocast, torch.amp.GradScaler(device_type, enabled=(amp == 'fp16'))


def check_model_memory(cfg, device):
    """Refuse, before anything is allocated, a model whose weights, gradients and Adam moments
    (16 bytes a parameter) exceed the free memory; the parameters are counted on the meta device."""
    try:
        with torch.device('meta'):
            n = DynamicPoolingLM(cfg).num_params()
    except (RuntimeError, ValueError, TypeError, OverflowError, MemoryError):
        n = math.inf  # sizes torch cannot even describe
    if torch.device(device).type == 'cuda':
        free = torch.cuda.mem_get_info(device)[0]
    else:  # the host's MemAvailable (free pages alone leave out the page cache it can drop)
        try:
            with open('/proc/meminfo') as f:
                free = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith('MemAvailable'))
        except (OSError, StopIteration, ValueError, IndexError):
            free = math.inf  # (no way to tell: let the allocation decide)
    if 16 * n > free:
        raise UserError(f'the model would have {n:.3g} parameters, {16 * n / 2**30:.3g} GiB with '
                        f'gradients and Adam moments, more than the {free / 2**30:.3g} GiB free on '
                        f'{device}; choose smaller --d-model, --d-inner, --n-head, --d-head or '
                        f'--layers', code=2)


def device_name(device):
    """The GPU's name, or the CPU's kind."""
    if torch.device(device).type == 'cuda':
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def peak_mem_mb(device):
    """Peak memory in MiB since the last call (CUDA: allocated on the device, whose peak this
    resets); on CPU the process's peak resident memory, which cannot be reset."""
    if torch.device(device).type == 'cuda':
        peak = torch.cuda.max_memory_allocated(device) / 2**20
        torch.cuda.reset_peak_memory_stats(device)
        return peak
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: kilobytes


def to_device(t, device):
    """Host tensor → device; on CUDA through pinned memory without waiting for the copy."""
    if torch.device(device).type == 'cuda':
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def sum_dtype(device):
    """float64 for the running sums, where the device has it."""
    return torch.float32 if torch.device(device).type == 'mps' else torch.float64


# ----------------------------------------------------------------------------- processes
def start_processes(device, procs):
    """torchrun's processes join one process group (NCCL on GPUs, gloo on CPU); TF32 on GPUs."""
    on = torch.device(device).type
    if procs.world > 1:
        if on == 'cuda':
            torch.cuda.set_device(device)  # before the process group: NCCL binds to this GPU
        torch.distributed.init_process_group('nccl' if on == 'cuda' else 'gloo')
    if on == 'cuda':
        torch.backends.cuda.matmul.allow_tf32 = True  # TF32 matmuls: same recipe, much faster
        torch.backends.cudnn.allow_tf32 = True


def wrap_model(model, args, world=1):
    """torch.compile and DDP around the model; the bare model stays for evaluation and saving."""
    if args.compile:
        # the default dynamic=None marks a size that changes between calls (the segment count) as
        # dynamic at its first recompile, instead of compiling once per value
        model = torch.compile(model)
    if world > 1:
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
        no_sync = ({'forward_sync_buffers': False} if 'forward_sync_buffers' in
                   inspect.signature(DDP.__init__).parameters else {'broadcast_buffers': False})
        device = torch.device(args.device)
        model = DDP(model, device_ids=[device.index] if device.type == 'cuda' else None,
                    find_unused_parameters=False, static_graph=args.grad_accum == 1,
                    gradient_as_bucket_view=True, **no_sync)
    return model


def leave_process_group(wait, world):
    """Tear the process group down together. A rank that exits while another still holds or closes
    its gloo connections to it can abort in C++ at exit ("terminate called without an active
    exception"): so every rank passes its last collective, destroys the group, and then waits, on
    the rendezvous store, for the others to have destroyed theirs. Not after an error (`wait`
    False): a rank still training would never arrive."""
    if not wait:
        torch.distributed.destroy_process_group()
        return
    torch.distributed.barrier()
    # gloo's worker threads free the barrier's work (and the earlier works it holds, whose tensors
    # Python owns) after barrier() returns, and need the GIL for it; a group destroyed with the GIL
    # held before then deadlocks in the join (seen when the DDP reducer was freed at exit). A
    # pause releases the GIL so they can finish.
    time.sleep(0.2)
    store = torch.distributed.distributed_c10d._get_default_store()  # outlives the group
    torch.distributed.destroy_process_group()
    key = f'dynpool/left/{os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")}'  # torchrun restarts
    deadline = time.time() + 60
    try:
        store.add(key, 1)
        while store.add(key, 0) < world and time.time() < deadline:
            time.sleep(0.01)
    except RuntimeError:  # the store's host (rank 0) saw everyone leave and exited first
        pass


@contextmanager
def run_guard(out_dir, procs, where):
    """A training run's lifetime: its folder locked by rank 0 (common.locked), Ctrl-C turned into
    one line and exit code 130 (where(): how far the run got, in words), and the DDP process group
    left by all ranks together (after an error, by each on its own)."""
    ended = False
    try:
        with common.locked(out_dir, 'the train.py using it') if procs.rank == 0 else nullcontext():
            yield
        ended = True
    except KeyboardInterrupt:
        raise UserError(where(), code=130) from None
    finally:
        if procs.world > 1 and torch.distributed.is_initialized():
            leave_process_group(wait=ended, world=procs.world)


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


# ----------------------------------------------------------------------------- log.jsonl
def import_optional(module, package, flag):
    """Import a logging package only when its flag asks for it; one line if it is not installed."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(f'{flag} needs the {package} package: pip install {package} '
                        f'(or drop {flag})') from None


def repair_log(path, resumed_from=None):
    """Before a run appends to log.jsonl: drop a cut last line (a run stopped mid-record), and on
    --resume the records of steps after the checkpoint's step resumed_from (the run redoes them;
    config records stay). One stderr line says what each drop was; the rewrite is atomic."""
    try:
        lines = path.read_bytes().splitlines(keepends=True)
    except FileNotFoundError:
        return
    recs = []
    for line in lines:
        try:
            recs.append(json.loads(line) if line.endswith(b'\n') else None)
        except ValueError:
            recs.append(None)  # (not JSON: kept, unless it is the last line)
    keep = [True] * len(lines)
    if lines and not isinstance(recs[-1], dict):
        keep[-1] = False
        print(f'warning: {path}: dropped its last line, cut short ({len(lines[-1])} bytes left by '
              f'a run that stopped while writing it)', file=sys.stderr, flush=True)
    later = [i for i, r in enumerate(recs) if resumed_from is not None and isinstance(r, dict)
             and r.get('kind') != 'config' and type(r.get('step')) is int
             and r['step'] > resumed_from]
    for i in later:
        keep[i] = False
    if later:
        print(f'note: {path}: dropped {len(later)} record(s) of steps after {resumed_from}, the '
              f'checkpoint\'s step (the resumed run redoes them)', file=sys.stderr, flush=True)
    if not all(keep):
        common.write_atomic(path, b''.join(ln for ln, k in zip(lines, keep) if k))


class Logger:
    """Records to log.jsonl on rank 0, each line written whole or not at all, and to TensorBoard /
    W&B when their flags ask (the console lines are the caller's). resumed_from: the checkpoint's
    step on --resume, whose later records are dropped first (repair_log)."""

    def __init__(self, out_dir, args, config_record, rank=0, resumed_from=None):
        self.path, self.tb, self.wandb, self.rank = out_dir / 'log.jsonl', None, None, rank
        if rank != 0:
            return
        repair_log(self.path, resumed_from)
        if args.tensorboard:
            tensorboard = import_optional('torch.utils.tensorboard', 'tensorboard', '--tensorboard')
            self.tb = tensorboard.SummaryWriter(str(out_dir / 'tensorboard'))
        if args.wandb:
            wandb = import_optional('wandb', 'wandb', '--wandb')
            try:
                self.wandb = wandb.init(project=args.wandb, name=out_dir.name, config=config_record)
            except Exception as e:  # a network or login problem: one line, as for every other fault
                raise UserError(f'--wandb {args.wandb}: cannot start Weights & Biases '
                                f'({(str(e).strip().splitlines() or [type(e).__name__])[0]})'
                                ) from None
        self.log(config_record)

    def append(self, line):
        """Append one line whole or not at all: a write that fails part-way (a full disk) or is
        interrupted is cut back off, so the file ends with the last whole record."""
        data = line.encode('utf-8')
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            size, done = os.fstat(fd).st_size, 0
            while done < len(data):  # one write, unless the system takes only part of it
                done += os.write(fd, data[done:])
        except BaseException as e:  # OSError, or Ctrl-C between two parts
            try:
                os.ftruncate(fd, size)
            except OSError:
                pass  # the next run's repair_log drops the cut line
            if isinstance(e, OSError):
                raise UserError(f'cannot write {self.path}: {e.strerror}; it keeps every whole '
                                f'record before this one') from None
            raise
        finally:
            os.close(fd)

    def log(self, rec):
        if self.rank != 0:
            return
        self.append(json.dumps(rec) + '\n')
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


# ----------------------------------------------------------------------------- step statistics
class StepStats:
    """Training statistics summed on the device step after step and read once per log record, the
    loop's only wait for the device. Per micro-step: loss, LM loss, SF, precision, recall; per
    step: FLOPs, the gradient norm (where finite) and how many, steps skipped as non-finite, and a
    time-is-up flag."""
    NAMES = ('loss', 'lm_loss', 'sf', 'precision', 'recall', 'flops', 'grad_norm', 'norms', 'bad',
             'late')

    def __init__(self, cfg, args, world=1):
        self.cfg, self.seq_len, self.world, self.accum = cfg, args.seq_len, world, args.grad_accum
        self.micro = args.batch_size // (world * args.grad_accum)
        self.sums = torch.zeros(len(self.NAMES), dtype=sum_dtype(args.device), device=args.device)
        self.index = {}  # names → their positions in sums, as a device tensor
        self.present, self.micro_steps, self.step_sf = set(), 0, []
        self.host_flops = 0.0  # all processes' FLOPs since the last read, where the host knew them
        self.last_flops = None  # the last step's: all processes' (a float) or this one's (a tensor)

    def add(self, **vals):
        names = tuple(vals)
        if names not in self.index:
            self.index[names] = torch.tensor([self.NAMES.index(k) for k in names],
                                             device=self.sums.device)
        values = torch.stack([v.to(self.sums.dtype) for v in vals.values()])
        self.sums.index_add_(0, self.index[names], values)

    def add_micro(self, out):
        vals = dict(loss=out.loss, lm_loss=out.lm_loss, sf=out.shortening_factor,
                    precision=out.precision, recall=out.recall)
        vals = {k: v.detach().to(self.sums.dtype) for k, v in vals.items() if v is not None}
        self.add(**vals)
        self.present |= vals.keys()
        self.micro_steps += 1
        if 'sf' in vals:
            self.step_sf.append(vals['sf'])

    def add_step(self, norm, bad, segments=None):
        """The step's gradient norm, non-finite flag and FLOPs. segments: the complete segments of
        each row of the step's global batch, a numpy array [accum, world, micro], where the host
        knows them (fixed, whitespace)."""
        finite = torch.isfinite(norm)
        self.add(grad_norm=torch.where(finite, norm, 0.0), norms=finite, bad=bad)
        L, B = self.seq_len, self.micro
        # the shortened stack runs on 1 + segments positions (the null group), on average per row
        if self.cfg.boundary == 'none' or segments is not None:  # known here: no device read
            n_short = ([None] * self.accum * self.world if segments is None else
                       (1 + np.asarray(segments).sum(-1) / B).ravel().tolist())
            self.last_flops = sum(step_flops(self.cfg, B, L, n) for n in n_short)
            self.host_flops += self.last_flops
        else:  # decided on the device: from each micro-step's measured SF = L / segments per row
            self.last_flops = sum(step_flops(self.cfg, B, L, 1 + L / sf) for sf in self.step_sf)
            self.add(flops=self.last_flops)
        self.step_sf = []

    def take_step_flops(self):
        """The last step's FLOPs over all processes (--flop-budget's bookkeeping). The predicted
        sources' are read from the device: a wait each step, which only they pay."""
        f, self.last_flops = self.last_flops, None
        if torch.is_tensor(f):
            if self.world > 1:
                torch.distributed.all_reduce(f)
            f = f.item()
        return f

    def read(self, late=False):
        """Sum over processes, read and reset → means since the last read, FLOPs, skipped steps,
        and whether any process is out of time."""
        self.sums[self.NAMES.index('late')] += float(late)
        if self.world > 1:
            torch.distributed.all_reduce(self.sums)
        v = dict(zip(self.NAMES, self.sums.tolist()))
        n = max(1, self.micro_steps * self.world)
        r = {k: v[k] / n if k in self.present else None
             for k in ('loss', 'lm_loss', 'sf', 'precision', 'recall')}
        r.update(sf=r['sf'] or 1.0, flops=v['flops'] + self.host_flops, bad=int(v['bad']),
                 late=v['late'] > 0, grad_norm=v['grad_norm'] / v['norms'] if v['norms'] else None)
        self.sums.zero_()
        self.micro_steps, self.host_flops = 0, 0.0
        return r


def adam_step_skipping(optimizer, skip):
    """optimizer.step(), skipped by a fused Adam where the 0-dim bool tensor `skip` is set: weights
    and moments stay untouched, and the host never reads the flag. This is how GradScaler talks to
    fused optimizers: `found_inf` (and `grad_scale`, here None: nothing to unscale) set on the
    optimizer for its step to read, and removed after."""
    optimizer.found_inf, optimizer.grad_scale = skip.float(), None
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf, optimizer.grad_scale


class Training(NamedTuple):
    """A training run's machinery: what its steps, evaluations and records need besides the data."""
    model: torch.nn.Module          # compiled and/or DDP-wrapped, for training
    raw_model: DynamicPoolingLM     # the bare model, for evaluation and checkpoints
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler    # fp16's loss scaling (disabled otherwise)
    autocast: object
    amp: str                        # the precision in use: bf16, fp16 or off
    stats: StepStats
    logger: Logger
    procs: Processes


class Clock:
    """Training time between log records (evaluating and saving are left out) and the ETA at this
    invocation's own pace, in steps or FLOPs (`work`)."""

    def __init__(self, step, work):
        self.last, self.step, self.spent, self.first_work = time.time(), step, 0.0, work

    def lap(self, step):
        """→ (seconds, steps) of training since the last lap."""
        now = time.time()
        dt, steps = now - self.last, step - self.step
        self.last, self.step, self.spent = now, step, self.spent + dt
        return dt, steps

    def pause_ended(self):
        self.last = time.time()

    def eta(self, work, total):
        """Seconds until `work` reaches `total` at this invocation's pace; None before any."""
        done = work - self.first_work
        return (total - work) * self.spent / done if done > 0 and self.spent > 0 else None


def duration(s):
    """Seconds for the terminal: 42s, 9m12s, 3h05m; '?' where unknown."""
    if s is None or not math.isfinite(s):
        return '?'
    s = max(0, round(s))
    return (f'{s // 3600}h{s % 3600 // 60:02d}m' if s >= 3600 else
            f'{s // 60}m{s % 60:02d}s' if s >= 60 else f'{s}s')


def short_count(n):
    """A count for the terminal: 812, 26k, 1.2M."""
    return f'{n / 1e6:.1f}M' if n >= 1e6 else f'{n / 1e3:.0f}k' if n >= 1e4 else f'{n:.0f}'
