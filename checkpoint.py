"""ckpt.pt: the sealed atomic write; the read that verifies the seal (only train.py's
save writes it: the one check of a damaged or foreign file), loads weights_only, refuses
an earlier format where it cannot serve and a changed or missing --import file; weights
that are NaN or inf are neither saved nor read; the training state it holds, restored
exactly on --resume; the model it holds (load_checkpoint, Config from its dict:
config_from_dict)."""
import dataclasses
import hashlib
import importlib.util
import io
import random
import re
import shlex
from pathlib import Path

import numpy as np
import torch

from common import UserError, first_line, write_atomic
import dynpool
import hnet  # noqa: F401  (registers the seventh source: its checkpoints load too)
from dynpool import Config, DynamicPoolingLM

# A checkpoint proves itself: ckpt.pt is torch.save's zip archive whose zip comment (its
# last bytes, which zip readers skip) is CHECKSUM_TAG and the hex SHA-256 of every byte
# before the hex digits.
CHECKSUM_TAG = b'dynpool-checkpoint sha256 '
_SEAL = len(CHECKSUM_TAG) + 64  # the comment's length
# The checkpoint's format: 2 records each --import with its SHA-256 (import_identity) and
# the training counters of now; one without the field is 1.
FORMAT = 2
# what a run resumes from: an earlier format lacks some of them
TRAINING_FIELDS = ('format', 'model', 'optimizer', 'scaler', 'config', 'vocab', 'dataset',
                   'args', 'rng', 'imports')


def write_sealed(f, data):
    """Write torch.save's bytes `data` (a zip archive with an empty comment) to file f with
    the checksum comment at the end."""
    h = hashlib.sha256()
    # the archive up to the comment's length, then the length and the comment
    for part in (data[:-2], _SEAL.to_bytes(2, 'little'), CHECKSUM_TAG):
        h.update(part)
        f.write(part)
    f.write(h.hexdigest().encode())


def verify_checksum(data, path):
    """A UserError unless the checkpoint's bytes end in their checksum and match it."""
    # (the zip comment, the last _SEAL bytes: the tag, then the 64 hex digits)
    if data[-_SEAL:-64] != CHECKSUM_TAG:
        raise UserError(f'checkpoint {path} is corrupt or not one: it does not end in the '
                        'checksum train.py writes (cut short, another kind of file, or written '
                        'before checkpoints carried one)')
    if hashlib.sha256(memoryview(data)[:-64]).hexdigest().encode() != data[-64:]:
        raise UserError(f'checkpoint {path} is corrupt: its content does not match the '
                        'SHA-256 checksum written with it (a damaged disk or copy); use '
                        'another copy')


# numpy's RNG state, pickled as arrays: what weights_only loading must allow besides tensors
_NUMPY = [(getattr(np, '_core', None) or np.core).multiarray._reconstruct, np.ndarray,
          np.dtype, *(type(np.dtype(t)) for t in ('u1', 'u2', 'u4', 'i4', 'i8', 'f4', 'f8', '?'))]


def read_checkpoint(path, trust=False, resume=False):
    """train.py's checkpoint (a file, or a run folder holding ckpt.pt) → its dict (and
    path): checksum verified (so its fields are as train.py wrote them), loaded
    weights_only (trust=True: any pickle), then check_contents (resume=True: for
    train.py --resume); else one UserError line."""
    path = Path(path)
    if path.is_dir():
        path = path / 'ckpt.pt'
    if not path.is_file():  # (a probe: opening a FIFO would hang)
        raise UserError(f'no checkpoint at {path}')
    data = path.read_bytes()   # verified and loaded from memory: the same bytes
    verify_checksum(data, path)
    try:
        with torch.serialization.safe_globals(_NUMPY):
            ckpt = torch.load(io.BytesIO(data), map_location='cpu',
                              weights_only=not trust)
    except Exception as e:  # (whatever unpickling these bytes raises)
        found = re.search(r'Unsupported global: GLOBAL (\S+)', str(e))
        if found:
            # a readable file that pickles more than tensors and containers (trusted, it
            # would have loaded)
            raise UserError(f'checkpoint {path} holds a pickled {found.group(1)}, which '
                            'safe loading refuses (train.py writes none); a file you trust '
                            'loads with sample.py --trust-ckpt') from None
        why = first_line(e).split('. ')[0]
        raise UserError(f'cannot read checkpoint {path} (corrupt or not a torch '
                        f'checkpoint): {why}'[:300]) from None
    if not isinstance(ckpt, dict) or {'model', 'config', 'vocab'} - ckpt.keys():
        raise UserError(f'checkpoint {path} lacks model, config or vocab: not written by '
                        'train.py')
    check_contents(ckpt, path, resume)
    return dict(ckpt, path=str(path))


def check_contents(ckpt, path, resume):
    """A UserError line unless the checkpoint can serve: of this FORMAT where it resumes or
    records --import files, each of them as it was (import_identity), its boundary
    source registered (else: the --import flags it needs), its weights finite."""
    version = ckpt.get('format', 1)
    if version != FORMAT and (resume or ckpt.get('imports')):
        lacks = ', '.join(k for k in TRAINING_FIELDS if k not in ckpt)
        raise UserError(f'checkpoint {path} is of an earlier train.py (format {version}, '
                        f'this one {FORMAT}; it lacks {lacks or "the SHA-256 of its imports"}'
                        '): it cannot be resumed or its --import files checked; start a new '
                        'run (sample.py reads it where it imports nothing)')
    for record in ckpt.get('imports') or []:
        try:
            now = import_identity(record['import'])['sha256']
        except (OSError, ImportError):
            now = None
        if now != record['sha256']:
            how = 'is missing now'
            if now is not None:
                how = (f'has changed since (SHA-256 {record["sha256"][:12]}... then, '
                       f'{now[:12]}... now)')
            raise UserError(f'checkpoint {path} was trained with --import {record["import"]}, '
                            f'which {how}: put back the file the run used, or train anew')
    boundary = ckpt['config'].get('boundary')
    if boundary not in dynpool.BOUNDARY_MODES:
        # a source of the user's: sample.py and bench.py import only what the user names
        needs = 'the --import that registers it'
        if ckpt.get('imports'):
            needs = shlex.join(import_flags(ckpt['imports']))
        raise UserError(f'checkpoint {path} pools with boundary {boundary!r}, which needs '
                        f'{needs}', code=2)
    bad = nonfinite_weight(ckpt['model'])
    if bad is not None:
        raise UserError(f'checkpoint {path}: model.{bad} holds NaN or inf values (from a run '
                        'that diverged?); use an earlier checkpoint')


def finished(step, train_flops, args):
    """Whether a run is at its end (train.py's loop, sample.py's note): --max-steps steps
    done, or the first step whose FLOPs reach the --flop-budget. args: train.py's flags as
    a dict (vars(args), or a checkpoint's "args")."""
    if step >= args['max_steps']:
        return True
    budget = args.get('flop_budget')
    return budget is not None and train_flops >= budget * (1 - 1e-9)


def nonfinite_weight(weights):
    """The name of the first floating tensor of the state dict `weights` that holds NaN or
    inf, or None: what save_checkpoint never writes and check_contents never reads."""
    for name, tensor in weights.items():
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            return name
    return None


def import_identity(name):
    """An --import as a checkpoint records it → {'import': name (a file by its absolute
    path, or a module name), 'sha256': the hex SHA-256 of the file it loads}; OSError or
    ImportError where there is none."""
    file = name
    if '/' not in name:
        spec = importlib.util.find_spec(name)
        # (a module gone since: the same error as importing it)
        if spec is None:
            raise ModuleNotFoundError(f'no module named {name!r}')
        file = spec.origin
    return {'import': name, 'sha256': hashlib.sha256(Path(file).read_bytes()).hexdigest()}


def load_weights(model, state, path):
    """A (possibly compiled or DDP) state dict into model; a UserError where it does not
    fit."""
    try:
        model.load_state_dict({re.sub(r'^((_orig_mod|module)\.)+', '', k): v
                               for k, v in state.items()})
    except RuntimeError as e:
        # missing, unexpected or other-shaped weights: the first kind named
        why = (str(e).splitlines() + [''])[1].strip()[:200]
        raise UserError(f'checkpoint {path}: the weights do not fit its config '
                        f'(boundary={model.cfg.boundary!r}, layers={model.cfg.layers}): '
                        f'{why}') from None
    return model


def import_flags(imports):
    """The flags that import a run's sources again: --import X for each record of imports
    (import_identity's)."""
    return [flag for record in imports for flag in ('--import', record['import'])]


def resume_command(out, imports=(), *flags):
    """The command that continues the run in folder `out` (its --import flags, then
    flags), quoted for the shell."""
    return shlex.join(['python', 'train.py', *path_flag('--out', out), '--resume',
                       *import_flags(imports), *flags])


def path_flag(flag, path):
    """The words of `flag PATH` in a command; `flag=PATH` where PATH starts with '-',
    which argparse would take for a flag."""
    if str(path).startswith('-'):
        return [f'{flag}={path}']
    return [flag, str(path)]


def kept(path, saved_step, imports=(), *flags):
    """What a stopped run leaves behind, in words, with the command that continues it."""
    if saved_step is None:
        return 'no checkpoint was written yet'
    return (f'the last good checkpoint is {path} (step {saved_step}); continue with: '
            f'{resume_command(Path(path).parent, imports, *flags)}')


def save_checkpoint(path, state, saved_step):
    """Write state atomically and sealed; on any failure, a weight of state['model'] that
    is NaN or inf too (nonfinite_weight, whatever let it through), the previous
    checkpoint (of step saved_step, or None) stays as it was."""
    left = kept(path, saved_step, state.get('imports', ()))
    bad = nonfinite_weight(state.get('model', {}))
    if bad is not None:
        raise UserError(f'cannot save checkpoint {path}: model.{bad} holds NaN or inf values '
                        f'(the run diverged); {left}')
    buf = io.BytesIO()  # in memory first: the checksum covers the bytes torch.save made

    def write(tmp):
        with open(tmp, 'wb') as f, buf.getbuffer() as data:
            write_sealed(f, data)
    try:
        torch.save(state, buf)
        write_atomic(path, write)
    except (OSError, RuntimeError) as e:
        # torch.save reports a failed write as a RuntimeError
        why = getattr(e, 'strerror', None) or first_line(e)
        raise UserError(f'cannot save checkpoint {path}: {why}; {left}') from None


def training_state(model, optimizer, scaler, counters, cfg, data_identity, args):
    """What train.py needs to continue a run exactly: weights, optimizer, AMP scaler,
    counters, config, flags, data_identity (vocab, the data's fingerprint), every RNG
    (this process's GPU only), the --import files and modules (args.imports:
    import_identity's records), its FORMAT."""
    rng = dict(torch=torch.get_rng_state(), numpy=np.random.get_state(),
               python=random.getstate(), cuda=None)
    if args.device.startswith('cuda'):
        rng['cuda'] = torch.cuda.get_rng_state(args.device)
    return dict(model=model.state_dict(), optimizer=optimizer.state_dict(),
                scaler=scaler.state_dict(), **counters, config=dataclasses.asdict(cfg),
                **data_identity, args=vars(args), rng=rng, imports=args.imports,
                format=FORMAT)


def restore_training(ckpt, model, optimizer, scaler, device):
    """Load training_state's weights, optimizer, AMP scaler and RNG states."""
    load_weights(model, ckpt['model'], ckpt['path'])
    optimizer.load_state_dict(ckpt['optimizer'])
    # a run saved without loss scaling (bf16, off) has none: fp16 starts afresh
    if ckpt['scaler']:
        scaler.load_state_dict(ckpt['scaler'])
    rng = ckpt['rng']
    torch.set_rng_state(rng['torch'])
    if 'cuda' in str(device) and rng['cuda'] is not None:
        torch.cuda.set_rng_state(rng['cuda'], device)
    np.random.set_state(rng['numpy'])
    random.setstate(rng['python'])


def check_resumable(ckpt, data_identity, data):
    """A resumed run keeps its data and vocabulary (its model flags: resolve_args)."""
    then = ckpt['dataset']
    if then['fingerprint'] != data_identity['dataset']['fingerprint']:
        raise UserError(f'--data {data} is not the data the run in '
                        f'{Path(ckpt["path"]).parent} started on ({then.get("path")}, '
                        'changed or moved?)', code=2)
    if ckpt['vocab']['alphabet'] != data_identity['vocab']['alphabet']:
        raise UserError(f'checkpoint {ckpt["path"]} was trained on another vocabulary '
                        f'(alphabet) than {data}')


def config_from_dict(d, **extra):
    """Config from flags (vars(args)) or a checkpoint's asdict(Config), and extra: keys
    that are not Config's ignored, missing ones default (checkpoints from before a new
    field load); the chosen source's Options fields (its flags) go into Config.options.
    UserError, exit 2, where Config refuses them."""
    d = {**d, **extra}
    names = {f.name for f in dataclasses.fields(Config)}
    kept = {k: v for k, v in d.items() if k in names}
    Options = getattr(dynpool.SOURCES.get(d.get('boundary')), 'Options', None)
    if Options is not None:
        # its fields given as flags, under those a checkpoint's config holds
        given = {f.name: d[f.name] for f in dataclasses.fields(Options) if f.name in d}
        kept['options'] = {**given, **kept.get('options', {})}
    try:
        return Config(**kept)
    except (TypeError, ValueError) as e:   # (TypeError: d is no dict, or a field's type)
        raise UserError(f'the config is invalid: {first_line(e)}', code=2) from None


def load_checkpoint(path, device='cpu', trust=False):
    """train.py's checkpoint (ckpt.pt or its run folder) → (its model in eval mode on
    device, the checkpoint's dict as checkpoint.read_checkpoint returns it)."""
    ckpt = read_checkpoint(path, trust)
    try:
        cfg = config_from_dict(ckpt['config'])
    except UserError as e:
        raise UserError(f'checkpoint {ckpt["path"]}: {e}') from None
    model = load_weights(DynamicPoolingLM(cfg), ckpt['model'], ckpt['path'])
    return model.to(device).eval(), ckpt
