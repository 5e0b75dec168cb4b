"""Tests of operations.py, the operational side: argument types, path checks, checkpoints that
prove themselves, logs of whole lines, and data files validated where they are read.
Run: python -m pytest -q test_operations.py
"""
import argparse
import copy
import errno
import hashlib
import io
import json
import os
import random
import zipfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import operations
from conftest import HYPOTHESIS_FIXTURES, checkpoint_state
from operations import UserError, check_path, user_path


# ----------------------------------------------------------------------------- argument types
REFUSED = {
    'positive_int': ['0', '-3', '1.5', 'x', '', '1e3'],
    'non_negative_int': ['-1', '2.0', 'nan'],
    'seed_int': ['-1', str(2 ** 63), 'inf'],
    'numpy_seed': ['-1', str(2 ** 32)],
    'positive_float': ['0', '-1e-9', 'inf', '-inf', 'nan', '1e400', 'x'],
    'non_negative_float': ['-1e-9', 'inf', 'nan', '-inf'],
    'fraction': ['1', '-0.1', 'nan', 'inf', '1.5'],
    'probability': ['0', '1', 'nan', '-0.5', 'inf'],
}
ACCEPTED = {
    'positive_int': [('1', 1), (' 7 ', 7)],
    'non_negative_int': [('0', 0)],
    'seed_int': [('0', 0), (str(2 ** 63 - 1), 2 ** 63 - 1)],
    'numpy_seed': [(str(2 ** 32 - 1), 2 ** 32 - 1)],
    'positive_float': [('1e-300', 1e-300), ('2.5e-4', 2.5e-4)],
    'non_negative_float': [('0', 0.0), ('-0', 0.0), ('3', 3.0)],
    'fraction': [('0', 0.0), ('0.999', 0.999)],
    'probability': [('0.37', 0.37), ('1e-9', 1e-9)],
}


@pytest.mark.parametrize('name', sorted(REFUSED))
def test_argument_types_refuse_out_of_range_and_non_finite_in_one_line(name, capsys):
    parser = argparse.ArgumentParser(prog='x')
    parser.add_argument('--flag', type=getattr(operations, name))
    for s in REFUSED[name]:
        with pytest.raises(SystemExit) as e:
            parser.parse_args([f'--flag={s}'])  # (argparse reads '-1e-9' as a flag)
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert e.value.code == 2 and err.startswith('x: error: argument --flag: must be '), (s, err)
        assert 'invalid' not in err and (repr(s) in err or s.strip() in err), (s, err)
    for s, v in ACCEPTED[name]:
        got = parser.parse_args([f'--flag={s}']).flag
        assert got == v and type(got) is type(v), (s, got)


def test_argument_type_messages_name_the_allowed_range():
    cases = {'positive_float': 'a finite number > 0', 'non_negative_float': 'a finite number >= 0',
             'fraction': 'a finite number in [0, 1)', 'probability': 'a finite number in (0, 1)',
             'positive_int': 'an integer >= 1', 'seed_int': 'an integer in [0, 2**63)',
             'numpy_seed': 'an integer in [0, 2**32)'}
    for name, rule in cases.items():
        with pytest.raises(argparse.ArgumentTypeError, match=rf'^must be {__import__("re").escape(rule)}, got'):
            getattr(operations, name)('-5')


def test_thread_count_stays_within_the_cores():
    cores = os.cpu_count() or 1
    assert operations.thread_count(str(cores)) == cores
    for s in ('0', str(cores + 1), str(10 ** 12), 'x'):
        with pytest.raises(argparse.ArgumentTypeError, match='must be'):
            operations.thread_count(s)


def test_range_factories_at_their_ends():
    t = operations.float_range(1, lo_open=True)   # e.g. hnet's ratio target > 1
    assert t('1.0001') == 1.0001
    for s in ('1', '0.5', 'nan', 'inf'):
        with pytest.raises(argparse.ArgumentTypeError, match=r'> 1, got'):
            t(s)
    t = operations.int_range(2, 5)
    assert [t(str(i)) for i in (2, 5)] == [2, 5]
    for s in ('1', '6'):
        with pytest.raises(argparse.ArgumentTypeError, match=r'in \[2, 5\], got'):
            t(s)


# ----------------------------------------------------------------------------- paths
@pytest.fixture
def tree(tmp_path, monkeypatch):
    """A folder with a file, a directory and a FIFO; the test runs inside it."""
    monkeypatch.chdir(tmp_path)
    Path('f').write_text('x')
    Path('d').mkdir()
    os.mkfifo('fifo')
    return tmp_path


LONG = 'x' * 300                        # one name over the usual 255-byte limit (ENAMETOOLONG)
DEEP = '/'.join(['y' * 200] * 25)       # 25 levels: a path over the 4096-byte limit
PATH_CASES = [
    ('f', 'file', None), ('d', 'dir', None), ('d/new.tsv', 'new-file', None), ('f', 'new-file', None),
    ('d', 'new-dir', None), ('a/b/c', 'new-dir', None),
    ('nope', 'file', 'no such file'), ('nope', 'dir', 'no such directory'),
    ('d', 'file', 'is a directory, not a regular file'),
    ('fifo', 'file', 'is a FIFO (named pipe), not a regular file'),
    ('/dev/null', 'file', 'is a character device, not a regular file'),
    ('fifo', 'new-file', 'is a FIFO (named pipe), not a regular file'),
    ('d', 'new-file', 'is a directory, not a regular file'),
    ('f', 'dir', 'is a file, not a directory'), ('f', 'new-dir', 'is a file, not a directory'),
    ('f/x', 'dir', 'f is a file, not a directory'), ('f/x/y', 'new-dir', 'f is a file, not a directory'),
    ('f/x.png', 'new-file', 'f is a file, not a directory'),
    ('no/such/x.png', 'new-file', 'the folder no/such does not exist'),
    (LONG, 'file', 'is 300 bytes, longer than the 255'), (LONG, 'new-dir', 'is 300 bytes, longer than the 255'),
    ('d/' + LONG, 'new-file', 'is 300 bytes, longer than the 255'),
    (DEEP, 'file', 'bytes long, over the 4096'), (DEEP, 'new-dir', 'bytes long, over the 4096'),
    ('', 'file', 'an empty path'), ('a\nb', 'new-dir', None),
]


@pytest.mark.parametrize('path, kind, words', PATH_CASES, ids=[f'{k}:{p[:12]!r}' for p, k, _ in PATH_CASES])
def test_check_path_each_case_in_one_line(tree, path, kind, words):
    if words is None:
        assert check_path(path, kind, '--out') == Path(path)
        return
    with pytest.raises(UserError) as e:
        check_path(path, kind, '--out')
    msg = str(e.value)
    assert '\n' not in msg and len(msg) < 300 and msg.startswith('--out ') and words in msg, msg
    assert e.value.code == 1


def test_check_path_unreadable_and_unwritable(tree, monkeypatch):
    # (root reads everything: the permission test asks os.access, which the check uses)
    monkeypatch.setattr(os, 'access', lambda p, mode: False)
    for path, kind, words in (('f', 'file', 'not readable'), ('d', 'dir', 'not readable'),
                              ('f', 'new-file', 'not writable'), ('d/x', 'new-file', 'd is not writable'),
                              ('d/a/b', 'new-dir', 'd is not writable')):
        with pytest.raises(UserError, match=words):
            check_path(path, kind)


def test_user_path_is_an_argparse_type_exiting_2(tree, capsys):
    parser = argparse.ArgumentParser(prog='x')
    parser.add_argument('--ckpt', type=user_path('file'))
    parser.add_argument('--out', type=user_path('new-dir'))
    assert parser.parse_args(['--ckpt', 'f', '--out', 'runs/a']).out == Path('runs/a')
    for argv, words in ((['--ckpt', 'd'], 'argument --ckpt: d: is a directory'),
                        (['--out', 'f/run'], 'argument --out: f/run: f is a file, not a directory')):
        with pytest.raises(SystemExit) as e:
            parser.parse_args(argv)
        assert e.value.code == 2 and words in capsys.readouterr().err


# ----------------------------------------------------------------------------- checkpoints
@pytest.fixture(scope='module')
def state():
    return checkpoint_state('fixed')


@pytest.fixture
def saved(state, tmp_path):
    """A checkpoint written by save_checkpoint, and its bytes."""
    path = tmp_path / 'ckpt.pt'
    operations.save_checkpoint(path, state, None)
    return path, path.read_bytes()


def refused(path, *words, capsys=None):
    """read_checkpoint(path) ends in one UserError line holding `words` → the line."""
    with pytest.raises(UserError) as e:
        operations.read_checkpoint(path)
    msg = str(e.value)
    assert '\n' not in msg and all(w in msg for w in words), msg
    return msg


def test_checkpoint_is_a_torch_zip_with_its_checksum_and_reads_back(saved, state, capsys):
    path, data = saved
    assert torch.load(path, weights_only=False)['step'] == 3      # still a plain torch checkpoint
    assert zipfile.ZipFile(path).comment.startswith(operations.CHECKSUM_TAG)
    assert data[-64:] == hashlib.sha256(data[:-64]).hexdigest().encode()
    ck = operations.read_checkpoint(path.parent)                  # a run directory works too
    assert operations.verify_checksum(path) is True and capsys.readouterr().err == ''
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
    places = {'model tensor': offsets_of(data, model_t), 'optimizer state': offsets_of(data, adam_t),
              'pickle': [data.find(b'data.pkl') + 40], 'zip directory': [data.rfind(b'PK\x01\x02') + 20],
              'zip end': [len(data) - operations._SEAL - 10], 'tag': [len(data) - 70],
              'digest': [len(data) - 1], 'first byte': [0]}
    rng = random.Random(0)
    places['anywhere'] = rng.sample(range(len(data)), 40)
    for where, offsets in places.items():
        for i in offsets:
            bad = bytearray(data)
            bad[i] ^= 0x10
            path.write_bytes(bytes(bad))
            msg = refused(path, str(path))
            assert 'corrupt' in msg, (where, i, msg)
    path.write_bytes(data)
    assert operations.read_checkpoint(path)['step'] == 3


def test_checkpoint_cut_short_is_refused(saved):
    path, data = saved
    for n in (len(data) - 1, len(data) - 64, len(data) // 2, 10, 0):
        path.write_bytes(data[:n])
        refused(path, 'corrupt')


def test_checkpoint_without_checksum_loads_with_one_warning(state, tmp_path, capsys):
    """A checkpoint from before checksums: accepted, saying in one line it cannot be verified;
    a refused one says only why it is refused."""
    path = tmp_path / 'old.pt'
    torch.save(state, path)
    assert operations.verify_checksum(path) is False
    assert operations.read_checkpoint(path)['step'] == 3
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and err.startswith('warning: ') and 'no checksum' in err, err
    model, ck = operations.load_checkpoint(path)
    assert capsys.readouterr().err == err
    torch.save(dict(state, step='3'), path)
    refused(path, 'step')
    assert capsys.readouterr().err == ''


def nan_in(state, where):
    """A copy of state with one NaN in the model's lm_head or in Adam's first moment."""
    s = dict(state, model=dict(state['model']), optimizer=copy.deepcopy(state['optimizer']))
    if where == 'model':
        t = s['model']['lm_head.weight'].clone()
        s['model']['lm_head.weight'] = t
    else:
        t = s['optimizer']['state'][2]['exp_avg']
    t.view(-1)[5] = float('nan') if where == 'model' else float('inf')
    return s, 'model.lm_head.weight' if where == 'model' else 'optimizer.state.2.exp_avg'


@pytest.mark.parametrize('where', ['model', 'optimizer'])
def test_non_finite_weights_are_never_written(saved, state, where):
    path, before = saved
    bad, name = nan_in(state, where)
    with pytest.raises(UserError) as e:
        operations.save_checkpoint(path, dict(bad, step=6), 3)
    msg = str(e.value)
    assert '\n' not in msg and name in msg and f'{path} (step 3)' in msg, msg
    assert path.read_bytes() == before and sorted(p.name for p in path.parent.iterdir()) == ['ckpt.pt']


@pytest.mark.parametrize('where', ['model', 'optimizer'])
@pytest.mark.parametrize('sealed', [True, False])
def test_non_finite_weights_are_refused_at_load(state, tmp_path, where, sealed):
    bad, name = nan_in(state, where)
    path = tmp_path / 'ckpt.pt'
    buf = io.BytesIO()
    torch.save(bad, buf)   # written around save_checkpoint's own check
    with open(path, 'wb') as f:
        operations.write_sealed(f, buf.getbuffer()) if sealed else f.write(buf.getvalue())
    refused(path, name, 'NaN or inf')


BAD_FIELDS = [('step', '3'), ('step', -1), ('step', True), ('step', 2.0), ('epoch', None), ('pos', [4]),
              ('train_chars', 1.5), ('train_flops', float('nan')), ('train_flops', 'x'),
              ('train_time', float('inf')), ('train_time', -1.0), ('budget_flops', None),
              ('args', ['--lr']), ('args', {1: 2}), ('rng', {}), ('rng', 'x'), ('optimizer', {'state': []}),
              ('optimizer', None), ('scaler', 1), ('schedule', None), ('model', {'w': [1.0]}),
              ('model', []), ('vocab', 'abc')]


@pytest.mark.parametrize('field, value', BAD_FIELDS, ids=[f'{k}={v!r}' for k, v in BAD_FIELDS])
def test_every_checkpoint_field_is_checked_where_it_is_read(state, tmp_path, field, value):
    path = tmp_path / 'ckpt.pt'
    operations.save_checkpoint(path, dict(state, **{field: value}), None)
    msg = refused(path, str(path), field)
    assert msg.startswith(f'checkpoint {path}: {field}') or 'vocab' in msg, msg


@pytest.mark.parametrize('vocab, words', [
    (dict(alphabet=['a', 'a', ' '], vocab_size=3, space_id=2), "'a' twice"),
    (dict(alphabet=['ab', ' '], vocab_size=2, space_id=1), 'single characters'),
    (dict(alphabet='abc ', vocab_size=4, space_id=3), 'single characters'),
    (dict(alphabet=[' ', 'a'], vocab_size=3, space_id=0), 'vocab_size 3'),
    (dict(alphabet=[' ', 'a'], vocab_size=2, space_id=1), 'space_id 1'),
    (dict(alphabet=[' ', 'a'], vocab_size=2, space_id='0'), 'space_id'),
    (dict(alphabet=[' ', 1], vocab_size=2, space_id=0), 'single characters'),
])
def test_checkpoint_vocabulary_is_checked(state, tmp_path, vocab, words):
    path = tmp_path / 'ckpt.pt'
    operations.save_checkpoint(path, dict(state, vocab=vocab), None)
    refused(path, 'vocab', words)


def test_checkpoint_save_failure_keeps_the_previous_one(saved, state, monkeypatch):
    """A full disk while the sealed bytes are written: the previous checkpoint stays, no temp file."""
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
    with pytest.raises(UserError, match=r'No space left on device; the last good checkpoint is .* \(step 3\)'):
        operations.save_checkpoint(path, dict(state, step=6), 3)
    monkeypatch.undo()
    assert path.read_bytes() == before and sorted(p.name for p in path.parent.iterdir()) == ['ckpt.pt']


# ----------------------------------------------------------------------------- log.jsonl
NO_SINKS = SimpleNamespace(tensorboard=False, wandb=None)


def records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def write_log(path, recs, tail=b''):
    path.write_bytes(b''.join(json.dumps(r).encode() + b'\n' for r in recs) + tail)


def test_logger_writes_whole_json_lines_and_nothing_to_stdout(tmp_path, capsys):
    log = operations.Logger(tmp_path, NO_SINKS, dict(kind='config', lr=1e-3))
    log.log(dict(kind='train', step=1, loss=2.5, sf=None))
    log.log(dict(kind='eval', step=1, split='valid', bpc=1.25))
    assert records(tmp_path / 'log.jsonl') == [dict(kind='config', lr=1e-3),
                                               dict(kind='train', step=1, loss=2.5, sf=None),
                                               dict(kind='eval', step=1, split='valid', bpc=1.25)]
    assert capsys.readouterr() == ('', '')
    operations.Logger(tmp_path, NO_SINKS, dict(kind='config'), rank=1).log(dict(kind='train', step=2))
    assert len(records(tmp_path / 'log.jsonl')) == 3   # other ranks write nothing


@pytest.mark.parametrize('tail', [b'{"kind": "train", "st', b'{"kind": "train"}', b'garbage\n', b'\n', b'[1, 2]\n'])
def test_a_cut_last_line_is_repaired_before_appending(tmp_path, capsys, tail):
    path = tmp_path / 'log.jsonl'
    before = [dict(kind='config'), dict(kind='train', step=1)]
    write_log(path, before, tail)
    operations.Logger(tmp_path, NO_SINKS, dict(kind='config', again=True))
    assert records(path) == before + [dict(kind='config', again=True)]
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and err.startswith(f'warning: {path}: dropped its last line'), err
    assert f'({len(tail)} bytes' in err


def test_a_whole_log_is_left_alone(tmp_path, capsys):
    path = tmp_path / 'log.jsonl'
    write_log(path, [dict(kind='config'), dict(kind='train', step=1)])
    operations.Logger(tmp_path, NO_SINKS, dict(kind='config'))
    assert len(records(path)) == 3 and capsys.readouterr().err == ''


def partial_then_full(monkeypatch, after=0.5):
    """os.write writes part of the bytes, then the disk is full (ENOSPC)."""
    real_write, calls = os.write, []

    def write(fd, data):
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, bytes(data[:int(len(data) * after)]))
        raise OSError(errno.ENOSPC, 'No space left on device')
    monkeypatch.setattr(os, 'write', write)
    return calls


@pytest.mark.parametrize('after', [0.0, 0.5, 0.99])
def test_a_full_disk_mid_record_leaves_no_partial_line(tmp_path, monkeypatch, after):
    log = operations.Logger(tmp_path, NO_SINKS, dict(kind='config'))
    log.log(dict(kind='train', step=1, loss=3.0))
    before = (tmp_path / 'log.jsonl').read_bytes()
    calls = partial_then_full(monkeypatch, after)
    with pytest.raises(UserError) as e:
        log.log(dict(kind='train', step=2, loss=2.0, note='x' * 500))
    monkeypatch.undo()
    assert len(calls) == 2 and calls[1] < calls[0] or after == 0.0   # the second write was the rest
    msg = str(e.value)
    assert '\n' not in msg and 'No space left on device' in msg and str(tmp_path / 'log.jsonl') in msg
    assert (tmp_path / 'log.jsonl').read_bytes() == before
    log.log(dict(kind='train', step=2, loss=2.0))  # the disk has room again: the log goes on
    assert [r.get('step') for r in records(tmp_path / 'log.jsonl')] == [None, 1, 2]


def test_ctrl_c_mid_record_leaves_no_partial_line(tmp_path, monkeypatch):
    log = operations.Logger(tmp_path, NO_SINKS, dict(kind='config'))
    before = (tmp_path / 'log.jsonl').read_bytes()
    real_write = os.write

    def write(fd, data):
        if len(data) > 100:
            return real_write(fd, bytes(data[:50]))
        raise KeyboardInterrupt
    monkeypatch.setattr(os, 'write', write)
    with pytest.raises(KeyboardInterrupt):
        log.log(dict(kind='train', step=1, note='y' * 200))
    monkeypatch.undo()
    assert (tmp_path / 'log.jsonl').read_bytes() == before


def test_resume_drops_the_records_after_the_checkpoint_step(tmp_path, capsys):
    path = tmp_path / 'log.jsonl'
    recs = ([dict(kind='config', seed=1)] + [dict(kind='train', step=s) for s in (2, 4, 6, 8)]
            + [dict(kind='eval', step=4, split='valid'), dict(kind='eval', step=8, split='valid'),
               dict(kind='config', seed=1, resumed_from=8)])
    write_log(path, recs, tail=b'{"kind": "train", "step": 1')
    operations.Logger(tmp_path, NO_SINKS, dict(kind='config', resumed_from=4), resumed_from=4)
    got = records(path)
    assert [r for r in got if r['kind'] != 'config'] == [dict(kind='train', step=2), dict(kind='train', step=4),
                                                         dict(kind='eval', step=4, split='valid')]
    assert [r for r in got if r['kind'] == 'config'] == [recs[0], recs[-1], dict(kind='config', resumed_from=4)]
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and 'dropped its last line' in err[0], err
    assert err[1] == (f"note: {path}: dropped 3 record(s) of steps after 4, the checkpoint's step "
                      f"(the resumed run redoes them)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ['log.jsonl']
    operations.Logger(tmp_path, NO_SINKS, dict(kind='config'), resumed_from=4)   # nothing more to drop
    assert capsys.readouterr().err == '' and len(records(path)) == len(got) + 1


def test_resume_rewrite_that_fails_leaves_the_log_as_it_was(tmp_path, monkeypatch):
    path = tmp_path / 'log.jsonl'
    write_log(path, [dict(kind='config'), dict(kind='train', step=2), dict(kind='train', step=4)])
    before = path.read_bytes()

    def full(*a, **k):
        raise OSError(errno.ENOSPC, 'No space left on device')
    monkeypatch.setattr(os, 'fsync', full)
    with pytest.raises(UserError, match='No space left on device; it is left as it was'):
        operations.Logger(tmp_path, NO_SINKS, dict(kind='config'), resumed_from=2)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ['log.jsonl']


# ----------------------------------------------------------------------------- meta.json
def make_dataset(root, unigram=(8, 16)):
    """A tiny dataset in prepare_data.py's layout: token ids, Unigram label sets, meta.json."""
    root.mkdir(parents=True, exist_ok=True)
    alphabet = [' ', 'a', 'b', 'c', '\n']
    rng = np.random.default_rng(0)
    sizes = dict(train=300, valid=60, test=60)
    for s, n in sizes.items():
        rng.integers(0, len(alphabet), n).astype(np.uint8).tofile(root / f'{s}.bin')
        for V in unigram:
            (rng.random(n) < 0.3).astype(np.uint8).tofile(root / f'{s}.unigram-{V}.bin')
    sets = {str(V): dict(vocab_size=V, model=f'unigram-{V}.model',
                         labels={s: f'{s}.unigram-{V}.bin' for s in sizes}, settings={'model_type': 'unigram'},
                         fit_words={'distinct_used': 10}, shortening_factor={s: 3.3 for s in sizes},
                         left_context_ceiling={'split': 'valid', 'shortening_factor': 2.9})
            for V in unigram}
    meta = dict(name=root.name, dataset=None, lang='en', alphabet=alphabet, vocab_size=len(alphabet),
                space_id=0, newline_id=4, dtype='uint8', sizes=sizes, source=None, slice=None,
                cleaning={'split': 'head'}, inputs=['x.txt'], mean_word_length=4.5,
                defaults={'unigram': 10000, 'prior': 0.2},
                unigram=sets[str(max(unigram))] if unigram else None, unigram_sets=sets)
    (root / 'meta.json').write_text(json.dumps(meta))
    return root, meta


@pytest.fixture(scope='module')
def dataset(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp('data') / 'tiny')


def test_load_data_reads_the_label_set_meta_json_names(dataset, tmp_path):
    root, meta = dataset
    m, splits, labels = operations.load_data(root, 'unigram')
    assert m == meta and {s: len(v) for s, v in splits.items()} == meta['sizes']
    assert np.array_equal(labels['valid'], np.fromfile(root / 'valid.unigram-16.bin', np.uint8))
    _, _, labels = operations.load_data(root, 'unigram', unigram=8)
    assert np.array_equal(labels['test'], np.fromfile(root / 'test.unigram-8.bin', np.uint8))
    with pytest.raises(UserError, match=r'needs Unigram labels in .*; it has unigram-8, unigram-16 \(make them '
                                        r'with: .* --unigram 32\)'):
        operations.load_data(root, 'unigram', unigram=32)
    # labels under other names are found through "labels"; a set from before "unigram_sets" too
    other, meta2 = make_dataset(tmp_path / 'other', unigram=(8,))
    for s in ('train', 'valid', 'test'):
        (other / f'{s}.unigram-8.bin').rename(other / f'{s}.pieces.bin')
    old = dict(meta2, unigram=dict(meta2['unigram'], labels={s: f'{s}.pieces.bin' for s in meta2['sizes']}))
    del old['unigram_sets']
    (other / 'meta.json').write_text(json.dumps(old))
    assert len(operations.load_data(other, 'unigram')[2]['train']) == 300
    assert len(operations.load_data(other, 'unigram', unigram=8)[2]['train']) == 300
    (other / 'meta.json').write_text(json.dumps(dict(old, unigram=None)))
    with pytest.raises(UserError, match=r'needs Unigram labels in \S+ \(make them with: .*--unigram 10000\)'):
        operations.load_data(other, 'unigram')


DAMAGE = [
    ('unigram', 300, '"unigram" is 300, expected a label set'),
    ('unigram', {'vocab_size': '16'}, 'expected a label set'),
    ('unigram', dict(vocab_size=16, labels={'train': '../../etc/passwd'}), '"unigram"["labels"]'),
    ('unigram', dict(vocab_size=16, labels=['train.bin']), '"unigram"["labels"]'),
    ('unigram', dict(vocab_size=32), '"unigram" names vocab_size 32, which "unigram_sets" lacks'),
    ('unigram_sets', [], '"unigram_sets" is []'),
    ('unigram_sets', {'16': dict(vocab_size=8)}, 'has vocab_size 8, not 16'),
    ('alphabet', [' ', 'a', 'a', 'c', '\n'], "holds 'a' twice"),
    ('alphabet', [' ', 'ab', 'b', 'c', '\n'], 'single characters'),
    ('alphabet', 'abcde', 'single characters'),
    ('space_id', 1, 'space_id 1 is not the id of the space'),
    ('space_id', True, 'space_id True'),
    ('newline_id', 0, 'newline_id 0'),
    ('vocab_size', 6, 'vocab_size 6 is not the 5 characters'),
    ('vocab_size', 5.0, 'gives vocab_size 5.0'),
    ('vocab_size', 300, 'fits uint8'),
    ('dtype', 'int64', 'gives dtype "int64"'),
    ('dtype', ['uint8'], 'gives dtype ["uint8"]'),
    ('sizes', {'train': '300'}, 'sizes is {"train": "300"}'),
    ('sizes', {'train': 3.5e2}, 'sizes is'),
    ('mean_word_length', -1, 'mean_word_length is -1'),
    ('defaults', {'prior': 1.5}, 'defaults is'),
    ('defaults', {'unigram': 'many'}, 'defaults is'),
]


@pytest.mark.parametrize('field, value, words', DAMAGE, ids=[f'{f}={v!r:.20}' for f, v, _ in DAMAGE])
def test_hand_edited_meta_json_ends_in_one_line(dataset, tmp_path, field, value, words):
    root, meta = dataset
    d = tmp_path / 'd'
    d.mkdir()
    (d / 'meta.json').write_text(json.dumps(dict(meta, **{field: value})))
    with pytest.raises(UserError) as e:
        operations.load_data(d, 'unigram')
    msg = str(e.value)
    assert '\n' not in msg and msg.startswith(f'{d / "meta.json"}: ') and words in msg, msg
    assert 'remake it with: python prepare_data.py' in msg


@pytest.mark.parametrize('text, words', [('{"alphabet": [', 'unreadable'), ('[1, 2]', 'holds [1, 2], not an object'),
                                         ('{}', 'lacks alphabet, vocab_size, dtype'), ('\udcff', 'unreadable'),
                                         ('[' * 100000, 'unreadable')])
def test_meta_json_that_is_no_json_object_ends_in_one_line(tmp_path, text, words):
    (tmp_path / 'meta.json').write_bytes(text.encode('utf-8', 'surrogateescape'))
    with pytest.raises(UserError) as e:
        operations.read_meta(tmp_path)
    assert '\n' not in str(e.value) and words in str(e.value), str(e.value)


def json_paths(obj, prefix=()):
    """Every (path of keys, value) in a JSON tree."""
    yield prefix, obj
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        yield from json_paths(v, prefix + (k,))


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-2, 70000) | st.floats() | st.text(max_size=3),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner,
                                                                                       max_size=3),
                           max_leaves=5)


@settings(**HYPOTHESIS_FIXTURES)
@given(data=st.data())
def test_damaged_meta_json_is_one_line_never_another_exception(dataset, tmp_path, data):
    """Random deletions and type changes anywhere in meta.json: load_data either works (and the
    meta it returns passes every check) or ends in one UserError line."""
    root, meta = dataset
    damaged = copy.deepcopy(meta)
    for _ in range(data.draw(st.integers(1, 3))):
        paths = [p for p, _ in json_paths(damaged) if p]
        if not paths:
            break
        path = data.draw(st.sampled_from(paths))
        parent = damaged
        for k in path[:-1]:
            parent = parent[k]
        if data.draw(st.booleans()):
            del parent[path[-1]]
        else:
            parent[path[-1]] = data.draw(JSON_VALUES)
    (root / 'meta.json').write_text(json.dumps(damaged))
    try:
        for boundary in ('unigram', 'whitespace'):
            try:
                got = operations.load_data(root, boundary)[0]
            except UserError as e:
                assert '\n' not in str(e), str(e)
            else:
                assert operations.meta_problem(got) is None
    finally:
        (root / 'meta.json').write_text(json.dumps(meta))
