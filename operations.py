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
import importlib
import inspect
import json
import math
import os
import pickle
import platform
import re
import resource
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

from dynpool import PREDICTOR_MODES, Config, DynamicPoolingLM, ModelOutput


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


class Logger:
    """Records to stdout and log.jsonl on rank 0, and to TensorBoard / W&B when their flags ask."""

    def __init__(self, out_dir, args, config_record, rank=0):
        self.path, self.tb, self.wandb, self.rank = out_dir / 'log.jsonl', None, None, rank
        if rank != 0:
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
        if self.rank != 0:
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


def setup_precision(amp, device_type):
    """--amp → (resolved name, autocast context, GradScaler): fp16 needs loss scaling, bf16 not."""
    if amp == 'auto' and device_type == 'cuda':
        amp = 'bf16' if torch.cuda.is_bf16_supported() else 'fp16'
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
    loop's only wait for the device. Per micro-step: loss, LM loss, SF, precision, recall, FLOPs;
    per step: the gradient norm (where finite) and how many, steps skipped as non-finite, and a
    time-is-up flag."""
    NAMES = ('loss', 'lm_loss', 'sf', 'precision', 'recall', 'flops', 'grad_norm', 'norms', 'bad',
             'late')

    def __init__(self, cfg, args, world=1):
        self.cfg, self.seq_len, self.world = cfg, args.seq_len, world
        self.micro = args.batch_size // (world * args.grad_accum)
        self.sums = torch.zeros(len(self.NAMES), dtype=sum_dtype(args.device), device=args.device)
        self.index = {}  # names → their positions in sums, as a device tensor
        self.present, self.micro_steps, self.host_flops = set(), 0, 0.0
        # --flop-budget: the schedule needs each step's FLOPs on the host (one read per step)
        self.track, self.step_flops = getattr(args, 'flop_budget', None) is not None, 0.0

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
        if self.world > 1:
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
        if self.world > 1:
            torch.distributed.all_reduce(self.sums)
        v = dict(zip(self.NAMES, self.sums.tolist()))
        n = max(1, self.micro_steps * self.world)
        r = {k: v[k] / n if k in self.present else None
             for k in ('loss', 'lm_loss', 'sf', 'precision', 'recall')}
        r.update(sf=r['sf'] or 1.0, flops=v['flops'], bad=int(v['bad']), late=v['late'] > 0,
                 grad_norm=v['grad_norm'] / v['norms'] if v['norms'] else None)
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
