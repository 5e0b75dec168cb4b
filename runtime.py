"""A training run around the method: processes, device, precision, DDP, lifetime, log and
the step's sums."""
import json
import math
import os
import re
import resource
import signal
import sys
import tempfile
import time
from contextlib import contextmanager, nullcontext, suppress
from datetime import timedelta
from typing import NamedTuple

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import common
from common import UserError
from dynpool import DynamicPoolingLM, ModelOutput, shortened_length, step_flops


class Processes(NamedTuple):
    """This process's place among torchrun's processes (one process without torchrun)."""
    rank: int = 0
    local_rank: int = 0
    world: int = 1

    @classmethod
    def of_torchrun(cls):
        env = os.environ
        return cls(int(env.get('RANK', 0)), int(env.get('LOCAL_RANK', 0)),
                   int(env.get('WORLD_SIZE', 1)))


def pick_device(name=None, local_rank=None):
    """--device → the checked device; under torchrun, GPU LOCAL_RANK of all, or the one
    it sees. A device that is not here is a flag mistake: exit 2."""
    name = name or ('cuda' if torch.cuda.is_available() else 'cpu')
    if not re.fullmatch(r'cpu|mps|cuda(:\d+)?', name):
        raise UserError(f'--device {name} is not one of cpu, cuda, cuda:N, mps', code=2)
    dev = torch.device(name)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    # one GPU per process, or the node's
    if dev.type == 'cuda' and local_rank is not None and gpus:
        dev = torch.device('cuda', 0 if gpus == 1 else local_rank)
    missing_gpu = dev.type == 'cuda' and (dev.index or 0) >= gpus
    if missing_gpu or (dev.type == 'mps' and not torch.backends.mps.is_available()):
        rank = '' if local_rank is None else f'LOCAL_RANK {local_rank} but '
        raise UserError(f'--device {name}: no {dev} here ({rank}this process sees {gpus} CUDA '
                        f'devices; try cpu)', code=2)
    return str(dev)


# The dtype each --amp computes in (bench.py's matmul peak reads it too; off: float32)
AMP_DTYPES = {'fp16': torch.float16, 'bf16': torch.bfloat16}


def setup_precision(amp, device_type):
    """--amp → (resolved name, autocast context, GradScaler: fp16's loss scaling)."""
    if (amp == 'fp16' and device_type != 'cuda') or (amp == 'bf16' and device_type == 'mps'):
        raise UserError(f'--amp {amp} does not run on {device_type} (fp16: CUDA only; bf16: CUDA '
                        f'or CPU); use another --amp or off', code=2)
    if amp == 'auto' and device_type != 'cuda':
        amp = 'off'
    elif amp == 'auto':
        # native bf16 only: V100 and T4 emulate it, slower than fp16 with scaling
        amp = 'fp16'
        if torch.cuda.is_bf16_supported(including_emulation=False):
            amp = 'bf16'
    # (off: an autocast that is not enabled, a context that changes nothing)
    dtype = AMP_DTYPES.get(amp, torch.bfloat16)
    autocast = torch.autocast(device_type, dtype=dtype, enabled=amp != 'off')
    return amp, autocast, torch.amp.GradScaler(device_type, enabled=amp == 'fp16')


def check_model_memory(cfg, device):
    """Refuse a model whose weights, gradients and Adam moments (16 B a parameter) do not
    fit in the device's free memory."""
    try:
        with torch.device('meta'):
            need = 16 * DynamicPoolingLM(cfg).num_params()
    except RuntimeError as e:
        # a size whose bytes overflow int64: torch cannot even count it
        if 'overflow' not in str(e):
            raise
        raise UserError(f'the model is too large to build ({common.first_line(e)[:120]}): '
                        'shrink the model', code=2) from None
    require_memory(need, 'the model, with gradients and Adam moments,', device, 'shrink the model')


def proc_bytes(path, key, default):
    """The `key: N kB` line of a Linux /proc file (meminfo, self/status) in bytes;
    `default` where there is none."""
    with suppress(OSError), open(path) as f:
        for line in f:
            if line.startswith(key + ':'):
                return int(line.split()[1]) * 1024
    return default


def require_memory(need, what, device, fix):
    """Refuse, before it is spent, `need` bytes that `what` would take on the device (CUDA's
    free memory, else the host's MemAvailable, inf where unknown): one UserError line
    (exit 2) that names what to change (`fix`, e.g. 'lower --gen-batch')."""
    if 'cuda' in str(device):
        free = torch.cuda.mem_get_info(device)[0]
    else:
        free = proc_bytes('/proc/meminfo', 'MemAvailable', math.inf)
    if need > free:
        raise UserError(f'{what} needs about {need / 2**30:.3g} GiB of memory, over '
                        f'the {free / 2**30:.3g} GiB free on {device}: {fix}', code=2)


def generation_bytes(cfg, batch, prompt_len, new):
    """An upper bound of the memory, in bytes, that generating `new` characters after a
    prompt of prompt_len takes for `batch` rows, beyond the weights (4 bytes a number):
    every layer's keys, values and position keys for all positions; the prompt's pass
    with all its attention scores (several tensors of them), the pooling's boundary
    matrix (at most a segment per character) and the activations."""
    length = prompt_len + new
    caches = (2 * batch + 1) * sum(cfg.layers) * cfg.n_head * cfg.d_head * length
    scores = 4 * batch * cfg.n_head * prompt_len ** 2
    pooling = 4 * batch * prompt_len ** 2   # (vanilla has none: a bound all the same)
    activations = 4 * batch * length * (cfg.d_inner + 4 * cfg.d_model + cfg.vocab_size)
    return 4 * (caches + scores + pooling + activations)


def setup_device(device, threads=None):
    """Every script's device setup: its CPU threads, --threads where given, else
    cpu_threads(); TF32 matmuls on a GPU (the same recipe, much faster) → the threads."""
    torch.set_num_threads(threads or cpu_threads())
    if 'cuda' in str(device):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return torch.get_num_threads()


def cpu_threads():
    """The CPU threads a script takes unless told: OMP_NUM_THREADS where the user set it,
    else half the CPUs this process may run on (its affinity), at least one."""
    # torch's default, a thread per core, lets two runs on one machine oversubscribe it:
    # OpenMP's threads spin waiting for each other and every step crawls. Half each, two
    # runs share it.
    given = os.environ.get('OMP_NUM_THREADS', '')
    if given.isdigit() and int(given) > 0:
        return int(given)
    cpus = os.cpu_count() or 1
    if hasattr(os, 'sched_getaffinity'):   # (Linux: the CPUs a scheduler gave this job)
        cpus = len(os.sched_getaffinity(0))
    return max(1, cpus // 2)


def peak_mem_mb(device):
    """Peak memory in MiB: CUDA's allocated since the last call (reset here), else the
    process's peak RSS."""
    if 'cuda' in str(device):
        peak = torch.cuda.max_memory_allocated(device) / 2**20
        torch.cuda.reset_peak_memory_stats(device)
        return peak
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: kilobytes


def to_device(t, device):
    """Host tensor → device; on CUDA through pinned memory without waiting for the copy."""
    return t.pin_memory().to(device, non_blocking=True) if 'cuda' in str(device) else t.to(device)


def sum_dtype(device):
    """float64 for the running sums, where the device has it."""
    return torch.float32 if 'mps' in str(device) else torch.float64


def start_processes(device, procs):
    """torchrun's processes join one process group (NCCL on GPUs, gloo on CPU)."""
    cuda = 'cuda' in str(device)
    if cuda:  # the device set first: NCCL binds to it
        torch.cuda.set_device(device)
    if procs.world > 1:
        torch.distributed.init_process_group('nccl' if cuda else 'gloo')


def wrap_model(model, args, world=1):
    """torch.compile and DDP around the model; the bare model stays, for evaluation and
    for saving."""
    # (dynamic=None: the segment count turns dynamic at its first recompile)
    if args.compile:
        model = torch.compile(model)
    if world == 1:
        return model
    with suppress(ValueError):  # (ValueError: already registered)
        # DDP's static graph finds tensors by pytrees
        torch.export.register_dataclass(ModelOutput)
    # A static graph but with --grad-accum > 1 (no_sync breaks it, pytorch#143580)
    ids = [torch.device(args.device).index] if 'cuda' in args.device else None
    ddp = DDP(model, device_ids=ids, static_graph=args.grad_accum == 1,
              gradient_as_bucket_view=True)
    # the only buffer, the constant Gumbel evaluation noise, is never re-broadcast: DDP's
    # attribute in every version (2.13 renamed the constructor's argument)
    ddp.broadcast_buffers = False
    return ddp


# Signals that stop a run to be resumed: a scheduler's or a spot instance's notice
# (SIGTERM), a user's (SIGUSR1). The one stop rule: the work in flight (a step, an
# evaluation's batch, a save) ends, the run saves what a resume needs and exits with
# EX_TEMPFAIL, "stopped to resume", whatever the phase.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
EXIT_PREEMPTED = 75


class Stopped(Exception):
    """A stop signal ended the evaluation or phase in flight (check_stop)."""


def check_stop(stop, procs, device):
    """Raise Stopped where a stop signal has arrived: this process's, or any process's
    under DDP (one collective: every process calls it at the same point)."""
    stopping = bool(stop)
    if procs.world > 1:
        # summed over the processes: any process's
        flag = torch.tensor(float(stopping), device=device)
        torch.distributed.all_reduce(flag)
        stopping = flag.item() > 0
    if stopping:
        raise Stopped


@contextmanager
def run_guard(out_dir, procs, where):
    """A run's lifetime: folder locked (rank 0); SIGTERM and SIGUSR1 add their name to
    the list it yields (the loop stops at its step's end); Ctrl-C → UserError(where(),
    130); DDP left."""
    stop = []

    def request_stop(signum, frame):
        stop.append(signal.Signals(signum).name)
    handlers = {s: signal.signal(s, request_stop) for s in STOP_SIGNALS}
    ended = False
    try:
        with common.locked(out_dir, 'the train.py using it') if procs.rank == 0 else nullcontext():
            if procs.rank == 0:
                # a folder that takes no new file fails here, not at the first save
                tempfile.TemporaryFile(dir=out_dir).close()
            yield stop
        ended = True
    except KeyboardInterrupt:
        # a second Ctrl-C while this one unwinds would end in a traceback (the caller
        # restores Ctrl-C: train.main)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise UserError(where(), code=130) from None
    finally:
        # together (a rank exiting while others use its gloo links can abort), not on error
        for s, handler in handlers.items():
            signal.signal(s, handler)
        if procs.world > 1 and torch.distributed.is_initialized():
            if ended:
                leave_together(procs)
            else:
                torch.distributed.destroy_process_group()


def leave_together(procs):
    """The end of a DDP run: each rank destroys its process group, then waits for the
    others to."""
    dist = torch.distributed
    dist.barrier()
    # gloo frees the barrier's work after it returns, needing the GIL: destroying it now
    # would deadlock
    time.sleep(0.2)
    store = dist.distributed_c10d._get_default_store()
    dist.destroy_process_group()
    # one key a restart (torchrun --max-restarts)
    key = f'dynpool/left/{os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")}'
    with suppress(RuntimeError):  # (the store's host, rank 0, saw all leave and exited)
        store.set(f'{key}/{procs.rank}', '1')   # then wait up to a minute for the others
        store.wait([f'{key}/{r}' for r in range(procs.world)], timedelta(seconds=60))


@contextmanager
def interrupts_deferred():
    """Ctrl-C in the block takes effect at its end (inside torch.save it would abort the
    process)."""
    pending = []  # a handler, not a signal mask, which torch's threads would not honour
    handler = signal.signal(signal.SIGINT, lambda *_: pending.append(True))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)
    if pending and callable(handler):
        # the usual handler: raises KeyboardInterrupt, now safely
        handler(signal.SIGINT, None)


def whole_record(line):
    """A log line's JSON object if the line is whole, else None (cut short)."""
    with suppress(ValueError):
        record = json.loads(line)
        if isinstance(record, dict) and line.endswith(b'\n'):
            return record


def after(line, step):
    """Whether a log line is a whole record (not the config) of a step after `step`, a
    resumed run's checkpoint (None: no step is)."""
    record = whole_record(line) or {}
    if step is None or record.get('kind') == 'config':
        return False
    return type(record.get('step')) is int and record['step'] > step


class Logger:
    """Records to log.jsonl (rank 0, whole lines); drops lines cut short and those a
    resumed run redoes."""

    def __init__(self, out_dir, args, config_record, rank=0, resumed_from=None):
        self.path = out_dir / 'log.jsonl'
        self.rank = rank
        if rank != 0:
            return
        lines = self.path.read_bytes().splitlines(True) if self.path.exists() else []
        cut = bool(lines) and whole_record(lines[-1]) is None
        if cut:
            print(f'warning: {self.path}: dropped its last line, cut short ({len(lines[-1])} bytes '
                  f'left by a run that stopped while writing it)', file=sys.stderr)
            lines.pop()
        kept = [line for line in lines if not after(line, resumed_from)]
        dropped = len(lines) - len(kept)
        if dropped:
            print(f'note: {self.path}: dropped {dropped} record(s) of steps after step '
                  f'{resumed_from}, the checkpoint (the resumed run redoes them)', file=sys.stderr)
        if cut or dropped:
            common.write_atomic(self.path, b''.join(kept))
        self.log(config_record)

    def log(self, rec):
        """Append rec as one line; a write cut short (a full disk, Ctrl-C) is cut back off
        the file."""
        if self.rank != 0:
            return
        data = (json.dumps(rec) + '\n').encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        size = os.fstat(fd).st_size
        done = 0
        try:
            while done < len(data):  # one write, unless the system takes only part of it
                done += os.write(fd, data[done:])
        except BaseException as e:  # OSError, or Ctrl-C between two parts
            with suppress(OSError):  # (else the next run drops the cut line)
                os.ftruncate(fd, size)
            if isinstance(e, OSError):
                # named by the log, which keeps every whole record
                raise OSError(e.errno, e.strerror, str(self.path)) from None
            raise
        finally:
            os.close(fd)


class StepStats:
    """Means, FLOPs, gradient norms, bad steps summed on the device; read (a wait) at each
    record."""
    # the means' sums first, then the counts and flags
    NAMES = ('loss lm_loss sf precision recall '
             'micro_steps flops grad_norm norms bad save late').split()

    def __init__(self, cfg, args, world=1):
        self.cfg = cfg
        self.args = args
        self.world = world
        self.sums = torch.zeros(len(self.NAMES), dtype=sum_dtype(args.device), device=args.device)
        self.step_sf = []        # this step's micro-steps' SF, on the device
        self.reset()

    def reset(self):
        self.sums.zero_()
        self.seen = set()
        self.host_flops = 0.0

    @torch.no_grad()
    def add(self, **values):
        """Values by name (device tensors or numbers; None: not measured) into the sums."""
        for name, value in values.items():
            if value is not None:
                self.sums[self.NAMES.index(name)] += value
                self.seen.add(name)

    def add_micro(self, out):
        self.add(loss=out.loss, lm_loss=out.lm_loss, sf=out.shortening_factor,
                 precision=out.precision, recall=out.recall, micro_steps=1)
        if out.shortening_factor is not None:
            self.step_sf.append(out.shortening_factor.detach())

    def add_step(self, norm, bad, segments=None):
        """Gradient norm, non-finite flag, FLOPs; segments [accum, world, micro] where the
        host counted them."""
        finite = torch.isfinite(norm)
        self.add(grad_norm=torch.where(finite, norm, 0.0), norms=finite, bad=bad)
        L = self.args.seq_len
        B = self.args.batch_size // (self.world * self.args.grad_accum)
        # the shortened stack runs on 1 + segments positions (the null group), on
        # average per row: a micro-step's FLOPs at its mean
        if segments is not None:
            # counted on the host, every process's micro-steps: no device read
            flops = float(step_flops(self.cfg, B, L, 1 + segments.sum(-1) / B).sum())
        elif self.step_sf:
            # decided on the device: this process's, from each measured SF = L / segments
            n_short = shortened_length(L, torch.stack(self.step_sf))
            flops = step_flops(self.cfg, B, L, n_short).sum()
        else:
            # no shortened stack (vanilla): every process's micro-steps alike
            flops = step_flops(self.cfg, B, L) * self.args.grad_accum * self.world
        if torch.is_tensor(flops):
            self.add(flops=flops)
        else:
            self.host_flops += flops
        self.last_flops = flops   # (a device tensor where measured there)
        self.step_sf = []

    def take_step_flops(self):
        """The last step's FLOPs, all processes' (--flop-budget; a device read where a
        network decides the segments)."""
        flops = self.last_flops
        if not torch.is_tensor(flops):
            return flops
        if self.world > 1:
            torch.distributed.all_reduce(flops)
        return flops.item()

    def read(self, late=False, save=False):
        """Sum over processes, read, reset → means, FLOPs, skipped steps, and whether any
        process says `save` (a checkpoint is due by its clock) or `late` (stop now)."""
        self.add(save=save, late=late)
        if self.world > 1:
            torch.distributed.all_reduce(self.sums)
        v = dict(zip(self.NAMES, self.sums.tolist()))
        # (a mean measured: one micro-step at least)
        means = {k: v[k] / v['micro_steps'] if k in self.seen else None
                 for k in self.NAMES[:5]}
        means.update(sf=means['sf'] or 1.0, flops=v['flops'] + self.host_flops,
                     bad=int(v['bad']), save=v['save'] > 0, late=v['late'] > 0, grad_norm=None)
        if v['norms']:
            means['grad_norm'] = v['grad_norm'] / v['norms']
        self.reset()
        return means
