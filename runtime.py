"""What a training run needs around the method: torchrun's processes, the device and its precision,
torch.compile and DDP, the run's lifetime, log.jsonl, the statistics summed on the device."""
import importlib
import inspect
import json
import math
import os
import resource
import signal
import sys
import time
from contextlib import contextmanager, nullcontext, suppress
from datetime import timedelta
from typing import NamedTuple

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import common
from common import UserError
from dynpool import DynamicPoolingLM, ModelOutput, step_flops


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


# ----------------------------------------------------------------------------- device
def pick_device(name=None, local_rank=None):
    """--device → the checked device string (None: cuda if there is one). Under torchrun
    (local_rank) CUDA is this process's GPU: the LOCAL_RANK-th where it sees all of the node's,
    its only one where a scheduler shows each process its own."""
    name = name or ('cuda' if torch.cuda.is_available() else 'cpu')
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        dev = torch.device('meta')
    if dev.type not in ('cpu', 'cuda', 'mps') or dev.type == 'cpu' and dev.index:
        raise UserError(f'--device {name} is not one of cpu, cuda, cuda:N, mps', code=2)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if dev.type == 'cuda' and local_rank is not None and gpus:
        if gpus <= local_rank and gpus != 1:
            raise UserError(f'LOCAL_RANK {local_rank} but this process sees {gpus} CUDA devices '
                            f"(one per process, or all of the node's, is expected)")
        dev = torch.device('cuda', local_rank if gpus > local_rank else 0)
    if (dev.index or 0) >= gpus if dev.type == 'cuda' else (
            dev.type == 'mps' and not torch.backends.mps.is_available()):
        raise UserError(f'--device {name}: no such device here ({gpus} CUDA GPU(s); try '
                        f'--device cpu)')
    return str(dev)


def setup_precision(amp, device_type):
    """--amp → (resolved name, autocast context, GradScaler): fp16 needs CUDA and loss scaling,
    bf16 runs on CUDA and CPU."""
    if amp == 'fp16' and device_type != 'cuda' or amp == 'bf16' and device_type == 'mps':
        raise UserError(f'--amp {amp} needs a CUDA GPU{"" if amp == "fp16" else " or the CPU"} '
                        f'(not {device_type}); use {"bf16 or " if device_type == "cpu" else ""}'
                        f'off', code=2)
    if amp == 'auto':  # native bf16 only: V100 and T4 emulate it, slower than fp16 with scaling
        amp = 'off' if device_type != 'cuda' else 'bf16' if torch.cuda.is_bf16_supported(
            including_emulation=False) else 'fp16'
    dtype = {'bf16': torch.bfloat16, 'fp16': torch.float16}.get(amp)
    autocast = torch.autocast(device_type, dtype=dtype) if dtype else nullcontext()
    return amp, autocast, torch.amp.GradScaler(device_type, enabled=(amp == 'fp16'))


def check_model_memory(cfg, device):
    """Refuse, before allocating it, a model whose weights, gradients and Adam moments (16 bytes a
    parameter, counted on the meta device) exceed the free memory (CPU: MemAvailable)."""
    with torch.device('meta'):
        n = DynamicPoolingLM(cfg).num_params()
    if torch.device(device).type == 'cuda':
        free = torch.cuda.mem_get_info(device)[0]
    else:
        with open('/proc/meminfo') if os.path.exists('/proc/meminfo') else nullcontext([]) as f:
            free = next((int(ln.split()[1]) * 1024 for ln in f if ln.startswith('MemAvailable')),
                        math.inf)
    if 16 * n > free:
        raise UserError(f'the model would have {n:.3g} parameters, {16 * n / 2**30:.3g} GiB with '
                        f'gradients and Adam moments, more than the {free / 2**30:.3g} GiB free on '
                        f'{device}; choose smaller --d-model, --d-inner, --n-head, --d-head or '
                        f'--layers', code=2)


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
    cuda = torch.device(device).type == 'cuda'
    return (t.pin_memory() if cuda else t).to(device, non_blocking=cuda)


def sum_dtype(device):
    """float64 for the running sums, where the device has it."""
    return torch.float32 if torch.device(device).type == 'mps' else torch.float64


# ----------------------------------------------------------------------------- processes
def start_processes(device, procs):
    """torchrun's processes join one process group (NCCL on GPUs, gloo on CPU); TF32 on GPUs."""
    cuda = torch.device(device).type == 'cuda'
    if procs.world > 1:
        if cuda:
            torch.cuda.set_device(device)  # before the process group: NCCL binds to this GPU
        torch.distributed.init_process_group('nccl' if cuda else 'gloo')
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True  # TF32 matmuls: same recipe, much faster
        torch.backends.cudnn.allow_tf32 = True


def wrap_model(model, args, world=1):
    """torch.compile and DDP around the model; the bare model stays for evaluation and saving."""
    if args.compile:  # (dynamic=None: the segment count turns dynamic at its first recompile)
        model = torch.compile(model)
    if world == 1:
        return model
    with suppress(ValueError):  # (ValueError: already registered)
        torch.export.register_dataclass(ModelOutput)  # DDP's static graph finds tensors by pytrees
    # Every parameter gets a gradient and each step runs the same graph (not static with
    # --grad-accum > 1: it breaks under no_sync, pytorch#143580). The only buffer is the
    # constant Gumbel evaluation noise: never re-broadcast (the argument's name since 2.13).
    no_sync = ({'forward_sync_buffers': False} if 'forward_sync_buffers' in
               inspect.signature(DDP.__init__).parameters else {'broadcast_buffers': False})
    device = torch.device(args.device)
    return DDP(model, device_ids=[device.index] if device.type == 'cuda' else None,
               static_graph=args.grad_accum == 1, gradient_as_bucket_view=True, **no_sync)


def leave_process_group(wait, world):
    """Leave the process group together: a rank that exits while another still uses its gloo
    connections can abort in C++. Barrier, destroy, wait on the store for the others; not after an
    error (`wait` False): a rank still training would never arrive."""
    if not wait:
        return torch.distributed.destroy_process_group()
    torch.distributed.barrier()
    # gloo's threads free the barrier's work after barrier() returns and need the GIL for it;
    # destroying the group before then deadlocks in the join: a pause lets them finish
    time.sleep(0.2)
    store = torch.distributed.distributed_c10d._get_default_store()  # outlives the group
    torch.distributed.destroy_process_group()
    key = f'dynpool/left/{os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")}'  # torchrun restarts
    deadline = time.time() + 60
    with suppress(RuntimeError):  # the store's host (rank 0) saw everyone leave and exited first
        store.add(key, 1)
        while store.add(key, 0) < world and time.time() < deadline:
            time.sleep(0.01)


@contextmanager
def run_guard(out_dir, procs, where):
    """A training run's lifetime: its folder locked by rank 0 (common.locked), Ctrl-C as one line
    and exit code 130 (where(): how far the run got), the DDP process group left together."""
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
    """Ctrl-C inside the block takes effect at its end: a KeyboardInterrupt inside torch.save's
    writer would abort the process (C++ terminate). A handler, not a signal mask: torch's worker
    threads would still take a process-wide SIGINT."""
    pending = []
    handler = signal.signal(signal.SIGINT, lambda *_: pending.append(True))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)
    if pending and callable(handler):
        handler(signal.SIGINT, None)  # the usual handler: raises KeyboardInterrupt, now safely


# ----------------------------------------------------------------------------- log.jsonl
def import_optional(module, flag):
    """Import a logging package its flag asks for; one line if it is not installed."""
    try:
        return importlib.import_module(module)
    except ImportError:
        package = module.split('.')[-1]
        raise UserError(f'{flag} needs the {package} package: pip install {package} '
                        f'(or drop {flag})') from None


def record(line):
    """A whole line of log.jsonl → its record, or None (cut short, or not a JSON object)."""
    try:
        r = json.loads(line)
    except ValueError:
        return None
    return r if isinstance(r, dict) and line.endswith(b'\n') else None


class Logger:
    """Records to log.jsonl on rank 0, each line whole or not at all, and to TensorBoard / W&B where
    their flags ask. Opening drops a cut last line (a run stopped mid-record) and, on --resume,
    records of steps after the checkpoint's (resumed_from: the run redoes them), one stderr line
    each, the rewrite atomic."""

    def __init__(self, out_dir, args, config_record, rank=0, resumed_from=None):
        self.path, self.tb, self.wandb, self.rank = out_dir / 'log.jsonl', None, None, rank
        if rank != 0:
            return
        lines = self.path.read_bytes().splitlines(True) if self.path.exists() else []
        recs = [record(line) for line in lines]
        later = {i for i, r in enumerate(recs) if resumed_from is not None and r and r.get(
            'kind') != 'config' and type(r.get('step')) is int and r['step'] > resumed_from}
        cut = bool(lines) and recs[-1] is None
        if cut:
            print(f'warning: {self.path}: dropped its last line, cut short ({len(lines[-1])} bytes '
                  f'left by a run that stopped while writing it)', file=sys.stderr, flush=True)
        if later:
            print(f'note: {self.path}: dropped {len(later)} record(s) of steps after '
                  f"{resumed_from}, the checkpoint's step (the resumed run redoes them)",
                  file=sys.stderr, flush=True)
        if cut or later:  # (the cut line is never one of `later`)
            kept = [ln for i, ln in enumerate(lines) if i not in later]
            common.write_atomic(self.path, b''.join(kept[:-1] if cut else kept))
        if args.tensorboard:
            tensorboard = import_optional('torch.utils.tensorboard', '--tensorboard')
            self.tb = tensorboard.SummaryWriter(str(out_dir / 'tensorboard'))
        if args.wandb:
            try:
                self.wandb = import_optional('wandb', '--wandb').init(
                    project=args.wandb, name=out_dir.name, config=config_record)
            except Exception as e:  # a network or login problem: one line, as for every other fault
                raise UserError(f'--wandb {args.wandb}: cannot start Weights & Biases ({e})'[:300]
                                .replace('\n', ' ')) from None
        self.log(config_record)

    def log(self, rec):
        """Append rec as one line: a write that fails part-way (a full disk) or is interrupted is
        cut back off, so the file ends with the last whole record."""
        if self.rank != 0:
            return
        data = (json.dumps(rec) + '\n').encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            size, done = os.fstat(fd).st_size, 0
            while done < len(data):  # one write, unless the system takes only part of it
                done += os.write(fd, data[done:])
        except BaseException as e:  # OSError, or Ctrl-C between two parts
            with suppress(OSError):  # (else the next run drops the cut line)
                os.ftruncate(fd, size)
            if isinstance(e, OSError):
                raise UserError(f'cannot write {self.path}: {e.strerror}; it keeps every whole '
                                f'record before this one') from None
            raise
        finally:
            os.close(fd)
        group = rec['split'] if rec['kind'] == 'eval' else rec['kind']
        scalars = {f'{group}/{k}': v for k, v in rec.items() if type(v) in (int, float)
                   and k != 'step' and rec['kind'] != 'config'}
        for k, v in scalars.items() if self.tb else ():
            self.tb.add_scalar(k, v, rec['step'])
        if self.wandb and scalars:
            self.wandb.log(scalars, step=rec['step'])

    def close(self):
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


# ----------------------------------------------------------------------------- step statistics
class StepStats:
    """Training statistics summed on the device step after step, read once per log record: the
    loop's only wait for the device. Per micro-step loss, LM loss, SF, precision, recall; per step
    FLOPs, the finite gradient norms and their count, steps skipped as non-finite."""
    NAMES = ('loss', 'lm_loss', 'sf', 'precision', 'recall', 'flops', 'grad_norm', 'norms', 'bad')

    def __init__(self, cfg, args, world=1):
        self.cfg, self.args, self.world = cfg, args, world
        self.sums, self.micro_steps, self.step_sf, self.host_flops = {}, 0, [], 0.0
        self.last_flops = None  # the last step's: all processes' (float), or this one's (tensor)

    def add(self, **vals):
        for k, v in vals.items():
            if v is not None:
                self.sums[k] = self.sums.get(k, 0) + v.detach().to(sum_dtype(self.args.device))

    def add_micro(self, out):
        self.add(loss=out.loss, lm_loss=out.lm_loss, sf=out.shortening_factor,
                 precision=out.precision, recall=out.recall)
        self.micro_steps += 1
        self.step_sf += [] if out.shortening_factor is None else [out.shortening_factor.detach()]

    def add_step(self, norm, bad, segments=None):
        """The step's gradient norm, non-finite flag and FLOPs; segments: complete segments per
        row, [accum, world, micro], where the host knows them (fixed, whitespace)."""
        finite = torch.isfinite(norm)
        self.add(grad_norm=torch.where(finite, norm, 0.0), norms=finite, bad=bad)
        L, B = self.args.seq_len, self.args.batch_size // (self.world * self.args.grad_accum)
        # the shortened stack runs on 1 + segments positions (the null group), on average per row
        if self.cfg.boundary == 'none' or segments is not None:  # known here: no device read
            n_short = ([None] * self.args.grad_accum * self.world if segments is None else
                       (1 + np.asarray(segments).sum(-1) / B).ravel().tolist())
            self.last_flops = sum(step_flops(self.cfg, B, L, n) for n in n_short)
            self.host_flops += self.last_flops
        else:  # decided on the device: from each micro-step's measured SF = L / segments per row
            self.last_flops = sum(step_flops(self.cfg, B, L, 1 + L / sf) for sf in self.step_sf)
            self.add(flops=self.last_flops)
        self.step_sf = []

    def take_step_flops(self):
        """The last step's FLOPs over all processes (--flop-budget); a predicted source's are read
        from the device: a wait each step, which only they pay."""
        f, self.last_flops = self.last_flops, None
        if torch.is_tensor(f) and self.world > 1:
            torch.distributed.all_reduce(f)
        return f.item() if torch.is_tensor(f) else f

    def read(self, late=False):
        """Sum over processes, read, reset → means since the last read, FLOPs, skipped steps, and
        whether any process is out of time (late)."""
        sums = torch.zeros(len(self.NAMES) + 1, dtype=sum_dtype(self.args.device),
                           device=self.args.device)
        for i, k in enumerate(self.NAMES):
            sums[i] += self.sums.get(k, 0)
        sums[-1] += float(late)
        if self.world > 1:
            torch.distributed.all_reduce(sums)
        v = dict(zip(self.NAMES + ('late',), sums.tolist()))
        n = max(1, self.micro_steps * self.world)
        r = {k: v[k] / n if k in self.sums else None for k in self.NAMES[:5]}
        r.update(sf=r['sf'] or 1.0, flops=v['flops'] + self.host_flops, bad=int(v['bad']),
                 late=v['late'] > 0, grad_norm=v['grad_norm'] / v['norms'] if v['norms'] else None)
        self.sums, self.micro_steps, self.host_flops = {}, 0, 0.0
        return r


def duration(s):
    """Seconds for the terminal: 0:09:12; '?' where unknown."""
    return '?' if s is None or not math.isfinite(s) else str(timedelta(seconds=round(max(0, s))))
