"""Tests of train.py: overlapping-window evaluation, exact resume, DDP, learning, user errors.

Run:   python -m pytest -q test_train.py
"""


import argparse
import io
import json
import math
import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import checkpoint
import dataset
import runtime
import flags
import report
import train
from common import UserError
from conftest import (HYPOTHESIS_FIXTURES, assert_cli_contract, random_words, run_main,
                      shared_data, write_dataset)
from dynpool import BOUNDARY_MODES, Config, DynamicPoolingLM, step_flops


ROOT = Path(__file__).parent
# A tiny model and short sequences: every run here takes a second or two on one CPU core.
TINY = ['--device', 'cpu', '--d-model', '32', '--n-head', '2', '--d-head', '16', '--d-inner', '64',
        '--layers', '1,1,1', '--seq-len', '32', '--batch-size', '4', '--eval-window', '32',
        '--eval-step', '8', '--eval-batch-size', '32', '--eval-subset-chars', '400',
        '--eval-max-chars', '400', '--log-interval', '1', '--warmup', '2', '--lr', '3e-3']


def tiny_args(data, boundary):
    return TINY + ['--data', str(data), '--boundary', boundary]


@pytest.fixture(scope='module')
def synth(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp('synth') / 'synth', random_words(40_000))


@pytest.fixture(scope='module')
def text8(tmp_path_factory):
    text = shared_data('text8-head.txt').read_text()[:400_000]
    return write_dataset(tmp_path_factory.mktemp('t8') / 'text8', text, valid=0.05, test=0.05)


def whole(n_tokens, window, step, batch_size):
    """The batches of windows of --eval-protocol whole."""
    args = argparse.Namespace(eval_window=window, eval_step=step, eval_batch_size=batch_size)
    return train.eval_batches(n_tokens, args, 'whole')


def read_log(out):
    return [json.loads(line) for line in (Path(out) / 'log.jsonl').read_text().splitlines()]


def user_error(argv, capsys, code=None):
    """Run train.main in-process, expect a user error: exit code != 0 (or `code`) and exactly one
    line on stderr."""
    capsys.readouterr()
    got = train.main(argv)
    assert got != 0 and got == (code or got)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith('error: '), err
    return err[0]


def trained(argv):
    """train.main(argv) in-process, which must succeed (exit code 0)."""
    assert train.main(argv) == 0


def run_cli(args, env=None):
    """train.py as a user runs it, in its own process."""
    return subprocess.Popen([sys.executable, 'train.py'] + args, cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=env or dict(os.environ, OMP_NUM_THREADS='1'))


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


@pytest.mark.parametrize('boundary', ['none', 'entropy'])
def test_train_eval_sf_is_the_mean_over_windows(boundary):
    """evaluate's SF: the mean over windows of the shortening factor of each window's batch (the
    model's SF of a batch: its tokens over its segments), 1.0 for a model that does not pool."""
    torch.manual_seed(0)
    text = random_words(90, seed=3)
    alphabet = sorted(set(text))
    tokens = np.array([alphabet.index(c) for c in text], dtype=np.uint8)
    cfg = Config(vocab_size=len(alphabet), d_model=32, n_head=2, d_head=16, d_inner=64,
                 layers=(1, 1, 1), boundary=boundary, whitespace_id=alphabet.index(' '))
    model = DynamicPoolingLM(cfg).eval()
    r = train.evaluate(model, tokens, whole(len(tokens), 24, 8, 4), device='cpu')
    windows = train.eval_windows(len(tokens) - 1, 24, 8)
    assert len(windows) > 4
    sfs = []
    with torch.no_grad():
        for i in range(0, len(windows), 4):
            group = windows[i:i + 4]
            x = np.stack([tokens[start:end] for start, end, _ in group]).astype(np.int64)
            out = model(torch.from_numpy(x))
            sf = 1.0
            if out.shortening_factor is not None:
                sf = out.shortening_factor.item()
            sfs += [sf] * len(group)
    assert r['sf'] == pytest.approx(sum(sfs) / len(sfs), rel=1e-6)
    if boundary == 'entropy':
        assert len(set(sfs)) > 1   # (windows that differ: a mean, not one window's)


@pytest.mark.parametrize('boundary', ['none', 'whitespace', 'entropy'])
def test_train_windowed_eval_equals_naive_per_character(boundary):
    """Batched overlapping-window evaluation == scoring each character alone, with the context the
    windows promise: the first `window` characters from the start, later ones from the start of the
    window whose last `step` characters they are in, the tail from the last window that ends at the
    text's end."""
    torch.manual_seed(0)
    text = random_words(71, seed=1)
    alphabet = sorted(set(text))
    tokens = np.array([alphabet.index(c) for c in text], dtype=np.uint8)
    cfg = Config(vocab_size=len(alphabet), d_model=32, n_head=2, d_head=16, d_inner=64, dropout=0.0,
                 dropatt=0.0,
                 layers=(1, 1, 1), boundary=boundary, whitespace_id=alphabet.index(' '))
    model = DynamicPoolingLM(cfg).eval()
    window, step = 16, 4
    r = train.evaluate(model, tokens, whole(len(tokens), window, step, 5), device='cpu')
    n = len(tokens) - 1
    x = torch.from_numpy(tokens.astype(np.int64))
    naive = 0.0
    assert (n - window) % step, 'the text should end in a partial window: the tail case'
    with torch.no_grad():
        # predict character j+1 from the window that scores it, cut right after j
        for j in range(n):
            start = 0 if j < window else min(-(-(j + 1 - window) // step) * step, n - window)
            logits = model(x[None, start:j + 1]).logits[0, -1]
            naive += F.cross_entropy(logits[None], x[j + 1:j + 2]).item()
    assert r['chars'] == n
    assert r['bpc'] * n * math.log(2) == pytest.approx(naive, rel=1e-5)
    assert r['bpc'] == pytest.approx(naive / n / math.log(2), rel=1e-5)


# ----------------------------------------------------------------------------- checkpoints
def test_train_stop_and_resume_is_bit_identical(synth, tmp_path, capsys):
    # gumbel with dropout: the run uses the RNG for noise and dropout, all of which must be restored
    common = tiny_args(synth, 'gumbel') + ['--max-steps', '6', '--eval-interval', '3',
                                                        '--dropout', '0.1', '--dropatt', '0.1']
    trained(common + ['--out', str(tmp_path / 'a')])
    trained(common + ['--out', str(tmp_path / 'b'), '--stop-step', '4'])
    assert 'stopped at step 4' in capsys.readouterr().out
    assert torch.load(tmp_path / 'b' / 'ckpt.pt', weights_only=False)['step'] == 4
    # the rest comes from the checkpoint
    trained(['--out', str(tmp_path / 'b'), '--resume', '--device', 'cpu'])
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith('test bpc ')
    a = torch.load(tmp_path / 'a' / 'ckpt.pt', weights_only=False)
    b = torch.load(tmp_path / 'b' / 'ckpt.pt', weights_only=False)
    assert a['step'] == b['step'] == 6 and (a['epoch'], a['pos']) == (b['epoch'], b['pos'])
    for k in a['model']:
        assert torch.equal(a['model'][k], b['model'][k]), k
    ra, rb = read_log(tmp_path / 'a')[-1], read_log(tmp_path / 'b')[-1]  # the same test result ...
    for k in ('kind', 'split', 'step', 'bpc', 'sf', 'eval_chars', 'train_chars'):
        assert ra[k] == rb[k], k
    # ... after the same training
    assert ra['train_flops'] == pytest.approx(rb['train_flops'], rel=1e-12)
    assert any(r.get('resumed_from') == 4 for r in read_log(tmp_path / 'b'))


def test_train_checkpoint_contents_and_data_epochs(tmp_path):
    # 6400 train chars / 65 = 98 chunks = 6 steps of 16 per epoch: step 8 is 2 steps into epoch 1
    data = write_dataset(tmp_path / 'small', random_words(8000))
    out = tmp_path / 'r'
    trained(tiny_args(data, 'unigram') + ['--seq-len', '64', '--batch-size', '16', '--max-steps',
                                          '8',
                                                    '--eval-interval', '8', '--out', str(out)])
    ck = torch.load(out / 'ckpt.pt', weights_only=False)
    for k in ('model', 'optimizer', 'scaler', 'step', 'epoch', 'pos', 'config', 'vocab', 'rng',
              'args'):
        assert k in ck, k
    assert set(ck['rng']) >= {'torch', 'numpy', 'python', 'cuda'}
    assert (ck['epoch'], ck['pos']) == (1, 32)
    assert Config(**ck['config']).boundary == 'unigram'
    assert not list(out.glob('*.tmp'))
    rec = [r for r in read_log(out) if 'loss' in r]
    assert rec and all(r.get('precision') is not None and r.get('recall') is not None for r in rec)
    assert all(k in rec[-1] for k in ('bpc', 'sf', 'chars_per_s', 'lr', 'mem_mb'))


def test_train_epoch_order_is_a_shuffled_rotation():
    n, seq = 1000, 9
    off, perm = train.epoch_order(n, seq, seed=3, epoch=0)
    off1, perm1 = train.epoch_order(n, seq, seed=3, epoch=1)
    assert (off, list(perm)) != (off1, list(perm1))  # a new shift and order every epoch ...
    # ... that depends on (seed, epoch) only
    assert off == train.epoch_order(n, seq, seed=3, epoch=0)[0]
    stream = np.arange(n)
    chunks = train.get_chunks(stream, off, perm, seq).numpy()
    # chunk k is the k-th non-overlapping piece of seq+1 characters of the stream rotated by the
    # offset
    rotated = np.roll(stream, -off)[:len(perm) * (seq + 1)].reshape(len(perm), seq + 1)
    assert sorted(perm) == list(range(n // (seq + 1)))
    assert (chunks[np.argsort(perm)] == rotated).all()


def nan_at_evaluation(n, monkeypatch):
    """train.evaluate, whose n-th call (1: the validation at step 0) says the BPC is nan."""
    real_evaluate = train.evaluate
    calls = []

    def evaluate(model, *a, **k):
        calls.append(1)
        r = real_evaluate(model, *a, **k)
        if len(calls) == n:
            return dict(r, bpc=float('nan'))
        return r
    monkeypatch.setattr(train, 'evaluate', evaluate)


@pytest.mark.parametrize('where', ['loss', 'validation'])
def test_train_divergence_keeps_the_last_finite_checkpoint_and_says_what_works(
        synth, tmp_path, capsys, monkeypatch, where):
    """A non-finite training loss (a NaN weight from step 3 on: steps skipped) or validation (the
    evaluation at step 4 says nan) stops the run before it saves: the checkpoint of step 2 stays,
    log.jsonl ends with a diverged record, and the command the error line suggests (--resume with
    a lower --lr) runs to the end."""
    out = tmp_path / 'run'
    real_step = train.train_step

    def poisoned_step(t, batch):
        real_step(t, batch)
        if t.state.step == 2:   # (counted after the call)
            with torch.no_grad():
                t.raw_model.lm_head.bias[0] = float('nan')

    if where == 'loss':
        monkeypatch.setattr(train, 'train_step', poisoned_step)
    else:
        nan_at_evaluation(3, monkeypatch)   # validations at steps 0, 2, 4
    msg = user_error(tiny_args(synth, 'none') + ['--max-steps', '6', '--eval-interval', '2',
                                                 '--out', str(out)], capsys, code=1)
    monkeypatch.undo()
    assert 'diverged at step' in msg and '(step 2)' in msg, msg
    ck = checkpoint.read_checkpoint(out)   # finite, else refused
    assert ck['step'] == 2
    last = read_log(out)[-1]
    assert last['diverged'] is True and last['step'] == 4 and last['checkpoint_step'] == 2
    assert {'loss': 'non-finite loss', 'validation': 'valid bpc nan'}[where] in msg, msg
    command = shlex.split(msg.split('continue with: ')[1])
    assert command[:2] == ['python', 'train.py'] and command[-2:] == ['--lr', '0.0003']
    trained(command[2:])
    assert read_log(out)[-1]['split'] == 'test'


def test_train_divergence_before_any_checkpoint_saves_none(synth, tmp_path, capsys, monkeypatch):
    """The first validation after step 1 is nan: nothing is saved (a diverged checkpoint would be
    the one --resume and sample.py find), and the line says so."""
    out = tmp_path / 'run'
    nan_at_evaluation(2, monkeypatch)   # validations at steps 0, 1
    argv = tiny_args(synth, 'entropy') + ['--max-steps', '3', '--eval-interval', '1', '--out',
                                          str(out)]
    msg = user_error(argv, capsys, code=1)
    assert 'at step 1 (non-finite valid bpc nan); no checkpoint was written' in msg, msg
    assert not (out / 'ckpt.pt').exists() and read_log(out)[-1]['diverged'] is True


# ----------------------------------------------------------------------------- DDP
def free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def test_train_ddp_two_processes_match_single(synth, tmp_path):
    """2 gloo processes with 2 sequences each == 1 process with 4 sequences (global batch 4). The
    processes get the environment torchrun gives its workers (RANK, WORLD_SIZE, MASTER_ADDR, ...),
    without torchrun's agent. Each takes two micro-steps of one sequence (--grad-accum 2),
    all-reduced once a step under no_sync: the harder path (DDP's static graph, --grad-accum 1, runs
    in the --slow tests: DDP stop and resume, DDP with compile)."""
    argv = tiny_args(synth, 'whitespace') + ['--max-steps', '3', '--eval-interval', '3',
                                             '--dropout', '0', '--dropatt', '0']
    runs = ddp_run(argv + ['--grad-accum', '2'], tmp_path / 'ddp')
    assert [code for code, _, _ in runs] == [0, 0], [err[-3000:] for _, _, err in runs]
    assert runs[0][1].strip().splitlines()[-1].startswith('test bpc ')
    assert runs[1][1].strip() == ''  # only rank 0 logs
    trained(argv + ['--out', str(tmp_path / 'one')])
    ddp, one = read_log(tmp_path / 'ddp'), read_log(tmp_path / 'one')
    assert ddp[0]['world'] == 2 and one[0]['world'] == 1
    for a, b in zip([r for r in ddp if 'loss' in r], [r for r in one if 'loss' in r]):
        assert a['step'] == b['step'] and a['loss'] == pytest.approx(b['loss'], rel=1e-4, abs=1e-5)
    wa = torch.load(tmp_path / 'ddp' / 'ckpt.pt', weights_only=False)['model']
    wb = torch.load(tmp_path / 'one' / 'ckpt.pt', weights_only=False)['model']
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-3, atol=1e-4)  # Adam magnifies float noise
    # evaluation splits the windows over the processes and sums their losses
    assert ddp[-1]['split'] == 'test' and ddp[-1]['eval_chars'] == one[-1]['eval_chars']
    assert ddp[-1]['bpc'] == pytest.approx(one[-1]['bpc'], rel=1e-3)


def ddp_run(argv, out, world=2):
    """train.py in `world` gloo processes, with the environment torchrun gives its workers → their
    (returncode, stdout, stderr)."""
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, 'train.py'] + argv + ['--out', str(out)], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, OMP_NUM_THREADS='1', RANK=str(r),
                                       LOCAL_RANK=str(r),
                                       WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                                       MASTER_ADDR='127.0.0.1', MASTER_PORT=port))
             for r in range(world)]
    outs = [p.communicate(timeout=900) for p in procs]
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs)]


@pytest.mark.slow
def test_train_compile_on_cpu_trains_like_eager(synth, tmp_path):
    """--compile (inductor on CPU): the same losses as eager, within float noise; the segment count
    passed as an int changes every step (whitespace), which must not break the compiled step."""
    argv = tiny_args(synth, 'whitespace') + ['--max-steps', '3', '--dropout', '0', '--dropatt', '0']
    trained(argv + ['--out', str(tmp_path / 'eager')])
    trained(argv + ['--compile', '--out', str(tmp_path / 'compiled')])
    eager, compiled = ([r['loss'] for r in read_log(tmp_path / d) if r['kind'] == 'train']
                       for d in ('eager', 'compiled'))
    assert len(eager) == 3 and compiled == pytest.approx(eager, rel=1e-3)


@pytest.mark.slow
def test_train_ddp_with_compile_under_gloo(synth, tmp_path):
    """DDP (2 gloo processes) around a compiled model: trains, evaluates and ends together."""
    argv = tiny_args(synth, 'fixed') + ['--max-steps', '2', '--compile']
    runs = ddp_run(argv, tmp_path / 'ddp')
    assert [code for code, _, _ in runs] == [0, 0], [err[-3000:] for _, _, err in runs]
    assert runs[0][1].strip().splitlines()[-1].startswith('test bpc ')


def test_train_grad_accum_keeps_the_global_batch(synth, tmp_path):
    argv = tiny_args(synth, 'fixed') + ['--max-steps', '2', '--eval-interval', '2', '--dropout',
                                        '0',
                                                      '--dropatt', '0']
    trained(argv + ['--out', str(tmp_path / 'one')])
    trained(argv + ['--out', str(tmp_path / 'acc'), '--grad-accum', '2'])
    one, acc = ([r['loss'] for r in read_log(tmp_path / d) if 'loss' in r] for d in ('one', 'acc'))
    assert len(one) == 2 and one == pytest.approx(acc, rel=1e-5)


# ----------------------------------------------------------------------------- learning
@pytest.mark.parametrize('boundary', BOUNDARY_MODES)
def test_train_short_run_lowers_validation_bpc(boundary, text8, tmp_path):
    out = tmp_path / boundary
    trained(tiny_args(text8, boundary) + ['--seq-len', '64', '--max-steps', '30',
               '--eval-interval', '30', '--eval-window', '64', '--eval-step', '32',
               '--log-interval', '10',
               '--out', str(out)])
    valid = [r for r in read_log(out) if r.get('split') == 'valid']
    assert [r['step'] for r in valid] == [0, 30]
    assert valid[-1]['bpc'] < valid[0]['bpc'] - 0.3, valid
    test = [r for r in read_log(out) if r.get('split') == 'test'][-1]
    assert math.isfinite(test['bpc']) and test['sf'] >= 1.0


# ----------------------------------------------------------------------------- user errors
@pytest.fixture(scope='module')
def done_run(synth, tmp_path_factory):
    """A finished one-step run to resume from."""
    out = tmp_path_factory.mktemp('done') / 'run'
    trained(tiny_args(synth, 'whitespace') + ['--max-steps', '1', '--out', str(out)])
    return out


def copy_run(run, tmp_path):
    shutil.copytree(run, tmp_path / 'run')
    return tmp_path / 'run'


def test_train_error_missing_data(tmp_path, capsys):
    msg = user_error(['--data', str(tmp_path / 'nope'), '--device', 'cpu', '--out',
                      str(tmp_path / 'o')], capsys)
    assert 'python prepare_data.py' in msg
    assert not (tmp_path / 'o').exists()


def test_train_error_unigram_without_labels(tmp_path, capsys):
    data = write_dataset(tmp_path / 'nolabels', random_words(5000), unigram=False)
    msg = user_error(tiny_args(data, 'unigram') + ['--out', str(tmp_path / 'o')], capsys)
    assert 'unigram' in msg.lower()


def test_train_checkpoint_records_how_its_data_was_cleaned(tmp_path):
    """sample.py cleans a prompt as the training text was cleaned: the checkpoint carries the
    dataset's language (meta.json "cleaning"), and sample.py uses it."""
    import sample
    data = write_dataset(tmp_path / 'fi', random_words(4000))
    meta = json.loads((data / 'meta.json').read_text())
    meta['cleaning'] = dict(lang='fi', pipeline='paper')
    (data / 'meta.json').write_text(json.dumps(meta))
    trained(tiny_args(data, 'whitespace') + ['--max-steps', '1', '--out', str(tmp_path / 'run')])
    vocab = checkpoint.read_checkpoint(tmp_path / 'run')['vocab']
    assert vocab['cleaning'] == dict(lang='fi')
    text, how = sample.clean_prompt('Ébaa', vocab)
    assert text == 'baa' and 'recorded in the checkpoint' in how


def test_train_resume_on_other_data_is_refused(done_run, synth, tmp_path, capsys):
    """A checkpoint records a fingerprint of its data: --resume --data OTHER is refused in one
    line (exit 2) naming the data the run started on, whether OTHER's alphabet differs or only its
    text; the same data under another path resumes, but not with another alphabet in its
    meta.json."""
    run = copy_run(done_run, tmp_path)
    before = (run / 'ckpt.pt').read_bytes()
    resume = ['--out', str(run), '--resume', '--device', 'cpu', '--max-steps', '2']
    for other in (write_dataset(tmp_path / 'xyz', random_words(5000, letters='xyz')),
                  write_dataset(tmp_path / 'same-letters', random_words(40_000, seed=5))):
        msg = user_error(resume + ['--data', str(other)], capsys, code=2)
        assert f'--data {other} is not the data' in msg and f'({synth}, ' in msg, msg
        assert (run / 'ckpt.pt').read_bytes() == before
    moved = shutil.copytree(synth, tmp_path / 'moved')
    trained(resume + ['--data', str(moved)])
    meta = json.loads((moved / 'meta.json').read_text())
    meta['alphabet'][1:3] = meta['alphabet'][2:0:-1]   # two letters swapped: the same ids
    (moved / 'meta.json').write_text(json.dumps(meta))
    msg = user_error(resume + ['--max-steps', '3', '--data', str(moved)], capsys)
    assert 'another vocabulary' in msg, msg


@pytest.mark.parametrize('extra, words', [
    (['--boundary', 'entropy'], '--boundary'),
    (['--d-model', '64'], '--d-model'),
])
def test_train_error_resume_with_other_model_flags(done_run, tmp_path, capsys, extra, words):
    run = copy_run(done_run, tmp_path)
    msg = user_error(['--out', str(run), '--resume', '--device', 'cpu'] + extra, capsys)
    assert words in msg


@pytest.mark.parametrize('extra, words', [
    (['--seq-len', '0'], '--seq-len'),
    (['--eval-step', '64', '--eval-window', '32'], '--eval-step'),
    (['--layers', '2,x'], '--layers'),
    (['--batch-size', '3', '--grad-accum', '2'], '--batch-size'),
    (['--boundary', 'bogus'], 'bogus'),
    (['--no-such-flag'], '--no-such-flag'),
    (['--max-time', '0'], '--max-time'),
    (['--eval-subset-chars', '-1'], '--eval-subset-chars'),
    (['--attention', 'fast'], '--attention'),
    (['--double-sigmoid'], 'double_sigmoid'),    # (tiny_args' boundary is fixed: no predictor)
    (['--lr', 'inf'], 'argument --lr: must be a finite number > 0'),
    (['--dropout', 'nan'], 'argument --dropout'),
    (['--device', 'meta'], '--device meta'),
    (['--layers', '1,2,3,4'], 'argument --layers'),
    (['--fixed-factor', '99999999999999999999'], 'argument --fixed-factor'),
    (['--d-model', '99999998', '--d-inner', '99999999'],
     'with gradients and Adam moments, needs about'),
    (['--d-head', str(2 ** 63 - 1)], 'the model is too large to build'),   # bytes overflow int64
    (['--d-head', str(2 ** 63)], 'argument --d-head: must be an integer >= 1 (below 2**63)'),
])
def test_train_error_bad_flags(synth, tmp_path, capsys, extra, words):
    msg = user_error(tiny_args(synth, 'fixed') + extra + ['--out', str(tmp_path / 'o')], capsys,
                            code=2)
    assert words in msg
    assert not (tmp_path / 'o').exists()


def test_train_error_existing_checkpoint_without_resume(done_run, synth, tmp_path, capsys):
    run = copy_run(done_run, tmp_path)
    before = (run / 'ckpt.pt').read_bytes(), (run / 'log.jsonl').read_bytes()
    msg = user_error(tiny_args(synth, 'whitespace') + ['--out', str(run)], capsys)
    assert '--resume' in msg
    assert ((run / 'ckpt.pt').read_bytes(), (run / 'log.jsonl').read_bytes()) == before


def test_train_error_resume_from_a_broken_checkpoint(tmp_path, capsys):
    (tmp_path / 'run').mkdir()
    (tmp_path / 'run' / 'ckpt.pt').write_bytes(b'not a checkpoint')
    msg = user_error(['--out', str(tmp_path / 'run'), '--resume', '--device', 'cpu'], capsys)
    assert 'checkpoint' in msg


def test_train_error_resume_without_checkpoint(tmp_path, capsys):
    msg = user_error(['--out', str(tmp_path / 'empty'), '--resume', '--device', 'cpu'], capsys)
    assert 'no checkpoint' in msg


# ------------------------------------------------------------------------ bad data, checked at load
def spoil(data, what):
    """Spoil one thing of a dataset in place, as a user's files can be spoiled."""
    meta = json.loads((data / 'meta.json').read_text())
    if what == 'short train.bin':  # cut off: meta.json's sizes say more
        (data / 'train.bin').write_bytes((data / 'train.bin').read_bytes()[:-100])
    elif what == 'id outside the alphabet':  # e.g. another language's file
        ids = bytearray((data / 'valid.bin').read_bytes())
        ids[7] = 200
        (data / 'valid.bin').write_bytes(bytes(ids))
    elif what == 'empty valid.bin':
        (data / 'valid.bin').write_bytes(b'')
        meta['sizes']['valid'] = 0
    elif what == 'unknown dtype':
        meta['dtype'] = 'float32'
    elif what == 'string vocab_size':
        meta['vocab_size'] = str(meta['vocab_size'])
    elif what == 'label outside 0/1':
        labels = bytearray((data / 'train.unigram-1000.bin').read_bytes())
        labels[3] = 7
        (data / 'train.unigram-1000.bin').write_bytes(bytes(labels))
    (data / 'meta.json').write_text(json.dumps(meta))


@pytest.mark.parametrize('what, words', [
    ('short train.bin', 'cut-off'),
    ('id outside the alphabet', 'the value 200'),
    ('empty valid.bin', 'valid.bin is empty'),
    ('unknown dtype', 'float32'),
    ('string vocab_size', 'vocab_size'),
    ('label outside 0/1', 'Unigram labels'),
])
def test_train_error_bad_data(tmp_path, capsys, what, words):
    data = write_dataset(tmp_path / 'data', random_words(5000))
    spoil(data, what)
    msg = user_error(tiny_args(data, 'unigram') + ['--out', str(tmp_path / 'o')], capsys, code=1)
    assert words in msg and 'prepare_data.py' in msg, msg
    assert not (tmp_path / 'o').exists()


# ----------------------------------------------------------------------------- the run directory
@pytest.mark.parametrize('where', ['a file', 'under a file', 'read-only'])
def test_train_error_unusable_out(synth, tmp_path, capsys, monkeypatch, where):
    (tmp_path / 'f').write_text('keep me')
    out = {'a file': tmp_path / 'f', 'under a file': tmp_path / 'f' / 'run',
           'read-only': tmp_path / 'ro'}[where]
    if where == 'read-only':  # (tests run as root, whom a chmod does not stop: the filesystem's)
        def read_only(*a, **k):
            raise OSError(30, 'Read-only file system')
        monkeypatch.setattr(Path, 'mkdir', read_only)
    # the operating system names what is in the way, when the folder is made, before anything
    # is written
    msg = user_error(tiny_args(synth, 'none') + ['--out', str(out)], capsys, code=1)
    assert {'a file': f'{out}: File exists', 'under a file': f'{out}: Not a directory',
            'read-only': 'Read-only file system'}[where] in msg, msg
    assert (tmp_path / 'f').read_text() == 'keep me' and not (tmp_path / 'ro').exists()


def test_train_disk_full_while_saving_keeps_the_last_checkpoint(synth, tmp_path, capsys,
                                                                monkeypatch):
    out, real_save, saves = tmp_path / 'full', torch.save, []

    def save_until_the_disk_fills(obj, f, *a, **k):
        saves.append(obj['step'])
        if len(saves) == 1:
            return real_save(obj, f, *a, **k)
        f.write(b'\0' * 1000)  # part of the file made it to disk ...
        raise OSError(28, 'No space left on device')  # ... then the disk was full
    monkeypatch.setattr(torch, 'save', save_until_the_disk_fills)
    msg = user_error(tiny_args(synth, 'none') + ['--max-steps', '6', '--eval-interval', '2',
                                                                      '--out', str(out)], capsys,
                                                                      code=1)
    monkeypatch.undo()
    assert saves == [2, 4]
    assert 'No space left on device' in msg and f'{out / "ckpt.pt"} (step 2)' in msg, msg
    # the previous checkpoint, whole, and no temp file left
    assert torch.load(out / 'ckpt.pt', weights_only=False)['step'] == 2
    assert sorted(p.name for p in out.iterdir()) == ['.lock', 'ckpt.pt', 'log.jsonl']


def test_train_ctrl_c_during_a_checkpoint_write_waits_for_it(tmp_path, monkeypatch):
    """Ctrl-C that arrives while torch.save writes: the checkpoint is finished and renamed first,
    and only then does the KeyboardInterrupt come (raised inside the writer, it would close the
    file under torch's C++ writer and abort the process)."""
    real_save = torch.save

    def save_interrupted_halfway(obj, f, *a, **k):
        f.write(b'')                       # the writer has started ...
        os.kill(os.getpid(), signal.SIGINT)  # ... when Ctrl-C arrives
        return real_save(obj, f, *a, **k)
    monkeypatch.setattr(torch, 'save', save_interrupted_halfway)
    path = tmp_path / 'ckpt.pt'
    saved = None
    with pytest.raises(KeyboardInterrupt):
        with runtime.interrupts_deferred():
            checkpoint.save_checkpoint(path, {'step': 7, 'w': torch.arange(5)}, None)
            saved = 7
    monkeypatch.undo()
    assert saved == 7  # what the interrupt message reports is the step on disk
    assert torch.load(path, weights_only=False)['step'] == 7
    assert sorted(p.name for p in tmp_path.iterdir()) == ['ckpt.pt']


def test_train_lock_refuses_a_second_run_and_ctrl_c_exits_130(synth, tmp_path, capsys):
    """`python train.py` as a user runs it: a second train.py on a run directory in use is refused
    in one line (run in this process), and Ctrl-C ends the first with exit code 130 and one line,
    no traceback, keeping its last checkpoint whole."""
    out = tmp_path / 'run'
    first = run_cli(tiny_args(synth, 'none') + ['--max-steps', '100000', '--eval-interval', '2',
                                                '--out', str(out)])
    try:
        for line in first.stdout:  # wait until it has saved a checkpoint and trains on
            if line.startswith('step 3/'):
                break
        msg = user_error(['--out', str(out), '--resume', '--device', 'cpu'], capsys, code=1)
        assert msg.startswith(f'error: another process is using {out}'), msg
        first.send_signal(signal.SIGINT)
        rest, err = first.communicate(timeout=120)
    finally:
        first.kill()
    assert first.returncode == 130, err
    assert err.splitlines() == [err.strip()] and err.startswith('error: interrupted at step '), err
    step = torch.load(out / 'ckpt.pt', weights_only=False)['step']
    assert step >= 2 and step % 2 == 0, step
    assert f'(step {step}); continue with: python train.py --out {out} --resume' in err, err
    assert not list(out.glob('*.tmp'))


def test_train_a_second_ctrl_c_while_the_run_ends_is_no_traceback(synth, tmp_path):
    """Ctrl-C twice: the second arrives once the first's error line is out, while the process
    ends (torch's exit handlers run then; an exit handler that takes a second holds that
    moment open): exit 130 all the same, the one line, no traceback nor 'Exception
    ignored'."""
    out = tmp_path / 'run'
    slow_exit = ('import atexit, runpy, sys, time; atexit.register(time.sleep, 3); '
                 "sys.argv[0] = 'train.py'; runpy.run_path('train.py', run_name='__main__')")
    args = tiny_args(synth, 'none') + ['--max-steps', '100000', '--out', str(out)]
    first = subprocess.Popen([sys.executable, '-c', slow_exit, *args], cwd=ROOT, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env=dict(os.environ, OMP_NUM_THREADS='1'))
    try:
        for line in first.stdout:
            if line.startswith('step 3/'):
                break
        first.send_signal(signal.SIGINT)
        said = first.stderr.readline()
        time.sleep(1)   # into the 3 s exit handler: past the interrupted run's own unwinding
        if first.poll() is None:
            first.send_signal(signal.SIGINT)
        rest, err = first.communicate(timeout=120)
    finally:
        first.kill()
    err = said + err
    assert first.returncode == 130, err
    assert err.startswith('error: interrupted at step ') and err.count('\n') == 1, err


# ------------------------------------------------------------------- the log, the budget, the step
SCHEMA = {
    'train': ['kind', 'step', 'train_chars', 'train_flops', 'train_time', 'loss', 'bpc', 'sf',
              'precision',
              'recall', 'chars_per_s', 'lr', 'grad_norm', 'mem_mb', 'epoch'],
    'eval': ['kind', 'step', 'split', 'bpc', 'sf', 'eval_chars', 'subset', 'train_chars',
             'train_flops', 'train_time', 'mem_mb'],
}


@pytest.mark.parametrize('boundary', ['none', 'gumbel'])
def test_train_log_schema_and_cumulative_flops(synth, tmp_path, boundary):
    """log.jsonl as the conventions fix it, and training FLOPs that add up step by step from the
    formula with each step's measured SF (a vanilla step's FLOPs are a constant)."""
    out = tmp_path / boundary
    trained(tiny_args(synth, boundary) + ['--max-steps', '4', '--eval-interval', '2',
                                                           '--eval-max-chars', '0', '--out',
                                                           str(out)])
    log = read_log(out)
    assert log[0]['kind'] == 'config' and log[0]['resumed_from'] is None
    assert (log[0]['encoding'], log[0]['unit']) == ('paper', 'char')
    for k in ('seed', 'boundary', 'data', 'layers', 'd_model', 'n_head', 'd_head', 'd_inner',
              'seq_len', 'batch_size', 'max_steps', 'lr', 'params', 'device', 'device_name',
              'world',
              'amp', 'torch'):
        assert log[0][k] is not None, k
    for r in log[1:]:
        assert list(r) == SCHEMA[r['kind']], r
    trains = [r for r in log if r['kind'] == 'train']
    cfg = Config(**torch.load(out / 'ckpt.pt', weights_only=False)['config'])
    assert [r['step'] for r in trains] == [1, 2, 3, 4]
    assert [r['train_chars'] for r in trains] == [128, 256, 384, 512]
    flops = 0.0
    for r in trains:
        flops += step_flops(cfg, 4, 32, None if boundary == 'none' else 1 + 32 / r['sf'])
        assert r['train_flops'] == pytest.approx(flops, rel=1e-6)
    assert all(a['train_time'] < b['train_time'] for a, b in zip(trains, trains[1:]))
    evals = [r for r in log if r['kind'] == 'eval']
    assert [(r['step'], r['split'], r['subset']) for r in evals] == [
        (0, 'valid', True), (2, 'valid', True), (4, 'valid', False), (4, 'test', False)]
    assert evals[1]['train_flops'] == trains[1]['train_flops']
    assert evals[-1]['eval_chars'] == 4000 - 1
    assert (boundary == 'none') == (evals[-1]['sf'] == 1.0 and trains[-1]['precision'] is None)


def test_train_on_bytes_says_bits_per_byte(tmp_path, capsys):
    """A byte dataset (meta.json's encoding bytes, vocabulary 256): the config record says
    encoding bytes, unit byte; train and eval records carry bpb where a character run has bpc
    (never both), the terminal says bpb, and the checkpoint's vocabulary keeps the encoding."""
    text = random_words(20_000, letters='abcdéfgh')   # é: two bytes
    data = write_dataset(tmp_path / 'bytes', text, encoding='bytes')
    out = tmp_path / 'run'
    capsys.readouterr()
    trained(tiny_args(data, 'whitespace') + ['--max-steps', '2', '--out', str(out)])
    said = capsys.readouterr().out
    log = read_log(out)
    assert (log[0]['encoding'], log[0]['unit']) == ('bytes', 'byte')
    for r in log[1:]:
        assert list(r) == [k.replace('bpc', 'bpb') for k in SCHEMA[r['kind']]], r
    assert 'test bpb' in said and 'valid bpb' in said and 'bpc' not in said
    vocab = checkpoint.read_checkpoint(out)['vocab']
    assert (vocab['encoding'], vocab['vocab_size']) == ('bytes', 256)


@pytest.mark.slow
@pytest.mark.parametrize('mode', BOUNDARY_MODES)
def test_every_source_trains_and_samples_on_bytes(mode, tmp_path, capsys):
    """Issue 33: each of the seven sources trains on a byte dataset of Hebrew words (two
    bytes a letter) and sample.py continues a Hebrew prompt from its checkpoint as text."""
    import sample
    text = random_words(12_000, letters='אבגדהוזח')
    data = write_dataset(tmp_path / 'bytes', text, encoding='bytes')
    out = tmp_path / 'run'
    trained(tiny_args(data, mode) + ['--max-steps', '2', '--out', str(out)])
    capsys.readouterr()
    assert sample.main(['--ckpt', str(out), '--prompt', 'אבג ', '--chars', '24',
                        '--device', 'cpu']) == 0
    said = capsys.readouterr().out
    assert said.startswith('אבג ') and len(said.encode('utf-8')) >= 24, said


# A boundary source of a user's own, in a file outside the project, with an option of its own.
EVERY_K = """
import dataclasses

import torch

from dynpool import ExternalBoundaries, register_source


@dataclasses.dataclass
class EveryOptions:
    every: int = 4


class EveryBoundaries(ExternalBoundaries):
    Options = EveryOptions

    @staticmethod
    def check_config(cfg):
        if cfg.options['every'] < 1:
            raise ValueError(f'every must be >= 1, got {cfg.options["every"]}')

    def derive(self, x, offset):
        t = torch.arange(offset, offset + x.size(1), device=x.device)
        return ((t + 1) % self.options.every == 0).expand_as(x)


register_source('every', EveryBoundaries)
"""


def test_train_imports_a_source_from_a_file_with_its_option_as_a_flag(synth, tmp_path, capsys):
    """train.py --import FILE trains the file's source (in its own process: the source stays out
    of this one), its Options field a flag whose value reaches the Config; the checkpoint records
    the file; reading the checkpoint, or resuming the run, without the import is refused in one
    line naming the --import it needs; an import that fails is one line, exit 2."""
    source = tmp_path / 'mine' / 'every_k.py'
    source.parent.mkdir()
    source.write_text(EVERY_K)
    # a second source with the same option: one flag sets both
    again = tmp_path / 'mine' / 'again.py'
    again.write_text(EVERY_K.replace("'every'", "'every_again'"))
    out = tmp_path / 'run'
    run = subprocess.run([sys.executable, 'train.py', '--import', str(source), f'--import={again}',
                          '--boundary', 'every', '--every', '3', '--max-steps', '2', '--out',
                          str(out)]
                         + TINY + ['--data', str(synth)], cwd=ROOT, capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stderr
    assert shlex.join(['python', 'sample.py', '--import', str(source), '--import', str(again),
                       '--ckpt', str(out)]) in run.stdout
    ckpt = torch.load(out / 'ckpt.pt', weights_only=False)
    assert (ckpt['config']['boundary'], ckpt['config']['options']['every']) == ('every', 3)
    assert [r['import'] for r in ckpt['imports']] == [str(source), str(again)]
    assert read_log(out)[0]['every'] == 3
    assert 'every' not in BOUNDARY_MODES
    needs = f'needs --import {source} --import {again}'
    with pytest.raises(UserError, match=needs):
        checkpoint.read_checkpoint(out)
    assert needs in user_error(['--out', str(out), '--resume', '--device', 'cpu'], capsys, 2)
    for missing in (tmp_path / 'none.py', 'no_such_module_here'):
        assert str(missing) in user_error(['--import', str(missing)] + tiny_args(synth, 'fixed'),
                                          capsys, 2)


def test_train_max_time_stops_evaluates_saves_and_resumes(synth, tmp_path, capsys):
    out = tmp_path / 'budget'
    trained(tiny_args(synth, 'none') + ['--max-steps', '5', '--max-time', '1e-9',
                                           '--out', str(out)])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == (f'stopped at step 1 of 5 (--max-time 1e-09s); continue with: '
                    f'python train.py --out {out} --resume')
    assert torch.load(out / 'ckpt.pt', weights_only=False)['step'] == 1
    evals = [(r['step'], r['split']) for r in read_log(out) if r['kind'] == 'eval']
    assert evals == [(0, 'valid'), (1, 'valid')]
    trained(['--out', str(out), '--resume', '--device', 'cpu'])  # the budget was that run's only
    log = read_log(out)
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith('test bpc ')
    assert [r['resumed_from'] for r in log if r['kind'] == 'config'] == [None, 1]
    assert [r['train_chars'] for r in log if r['kind'] == 'train'] == [128 * s for s in range(1, 6)]


def training(model, optimizer, cfg, args):
    """train.py's machinery for one process on CPU, without loss scaling, logger or compile."""
    return train.Trainer(args, cfg, model, model, optimizer,
                         torch.amp.GradScaler('cpu', enabled=False), runtime.StepStats(cfg, args))


def test_train_non_finite_step_is_skipped_on_the_device():
    """A step whose loss is not finite leaves weights and Adam's moments untouched, without the host
    looking, and is counted for the next log record."""
    torch.manual_seed(0)
    cfg = Config(vocab_size=9, d_model=32, n_head=2, d_head=16, d_inner=64, layers=(1, 1, 1),
                 dropout=0.0, dropatt=0.0, boundary='fixed')
    model = DynamicPoolingLM(cfg)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    args = type('Args', (), dict(grad_accum=1, grad_clip=0.25, batch_size=2, seq_len=16,
                                 device='cpu'))()
    x = torch.randint(0, 9, (1, 2, 16))
    batch = train.Batch(0, 2, x, x, None)
    t = training(model, optimizer, cfg, args)
    train.train_step(t, batch)
    assert t.stats.read()['bad'] == 0
    with torch.no_grad():
        model.lm_head.bias[0] = float('nan')
    before = {k: v.clone() for k, v in model.state_dict().items()}
    moments = [optimizer.state[p]['exp_avg'].clone() for p in model.parameters()]
    train.train_step(t, batch)
    assert t.stats.read()['bad'] == 1
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) or k == 'lm_head.bias' for k in before)
    assert all(torch.equal(m, optimizer.state[p]['exp_avg'])
               for m, p in zip(moments, model.parameters()))
    assert all(int(optimizer.state[p]['step']) == 1 for p in model.parameters())


# ------------------------------------------------------------------------ GPU paths, checked on CPU
def test_train_fp16_resumes_a_checkpoint_saved_without_loss_scaling(done_run):
    """(issue 20.1) A bf16 or fp32 run saves its disabled GradScaler's empty state; resuming it with
    --amp fp16 (an enabled scaler) starts loss scaling afresh, where loading {} raised."""
    ckpt = checkpoint.read_checkpoint(done_run)
    assert ckpt['scaler'] == {}
    model = DynamicPoolingLM(Config(**ckpt['config']))
    optimizer = torch.optim.Adam(model.parameters(), fused=True)
    scaler = torch.amp.GradScaler('cpu', enabled=True)
    rng = random.getstate(), np.random.get_state()
    with torch.random.fork_rng():
        checkpoint.restore_training(ckpt, model, optimizer, scaler, 'cpu')
    random.setstate(rng[0])
    np.random.set_state(rng[1])
    assert scaler.is_enabled() and scaler.get_scale() == 2.0 ** 16


@pytest.mark.parametrize('native, expected', [(False, 'fp16'), (True, 'bf16')])
def test_train_amp_auto_takes_bf16_only_where_the_gpu_has_it(monkeypatch, native, expected):
    """(issue 20.2) V100 and T4 only emulate bf16, which torch.cuda.is_bf16_supported() counts by
    default: --amp auto must ask for native support and give them fp16 with loss scaling."""
    monkeypatch.setattr(torch.cuda, 'is_bf16_supported',
                        lambda including_emulation=True: native or including_emulation)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')  # (autocast and GradScaler on 'cuda' without CUDA)
        assert runtime.setup_precision('auto', 'cuda')[0] == expected


class ScalarReads(TorchDispatchMode):
    """Counts aten._local_scalar_dense: every read of a tensor's value by the host (.item(), int(),
    bool()), which on a GPU waits for the device."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize('boundary', ['none', 'fixed', 'whitespace', 'entropy'])
def test_train_step_reads_nothing_back_where_the_host_knows_the_segments(synth, tmp_path, boundary):
    """(issue 20.3) fixed and whitespace boundaries are counted when the batch is cut, so a training
    step, --flop-budget's FLOP count included, never reads the device; entropy decides on the device
    and reads S (the counter's control)."""
    args, _ = flags.resolve_args(tiny_args(synth, boundary) + [
        '--flop-budget', '1e15', '--out', str(tmp_path / 'o')])
    meta, splits, _ = dataset.load_data(args.data, args.boundary)
    cfg = flags.model_config(args, meta)
    model = DynamicPoolingLM(cfg)
    # on CPU the model checks token values per forward (a GPU skips that: it would read the device)
    model.check_inputs = lambda *a, **k: None
    t = training(model, torch.optim.Adam(model.parameters(), fused=True), cfg, args)
    stream = train.batches(splits['train'], None, args, cfg, train.RunState(), runtime.Processes())
    train.train_step(t, next(stream))  # (the first step creates Adam's state)
    batch = next(stream)
    with ScalarReads() as reads:
        train.train_step(t, batch)
        flops = t.stats.take_step_flops()
    assert (reads.n == 0) == (boundary != 'entropy'), reads.n
    assert flops > 0


def test_train_mem_mb_is_the_peak_since_the_last_record(monkeypatch):
    """(issue 20.4) On CUDA each read of the peak resets it: a record shows the peak since the one
    before (and an eval record the evaluation's), not the run's so far."""
    peak = [0]
    monkeypatch.setattr(torch.cuda, 'max_memory_allocated', lambda device=None: peak[0])
    monkeypatch.setattr(torch.cuda, 'reset_peak_memory_stats',
                        lambda device=None: peak.__setitem__(0, 0))
    peak[0] = 3 * 2**20        # e.g. training
    assert runtime.peak_mem_mb('cuda:0') == 3
    peak[0] = max(peak[0], 2**20)  # then an evaluation that needs less
    assert runtime.peak_mem_mb('cuda:0') == 1


@pytest.mark.parametrize('visible, local_rank, device', [(8, 3, 'cuda:3'), (1, 3, 'cuda:0'),
                                                         (1, 0, 'cuda:0'), (2, 3, None)])
def test_train_torchrun_process_takes_its_visible_gpu(tmp_path, monkeypatch, visible, local_rank,
                                                       device):
    """(issue 20.5) Under torchrun a process takes GPU LOCAL_RANK where it sees all of the node's,
    and its one GPU where a scheduler shows each process only its own."""
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: visible)
    argv = ['--device', 'cuda', '--out', str(tmp_path / 'o')]
    procs = runtime.Processes(local_rank, local_rank, 8)
    if device is None:
        with pytest.raises(UserError, match=f'LOCAL_RANK {local_rank} but this process sees 2'):
            flags.resolve_args(argv, procs)
    else:
        assert flags.resolve_args(argv, procs)[0].device == device


# ----------------------------------------------------------------------------- fuzz
ODD_NUMBERS = ['0', '-1', '1', '2', '3', '0.5', '1e-300', '1e308', 'inf', '-inf', 'nan', '',
               '99999999999999999999', 'x', '1,1', '0x10', ' 2']
ODD_TEXT = ['', ' ', 'x', '/', '/dev/null', 'a\0b', '..', 'é', '-', "it's", 'cuda', 'meta', 'cpu']
# train.py's flags as its parser declares them: {'--flag': argparse action}
ACTIONS = {a.option_strings[0]: a for a in flags.parser()._actions if a.dest != 'help'}
SWITCHES = {flag for flag, action in ACTIONS.items() if action.nargs == 0}
SWITCHES -= {'--compile'}
# (--data and --out are drawn apart; compile is left out, and the
# evaluation sizes stay tiny: the contract, not the evaluation's speed, is under test)
FUZZED = sorted(flag for flag in ACTIONS if flag not in (
    '--data', '--out', '--compile', '--eval-subset-chars',
    '--eval-max-chars', '--eval-batch-size'))


@st.composite
def odd_argv(draw, synth, where):
    """train.py's flags: a few drawn at random, each with an odd or an ordinary value."""
    argv = []
    for flag in draw(st.lists(st.sampled_from(FUZZED), max_size=4, unique=True)):
        action = ACTIONS[flag]
        if flag in SWITCHES:
            argv.append(flag)
            continue
        values = (st.sampled_from(list(action.choices) + ['bogus']) if action.choices else
                  st.sampled_from(ODD_TEXT) if action.type is flags.nonblank else
                  st.sampled_from(ODD_NUMBERS) | st.integers(-3, 4).map(str)
                  | st.floats(allow_nan=True, allow_infinity=True).map(repr))
        argv += [flag, draw(values)]
    data = draw(st.sampled_from([str(synth)] * 3 + ['', 'a\0b', str(where / 'none'), '/dev/null']))
    out = draw(st.sampled_from([str(where / 'run')] * 3 + ['', 'a\0b', str(where / 'f'),
                                                           str(where / 'f' / 'run'), None]))
    return TINY + ['--data', data, '--eval-interval', '1'] + argv + (
        ['--out', out] if out is not None else []) + ['--max-steps', draw(st.sampled_from('12'))]


@settings(max_examples=12, deadline=None, **HYPOTHESIS_FIXTURES)
@given(data=st.data())
def test_train_fuzzed_flags_keep_the_contract(synth, tmp_path, capsys, monkeypatch, data):
    """Whatever the flags: no traceback, exit 0, 1, 2 (or 130); a failure says one `error:` line;
    nothing half-written (no temp file, a checkpoint that loads, a log of whole JSON lines) and,
    for a bad flag (2), nothing written at all."""
    where = Path(tempfile.mkdtemp(dir=tmp_path))
    (where / 'f').write_text('a file where a folder could be')
    monkeypatch.chdir(where)  # (the default --out is relative)
    argv = data.draw(odd_argv(synth, where))
    capsys.readouterr()
    code, out, err = run_main(train.main, argv, capsys)
    assert_cli_contract(code, err, argv)
    runs = [p.parent for p in where.rglob('log.jsonl')] + [p.parent for p in where.rglob('ckpt.pt')]
    assert not list(where.rglob('*.tmp')), argv
    assert code != 2 or not runs, (argv, err)
    for run in set(runs):
        [json.loads(line) for line in (run / 'log.jsonl').read_text().splitlines()]
        if (run / 'ckpt.pt').exists():
            checkpoint.read_checkpoint(run / 'ckpt.pt')


def test_train_odd_values_of_every_flag_are_refused_in_one_line(synth, tmp_path):
    """Each flag alone with each odd value, parsed and checked up to the model's config (nothing
    runs): accepted, or refused as one UserError line with exit code 2 (1 for what is missing
    here, e.g. CUDA) - never another exception."""
    meta = json.loads((synth / 'meta.json').read_text())
    for flag in FUZZED:
        for value in [None] if flag in SWITCHES else ODD_NUMBERS + ODD_TEXT:
            argv = tiny_args(synth, 'fixed') + [flag] + ([] if value is None else [value])
            try:
                args, _ = flags.resolve_args(argv + ['--out', str(tmp_path / 'o')])
                flags.model_config(args, meta)
            except UserError as e:
                assert e.code in (1, 2) and '\n' not in str(e), (flag, value, str(e))


@pytest.mark.slow
def test_train_ddp_stop_and_resume_is_bit_identical(synth, tmp_path):
    """2 gloo processes with dropout and Gumbel noise (every rank draws its own): stopped at a
    checkpoint and resumed, the run ends with the weights of one that never stopped."""
    argv = tiny_args(synth, 'gumbel') + ['--max-steps', '4', '--eval-interval', '2', '--dropout',
                                         '0.1',
                                         '--dropatt', '0.1']
    assert all(rc == 0 for rc, _, _ in ddp_run(argv, tmp_path / 'straight'))
    assert all(rc == 0 for rc, _, _ in ddp_run(argv + ['--stop-step', '2'], tmp_path / 'resumed'))
    assert all(rc == 0 for rc, _, _ in ddp_run(argv + ['--resume'], tmp_path / 'resumed'))
    a, b = (torch.load(tmp_path / d / 'ckpt.pt', weights_only=False)['model']
            for d in ('straight', 'resumed'))
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]


def test_train_resume_of_a_finished_run_evaluates_it_again(done_run, tmp_path, capsys):
    """--resume of a finished run (or with --max-steps at its step) trains nothing: the final
    validation and test again, logged at the same step; a larger --max-steps trains on."""
    run = copy_run(done_run, tmp_path)
    trained(['--out', str(run), '--resume', '--device', 'cpu'])
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith('test bpc ')
    log = read_log(run)
    assert [r['step'] for r in log if r['kind'] == 'train'] == [1]
    assert [(r['step'], r['split']) for r in log if r['kind'] == 'eval'][-4:] == [
        (1, 'valid'), (1, 'test'), (1, 'valid'), (1, 'test')]
    trained(['--out', str(run), '--resume', '--device', 'cpu', '--max-steps', '2'])
    assert [r['step'] for r in read_log(run) if r.get('split') == 'test'] == [1, 1, 2]


# --------------------------------------------------------------- preemption, saves, clock, checks
@pytest.mark.parametrize('signum', [signal.SIGTERM, signal.SIGUSR1])
def test_train_stop_signal_saves_and_resume_is_bit_identical(synth, tmp_path, capsys, monkeypatch,
                                                             signum):
    """SIGTERM or SIGUSR1 (a scheduler's notice) during step 3, between the evaluations of steps 0
    and 4: the step ends, the checkpoint of step 3 is saved (no evaluation), the exit code is 75
    with a command to continue; that --resume ends with the weights, run_id and test result of a
    run never stopped."""
    argv = tiny_args(synth, 'gumbel') + ['--max-steps', '6', '--eval-interval', '4',
                                         '--log-interval', '5', '--dropout', '0.1', '--dropatt',
                                         '0.1']
    trained(argv + ['--out', str(tmp_path / 'straight')])
    real_step = train.train_step

    def signalled_step(t, batch):
        if t.state.step == 2:   # (the step in flight is step 3)
            os.kill(os.getpid(), signum)
        real_step(t, batch)
    monkeypatch.setattr(train, 'train_step', signalled_step)
    out = tmp_path / 'stopped'
    capsys.readouterr()
    assert train.main(argv + ['--out', str(out)]) == 75
    monkeypatch.undo()
    said = capsys.readouterr().out.strip().splitlines()[-1]
    assert said.startswith(f'stopped at step 3 of 6 ({signal.Signals(signum).name}'), said
    assert torch.load(out / 'ckpt.pt', weights_only=False)['step'] == 3
    assert [r['step'] for r in read_log(out) if r['kind'] == 'eval'] == [0]
    assert signal.getsignal(signum) is signal.SIG_DFL   # the handler is the run's only
    # the log says it stopped to be resumed, so report.py tells it from a crash
    assert read_log(out)[-1]['kind'] == 'stopped'
    assert report.summarize(out)['state'] == 'unfinished'
    trained(shlex.split(said.split('continue with: ')[1])[2:])
    a, b = (torch.load(tmp_path / d / 'ckpt.pt', weights_only=False)
            for d in ('straight', 'stopped'))
    assert a['step'] == b['step'] == 6
    assert all(torch.equal(a['model'][k], b['model'][k]) for k in a['model'])
    configs = [r for r in read_log(out) if r['kind'] == 'config']
    assert len(configs) == 2 and configs[0]['run_id'] == configs[1]['run_id']
    assert len(configs[0]['run_id']) == 32
    assert configs[0]['run_id'] != read_log(tmp_path / 'straight')[0]['run_id']
    assert read_log(out)[-1]['bpc'] == read_log(tmp_path / 'straight')[-1]['bpc']


@pytest.mark.parametrize('interval, saved', [('2', [2, 4, 5]), ('1e-9m', [1, 2, 3, 4, 5])])
def test_train_save_interval_in_steps_or_minutes(synth, tmp_path, monkeypatch, interval, saved):
    """--save-interval saves apart from the evaluations (here only at the end): every N steps, or
    once N minutes of training have passed since the last save (checked at each record)."""
    steps = []
    real_save = train.save_checkpoint

    def save(path, state, saved_step):
        steps.append(state['step'])
        real_save(path, state, saved_step)
    monkeypatch.setattr(train, 'save_checkpoint', save)
    trained(tiny_args(synth, 'none') + ['--max-steps', '5', '--eval-interval', '100',
                                        '--save-interval', interval, '--out', str(tmp_path / 'o')])
    assert steps == saved
    assert [r['step'] for r in read_log(tmp_path / 'o') if r['kind'] == 'eval'] == [0, 5, 5]


def test_save_interval_reads_steps_or_minutes_in_one_place():
    """flags.save_schedule: '500' every 500 steps, '30m' every 1800 seconds of training, none
    where not given; the flag's type refuses what it cannot read, and keeps the text."""
    assert flags.save_schedule('500') == (500, None)
    assert flags.save_schedule('30m') == (None, 1800.0)
    assert flags.save_schedule(None) == (None, None)
    assert flags.save_interval(' 2.5m ') == '2.5m'
    for bad in ('0', '-1m', 'm', '5s', 'nanm'):
        with pytest.raises(argparse.ArgumentTypeError):
            flags.save_interval(bad)


def test_train_clock_is_monotonic(synth, tmp_path, monkeypatch):
    """train_time counts on a monotonic clock: a wall clock set back during the run (NTP, a
    suspended VM) changes nothing."""
    wall = iter(range(10**6, 0, -1000))
    monkeypatch.setattr(train.time, 'time', lambda: float(next(wall)))
    out = tmp_path / 'o'
    trained(tiny_args(synth, 'none') + ['--max-steps', '3', '--out', str(out)])
    monkeypatch.undo()
    times = [r['train_time'] for r in read_log(out) if r['kind'] == 'train']
    assert 0 < times[0] < times[1] < times[2] < 600, times


@pytest.mark.parametrize('boundary, extra, words', [
    ('whitespace', [], '--boundary whitespace closes 0 segments'),
    ('fixed', ['--fixed-factor', '33'], '--boundary fixed closes 0 segments'),
])
def test_train_refuses_a_source_that_cannot_pool(tmp_path, capsys, boundary, extra, words):
    """A source decided by the text alone that closes no segment in a training sequence (no space
    in the training text; fixed k > --seq-len 32) would train a model that never pools: refused
    at the start, exit 2, nothing written."""
    rng = np.random.default_rng(0)
    dna = ''.join(rng.choice(list('ACGT'), 9000)) + random_words(1000)  # spaces in test only
    data = write_dataset(tmp_path / 'dna', dna)
    msg = user_error(tiny_args(data, boundary) + extra + ['--out', str(tmp_path / 'o')], capsys,
                     code=2)
    assert words in msg and 'never pool' in msg, msg
    assert not (tmp_path / 'o').exists()


def test_train_a_source_that_pools_rarely_is_not_refused():
    """Whitespace where only every other sequence of --seq-len 4 holds a space pools rarely, but
    pools: the check refuses only a source that closes no segment at all."""
    cfg = Config(vocab_size=27, boundary='whitespace', whitespace_id=0)
    tokens = np.array(([1] * 7 + [0]) * 100)   # a space every 8 characters
    train.check_pooling(cfg, tokens, 4, 'data/sparse')   # mean 0.5 segments a sequence


def test_train_out_as_a_dangling_link_says_so(synth, tmp_path, capsys):
    """--out a link to a folder that does not exist (an unmounted disk): one line naming the link
    and its missing target, where the folder is made; nothing is created through it."""
    gone = tmp_path / 'unmounted' / 'run'
    (tmp_path / 'link').symlink_to(gone)
    msg = user_error(tiny_args(synth, 'none') + ['--out', str(tmp_path / 'link' / 'run')],
                     capsys, code=1)
    assert f'{tmp_path / "link"}: a link to {gone}, which does not exist' in msg, msg
    assert not (tmp_path / 'unmounted').exists()


def test_train_resume_keeps_the_layers_and_refuses_damaged_ones(done_run, tmp_path, capsys):
    """A resumed run takes --layers from its checkpoint or as given, the same; other layers, or
    layers damaged in the checkpoint, are one line."""
    run = copy_run(done_run, tmp_path)
    trained(['--out', str(run), '--resume', '--device', 'cpu', '--max-steps', '2'])
    trained(['--out', str(run), '--resume', '--device', 'cpu', '--max-steps', '3', '--layers',
             '1,1,1'])
    assert read_log(run)[-1]['step'] == 3
    msg = user_error(['--out', str(run), '--resume', '--device', 'cpu', '--layers', '1,2,1'],
                     capsys, code=2)
    assert "--layers differs from the checkpoint's 1,1,1" in msg, msg
    ck = torch.load(run / 'ckpt.pt', weights_only=False)
    ck['args']['layers'] = 'x'
    checkpoint.save_checkpoint(run / 'ckpt.pt', ck, None)
    msg = user_error(['--out', str(run), '--resume', '--device', 'cpu'], capsys)
    assert 'layers must be three counts' in msg, msg


def test_train_evaluation_shows_progress_on_a_terminal(monkeypatch):
    """A progress bar of the evaluation's batches on stderr where it is a terminal, none where it
    is not (a log file)."""
    cfg = Config(vocab_size=9, d_model=32, n_head=2, d_head=16, d_inner=64, layers=(1, 1, 1),
                 boundary='none')
    model = DynamicPoolingLM(cfg)
    tokens = np.arange(400) % 9

    class Terminal(io.StringIO):
        def isatty(self):
            return True
    for stream, shown in ((Terminal(), True), (io.StringIO(), False)):
        monkeypatch.setattr(sys, 'stderr', stream)
        train.evaluate(model, tokens, whole(len(tokens), 32, 8, 4), 'cpu', desc='step 7 valid')
        monkeypatch.undo()
        assert ('step 7 valid' in stream.getvalue()) == shown, stream.getvalue()


def test_train_a_name_in_another_encoding_is_one_line(synth, tmp_path):
    """An --out whose name is not UTF-8 (Latin-1 'caf\\xe9'), shown on a strict UTF-8 stdout: the
    error boundary says what cannot be encoded, in one line, exit 1."""
    first = run_cli(tiny_args(synth, 'none') + ['--max-steps', '1', '--out',
                                                str(tmp_path / 'caf\udce9')],
                    env=dict(os.environ, PYTHONIOENCODING='utf-8', OMP_NUM_THREADS='1'))
    out, err = first.communicate(timeout=120)
    assert first.returncode == 1, err
    assert err.splitlines() == [err.strip()] and 'is not utf-8' in err and 'caf' in err, err


# ----------------------------------------------------------------------------- issue 39, 41, 42
def test_train_a_stop_signal_in_the_final_evaluation_exits_75_and_resume_finishes(synth,
                                                                                  tmp_path):
    """SIGTERM during the final evaluation, whose start a line on stdout shows (stdout is a pipe,
    no progress bar): the evaluation ends at its batch, the run exits 75 with the stopped line and
    no traceback, keeping the checkpoint of its last step; --resume trains nothing, evaluates and
    ends with the test line."""
    out = tmp_path / 'run'
    # one window a batch, each scoring one character: thousands of batches, minutes of work
    argv = tiny_args(synth, 'fixed') + ['--max-steps', '2', '--eval-max-chars', '0',
                                        '--eval-step', '1', '--eval-batch-size', '1']
    run = run_cli(argv + ['--out', str(out)])
    started = next((line for line in run.stdout
                    if line.startswith('step 2 | valid: evaluating')), None)
    assert started, run.communicate()
    run.send_signal(signal.SIGTERM)
    rest, err = run.communicate(timeout=120)   # (bounded by the signal; generous: a busy machine)
    assert run.returncode == 75, err
    assert 'Traceback' not in err
    assert rest.strip().splitlines()[-1].startswith('stopped at step 2 of 2 (SIGTERM'), rest
    assert torch.load(out / 'ckpt.pt', weights_only=False)['step'] == 2
    log = read_log(out)
    assert log[-1]['kind'] == 'stopped' and [r['step'] for r in log if r['kind'] == 'eval'] == [0]
    trained(['--out', str(out), '--resume', '--device', 'cpu', '--eval-max-chars', '400'])
    assert [r['split'] for r in read_log(out) if r['kind'] == 'eval'] == ['valid', 'valid', 'test']


def test_train_released_protocol_scores_the_released_codes_positions(synth, tmp_path):
    """--eval-protocol released scores what the released code's evaluation scores: the text cut
    into 16 equal columns (the rest dropped), each column's targets from its second token on, each
    batch one window a column of --eval-step targets after at most --eval-window - --eval-step
    tokens of that column's own context (a cold start a column), the first 500 batches."""
    rows, window, step = 40, 12, 4
    groups = train.released_windows(16 * rows + 5, window, step)
    targets = sorted(p + 1 for group in groups for _, end, first in group
                     for p in range(first, end))
    assert targets == [c * rows + j for c in range(16) for j in range(1, rows)]
    for group in groups:
        assert len(group) == 16 and len({end - start for start, end, _ in group}) == 1
        for c, (start, end, first) in enumerate(group):
            assert start >= c * rows and first - start == min(first - c * rows, window - step)
            assert 0 < end - first <= step
    long = train.released_windows(16 * 3000, 8, 2)   # 1,500 batches a column: the first 500
    assert len(long) == 500 and train.scored_chars(long) == 16 * 500 * 2
    # train.py evaluates its 400-character subset so: 16 columns of 25, 24 targets each
    out = tmp_path / 'run'
    trained(tiny_args(synth, 'none') + ['--max-steps', '1', '--eval-protocol', 'released',
                                        '--out', str(out)])
    evals = [r for r in read_log(out) if r['kind'] == 'eval']
    assert [(r['eval_chars'], r['subset']) for r in evals] == [(16 * 24, True)] * 3


def test_train_resume_on_its_data_remade_from_another_text_is_refused(synth, tmp_path, capsys):
    """The run's data folder remade from another text (here one too short for a batch): --resume
    is refused in one line, exit 2, for being other data, not for what the new text lacks; the
    checkpoint is left as it was."""
    data = shutil.copytree(synth, tmp_path / 'data')
    out = tmp_path / 'run'
    trained(tiny_args(data, 'whitespace') + ['--max-steps', '1', '--out', str(out)])
    before = (out / 'ckpt.pt').read_bytes()
    shutil.rmtree(data)
    write_dataset(data, random_words(100, seed=9))
    msg = user_error(['--out', str(out), '--resume', '--device', 'cpu', '--max-steps', '2'],
                     capsys, code=2)
    assert f'--data {data} is not the data the run' in msg, msg
    assert (out / 'ckpt.pt').read_bytes() == before


def test_train_threads_default_to_half_the_cpus_unless_the_user_says(synth, tmp_path,
                                                                     monkeypatch):
    """Without --threads or OMP_NUM_THREADS a run takes half the CPUs it may run on (two runs
    share a machine); a user's OMP_NUM_THREADS, and --threads over it, decide otherwise. The
    config record holds what torch then used."""
    half = max(1, len(os.sched_getaffinity(0)) // 2)
    cases = [(None, [], half), (str(half + 1), [], half + 1), (str(half + 1), ['--threads', '1'],
                                                              1)]
    try:
        for i, (omp, extra, expected) in enumerate(cases):
            monkeypatch.delenv('OMP_NUM_THREADS', raising=False)
            if omp:
                monkeypatch.setenv('OMP_NUM_THREADS', omp)
            out = tmp_path / f'run{i}'
            trained(tiny_args(synth, 'none') + ['--max-steps', '1', '--out', str(out)] + extra)
            assert read_log(out)[0]['threads'] == expected, (omp, extra)
    finally:
        torch.set_num_threads(1)   # (conftest's, for the tests after)


def test_train_eta_counts_the_validations_left_and_the_final_evaluation():
    """The ETA of a train line is the whole run's: the steps left at this invocation's speed,
    then each validation left and the final evaluation at the last evaluation's seconds a
    character; before any evaluation, the steps alone."""
    args = argparse.Namespace(max_steps=100, flop_budget=None, eval_interval=10)
    trainer = train.Trainer(args=args, cfg=None, model=None, raw_model=None, optimizer=None,
                            scaler=None, stats=None,
                            state=train.RunState(step=20, train_time=25.0))
    first = train.RunState(step=0, train_time=5.0)   # 20 steps in 20 s
    assert train.eta(trainer, first).total_seconds() == 80
    trainer.eval_chars = (1000, 50_000)   # a validation, the final evaluation
    trainer.eval_rate = 0.002
    # 80 steps; validations at steps 30 to 90 (7) of 2 s; the final evaluation, 100 s
    assert train.eta(trainer, first).total_seconds() == 80 + 7 * 2 + 100


@pytest.mark.slow
def test_train_under_torchrun_and_the_slurm_script_a_stop_exits_75(synth, tmp_path):
    """docs/slurm-array.sh running a torchrun line: Slurm's SIGUSR1 to the script stops both
    workers, which save and exit 75, and the task as a whole exits 75 with no traceback."""
    out = tmp_path / 'run'
    line = shlex.join(['torchrun', '--standalone', '--nproc_per_node=2', 'train.py',
                       *tiny_args(synth, 'fixed'), '--max-steps', '5000', '--out', str(out)])
    jobs = tmp_path / 'jobs.txt'
    jobs.write_text(f'cd {shlex.quote(str(ROOT))} && {line}\n')
    script = subprocess.Popen(['bash', ROOT / 'docs' / 'slurm-array.sh', jobs], text=True,
                              env=dict(os.environ, SLURM_ARRAY_TASK_ID='1', OMP_NUM_THREADS='1'),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    seen = next((line for line in script.stdout if line.startswith('step 20/')), None)
    assert seen, script.communicate()
    script.send_signal(signal.SIGUSR1)
    said = script.communicate(timeout=120)[0]
    assert script.returncode == 75, said
    assert 'Traceback' not in said and '(SIGTERM: stopped to be resumed)' in said, said
    assert read_log(out)[-1]['kind'] == 'stopped'
    assert checkpoint.read_checkpoint(out)['step'] == read_log(out)[-1]['step']


def test_train_resume_refuses_a_config_unlike_its_flags_and_notes_a_changed_recipe(done_run,
                                                                                   tmp_path,
                                                                                   capsys):
    """A sealed checkpoint whose config does not fit the flags it holds (d_model 64, flags 32) is
    refused in one line naming the field; a resume at another --lr continues with it and says so
    on stderr."""
    run = copy_run(done_run, tmp_path)
    before = torch.load(run / 'ckpt.pt', weights_only=False)
    capsys.readouterr()
    trained(['--out', str(run), '--resume', '--device', 'cpu', '--max-steps', '2', '--lr', '0.5'])
    assert "note: --lr 0.5 differs from the checkpoint's 0.003" in capsys.readouterr().err
    ck = dict(before, config=dict(before['config'], d_model=64))
    checkpoint.save_checkpoint(run / 'ckpt.pt', ck, None)
    msg = user_error(['--out', str(run), '--resume', '--device', 'cpu'], capsys)
    assert 'its config has d_model 64, its flags 32' in msg, msg


def test_train_resume_from_another_working_directory_finds_its_data(synth, tmp_path,
                                                                    monkeypatch):
    """A run started with a relative --data resumes from another working directory: the
    checkpoint records where its data was."""
    shutil.copytree(synth, tmp_path / 'data')
    monkeypatch.chdir(tmp_path)
    out = tmp_path / 'run'
    trained(tiny_args('data', 'fixed') + ['--max-steps', '1', '--out', str(out)])
    (tmp_path / 'elsewhere').mkdir()
    monkeypatch.chdir(tmp_path / 'elsewhere')
    trained(['--out', str(out), '--resume', '--device', 'cpu', '--max-steps', '2'])
    assert read_log(out)[-1]['step'] == 2


def test_train_commands_it_prints_for_a_folder_named_like_a_flag_work(synth, tmp_path, capsys,
                                                                      monkeypatch):
    """A run folder whose name starts with '-' (--out=-run): the continue command the run prints
    resumes it, and the sample command it prints then reads it."""
    import sample
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    trained(tiny_args(synth, 'fixed') + ['--max-steps', '2', '--stop-step', '1', '--out=-run'])
    said = capsys.readouterr().out.strip().splitlines()[-1]
    trained(shlex.split(said.split('continue with: ')[1])[2:] + ['--device', 'cpu'])
    said = capsys.readouterr().out.strip().splitlines()[-2]
    assert run_main(sample.main, shlex.split(said.split('sample with: ')[1])[2:] +
                    ['--chars', '5', '--device', 'cpu'], capsys)[0] == 0


def test_train_a_source_with_options_trains_to_vanillas_flops(synth, tmp_path):
    """--flop-budget vanilla:N for a source with options of its own (hnet's): the budget is N
    steps of the same shape unpooled, vanilla having no source options; the run trains to it."""
    out = tmp_path / 'hnet'
    trained(tiny_args(synth, 'hnet') + ['--flop-budget', 'vanilla:3', '--out', str(out)])
    log = read_log(out)
    budget = log[0]['flop_budget']
    trains = [r for r in log if r['kind'] == 'train']
    assert budget > 0 and trains[-1]['train_flops'] >= budget
