"""Tests of checkpoint.py: checkpoints that prove themselves (sealed, verified at every read),
every field checked, non-finite weights never loaded, a failed save that keeps the
previous checkpoint.
Run: python -m pytest -q test_checkpoint.py
"""
import hashlib
import io
import random
import shlex
import zipfile

import pytest
import torch

import checkpoint
from common import UserError
from conftest import checkpoint_state


# ----------------------------------------------------------------------------- checkpoints
@pytest.fixture(scope='module')
def state():
    return checkpoint_state('fixed')


@pytest.fixture
def saved(state, tmp_path):
    """A checkpoint written by save_checkpoint, and its bytes."""
    path = tmp_path / 'ckpt.pt'
    checkpoint.save_checkpoint(path, state, None)
    return path, path.read_bytes()


def refused(path, *words, capsys=None):
    """read_checkpoint(path) ends in one UserError line holding `words` → the line."""
    with pytest.raises(UserError) as e:
        checkpoint.read_checkpoint(path)
    msg = str(e.value)
    assert '\n' not in msg and all(w in msg for w in words), msg
    return msg


def test_checkpoint_is_a_torch_zip_with_its_checksum_and_reads_back(saved, state, capsys):
    path, data = saved
    assert torch.load(path, weights_only=False)['step'] == 3      # still a plain torch checkpoint
    assert zipfile.ZipFile(path).comment.startswith(checkpoint.CHECKSUM_TAG)
    assert data[-64:] == hashlib.sha256(data[:-64]).hexdigest().encode()
    ck = checkpoint.read_checkpoint(path.parent)                  # a run directory works too
    checkpoint.verify_checksum(data, path)
    assert capsys.readouterr().err == ''
    for k in ('step', 'epoch', 'pos', 'train_chars', 'args'):
        assert ck[k] == state[k]
    for k, t in state['model'].items():
        assert torch.equal(ck['model'][k], t), k
    assert sorted(p.name for p in path.parent.iterdir()) == ['ckpt.pt']   # no temp file left


def offsets_of(data, tensor, n=3):
    """Byte offsets inside the stored bytes of `tensor` (first, middle, last) in a checkpoint."""
    start = data.find(tensor.contiguous().numpy().tobytes())
    assert start > 0, 'tensor bytes not found in the file'
    size = tensor.numel() * tensor.element_size()
    return [start, start + size // 2, start + size - 1][:n]


def test_checkpoint_with_a_flipped_byte_anywhere_is_refused(saved, state, tmp_path):
    path, data = saved
    model_t = state['model']['lm_head.weight']
    adam_t = state['optimizer']['state'][0]['exp_avg_sq']
    places = {'model tensor': offsets_of(data, model_t),
              'optimizer state': offsets_of(data, adam_t),
              'pickle': [data.find(b'data.pkl') + 40],
              'zip directory': [data.rfind(b'PK\x01\x02') + 20],
              'zip end': [len(data) - checkpoint._SEAL - 10], 'tag': [len(data) - 70],
              'digest': [len(data) - 1], 'first byte': [0]}
    rng = random.Random(0)
    places['anywhere'] = rng.sample(range(len(data)), 20)
    for where, offsets in places.items():
        for i in offsets:
            bad = bytearray(data)
            bad[i] ^= 0x10
            path.write_bytes(bytes(bad))
            msg = refused(path, str(path))
            assert 'corrupt' in msg, (where, i, msg)
    path.write_bytes(data)
    assert checkpoint.read_checkpoint(path)['step'] == 3


def test_checkpoint_cut_short_is_refused(saved):
    path, data = saved
    for n in (len(data) - 1, len(data) - 64, len(data) // 2, 10, 0):
        path.write_bytes(data[:n])
        refused(path, 'corrupt')


def test_checkpoint_without_checksum_is_refused(state, tmp_path, capsys):
    """A checkpoint without the checksum (torch.save's file as it is, from before checksums):
    refused in one line, before anything of it is loaded."""
    path = tmp_path / 'old.pt'
    torch.save(state, path)
    refused(path, str(path), 'checksum')
    with pytest.raises(UserError):
        checkpoint.load_checkpoint(path)
    assert capsys.readouterr().err == ''


def test_non_finite_weights_are_refused_at_load(state, tmp_path):
    """A NaN or an inf in the weights (sealed: written around train.py, which never saves
    one) is refused, naming the tensor."""
    path = tmp_path / 'ckpt.pt'
    for value in (float('nan'), float('inf')):
        weights = state['model']['lm_head.weight'].clone()
        weights.view(-1)[5] = value
        buf = io.BytesIO()
        torch.save(dict(state, model=dict(state['model'], **{'lm_head.weight': weights})), buf)
        with open(path, 'wb') as f:
            checkpoint.write_sealed(f, buf.getbuffer())
        refused(path, 'model.lm_head.weight', 'NaN or inf')


def test_a_non_finite_weight_never_replaces_the_last_good_checkpoint(saved, state):
    """Whatever let it through (here nothing skips the step: the weight is written into the
    model's state), a NaN or inf weight is not saved: one line naming it and the last good
    checkpoint, which stays as it was; the one check save and read share."""
    path, before = saved
    for value in (float('nan'), float('-inf')):
        weights = state['model']['lm_head.weight'].clone()
        weights.view(-1)[7] = value
        bad = dict(state, step=6, model=dict(state['model'], **{'lm_head.weight': weights}))
        with pytest.raises(UserError, match=r'model.lm_head.weight holds NaN or inf values .*'
                           r'the last good checkpoint is .* \(step 3\)'):
            checkpoint.save_checkpoint(path, bad, 3)
        assert path.read_bytes() == before
    assert sorted(p.name for p in path.parent.iterdir()) == ['ckpt.pt']


def test_checkpoint_save_failure_keeps_the_previous_one(saved, state, monkeypatch):
    """A full disk while the sealed bytes are written: the previous checkpoint stays, no temp
    file."""
    path, before = saved
    real_open = open

    class FullDisk:
        def __init__(self, f):
            self.f, self.written = f, 0

        def write(self, b):
            if self.written > 1000:
                raise OSError(28, 'No space left on device')
            self.written += len(b)
            return self.f.write(b)

        def __getattr__(self, k):
            return getattr(self.f, k)

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return self.f.__exit__(*a)
    monkeypatch.setattr('builtins.open', lambda p, *a, **k: FullDisk(real_open(p, *a, **k)))
    with pytest.raises(UserError,
                       match=r'No space left on device; the last good checkpoint is .* \(step 3\)'):
        checkpoint.save_checkpoint(path, dict(state, step=6), 3)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert sorted(p.name for p in path.parent.iterdir()) == ['ckpt.pt']


def test_write_atomic_temporary_names_are_those_prepare_data_clears(tmp_path):
    """A write killed outright (SIGKILL: no clean-up runs) leaves its temporary file: its name is
    of the form prepare_data.py removes at its next run in a dataset folder."""
    import prepare_data
    from common import write_atomic
    names = []

    def write(tmp):
        names.append(tmp.name)
        tmp.write_text('x')
    for target in ('train.unigram-60.bin', 'meta.json', 'unigram-60.model'):
        write_atomic(tmp_path / target, write)
    assert all(prepare_data.LEFTOVER.fullmatch(name) for name in names), names


def test_kept_names_the_command_that_continues_the_run_with_its_imports(tmp_path):
    """What a stopped run (Ctrl-C, a failed save, a divergence) says: the command that continues
    it imports the run's sources again, then takes the extra flags."""
    path = tmp_path / 'my run' / 'ckpt.pt'
    every = dict(sha256='0' * 64)
    every['import'] = str(tmp_path / 'every.py')
    said = checkpoint.kept(path, 4, [every], '--lr', '0.0001')
    command = shlex.split(said.split('continue with: ')[1])
    assert said.startswith(f'the last good checkpoint is {path} (step 4)'), said
    assert command == ['python', 'train.py', '--out', str(path.parent), '--resume', '--import',
                       str(tmp_path / 'every.py'), '--lr', '0.0001']
    assert checkpoint.kept(path, None, [every]) == 'no checkpoint was written yet'
