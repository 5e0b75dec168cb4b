"""ckpt.pt: the sealed atomic write; the read that verifies the seal (only train.py's
save writes it: the one check of a damaged or foreign file), loads weights_only and refuses
weights that are NaN or inf; the training state it holds, restored exactly on --resume."""
import dataclasses
import hashlib
import io
import random
import re
import shlex
from pathlib import Path

import numpy as np
import torch

from common import UserError, first_line, write_atomic
import dynpool
from dynpool import Config, DynamicPoolingLM

# A checkpoint proves itself: ckpt.pt is torch.save's zip archive whose zip comment (its
# last bytes, which zip readers skip) is CHECKSUM_TAG and the hex SHA-256 of every byte
# before the hex digits.
CHECKSUM_TAG = b'dynpool-checkpoint sha256 '
_SEAL = len(CHECKSUM_TAG) + 64  # the comment's length


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
    # (zip's end-of-central-directory record: 22 bytes, then the comment)
    tail = bytes(data[-22 - _SEAL:])
    if tail[22:-64] != CHECKSUM_TAG:
        raise UserError(f'checkpoint {path} is corrupt or not one: it does not end in the '
                        'checksum train.py writes (cut short, another kind of file, or written '
                        'before checkpoints carried one)')
    if hashlib.sha256(memoryview(data)[:-64]).hexdigest().encode() != tail[-64:]:
        raise UserError(f'checkpoint {path} is corrupt: its content does not match the '
                        'SHA-256 checksum written with it (a damaged disk or copy); use '
                        'another copy')


def config_from_dict(d, **extra):
    """Config from asdict(Config) and extra: other keys ignored, missing ones default
    (checkpoints from before a new field load); UserError, exit 2 (train.py's flags;
    read_checkpoint: file)."""
    names = {f.name for f in dataclasses.fields(Config)}
    try:
        return Config(**{k: v for k, v in {**d, **extra}.items() if k in names})
    except (TypeError, ValueError) as e:   # (TypeError: d is no dict, or a field's type)
        raise UserError(f'the config is invalid: {first_line(e)}', code=2) from None


# numpy's RNG state, pickled as arrays: what weights_only loading must allow besides tensors
_NUMPY = [(getattr(np, '_core', None) or np.core).multiarray._reconstruct, np.ndarray,
          np.dtype, *(type(np.dtype(t)) for t in ('u1', 'u2', 'u4', 'i4', 'i8', 'f4', 'f8', '?'))]


def read_checkpoint(path, trust=False):
    """train.py's checkpoint (a file, or a run folder holding ckpt.pt) → its dict: checksum
    verified (so its fields are as train.py wrote them), loaded weights_only (trust=True:
    any pickle), its config valid, its boundary source registered (else: the --import it
    needs), weights finite; else one UserError line."""
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
        if found and not trust:
            # a readable file that pickles more than tensors and containers
            raise UserError(f'checkpoint {path} holds a pickled {found.group(1)}, which '
                            'safe loading refuses (train.py writes none); a file you trust '
                            'loads with sample.py --trust-ckpt') from None
        why = first_line(e).split('. ')[0]
        raise UserError(f'cannot read checkpoint {path} (corrupt or not a torch '
                        f'checkpoint): {why}'[:300]) from None
    if not isinstance(ckpt, dict) or {'model', 'config', 'vocab'} - ckpt.keys():
        raise UserError(f'checkpoint {path} lacks model, config or vocab: not written by '
                        'train.py')
    boundary = ckpt['config'].get('boundary')
    if boundary not in dynpool.BOUNDARY_MODES:
        # a source of the user's: sample.py and bench.py import only what the user names
        needs = 'the --import that registers it'
        if ckpt.get('imports'):
            needs = shlex.join(import_flags(ckpt['imports']))
        raise UserError(f'checkpoint {path} pools with boundary {boundary!r}, which needs '
                        f'{needs}', code=2)
    try:
        config_from_dict(ckpt['config'])
    except UserError as e:
        raise UserError(f'checkpoint {path}: {e}') from None
    # (what sample.py and bench.py run; train.py never saves a step that was not finite)
    for name, weights in ckpt['model'].items():
        if weights.is_floating_point() and not torch.isfinite(weights).all():
            raise UserError(f'checkpoint {path}: model.{name} holds NaN or inf values (saved '
                            'from a run that diverged?); use an earlier checkpoint')
    return dict(ckpt, path=str(path))


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


def load_checkpoint(path, device='cpu', trust=False):
    """train.py's checkpoint → (its model in eval mode on device, the checkpoint's dict)."""
    ckpt = read_checkpoint(path, trust)
    model = DynamicPoolingLM(config_from_dict(ckpt['config']))
    return load_weights(model, ckpt['model'], ckpt['path']).to(device).eval(), ckpt


def import_flags(imports):
    """The flags that import a run's sources again: --import X for each X of imports."""
    return [flag for name in imports for flag in ('--import', name)]


def resume_command(out, imports=(), *flags):
    """The command that continues the run in folder `out` (its --import flags, then
    flags), quoted for the shell."""
    command = ['python', 'train.py', *path_flag('--out', out), '--resume',
               *import_flags(imports)]
    return shlex.join(command + list(flags))


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
    """Write state atomically and sealed; on any failure the previous checkpoint (of step
    saved_step, or None) stays as it was. (NaN or inf never reaches it: train.py stops a
    run that diverges before it saves, and its Adam step skips non-finite gradients.)"""
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
        raise UserError(f'cannot save checkpoint {path}: {why}; '
                        f'{kept(path, saved_step, state.get("imports", ()))}') from None


def training_state(model, optimizer, scaler, counters, cfg, data_identity, args):
    """What train.py needs to continue a run exactly: weights, optimizer, AMP scaler,
    counters, config, flags, data_identity (vocab, the data's fingerprint), every RNG
    (this process's GPU only), the --import files and modules (args.imports)."""
    rng = dict(torch=torch.get_rng_state(), numpy=np.random.get_state(),
               python=random.getstate(), cuda=None)
    if args.device.startswith('cuda'):
        rng['cuda'] = torch.cuda.get_rng_state(args.device)
    return dict(model=model.state_dict(), optimizer=optimizer.state_dict(),
                scaler=scaler.state_dict(), **counters, config=dataclasses.asdict(cfg),
                **data_identity, args=vars(args), rng=rng, imports=args.imports)


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
