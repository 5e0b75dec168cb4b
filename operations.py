"""
The operational side of dynpool: what keeps runs safe and scripts honest, apart from the method.

train.py, sample.py and bench.py import this module; the model is in dynpool.py and the training
method in train.py. Here: the user-error type and exit handling, shared argument types, device
choice, checkpoint reading and writing, run-folder locks, deferred Ctrl-C, data-file validation,
the logger, device-side step statistics, and DDP wrapping and teardown. Nothing here reads the
environment at import time: torchrun's RANK / LOCAL_RANK / WORLD_SIZE are read by
`torchrun_processes()` when a script asks.
"""
import argparse
import dataclasses
import errno
import fcntl
import hashlib
import importlib
import inspect
import io
import json
import math
import os
import pickle
import platform
import random
import re
import resource
import shlex
import signal
import stat
import sys
import time
import zipfile
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from torch.nn.parallel import DistributedDataParallel as DDP

from dynpool import Config, DynamicPoolingLM, ModelOutput, step_flops


class Processes(NamedTuple):
    """This process's place among torchrun's processes."""
    rank: int = 0
    local_rank: int = 0
    world: int = 1


def torchrun_processes():
    """Processes from torchrun's environment (one process without torchrun)."""
    env = os.environ
    return Processes(int(env.get('RANK', 0)), int(env.get('LOCAL_RANK', 0)),
                     int(env.get('WORLD_SIZE', 1)))


class UserError(Exception):
    """A user mistake or a fault the user can fix: the script prints it as one `error: ...` line and
    exits with `code` (1; 2 for bad command-line flags, 130 for Ctrl-C)."""

    def __init__(self, msg, code=1):
        super().__init__(msg)
        self.code = code


def pick_device(name=None, local_rank=None):
    """'cpu', 'cuda', 'cuda:1', 'mps' → the checked device string; None → cuda if there is one.
    local_rank (torchrun's LOCAL_RANK): a CUDA device becomes this process's own GPU."""
    if name is None:
        name = 'cuda' if torch.cuda.is_available() else 'cpu'
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        dev = None
    if dev is None or dev.type not in ('cpu', 'cuda', 'mps') or dev.type == 'cpu' and dev.index:
        raise UserError(f'--device {name} is not one of cpu, cuda, cuda:N, mps', code=2)
    if dev.type == 'cuda' and local_rank is not None and torch.cuda.is_available():
        count = torch.cuda.device_count()
        # every GPU of the node visible: the LOCAL_RANK-th; a scheduler that shows each process
        # only its own (CUDA_VISIBLE_DEVICES): that one, whatever LOCAL_RANK says
        if count > local_rank or count == 1:
            dev = torch.device('cuda', local_rank if count > local_rank else 0)
        else:
            raise UserError(f'LOCAL_RANK {local_rank} but this process sees {count} CUDA devices '
                            f'(one per process, or all of the node\'s, is expected)')
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


# A checkpoint proves itself: ckpt.pt is torch.save's zip archive whose zip comment (the archive's
# last bytes, which torch.load and zip readers skip) is CHECKSUM_TAG and the SHA-256, in hex, of
# every byte before the hex digits. Any flipped byte, anywhere in the file, fails the check.
CHECKSUM_TAG = b'dynpool-checkpoint sha256 '
_EOCD = b'PK\x05\x06'  # zip's end-of-central-directory record: 22 bytes, then the comment
_SEAL = len(CHECKSUM_TAG) + 64  # the comment's length


def write_sealed(f, data):
    """Write torch.save's bytes `data` to file f with the checksum comment at the end."""
    if len(data) < 22 or bytes(data[-22:-18]) != _EOCD or bytes(data[-2:]) != b'\0\0':
        raise RuntimeError('torch.save wrote no zip archive with an empty comment')
    h = hashlib.sha256()
    for part in (data[:-2], _SEAL.to_bytes(2, 'little'), CHECKSUM_TAG):  # the comment's length
        h.update(part)
        f.write(part)
    f.write(h.hexdigest().encode())


def verify_checksum(path):
    """True where the file's checksum matches its content, False for a checkpoint without one
    (torch.save's own archive, written before checkpoints carried one); UserError otherwise."""
    size = path.stat().st_size
    with open(path, 'rb') as f:
        f.seek(max(0, size - 22 - _SEAL))
        tail = f.read()
        sealed = len(tail) == 22 + _SEAL and (tail[:4] == _EOCD or
                                              tail[22:22 + len(CHECKSUM_TAG)] == CHECKSUM_TAG)
        if not sealed:
            if tail[-22:-18] == _EOCD and tail[-2:] == b'\0\0':
                return False
            raise UserError(f'cannot read checkpoint {path}: corrupt or not a torch checkpoint '
                            f'(it does not end as one: cut short, or another kind of file)')
        f.seek(0)
        h, left = hashlib.sha256(), size - 64
        while left > 0:
            block = f.read(min(left, 1 << 22))
            if not block:
                break
            h.update(block)
            left -= len(block)
    if h.hexdigest().encode() != tail[-64:]:
        raise UserError(f'checkpoint {path} is corrupt: its content does not match the SHA-256 '
                        f'checksum written with it (a damaged disk or copy); use another copy')
    return True


def non_finite_tensor(obj, name=''):
    """The name of the first floating tensor in obj (nested dicts, lists, tuples) that holds a NaN
    or an inf, e.g. 'model.lm_head.weight' or 'optimizer.state.3.exp_avg'; None if all are finite."""
    if isinstance(obj, torch.Tensor):
        finite = not (obj.is_floating_point() or obj.is_complex()) or bool(torch.isfinite(obj).all())
        return None if finite else name
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(
        obj, (list, tuple)) else ()
    for k, v in items:
        found = non_finite_tensor(v, f'{name}.{k}' if name else str(k))
        if found is not None:
            return found
    return None


def alphabet_problem(alphabet, space_id, vocab_size=None):
    """What is wrong with a vocabulary (distinct single characters, the space's id pointing at ' ',
    vocab_size its length where given), in words; None if nothing."""
    if not isinstance(alphabet, (list, tuple)) or not all(isinstance(c, str) and len(c) == 1
                                                          for c in alphabet):
        return 'the alphabet must be a list of single characters'
    if len(set(alphabet)) != len(alphabet):
        twice = next(c for i, c in enumerate(alphabet) if c in alphabet[:i])
        return f'the alphabet holds {twice!r} twice'
    if vocab_size is not None and (type(vocab_size) is not int or vocab_size != len(alphabet)):
        return f'vocab_size {vocab_size!r} is not the {len(alphabet)} characters of the alphabet'
    if space_id is not None and (type(space_id) is not int or not 0 <= space_id < len(alphabet)
                                 or alphabet[space_id] != ' '):
        return f'space_id {space_id!r} is not the id of the space character in the alphabet'
    return None


def _is_number(v, none_ok=False):
    """A finite, non-negative int or float (bool is not a number here)."""
    if v is None:
        return none_ok
    return type(v) in (int, float) and math.isfinite(v) and v >= 0


def _is_rng(rng):
    """train.py's RNG states: torch's and CUDA's byte tensors, numpy's and Python's state tuples."""
    def byte_tensor(t):
        return isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.dim() == 1
    numpy, python = rng.get('numpy'), rng.get('python')
    return (byte_tensor(rng.get('torch')) and (rng.get('cuda') is None or byte_tensor(rng['cuda']))
            and isinstance(numpy, (tuple, list)) and len(numpy) == 5 and numpy[0] == 'MT19937'
            and isinstance(python, (tuple, list)) and len(python) == 3)


# The training state's fields and what each must be, checked where a checkpoint is read.
CHECKPOINT_FIELDS = {
    'step': ('a count >= 0', lambda v: type(v) is int and v >= 0),
    'epoch': ('a count >= 0', lambda v: type(v) is int and v >= 0),
    'pos': ('a count >= 0', lambda v: type(v) is int and v >= 0),
    'train_chars': ('a count >= 0', lambda v: type(v) is int and v >= 0),
    'train_flops': ('a number >= 0 or null', lambda v: _is_number(v, none_ok=True)),
    'train_time': ('a number of seconds >= 0', _is_number),
    'budget_flops': ('a number >= 0', _is_number),
    'warmup_flops': ('a number >= 0 or null', lambda v: _is_number(v, none_ok=True)),
    'args': ('a dict of flags', lambda v: isinstance(v, dict) and all(isinstance(k, str) for k in v)),
    'schedule': ('a dict', lambda v: isinstance(v, dict)),
    'scaler': ('a dict (the GradScaler state)', lambda v: isinstance(v, dict)),
    'optimizer': ('a dict with state and param_groups', lambda v: isinstance(v, dict) and
                  isinstance(v.get('state'), dict) and isinstance(v.get('param_groups'), list)),
    'rng': ('a dict of torch, cuda, numpy and python RNG states',
            lambda v: isinstance(v, dict) and _is_rng(v)),
    'model': ('a dict of named tensors', lambda v: isinstance(v, dict) and all(
        isinstance(k, str) and isinstance(t, torch.Tensor) for k, t in v.items())),
}


def check_checkpoint_fields(ckpt, path):
    """Every field of a checkpoint that is present, checked (counts, numbers, dicts, RNG states,
    the model's named tensors, the vocabulary): one UserError line naming the first wrong one."""
    for k, (rule, ok) in CHECKPOINT_FIELDS.items():
        if k in ckpt and not ok(ckpt[k]):
            shown = ckpt[k] if isinstance(ckpt[k], (int, float, str, type(None))) else \
                type(ckpt[k]).__name__
            raise UserError(f'checkpoint {path}: {k} must be {rule}, not {shown!r}'[:300])
    vocab = ckpt.get('vocab')
    why = 'it must be a dict' if not isinstance(vocab, dict) else alphabet_problem(
        vocab.get('alphabet'), vocab.get('space_id'), vocab.get('vocab_size'))
    if why:
        raise UserError(f'checkpoint {path}: its vocab is wrong: {why}')


def _torch_load(path, trust):
    """torch.load with safe loading (numpy's RNG state allowed), every failure one UserError line."""
    try:
        with torch.serialization.safe_globals(_numpy_safe_globals()):
            return torch.load(path, map_location='cpu', weights_only=not trust)
    except pickle.UnpicklingError as e:
        found = re.search(r'Unsupported global: GLOBAL (\S+)', str(e))
        if found and not trust:  # a readable file that pickles more than tensors and containers
            raise UserError(f'checkpoint {path} holds a pickled {found.group(1)}, which safe '
                            f'loading refuses; load it only if you trust the file') from None
        raise UserError(f'cannot read checkpoint {path}: corrupt or not a torch '
                        f'checkpoint') from None
    except (RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile, AttributeError,
            ImportError, TypeError, KeyError, IndexError, RecursionError) as e:
        msg = str(e).strip().splitlines()[0].split('. ')[0] if str(e).strip() else type(e).__name__
        raise UserError(f'cannot read checkpoint {path} (corrupt or not a torch checkpoint): '
                        f'{msg}') from None


def _read_checkpoint(path, trust=False):
    """read_checkpoint → (checkpoint dict, whether its checksum was verified)."""
    path = Path(path)
    if path.is_dir():
        path = path / 'ckpt.pt'
    if not path.is_file():
        raise UserError(f'no checkpoint at {path}')
    try:
        verified = verify_checksum(path)
    except OSError as e:
        raise UserError(f'cannot read checkpoint {path}: {e.strerror or e}') from None
    ckpt = _torch_load(path, trust)
    if not isinstance(ckpt, dict):
        raise UserError(f'checkpoint {path} holds a {type(ckpt).__name__}, not the dict train.py '
                        f'writes')
    missing = [k for k in ('model', 'config', 'vocab') if k not in ckpt]
    if missing:
        raise UserError(f'checkpoint {path} lacks {", ".join(missing)}: not written by train.py')
    check_checkpoint_fields(ckpt, path)
    try:
        cfg = config_from_dict(ckpt['config'])
    except UserError as e:
        raise UserError(f'checkpoint {path}: {e}') from None
    if len(ckpt['vocab']['alphabet']) > cfg.vocab_size:
        raise UserError(f'checkpoint {path}: the alphabet has {len(ckpt["vocab"]["alphabet"])} '
                        f'characters but the model\'s vocab_size is {cfg.vocab_size}')
    bad = non_finite_tensor({k: ckpt[k] for k in ('model', 'optimizer') if k in ckpt})
    if bad is not None:
        raise UserError(f'checkpoint {path}: {bad} holds NaN or inf values (saved from a run that '
                        f'diverged?); use an earlier checkpoint')
    ckpt['path'] = str(path)
    return ckpt, verified


def warn_unverified(path):
    """One stderr line (rank 0) for a checkpoint without a checksum, which is loaded as it is."""
    if torchrun_processes().rank == 0:
        print(f'warning: checkpoint {path} has no checksum (written before checkpoints carried '
              f'one), so its bytes cannot be verified; loading it as it is', file=sys.stderr,
              flush=True)


def read_checkpoint(path, trust=False):
    """train.py's checkpoint (a file, or a run directory holding ckpt.pt) → its dict, its checksum
    verified, its fields checked (check_checkpoint_fields), its weights and optimizer state finite.
    Raises UserError, one line, for every way it can be wrong; a checkpoint from before checksums
    loads with a one-line warning. trust=True also unpickles arbitrary Python objects (only for
    files you trust)."""
    ckpt, verified = _read_checkpoint(path, trust)
    if not verified:
        warn_unverified(ckpt['path'])
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
    ckpt, verified = _read_checkpoint(path, trust)
    model = DynamicPoolingLM(config_from_dict(ckpt['config']))
    model = load_weights(model, ckpt['model'], ckpt['path']).to(device).eval()
    if not verified:  # (only once it loads: a refused file says only why)
        warn_unverified(ckpt['path'])
    return model, ckpt


# ----------------------------------------------------------------------------- argument types
# Every script's flags use these: argparse turns their ArgumentTypeError into one line that names
# the flag ("argument --lr: must be a finite number > 0, got inf") and the script exits with 2.
def _parse(s, kind, rule):
    """s → int or float (finite), or ArgumentTypeError naming the rule."""
    try:
        v = kind(s)
    except (TypeError, ValueError, OverflowError):
        v = None
    if v is None or (kind is float and not math.isfinite(v)):
        raise argparse.ArgumentTypeError(f'must be {rule}, got {s!r}')
    return v


def int_range(lo, hi=None):
    """Argument type: an integer in [lo, hi] (hi None: no upper end)."""
    top = f'2**{hi.bit_length()})' if hi is not None and hi > 2 ** 16 and not hi & (hi + 1) else f'{hi}]'
    rule = f'an integer >= {lo}' if hi is None else f'an integer in [{lo}, {top}'

    def parse(s):
        v = _parse(s, int, rule)
        if v < lo or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f'must be {rule}, got {v}')
        return v
    parse.__name__ = f'int_range({lo}, {hi})'
    return parse


def float_range(lo=None, hi=None, lo_open=False, hi_open=False):
    """Argument type: a finite float between lo and hi (None: no end; *_open: the end excluded)."""
    if lo is not None and hi is not None:
        rule = f'a finite number in {"(" if lo_open else "["}{lo:g}, {hi:g}{")" if hi_open else "]"}'
    elif lo is not None:
        rule = f'a finite number {">" if lo_open else ">="} {lo:g}'
    else:
        rule = f'a finite number {"<" if hi_open else "<="} {hi:g}' if hi is not None else 'a finite number'

    def parse(s):
        v = _parse(s, float, rule)
        if (lo is not None and (v < lo or lo_open and v == lo)
                or hi is not None and (v > hi or hi_open and v == hi)):
            raise argparse.ArgumentTypeError(f'must be {rule}, got {str(s).strip()}')
        return v
    parse.__name__ = f'float_range({lo}, {hi})'
    return parse


positive_int = int_range(1)                    # counts, sizes, steps
non_negative_int = int_range(0)                # counts where 0 means none
seed_int = int_range(0, 2 ** 63 - 1)           # torch.Generator seeds
numpy_seed = int_range(0, 2 ** 32 - 1)         # seeds that also seed numpy's legacy RNG
positive_float = float_range(0, lo_open=True)  # learning rate, temperature, seconds, FLOPs
non_negative_float = float_range(0)            # gradient clip (0 = off), loss weights
fraction = float_range(0, 1, hi_open=True)     # dropout rates: [0, 1)
probability = float_range(0, 1, lo_open=True, hi_open=True)  # a rate whose log is taken: (0, 1)


def flop_budget(s):
    """Argument type of --flop-budget: a number of FLOPs, or `vanilla:N`, the FLOPs of N steps of
    the vanilla model of the same shape (resolve_budget turns it into the number)."""
    if str(s).strip().startswith('vanilla:'):
        steps = str(s).strip()[len('vanilla:'):]
        if not steps.isdigit() or int(steps) < 1:
            raise argparse.ArgumentTypeError(f'vanilla:N needs N, a step count >= 1, got {s}')
        return f'vanilla:{int(steps)}'
    return positive_float(s)


def reseed_rank(seed, rank, step):
    """Ranks above 0 draw dropout masks and Gumbel noise of their own. Only rank 0's random state
    is saved, so the others restart their streams at every checkpoint's step, as a resumed run
    does: kill/resume stays bit-exact under DDP."""
    if rank > 0:
        torch.manual_seed(seed + 1000 * rank + step)


def resolve_budget(args, cfg):
    """--flop-budget vanilla:N → N x the FLOPs of a step of the vanilla model of cfg's shape."""
    if isinstance(args.flop_budget, str):
        vanilla = dataclasses.replace(cfg, boundary='none')
        steps = int(args.flop_budget.split(':')[1])
        args.flop_budget = steps * step_flops(vanilla, args.batch_size, args.seq_len)


def thread_count(s):
    """Argument type: threads, between 1 and this machine's cores."""
    v, cores = _parse(s, int, 'an integer number of threads'), os.cpu_count() or 1
    if not 1 <= v <= cores:   # torch would try to start them all (and abort for a huge count)
        raise argparse.ArgumentTypeError(f'must be between 1 and the {cores} cores of this machine, '
                                         f'got {v}')
    return v


def _limit(p, name, default):
    """os.pathconf limit of the nearest existing folder of p (default where the system has none)."""
    for d in (p, *p.parents) if p.is_absolute() else (p, *p.parents, Path('.')):
        try:
            return os.pathconf(d, name) if d.is_dir() else default
        except (OSError, ValueError):
            continue
    return default


def _name_problem(p, room=0):
    """Why path p cannot exist on this file system (a name or the whole path too long), or None."""
    name_max, path_max = _limit(p, 'PC_NAME_MAX', 255), _limit(p, 'PC_PATH_MAX', 4096)
    long = [part for part in p.parts if len(os.fsencode(part)) > name_max]
    if long:
        return (f'the name {long[0][:20]}... is {len(os.fsencode(long[0]))} bytes, longer than the '
                f'{name_max} this file system allows')
    if len(os.fsencode(str(p))) + room >= path_max:
        return (f'the path is {len(os.fsencode(str(p)))} bytes long, over the {path_max} this system '
                f'allows' + (' with the file names written inside it' if room else ''))
    return None


def _kind_of(st):
    """What a stat result describes, in words."""
    for test, what in ((stat.S_ISDIR, 'a directory'), (stat.S_ISREG, 'a file'),
                       (stat.S_ISFIFO, 'a FIFO (named pipe)'), (stat.S_ISSOCK, 'a socket'),
                       (stat.S_ISCHR, 'a character device'), (stat.S_ISBLK, 'a block device')):
        if test(st.st_mode):
            return what
    return 'not a regular file'


def _stat(p):
    """os.stat(p), None if p does not exist, or the reason it cannot be looked at, in words."""
    try:
        return os.stat(p)
    except FileNotFoundError:
        return None
    except NotADirectoryError:  # a component on the way is a file
        blocker = next((q for q in reversed((p, *p.parents)) if q.exists() and not q.is_dir()), p)
        return f'{blocker} is {_kind_of(blocker.stat())}, not a directory'
    except OSError as e:
        if e.errno == errno.ENAMETOOLONG:
            return _name_problem(p) or e.strerror
        return e.strerror or str(e)


def _path_problem(p, kind):
    """Why p cannot serve as `kind` (see check_path), or None."""
    if '\0' in str(p):
        return 'a path cannot hold a NUL character'
    st = _stat(p)
    if isinstance(st, str):
        return st
    if kind in ('file', 'dir'):
        want = 'a directory' if kind == 'dir' else 'a file'
        if st is None:
            return f'no such {"directory" if kind == "dir" else "file"}'
        if _kind_of(st) != want:
            return f'is {_kind_of(st)}, not {"a regular file" if kind == "file" else want}'
        if not os.access(p, os.R_OK | (os.X_OK if kind == 'dir' else 0)):
            return 'is not readable (permission denied)'
        return None
    want = 'a directory' if kind == 'new-dir' else 'a file'
    if st is not None:
        if _kind_of(st) != want:
            return f'is {_kind_of(st)}, not {"a directory" if kind == "new-dir" else "a regular file"}'
        return None if os.access(p, os.W_OK) else 'is not writable (permission denied)'
    too_long = _name_problem(p, room=64 if kind == 'new-dir' else 0)
    if too_long:
        return too_long
    # new-file: its folder must exist; new-dir: the nearest existing folder must take a new one
    parent = p.parent if kind == 'new-file' else next(q for q in p.parents if q.exists())
    pst = _stat(parent)
    if isinstance(pst, str):
        return pst
    if pst is None:
        return f'the folder {parent} does not exist'
    if not stat.S_ISDIR(pst.st_mode):
        return f'{parent} is {_kind_of(pst)}, not a directory'
    if not os.access(parent, os.W_OK | os.X_OK):
        return f'cannot create it: {parent} is not writable (permission denied)'
    return None


PATH_KINDS = ('file', 'dir', 'new-file', 'new-dir')


def check_path(path, kind='file', flag=None, code=1):
    """A user's path → Path, checked for `kind`: 'file' (a readable regular file), 'dir' (a readable
    directory), 'new-file' (a regular file, or none yet, to write in an existing directory), 'new-dir'
    (a writable directory, or one that can be made); one UserError line naming it otherwise."""
    if kind not in PATH_KINDS:
        raise ValueError(f'kind must be one of {PATH_KINDS}, not {kind!r}')
    text = os.fspath(path)
    why = 'an empty path' if not text else _path_problem(Path(text), kind)
    if why:
        shown = text if len(text) <= 100 else f'{text[:40]}...{text[-40:]}'  # one readable line
        shown = ''.join(c if c.isprintable() else repr(c)[1:-1] for c in shown)
        raise UserError(f'{flag + " " if flag else ""}{shown}: {why}', code)
    return Path(text)


def user_path(kind='file'):
    """Argument type: a path checked by check_path at parse time (exit 2, the flag named)."""
    def parse(s):
        try:
            return check_path(s, kind)
        except UserError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    parse.__name__ = f'{kind} path'
    return parse


def die(msg, code=1, rank=0):
    """One clear line on stderr (rank 0) and exit code `code`: never a traceback."""
    if rank == 0:
        print(f'error: {msg}', file=sys.stderr, flush=True)
    sys.exit(code)


def import_optional(module, package, flag):
    """Import a logging package only when its flag asks for it; one line if it is not installed."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(f'{flag} needs the {package} package: pip install {package} '
                        f'(or drop {flag})') from None


def prepare_command(d):
    """The prepare_data.py command that writes dataset directory d."""
    out_dir = '' if d.parent == Path('data') else f' --out-dir {d.parent}'
    name, _, lang = d.name.partition('-')
    if d.name == 'text8':
        return f'python prepare_data.py{out_dir}'
    if name in ('wiki40b', 'cc100') and lang:
        return f'python prepare_data.py --dataset {name} --lang {lang}{out_dir}'
    return f'python prepare_data.py --input FILE --lang LANG --name {d.name}{out_dir}'


def _clip(v, n=60):
    """A JSON value in a message, cut to n characters."""
    text = json.dumps(v, ensure_ascii=False) if not isinstance(v, float) or math.isfinite(v) else str(v)
    return text if len(text) <= n else text[:n - 3] + '...'


def _is_file_name(v):
    """A plain file name inside the dataset directory (no folder, no way out of it)."""
    return isinstance(v, str) and v not in ('', '.', '..') and '/' not in v and '\\' not in v \
        and '\0' not in v


def label_set_problem(u, where):
    """What is wrong with one Unigram label set of meta.json (vocab_size, label file names, model,
    shortening factors, settings), in words; None if nothing."""
    if not isinstance(u, dict) or type(u.get('vocab_size')) is not int or u['vocab_size'] < 1:
        return f'{where} is {_clip(u)}, expected a label set: an object with an integer vocab_size'
    labels, sf = u.get('labels', {}), u.get('shortening_factor', {})
    if not isinstance(labels, dict) or not all(isinstance(s, str) and _is_file_name(f)
                                               for s, f in labels.items()):
        return f'{where}["labels"] is {_clip(labels)}, expected {{split: file name in the dataset}}'
    if u.get('model') is not None and not _is_file_name(u['model']):
        return f'{where}["model"] is {_clip(u["model"])}, expected a file name or null'
    if not isinstance(sf, dict) or not all(v is None or _is_number(v) for v in sf.values()):
        return f'{where}["shortening_factor"] is {_clip(sf)}, expected {{split: number or null}}'
    if not isinstance(u.get('settings', {}), (dict, type(None))):
        return f'{where}["settings"] is {_clip(u["settings"])}, expected an object or null'
    return None


def unigram_problem(meta):
    """What is wrong with meta.json's Unigram label sets: "unigram" (the default set, or null) and
    "unigram_sets" ({"<V>": set}, absent in datasets with one set); None if nothing."""
    default, sets = meta.get('unigram'), meta.get('unigram_sets')
    if default is not None:
        why = label_set_problem(default, '"unigram"')
        if why:
            return why
    if sets is None:
        return None
    if not isinstance(sets, dict):
        return f'"unigram_sets" is {_clip(sets)}, expected {{"<V>": label set}}'
    for k, u in sets.items():
        why = label_set_problem(u, f'"unigram_sets"[{json.dumps(k)}]')
        if why or str(u['vocab_size']) != k:
            return why or f'"unigram_sets"[{json.dumps(k)}] has vocab_size {u["vocab_size"]}, not {k}'
    if default is not None and str(default['vocab_size']) not in sets:
        return f'"unigram" names vocab_size {default["vocab_size"]}, which "unigram_sets" lacks'
    return None


def meta_problem(meta):
    """What is wrong with a meta.json dict, field by field, in words; None if nothing."""
    if not isinstance(meta, dict):
        return f'holds {_clip(meta)}, not an object'
    missing = [k for k in ('alphabet', 'vocab_size', 'dtype') if k not in meta]
    if missing:
        return f'lacks {", ".join(missing)}'
    dtype, V = meta['dtype'], meta['vocab_size']
    if not isinstance(dtype, str) or dtype not in ('uint8', 'uint16'):
        return f'gives dtype {_clip(dtype)}; token ids are uint8 or uint16'
    if type(V) is not int or not 1 <= V <= np.iinfo(dtype).max + 1:
        return f'gives vocab_size {_clip(V)}, not a count of characters that fits {dtype}'
    why = alphabet_problem(meta['alphabet'], meta.get('space_id'), V)
    if why:
        return why
    nl = meta.get('newline_id')
    if nl is not None and (type(nl) is not int or not 0 <= nl < V or meta['alphabet'][nl] != '\n'):
        return f'newline_id {_clip(nl)} is not the id of the newline character in the alphabet'
    sizes = meta.get('sizes', {})
    if not isinstance(sizes, dict) or not all(type(n) is int and n >= 0 for n in sizes.values()):
        return f'sizes is {_clip(sizes)}, expected {{split: number of characters}}'
    mwl = meta.get('mean_word_length')
    if mwl is not None and not (_is_number(mwl) and mwl > 0):
        return f'mean_word_length is {_clip(mwl)}, expected a positive number or null'
    defaults = meta.get('defaults', {})
    if not isinstance(defaults, dict) or not all(_is_number(v) for v in defaults.values()) or \
            not 0 < defaults.get('prior', 0.5) < 1 or type(defaults.get('unigram', 0)) is not int:
        return (f'defaults is {_clip(defaults)}, expected numbers per flag (an integer "unigram", '
                f'a "prior" in (0, 1))')
    return unigram_problem(meta)


def read_meta(d):
    """meta.json of dataset directory d, every field checked (meta_problem): one line otherwise."""
    path, remake = d / 'meta.json', f'remake it with: {prepare_command(d)}'
    if not path.is_file():
        raise UserError(f'no dataset at {d} (make it with: {prepare_command(d)})')
    try:
        meta = json.loads(path.read_text(encoding='utf-8'))
    except (ValueError, OSError, RecursionError) as e:
        why = getattr(e, 'strerror', None) or str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f'{path} is unreadable ({why}); {remake}') from None
    why = meta_problem(meta)
    if why:
        raise UserError(f'{path}: {why}; {remake}')
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


def label_files(d, meta, splits, vocab_size=None):
    """{split: path} of the Unigram label set of vocab_size (None: meta.json's default "unigram"),
    named as the set's "labels" gives them; None if the dataset has no such set."""
    sets = meta.get('unigram_sets') or {}
    u = meta.get('unigram') if vocab_size is None else sets.get(str(vocab_size))
    if u is None and vocab_size is not None and (meta.get('unigram') or {}).get('vocab_size') == \
            vocab_size:
        u = meta['unigram']  # a dataset from before "unigram_sets": its one set
    if u is None:
        return None
    names = u.get('labels') or {}
    return {s: d / names.get(s, f'{s}.unigram-{u["vocab_size"]}.bin') for s in splits}


def load_data(data_dir, boundary, unigram=None):
    """(meta, {split: token ids}, {split: Unigram labels} or None), all checked once at load;
    unigram: the vocab_size of the label set to train on (None: meta.json's default set)."""
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
        files = label_files(d, meta, splits, unigram)
        if files is None:
            have = sorted(int(v) for v in meta.get('unigram_sets') or {})
            size = unigram or (have[-1] if have else 10000)
            has = f'; it has unigram-{", unigram-".join(map(str, have))}' if have else ''
            raise UserError(f'--boundary unigram needs Unigram labels in {d}{has} (make them '
                            f'with: {prepare_command(d)} --unigram {size})')
        labels = {s: open_ids(f, 'uint8', len(splits[s]), 2, 'Unigram labels', remake)
                  for s, f in files.items()}
    return meta, splits, labels


def to_device(t, device):
    """Host tensor → device; on CUDA through pinned memory without waiting for the copy."""
    if torch.device(device).type == 'cuda':
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


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
    """Write state atomically (temp file, fsync, rename) with its checksum (write_sealed); weights
    or optimizer state holding NaN or inf are refused, never written. On any failure the temp file
    is removed and the previous checkpoint (of step saved_step, None if none) stays as it was."""
    bad = non_finite_tensor(state)
    if bad is not None:
        raise UserError(f'refusing to save checkpoint {path}: {bad} holds NaN or inf values; '
                        f'{kept(path, saved_step)}')
    tmp = path.with_name(path.name + '.tmp')
    try:
        buf = io.BytesIO()  # in memory first: the checksum covers the bytes as torch.save made them
        torch.save(state, buf)
        with open(tmp, 'wb') as f, buf.getbuffer() as data:
            write_sealed(f, data)
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename: a power cut leaves no empty ckpt.pt
        os.replace(tmp, path)  # atomic: a crash mid-save never leaves a broken checkpoint
        try:  # the rename itself survives a power cut once the directory is on disk
            fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError:
            pass  # some file systems cannot sync a directory; the checkpoint is written all the same
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


def _last_line_cut(data):
    """Where the last line of a JSON-lines log's bytes starts if it is cut (no newline at its end,
    or not a JSON object), else None."""
    if not data:
        return None
    end = len(data) - 1 if data.endswith(b'\n') else len(data)
    start = data.rfind(b'\n', 0, end) + 1
    if end < len(data):
        try:
            if isinstance(json.loads(data[start:end]), dict):
                return None
        except ValueError:
            pass
    return start


def _write_atomically(path, data):
    """Replace path's content by data (temp file, fsync, rename): never half of each."""
    tmp = path.with_name(path.name + '.tmp')
    try:
        with open(tmp, 'wb') as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise UserError(f'cannot rewrite {path}: {e.strerror or e}; it is left as it was') from None
    finally:
        tmp.unlink(missing_ok=True)


def repair_log(path, resumed_from=None):
    """Before a run appends to log.jsonl: drop a cut last line (a run stopped mid-record), and on
    --resume the records of steps after the checkpoint's step resumed_from (the run redoes them;
    config records stay). Says what it dropped in one stderr line each; the rewrite is atomic."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return
    except OSError as e:
        raise UserError(f'cannot read {path}: {e.strerror or e}') from None
    cut = _last_line_cut(data)
    if cut is not None:
        print(f'warning: {path}: dropped its last line, cut short ({len(data) - cut} bytes left by '
              f'a run that stopped while writing it)', file=sys.stderr, flush=True)
        data = data[:cut]
    dropped = 0
    if resumed_from is not None:
        kept_lines = []
        for line in data.splitlines(keepends=True):
            try:
                rec = json.loads(line)
            except ValueError:
                rec = None  # a line we cannot read is no record of a later step: kept as it is
            later = (isinstance(rec, dict) and rec.get('kind') != 'config'
                     and type(rec.get('step')) is int and rec['step'] > resumed_from)
            dropped += later
            if not later:
                kept_lines.append(line)
        data = b''.join(kept_lines)
        if dropped:
            print(f'note: {path}: dropped {dropped} record(s) of steps after {resumed_from}, the '
                  f'checkpoint\'s step (the resumed run redoes them)', file=sys.stderr, flush=True)
    if cut is not None or dropped:
        _write_atomically(path, data)


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
                why = (str(e).strip().splitlines() or [type(e).__name__])[0]
                raise UserError(f'--wandb {args.wandb}: cannot start Weights & Biases '
                                f'({why})') from None
        self.log(config_record)

    def append(self, line):
        """Append one line to log.jsonl whole or not at all: a write that fails part-way (a full
        disk) or is interrupted is cut back off, so the file ends with the last whole record."""
        data = line.encode('utf-8')
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as e:
            raise UserError(f'cannot write {self.path}: {e.strerror or e}') from None
        try:
            size = os.fstat(fd).st_size
            done = 0
            while done < len(data):  # one write, unless the system takes only part of it
                done += os.write(fd, data[done:])
        except BaseException as e:  # OSError, or Ctrl-C between two parts
            try:
                os.ftruncate(fd, size)
            except OSError:
                pass  # the next run's repair_log drops the cut line
            if not isinstance(e, OSError):
                raise
            raise UserError(f'cannot write {self.path}: {e.strerror or e}; it keeps every whole '
                            f'record before this one') from None
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
    """Peak memory in MiB since the last call (CUDA: allocated on the device, whose peak this
    resets); on CPU the process's peak resident memory, which cannot be reset."""
    if torch.device(device).type == 'cuda':
        peak = torch.cuda.max_memory_allocated(device) / 2**20
        torch.cuda.reset_peak_memory_stats(device)
        return peak
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: kilobytes


def sum_dtype(device):
    """float64 for the running sums, where the device has it."""
    return torch.float32 if torch.device(device).type == 'mps' else torch.float64


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
        ddp_kw = inspect.signature(DDP.__init__).parameters
        no_sync = ({'forward_sync_buffers': False} if 'forward_sync_buffers' in ddp_kw
                   else {'broadcast_buffers': False})
        device = torch.device(args.device)
        model = DDP(model, device_ids=[device.index] if device.type == 'cuda' else None,
                    find_unused_parameters=False, static_graph=args.grad_accum == 1,
                    gradient_as_bucket_view=True, **no_sync)
    return model


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
            at = [self.NAMES.index(k) for k in names]
            self.index[names] = torch.tensor(at, device=self.sums.device)
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


# ----------------------------------------------------------------------------- training runs
# train.py's run lifetime, its lines on the terminal, and the parts of its set-up and checkpoints
# that keep a run safe rather than define the method.


def layer_counts(s):
    """Argument type: pre,shortened,post layer counts like 2,8,2 (each 0 to 1000)."""
    try:
        counts = [int(v) for v in str(s).split(',')]
    except ValueError:
        counts = []
    if len(counts) != 3 or not all(0 <= n <= 1000 for n in counts):
        raise argparse.ArgumentTypeError(f'must be three counts like 2,8,2 (each 0 to 1000), '
                                         f'got {s!r}')
    return ','.join(map(str, counts))


def nonblank(s):
    """Argument type: a name or path that is not blank and holds no NUL character."""
    if not s.strip() or '\0' in s:
        raise argparse.ArgumentTypeError(f'must be a non-blank name without NUL, got {s!r}')
    return s


def dataset_defaults(data_dir, names):
    """meta.json's per-language defaults ("defaults", e.g. the Gumbel prior 0.37 for Finnish) of
    the flags in names; {} where there are none (a missing or broken dataset is reported when the
    data is loaded)."""
    try:
        defaults = read_meta(Path(data_dir)).get('defaults')
    except UserError:
        return {}
    return {k: v for k, v in defaults.items() if k in names} if isinstance(defaults, dict) else {}


def _free_memory(device):
    """Bytes free for a new model on device: the GPU's free memory, else the host's available."""
    if torch.device(device).type == 'cuda':
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open('/proc/meminfo') as f:
            return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith('MemAvailable:'))
    except (OSError, StopIteration, ValueError, IndexError):
        return math.inf  # (no way to tell: let the allocation decide)


def check_model_memory(cfg, device):
    """Refuse, before anything is allocated, a model whose weights, gradients and Adam moments
    (16 bytes a parameter) exceed the free memory; the parameters are counted on the meta device."""
    try:
        with torch.device('meta'):
            n = DynamicPoolingLM(cfg).num_params()
    except (RuntimeError, ValueError, TypeError, OverflowError, MemoryError):
        n = math.inf  # sizes torch cannot even describe
    free = _free_memory(device)
    if 16 * n > free:
        raise UserError(f'the model would have {n:.3g} parameters, {16 * n / 2**30:.3g} GiB with '
                        f'gradients and Adam moments, more than the {free / 2**30:.3g} GiB free on '
                        f'{device}; choose smaller --d-model, --d-inner, --n-head, --d-head or '
                        f'--layers', code=2)


def check_resumable(ckpt, cfg, vocab, data):
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


def rng_states(device):
    """Every random generator's state, for a checkpoint to continue exactly."""
    device = torch.device(device)
    # this process's GPU only: the states of all of them would not restore on a machine with fewer
    cuda = torch.cuda.get_rng_state(device) if device.type == 'cuda' else None
    return dict(torch=torch.get_rng_state(), numpy=np.random.get_state(), python=random.getstate(),
                cuda=cuda)


def set_rng_states(rng, device):
    """Restore rng_states()."""
    torch.set_rng_state(rng['torch'])
    if torch.device(device).type == 'cuda' and rng['cuda'] is not None:
        torch.cuda.set_rng_state(rng['cuda'], device)
    np.random.set_state(rng['numpy'])
    random.setstate(rng['python'])


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


@contextmanager
def run_guard(out_dir, procs, where):
    """A training run's lifetime: its folder locked (rank 0; the OS drops a killed process's
    lock), Ctrl-C turned into one line and exit code 130 (where(): how far the run got, in
    words), and the DDP process group taken down by all ranks together (after an error, by each
    on its own: a rank still training would never arrive)."""
    lock = lock_run_dir(out_dir) if procs.rank == 0 else None
    ended = False
    try:
        yield
        ended = True
    except KeyboardInterrupt:
        raise UserError(where(), code=130) from None
    finally:
        if lock is not None:
            os.close(lock)
        if procs.world > 1 and torch.distributed.is_initialized():
            leave_process_group(wait=ended, world=procs.world)


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


class OneLineParser(argparse.ArgumentParser):
    """argparse whose mistakes are one UserError line (exit code 2), not the usage and a message."""

    def error(self, message):
        raise UserError(f'{message} (see python {self.prog} --help)', code=2)


def flag_parser(flags, description, default_of, prog=None):
    """A OneLineParser from a table of (flag, type, help): type None makes a switch (None, not
    False, when not given: a resumed run can tell), a tuple the choices; default_of(name) → the
    default in words, added to the help where it does not say its own."""
    p = OneLineParser(prog=prog, description=description)
    for flag, kind, words in flags:
        shown = default_of(flag[2:].replace('-', '_'))
        words += f' ({shown})' if shown and 'default' not in words else ''
        if kind is None:
            p.add_argument(flag, action='store_true', default=None, help=words)
        elif isinstance(kind, tuple):
            p.add_argument(flag, choices=kind, help=words)
        else:
            p.add_argument(flag, type=kind, help=words)
    return p


def resume_flags(ckpt_path, args, given, kept, not_resumed):
    """--resume: the checkpoint at ckpt_path, checked to hold a training state, and the flags it
    gives (all not given now, but those of one invocation only). A flag in `kept` given with
    another value than the checkpoint's ends with exit code 2."""
    if not ckpt_path.is_file():
        raise UserError(f'--resume but there is no checkpoint at {ckpt_path}')
    ckpt = read_checkpoint(ckpt_path)
    if {'args', 'optimizer', 'scaler', 'step', 'epoch', 'pos', 'rng'} - ckpt.keys():
        raise UserError(f'{ckpt_path} lacks the training state to resume from (not written by '
                        f'train.py)')
    for k in sorted(given & set(kept)):
        if getattr(args, k) != ckpt['args'].get(k):
            raise UserError(f'--{k.replace("_", "-")} {getattr(args, k)} differs from the '
                            f'checkpoint\'s {ckpt["args"].get(k)} (a resumed run keeps its model '
                            f'and data order)', code=2)
    return ckpt, {k: v for k, v in ckpt['args'].items() if k not in given and k not in not_resumed}


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


def training_checkpoint(model, optimizer, scaler, counters, cfg, vocab, args):
    """Everything train.py needs to continue a run exactly: weights, optimizer, AMP scaler, every
    RNG, the run's counters (step, data position, ...), config, vocabulary and flags."""
    return dict(model=model.state_dict(), optimizer=optimizer.state_dict(),
                scaler=scaler.state_dict(), **counters, config=dataclasses.asdict(cfg),
                vocab=vocab, args=vars(args), rng=rng_states(args.device),
                schedule=dict(lr=args.lr, warmup=args.warmup, max_steps=args.max_steps,
                              flop_budget=args.flop_budget))


def save_training(t, state, cfg, vocab, args):
    """Rank 0 writes the run's checkpoint (training_checkpoint, with the state's counters)."""
    if t.procs.rank == 0:
        counters = {k: v for k, v in vars(state).items() if k != 'saved'}
        save_checkpoint(Path(args.out) / 'ckpt.pt', training_checkpoint(
            t.raw_model, t.optimizer, t.scaler, counters, cfg, vocab, args), state.saved)


def restore_training(ckpt, model, optimizer, scaler, device):
    """Load training_checkpoint's weights, optimizer, AMP scaler and RNG states."""
    load_weights(model, ckpt['model'], ckpt['path'])
    optimizer.load_state_dict(ckpt['optimizer'])
    if ckpt['scaler']:  # a run saved without loss scaling (bf16, off) has none: fp16 starts afresh
        scaler.load_state_dict(ckpt['scaler'])
    set_rng_states(ckpt['rng'], device)


def run_summary(args, params, amp, world, resumed_at=None):
    """A training run's set-up in three lines for the terminal (log.jsonl has every flag)."""
    resumed = f' (resumed at step {resumed_at})' if resumed_at is not None else ''
    cap = f' (at most {args.max_steps} steps)' if args.max_steps < 10**9 else ''  # given
    end = (f'until {args.flop_budget:.3g} FLOPs{cap}' if args.flop_budget is not None
           else f'to step {args.max_steps}')
    return (f'{args.boundary} on {args.data} -> {args.out}{resumed}\n'
            f'  model: {params / 1e6:.2f}M parameters, layers {args.layers}, d_model '
            f'{args.d_model}, {args.n_head} heads x {args.d_head}, d_inner {args.d_inner}; '
            f'{args.device}, amp {amp}, {world} process(es)\n'
            f'  training: {args.batch_size} x {args.seq_len} chars a step, lr {args.lr:g}, '
            f'{args.warmup} warm-up steps, then a cosine {end}')


def check_loggers(args, rank):
    """Import the optional logging packages their flags ask for, before anything is written."""
    for flag, module, package in (('tensorboard', 'torch.utils.tensorboard', 'tensorboard'),
                                  ('wandb', 'wandb', 'wandb')):
        if getattr(args, flag) and rank == 0:
            import_optional(module, package, f'--{flag}')


def progress_line(where, r, dt, steps, chars_per_s, eta):
    """The terminal's line for a train record: where the run is, loss, speed and ETA."""
    return (f'{where} | loss {r["loss"]:.3f} | bpc {r["lm_loss"] / math.log(2):.3f} | sf '
            f'{r["sf"]:.2f} | {1000 * dt / max(1, steps):.0f} ms/step | '
            f'{short_count(chars_per_s)} chars/s | eta {duration(eta)}')


def sample_command(out, alphabet, tokens):
    """The sample.py command for run folder `out`, prompted with the first words of `tokens`."""
    text = ''.join(alphabet[i] for i in tokens[:40]).split('\n')[0]
    prompt = text.rsplit(' ', 1)[0] if ' ' in text.strip() else text  # whole words
    return f'python sample.py --ckpt {shlex.quote(str(out))} --prompt {shlex.quote(prompt)}'


def check_amp(amp, device):
    """--amp against the device: fp16 needs CUDA (loss scaling), bf16 runs on CUDA and CPU."""
    on = torch.device(device).type
    if amp in ('fp16', 'bf16') and on not in ('cuda', 'cpu') or amp == 'fp16' and on != 'cuda':
        raise UserError(f'--amp {amp} needs a CUDA GPU{"" if amp == "fp16" else " or the CPU"} '
                        f'(not {device}); use {"bf16 or " if on == "cpu" else ""}off', code=2)


def recipe_warnings(args, world):
    """Settings that run but are probably not what was meant: one line each."""
    warn = []
    if args.warmup >= args.max_steps:
        warn.append(f'--warmup {args.warmup} is not shorter than --max-steps {args.max_steps}: the '
                    f'learning rate never reaches its peak --lr {args.lr:g}')
    if args.batch_size == world * args.grad_accum and torch.device(args.device).type == 'cuda':
        warn.append(f'one sequence per process and micro-step ({world} process(es), --batch-size '
                    f'{args.batch_size}, --grad-accum {args.grad_accum}) keeps a GPU waiting on '
                    f'kernel launches; raise --batch-size, and --lr with it')
    return warn


def eval_progress(name, done, windows, seconds):
    """A slow evaluation's progress line: share done, time spent, ETA."""
    return (f'  {name}: {done:4.0%} of {windows} windows, {duration(seconds)}, eta '
            f'{duration(seconds * (1 - done) / done)}')


def resolve_flags(args, procs, defaults, common, kept, not_resumed):
    """Fill in train.py's flags not given, in place and once: the device (this process's GPU under
    torchrun), --out (default out/<dataset>-<boundary>, checked), on --resume the checkpoint's
    flags, then defaults(args) → (args, checkpoint or None)."""
    given = {k for k, v in vars(args).items() if v is not None}
    device = pick_device(args.device, procs.local_rank if procs.world > 1 else None)
    if args.out is None and args.resume:
        raise UserError('--resume needs --out, the run directory to continue', code=2)
    out = check_path(args.out or f'out/{Path(args.data or common["data"]).name}-'
                     f'{args.boundary or common["boundary"]}', 'new-dir', '--out', code=2)
    ckpt, taken = None, {}
    if args.resume:
        ckpt, taken = resume_flags(out / 'ckpt.pt', args, given, kept, not_resumed)
    elif (out / 'ckpt.pt').exists():
        raise UserError(f'{out / "ckpt.pt"} already exists; pass --resume to continue it or '
                        f'choose another --out')
    vars(args).update({**taken, 'out': str(out), 'device': device})
    vars(args).update({k: v for k, v in defaults(args).items() if getattr(args, k, None) is None})
    return args, ckpt


def report_train(t, args, state, r, lr, dt, steps, clock, stop):
    """A train record of the statistics r read since the last one (`steps` steps in `dt` seconds
    of training): to log.jsonl (the Logger), and its line to the terminal (rank 0) with the ETA of
    step `stop`, or of the --flop-budget."""
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
        print(progress_line(where, r, dt, steps, chars_per_s, eta), flush=True)


def report_eval(t, args, state, split, r, subset, seconds):
    """An eval record (r: evaluate's result) to log.jsonl and its line to the terminal → the
    record."""
    p = None if r.get('boundary_p') is None else round(r['boundary_p'], 5)
    rec = dict(kind='eval', step=state.step, split=split, bpc=r['bpc'], sf=r['sf'],
               boundary_p=p, eval_chars=r['chars'], subset=subset, train_chars=state.train_chars,
               train_flops=state.train_flops, train_time=round(state.train_time, 3),
               mem_mb=round(peak_mem_mb(args.device)))
    t.logger.log(rec)
    if t.procs.rank == 0:
        print(f'step {state.step} | {split} bpc {r["bpc"]:.4f} | sf {r["sf"]:.2f} | '
              + ('' if p is None else f'mean p {p:.3f} | ') +
              f'{short_count(r["chars"])} chars{" (a subset)" if subset else ""} | '
              f'{duration(seconds)}', flush=True)
    return rec


def unigram_note(boundary, meta, sf):
    """A Unigram run's line (else ''): the predictor's test SF beside its labels' (test) and the
    left-context ceiling (valid), the SF a causal predictor can reach at the threshold 0.5."""
    if boundary != 'unigram':
        return ''
    u = meta.get('unigram') or {}
    sfs, ceiling = u.get('shortening_factor'), u.get('left_context_ceiling')
    labels = sfs.get('test') if isinstance(sfs, dict) else None
    line = f'unigram-{u.get("vocab_size")}: the predictor pools at SF {sf:.2f} on test'
    line += f', its labels at {labels:.2f}' if _is_number(labels) else ''
    if isinstance(ceiling, dict) and _is_number(ceiling.get('shortening_factor')):
        line += (f'; the left-context ceiling is SF {ceiling["shortening_factor"]:.2f} on '
                 f'{ceiling.get("split")}')
    return line + '\n'


def run_logger(args, procs, amp, params, resumed_from):
    """The Logger of a training run, its config record first (every flag and the set-up), and the
    run's summary on the terminal (rank 0)."""
    if procs.rank == 0:
        print(run_summary(args, params, amp, procs.world, resumed_from), flush=True)
    return Logger(Path(args.out), args, rank=procs.rank, config_record=dict(
        kind='config', **{**vars(args), 'amp': amp}, params=params,
        device_name=device_name(args.device), world=procs.world, torch=torch.__version__,
        resumed_from=resumed_from), resumed_from=resumed_from)


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


def check_flags(args, world):
    """train.py's rules between flags (each flag's own range is its type's)."""
    if args.eval_step > args.eval_window:
        raise UserError(f'--eval-step {args.eval_step} is larger than --eval-window '
                        f'{args.eval_window}: characters between windows would never be scored',
                        code=2)
    if args.batch_size % (world * args.grad_accum):
        raise UserError(f'--batch-size {args.batch_size} must split evenly over {world} '
                        f'processes x {args.grad_accum} micro-steps', code=2)
    check_amp(args.amp, args.device)


def check_run(args, ckpt, cfg, vocab, train_tokens, procs, done=False):
    """The last checks before anything is written: one batch of data, a model that fits in memory,
    a checkpoint that fits the model and has steps left (done: none left, train.py's verdict);
    then the recipe's warnings on stderr (rank 0)."""
    if len(train_tokens) < args.batch_size * (args.seq_len + 1):
        raise UserError(f'{args.data}/train.bin has {len(train_tokens)} chars, fewer than one '
                        f'batch ({args.batch_size} x {args.seq_len + 1})')
    check_model_memory(cfg, args.device)
    if ckpt is not None:
        check_resumable(ckpt, cfg, vocab, args.data)
        # (at --max-steps exactly it resumes: a run stopped in its final evaluation redoes it)
        for flag, at in (('--max-steps', args.max_steps), ('--stop-step', args.stop_step)):
            if at is not None and (at < ckpt['step'] or flag == '--stop-step' and at == ckpt['step']):
                raise UserError(f'{flag} {at} is not after the checkpoint\'s step {ckpt["step"]}: '
                                f'nothing would be trained', code=2)
        test = final_test_bpc(Path(args.out) / 'log.jsonl', ckpt['step']) if done else None
        if test is not None:  # (not yet evaluated: resumed, it evaluates again)
            raise UserError(f'the run in {args.out} is finished (step {ckpt["step"]}, test bpc '
                            f'{test:.4f} in its log): nothing to resume; a larger --max-steps '
                            f'or --flop-budget trains it further', code=2)
    for line in recipe_warnings(args, procs.world) if procs.rank == 0 else ():
        print(f'warning: {line}', file=sys.stderr, flush=True)


def final_test_bpc(log, step):
    """The test BPC log.jsonl records at `step` (a finished run's final evaluation), or None."""
    try:
        lines = log.read_bytes().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get('kind') == 'eval' and rec.get('split') == 'test' \
                and rec.get('step') == step and _is_number(rec.get('bpc')):
            return rec['bpc']
    return None


def run_cli(run, argv):
    """run(argv, procs) among torchrun's processes: every UserError ends as one `error: ...` line
    and its exit code, and a Ctrl-C before the run's own guard as exit code 130."""
    procs = torchrun_processes()
    try:
        run(argv, procs)
    except UserError as e:
        die(str(e), e.code, procs.rank)
    except KeyboardInterrupt:
        die('interrupted before training began; nothing was written', 130, procs.rank)
