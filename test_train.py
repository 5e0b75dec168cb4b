"""Tests of train.py: overlapping-window evaluation, exact resume, DDP, learning, user errors.

Run:   python -m pytest -q test_train.py
"""


import json
import math
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import train
from dynpool import BOUNDARY_MODES, Config, DynamicPoolingLM


# ==================================================================================================
# TRAINING: overlapping-window evaluation, exact resume, DDP, learning, user errors
# (formerly test_train.py)
# ==================================================================================================

_TRAIN_ROOT = Path(__file__).parent
_TRAIN_SHARED = Path(__file__).parent.parent / 'shared' / 'data'
# A tiny model and short sequences: every run here takes a second or two on one CPU core.
_TRAIN_TINY = ['--device', 'cpu', '--d-model', '32', '--n-head', '2', '--d-head', '16', '--d-inner', '64',
               '--layers', '1,1,1', '--seq-len', '32', '--batch-size', '4', '--eval-window', '32',
               '--eval-step', '8', '--eval-batch-size', '32', '--eval-max-chars', '400', '--log-interval', '1',
               '--warmup', '2', '--lr', '3e-3']


def _train_tiny_with(data, boundary):
    return _TRAIN_TINY + ['--data', str(data), '--boundary', boundary]


@pytest.fixture
def _train_one_thread():
    """Tiny models run fastest on one thread, and far faster than on two when the cores are busy."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _train_write_dataset(root, text, valid=0.1, test=0.1, unigram=True):
    """A dataset in prepare_data.py's layout; Unigram labels are the whitespace labels (each space closes
    its word, which is also a Unigram boundary), enough to exercise the label plumbing."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    alphabet = sorted(set(text))
    ids = np.frombuffer(text.encode('latin-1'), dtype=np.uint8)
    ids = np.searchsorted(np.array([ord(c) for c in alphabet]), ids).astype(np.uint8)
    n_va, n_te = int(len(ids) * valid), int(len(ids) * test)
    parts = dict(train=ids[:len(ids) - n_va - n_te], valid=ids[len(ids) - n_va - n_te:len(ids) - n_te],
                 test=ids[len(ids) - n_te:])
    space = alphabet.index(' ') if ' ' in alphabet else None
    for name, arr in parts.items():
        arr.tofile(root / f'{name}.bin')
        if unigram:
            (arr == space).astype(np.uint8).tofile(root / f'{name}.unigram-1000.bin')
    meta = dict(alphabet=alphabet, vocab_size=len(alphabet), space_id=space,
                newline_id=alphabet.index('\n') if '\n' in alphabet else None, dtype='uint8',
                sizes={k: len(v) for k, v in parts.items()}, mean_word_length=len(text) / max(1, text.count(' ')),
                unigram={'vocab_size': 1000, 'model': None, 'shortening_factor': {}} if unigram else None)
    (root / 'meta.json').write_text(json.dumps(meta))
    return root


def _train_words(n_chars, seed=0, letters='abcdefgh'):
    """Random 'words' from a small alphabet: text that needs no shared data."""
    rng = np.random.default_rng(seed)
    words = [''.join(rng.choice(list(letters), size=rng.integers(1, 7))) for _ in range(n_chars // 3)]
    return ' '.join(words)[:n_chars]


@pytest.fixture(scope='module')
def _train_synth(tmp_path_factory):
    return _train_write_dataset(tmp_path_factory.mktemp('synth') / 'synth', _train_words(40_000))


@pytest.fixture(scope='module')
def _train_text8(tmp_path_factory):
    src = _TRAIN_SHARED / 'text8-head.txt'
    if not src.is_file():
        pytest.skip(f'{src} is absent (shared data lives beside the repo in the project CI)')
    text = src.read_text()[:400_000]
    return _train_write_dataset(tmp_path_factory.mktemp('t8') / 'text8', text, valid=0.05, test=0.05)


def _train_log(out):
    return [json.loads(line) for line in (Path(out) / 'log.jsonl').read_text().splitlines()]


def _train_user_error(argv, capsys):
    """Run train.main in-process, expect a user error: exit code != 0 and exactly one line on stderr."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        train.main(argv)
    assert e.value.code not in (0, None)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith('error: '), err
    return err[0]


# ----------------------------------------------------------------------------- evaluation
@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 400), window=st.integers(1, 64), step=st.integers(1, 64))
def test_train_eval_windows_score_every_position_once(n, window, step):
    step = min(step, window)
    wins = train.eval_windows(n, window, step)
    scored = np.zeros(n, dtype=int)
    for start, end, first in wins:
        assert 0 <= start <= first < end <= n and end - start == min(n, window)
        scored[first:end] += 1
        for j in (first, end - 1):  # context = characters before j in the window
            assert j - start >= min(j, window - step)
    assert (scored == 1).all()


@pytest.mark.usefixtures('_train_one_thread')
@pytest.mark.parametrize('boundary', ['none', 'whitespace', 'entropy'])
def test_train_windowed_eval_equals_naive_per_character(boundary):
    """Batched overlapping-window evaluation == scoring each character alone, with the context the windows
    promise: the first `window` characters from the start, later ones from the start of the window whose
    last `step` characters they are in, the tail from the last window that ends at the text's end."""
    torch.manual_seed(0)
    text = _train_words(71, seed=1)
    alphabet = sorted(set(text))
    tokens = np.array([alphabet.index(c) for c in text], dtype=np.uint8)
    cfg = Config(vocab_size=len(alphabet), d_model=32, n_head=2, d_head=16, d_inner=64, dropout=0.0, dropatt=0.0,
                 layers=(1, 1, 1), boundary=boundary, whitespace_id=alphabet.index(' '))
    model = DynamicPoolingLM(cfg).eval()
    window, step = 16, 4
    r = train.evaluate(model, tokens, window, step, batch_size=5, device='cpu')
    n = len(tokens) - 1
    x = torch.from_numpy(tokens.astype(np.int64))
    naive = 0.0
    assert (n - window) % step, 'the text should end in a partial window: the tail case'
    with torch.no_grad():
        for j in range(n):  # predict character j+1 from the window that scores it, cut right after j
            start = 0 if j < window else min(-(-(j + 1 - window) // step) * step, n - window)
            logits = model(x[None, start:j + 1]).logits[0, -1]
            naive += F.cross_entropy(logits[None], x[j + 1:j + 2]).item()
    assert r['chars'] == n
    assert r['nats'] == pytest.approx(naive, rel=1e-5)
    assert r['bpc'] == pytest.approx(naive / n / math.log(2), rel=1e-5)


# ----------------------------------------------------------------------------- checkpoints
@pytest.mark.usefixtures('_train_one_thread')
def test_train_stop_and_resume_is_bit_identical(_train_synth, tmp_path, capsys):
    # gumbel with dropout: the run uses the RNG for noise and dropout, all of which must be restored
    common = _train_tiny_with(_train_synth, 'gumbel') + ['--max-steps', '6', '--eval-interval', '3',
                                                        '--dropout', '0.1', '--dropatt', '0.1']
    train.main(common + ['--out', str(tmp_path / 'a')])
    train.main(common + ['--out', str(tmp_path / 'b'), '--stop-step', '4'])
    assert 'stopped at step 4' in capsys.readouterr().out
    assert torch.load(tmp_path / 'b' / 'ckpt.pt', weights_only=False)['step'] == 4
    train.main(['--out', str(tmp_path / 'b'), '--resume', '--device', 'cpu'])  # the rest comes from the checkpoint
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith('test bpc ')
    a = torch.load(tmp_path / 'a' / 'ckpt.pt', weights_only=False)
    b = torch.load(tmp_path / 'b' / 'ckpt.pt', weights_only=False)
    assert a['step'] == b['step'] == 6 and (a['epoch'], a['pos']) == (b['epoch'], b['pos'])
    for k in a['model']:
        assert torch.equal(a['model'][k], b['model'][k]), k
    assert _train_log(tmp_path / 'a')[-1] == _train_log(tmp_path / 'b')[-1]  # the same test result
    assert any(r.get('resumed_from') == 4 for r in _train_log(tmp_path / 'b'))


@pytest.mark.usefixtures('_train_one_thread')
def test_train_checkpoint_contents_and_data_epochs(tmp_path):
    # 6400 train chars / 65 = 98 chunks = 6 steps of 16 per epoch: step 8 is 2 steps into epoch 1
    data = _train_write_dataset(tmp_path / 'small', _train_words(8000))
    out = tmp_path / 'r'
    train.main(_train_tiny_with(data, 'unigram') + ['--seq-len', '64', '--batch-size', '16', '--max-steps', '8',
                                                    '--eval-interval', '8', '--out', str(out)])
    ck = torch.load(out / 'ckpt.pt', weights_only=False)
    for k in ('model', 'optimizer', 'scaler', 'step', 'epoch', 'pos', 'config', 'vocab', 'rng', 'schedule', 'args'):
        assert k in ck, k
    assert set(ck['rng']) >= {'torch', 'numpy', 'python', 'cuda'}
    assert (ck['epoch'], ck['pos']) == (1, 32)
    assert Config(**ck['config']).boundary == 'unigram'
    assert not list(out.glob('*.tmp'))
    rec = [r for r in _train_log(out) if 'loss' in r]
    assert rec and all(r.get('precision') is not None and r.get('recall') is not None for r in rec)
    assert all(k in rec[-1] for k in ('bpc', 'sf', 'chars_per_s', 'lr', 'mem_mb'))


def test_train_epoch_order_is_a_shuffled_rotation():
    n, seq = 1000, 9
    off, perm = train.epoch_order(n, seq, seed=3, epoch=0)
    off1, perm1 = train.epoch_order(n, seq, seed=3, epoch=1)
    assert (off, list(perm)) != (off1, list(perm1))  # a new shift and order every epoch ...
    assert off == train.epoch_order(n, seq, seed=3, epoch=0)[0]  # ... that depends on (seed, epoch) only
    stream = np.arange(n)
    chunks = train.get_chunks(stream, off, perm, seq).numpy()
    # chunk k is the k-th non-overlapping piece of seq+1 characters of the stream rotated by the offset
    rotated = np.roll(stream, -off)[:len(perm) * (seq + 1)].reshape(len(perm), seq + 1)
    assert sorted(perm) == list(range(n // (seq + 1)))
    assert (chunks[np.argsort(perm)] == rotated).all()


@pytest.mark.usefixtures('_train_one_thread')
def test_train_non_finite_loss_stops_and_keeps_checkpoint(_train_synth, tmp_path, capsys):
    out = tmp_path / 'nan'
    # Adam moves each weight by ~lr per step: lr 1e30 overflows the logits on the next step
    msg = _train_user_error(_train_tiny_with(_train_synth, 'none') + ['--lr', '1e30', '--warmup', '1',
                            '--max-steps', '5', '--eval-interval', '1', '--out', str(out)], capsys)
    assert 'non-finite' in msg
    ck = torch.load(out / 'ckpt.pt', weights_only=False)  # the last checkpoint, written before the failure
    assert all(torch.isfinite(v).all() for v in ck['model'].values())


# ----------------------------------------------------------------------------- DDP
def _train_free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


@pytest.mark.usefixtures('_train_one_thread')
def test_train_ddp_two_processes_match_single(_train_synth, tmp_path):
    """2 gloo processes with 2 sequences each == 1 process with 4 sequences (global batch 4). The processes get
    the environment torchrun gives its workers (RANK, WORLD_SIZE, MASTER_ADDR, ...), without torchrun's agent."""
    argv = _train_tiny_with(_train_synth, 'whitespace') + ['--max-steps', '3', '--eval-interval', '3',
                                                           '--dropout', '0', '--dropatt', '0']
    port = str(_train_free_port())
    procs = [subprocess.Popen([sys.executable, 'train.py'] + argv + ['--out', str(tmp_path / 'ddp')],
                              cwd=_TRAIN_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, OMP_NUM_THREADS='1', RANK=str(r), LOCAL_RANK=str(r),
                                       WORLD_SIZE='2', LOCAL_WORLD_SIZE='2', MASTER_ADDR='127.0.0.1',
                                       MASTER_PORT=port)) for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-3000:] for _, err in outs]
    assert outs[0][0].strip().splitlines()[-1].startswith('test bpc ')
    assert outs[1][0].strip() == ''  # only rank 0 logs
    train.main(argv + ['--out', str(tmp_path / 'one')])
    ddp, one = _train_log(tmp_path / 'ddp'), _train_log(tmp_path / 'one')
    assert ddp[0]['world'] == 2 and one[0]['world'] == 1
    for a, b in zip([r for r in ddp if 'loss' in r], [r for r in one if 'loss' in r]):
        assert a['step'] == b['step'] and a['loss'] == pytest.approx(b['loss'], rel=1e-4, abs=1e-5)
    wa = torch.load(tmp_path / 'ddp' / 'ckpt.pt', weights_only=False)['model']
    wb = torch.load(tmp_path / 'one' / 'ckpt.pt', weights_only=False)['model']
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-3, atol=1e-4)  # Adam magnifies float noise
    # evaluation splits the windows over the processes and sums their losses
    assert ddp[-1]['split'] == 'test' and ddp[-1]['chars'] == one[-1]['chars']
    assert ddp[-1]['bpc'] == pytest.approx(one[-1]['bpc'], rel=1e-3)


@pytest.mark.usefixtures('_train_one_thread')
def test_train_grad_accum_keeps_the_global_batch(_train_synth, tmp_path):
    argv = _train_tiny_with(_train_synth, 'fixed') + ['--max-steps', '2', '--eval-interval', '2', '--dropout', '0',
                                                      '--dropatt', '0']
    train.main(argv + ['--out', str(tmp_path / 'one')])
    train.main(argv + ['--out', str(tmp_path / 'acc'), '--grad-accum', '2'])
    one, acc = ([r['loss'] for r in _train_log(tmp_path / d) if 'loss' in r] for d in ('one', 'acc'))
    assert len(one) == 2 and one == pytest.approx(acc, rel=1e-5)


# ----------------------------------------------------------------------------- learning
@pytest.mark.usefixtures('_train_one_thread')
@pytest.mark.parametrize("boundary", BOUNDARY_MODES)
def test_train_short_run_lowers_validation_bpc(boundary, _train_text8, tmp_path):
    out = tmp_path / boundary
    train.main(_train_tiny_with(_train_text8, boundary) + ['--seq-len', '64', '--max-steps', '30',
               '--eval-interval', '30', '--eval-window', '64', '--eval-step', '32', '--log-interval', '10',
               '--out', str(out)])
    valid = [r for r in _train_log(out) if r.get('split') == 'valid']
    assert [r['step'] for r in valid] == [0, 30]
    assert valid[-1]['bpc'] < valid[0]['bpc'] - 0.3, valid
    test = [r for r in _train_log(out) if r.get('split') == 'test'][-1]
    assert math.isfinite(test['bpc']) and test['sf'] >= 1.0


# ----------------------------------------------------------------------------- user errors
@pytest.fixture(scope='module')
def _train_done_run(_train_synth, tmp_path_factory):
    """A finished one-step run to resume from."""
    out = tmp_path_factory.mktemp('done') / 'run'
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    train.main(_train_tiny_with(_train_synth, 'whitespace') + ['--max-steps', '1', '--out', str(out)])
    torch.set_num_threads(n)
    return out


def _train_copy(run, tmp_path):
    shutil.copytree(run, tmp_path / 'run')
    return tmp_path / 'run'


def test_train_error_missing_data(tmp_path, capsys):
    msg = _train_user_error(['--data', str(tmp_path / 'nope'), '--device', 'cpu', '--out', str(tmp_path / 'o')], capsys)
    assert 'python prepare_data.py' in msg
    assert not (tmp_path / 'o').exists()


@pytest.mark.usefixtures('_train_one_thread')
def test_train_error_unigram_without_labels(tmp_path, capsys):
    data = _train_write_dataset(tmp_path / 'nolabels', _train_words(5000), unigram=False)
    msg = _train_user_error(_train_tiny_with(data, 'unigram') + ['--out', str(tmp_path / 'o')], capsys)
    assert 'unigram' in msg.lower()


@pytest.mark.usefixtures('_train_one_thread')
def test_train_error_checkpoint_vocab_mismatch(_train_done_run, tmp_path, capsys):
    run = _train_copy(_train_done_run, tmp_path)
    before = (run / 'ckpt.pt').read_bytes()
    other = _train_write_dataset(tmp_path / 'other', _train_words(5000, letters='xyz'))
    msg = _train_user_error(['--out', str(run), '--resume', '--device', 'cpu', '--data', str(other)], capsys)
    assert 'vocabulary' in msg
    assert (run / 'ckpt.pt').read_bytes() == before


@pytest.mark.parametrize('extra, words', [
    (['--boundary', 'entropy'], '--boundary'),
    (['--d-model', '64'], '--d-model'),
])
@pytest.mark.usefixtures('_train_one_thread')
def test_train_error_resume_with_other_model_flags(_train_done_run, tmp_path, capsys, extra, words):
    run = _train_copy(_train_done_run, tmp_path)
    msg = _train_user_error(['--out', str(run), '--resume', '--device', 'cpu'] + extra, capsys)
    assert words in msg


@pytest.mark.parametrize('extra, words', [
    (['--seq-len', '0'], '--seq-len'),
    (['--eval-step', '64', '--eval-window', '32'], '--eval-step'),
    (['--layers', '2,x'], '--layers'),
    (['--batch-size', '3', '--grad-accum', '2'], '--batch-size'),
    (['--boundary', 'bogus'], 'bogus'),
    (['--no-such-flag'], '--no-such-flag'),
])
@pytest.mark.usefixtures('_train_one_thread')
def test_train_error_bad_flags(_train_synth, tmp_path, capsys, extra, words):
    msg = _train_user_error(_train_tiny_with(_train_synth, 'fixed') + extra + ['--out', str(tmp_path / 'o')], capsys)
    assert words in msg
    assert not (tmp_path / 'o').exists()


@pytest.mark.usefixtures('_train_one_thread')
def test_train_error_existing_checkpoint_without_resume(_train_done_run, _train_synth, tmp_path, capsys):
    run = _train_copy(_train_done_run, tmp_path)
    before = (run / 'ckpt.pt').read_bytes(), (run / 'log.jsonl').read_bytes()
    msg = _train_user_error(_train_tiny_with(_train_synth, 'whitespace') + ['--out', str(run)], capsys)
    assert '--resume' in msg
    assert ((run / 'ckpt.pt').read_bytes(), (run / 'log.jsonl').read_bytes()) == before


def test_train_error_resume_from_a_broken_checkpoint(tmp_path, capsys):
    (tmp_path / 'run').mkdir()
    (tmp_path / 'run' / 'ckpt.pt').write_bytes(b'not a checkpoint')
    msg = _train_user_error(['--out', str(tmp_path / 'run'), '--resume', '--device', 'cpu'], capsys)
    assert 'checkpoint' in msg


def test_train_error_resume_without_checkpoint(tmp_path, capsys):
    msg = _train_user_error(['--out', str(tmp_path / 'empty'), '--resume', '--device', 'cpu'], capsys)
    assert 'no checkpoint' in msg


def test_train_cli_error_is_one_line_without_traceback(tmp_path):
    p = subprocess.run([sys.executable, 'train.py', '--data', str(tmp_path / 'missing'), '--device', 'cpu'],
                       cwd=_TRAIN_ROOT, capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, OMP_NUM_THREADS='1'))
    assert p.returncode != 0
    assert p.stderr.strip().splitlines() == [p.stderr.strip()] and p.stderr.startswith('error: ')
    assert 'Traceback' not in p.stderr + p.stdout
