"""Tests of sample.py: segment display, prompt cleaning, the CLI end to end, its errors, paths and
flags, and a fuzz test of its contract.

Run:   python -m pytest -q test_sample.py
"""

import dataclasses
import io
import json
import math
import os
import random
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

import operations
import sample
import train
from conftest import (ALPHABET, HYPOTHESIS_FIXTURES, MODES, ROOT, assert_cli_contract, full_forward, no_hang,
                      odd_paths, run_main, tiny_model)
from cleaning import LANGS


# ---------------------------------------------------------------------------------------------
# Segment display
# ---------------------------------------------------------------------------------------------
@settings(max_examples=50, **HYPOTHESIS_FIXTURES)
@given(data=st.data())
def test_sample_segment_display_reassembles(data):
    text = data.draw(st.text(alphabet=''.join(ALPHABET), max_size=60))
    b = data.draw(st.lists(st.booleans(), min_size=len(text), max_size=len(text)))
    shown = sample.show_segments(text, b, '|')
    assert shown.replace('|', '') == text
    assert shown.count('|') == sum(b)
    pieces = shown.split('|')            # each closed segment, then the open one
    assert len(pieces) == sum(b) + 1
    ends = [i for i, bi in enumerate(b) if bi]
    starts = [0] + [e + 1 for e in ends]
    assert pieces == [text[s:e + 1] for s, e in zip(starts, ends)] + [text[starts[-1]:]]
    coloured = sample.show_segments(text, b, colour=True)
    assert re.sub(r'\033\[[0-9;]*m', '', coloured) == text
    assert sample.show_segments(text, None) == text
    # the prompt's end: one mark, after the prompt's last character and its separator
    n = data.draw(st.integers(1, max(1, len(text))))
    for colour in (False, True):
        marked = sample.show_segments(text, b, '|', colour, prompt_len=n)
        plain = re.sub(r'\033\[[0-9;]*m', '', marked)
        assert plain.replace('|', '').replace(sample.PROMPT_MARK, '') == text
        if text:
            assert plain.count(sample.PROMPT_MARK) == 1
            before = plain.split(sample.PROMPT_MARK)[0]
            assert before.replace('|', '') == text[:n]
            assert not colour and before.endswith('|') == b[n - 1] or colour
    assert sample.show_segments(text, None, prompt_len=n) == text[:n] + (sample.PROMPT_MARK if text else '') + text[n:]


def test_sample_segment_summary_counts_closed_segments():
    line = sample.segment_summary('the cat sat', [c == ' ' for c in 'the cat sat'], 4)
    assert line == ('11 characters (4 of the prompt), 2 segments closed (1 in the prompt) and 1 still open; '
                    'shortening factor 5.50')
    assert 'no segment closed yet' in sample.segment_summary('abc', [False] * 3, 1)


# ---------------------------------------------------------------------------------------------
# Prompt cleaning: the training text's own
# ---------------------------------------------------------------------------------------------
def test_prompt_is_cleaned_as_the_training_text_was():
    text8 = dict(alphabet=[' '] + list('abcdefghijklmnopqrstuvwxyz'))
    assert sample.clean_prompt('Hello, World 42!', text8)[0] == 'hello world four two'
    assert sample.clean_prompt('Line one.\nLine 2 ', text8)[0] == 'line one line two '   # no \n in text8
    assert 'en' in sample.clean_prompt('x', text8)[1] and "text8's alphabet" in sample.clean_prompt('x', text8)[1]
    fi = dict(alphabet=['\n', ' '] + list(LANGS['fi']['letters']))
    assert sample.clean_prompt('Äiti 5\n', fi)[0] == 'äiti viisi\n'
    assert sample.clean_prompt('Éclair', fi)[0] == 'clair'                   # é is no Finnish letter
    recorded = dict(fi, cleaning=dict(lang='fi', fold_accents=True))
    text, how = sample.clean_prompt('Éclair', recorded)
    assert text == 'eclair' and 'recorded in the checkpoint' in how and 'accents folded' in how
    other = dict(alphabet=list(' abcdefghijklmnopqrs'))                       # no language's alphabet
    text, how = sample.clean_prompt('Née 1999!', other)
    assert text == 'née 1999!' and 'lower-cased only' in how


def _write_ckpt(state, path, sealed=True):
    """torch.save to path, with the checksum train.py's checkpoints carry (operations.write_sealed)
    unless sealed=False (a checkpoint from before checksums)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    with open(path, 'wb') as f:
        if sealed and hasattr(operations, 'write_sealed'):
            operations.write_sealed(f, buf.getbuffer())
        else:
            f.write(buf.getvalue())
    return path


def _save_ckpt(path, mode, vocab_size=27, alphabet=None, rate=0.3, nan=False, scale=None):
    """A checkpoint with train.py's keys: model, optimizer, scaler, step, epoch, pos, config (asdict),
    vocab (alphabet, vocab_size, space_id), args, schedule, rng (numpy's state included)."""
    alphabet = alphabet or ALPHABET[:vocab_size]
    model = tiny_model(mode, vocab=vocab_size, seed=1, rate=rate, whitespace_id=alphabet.index(' '))
    state_dict = model.state_dict()
    if nan:
        state_dict['lm_head.weight'] = state_dict['lm_head.weight'].clone()
        state_dict['lm_head.weight'][3, 5] = float('nan')
    if scale:   # finite weights whose logits overflow to +-inf on the way
        w = state_dict['lm_head.weight']
        state_dict['lm_head.weight'] = torch.where(torch.arange(w.numel()) % 2 == 0, scale, -scale).view_as(w)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    state = dict(model=state_dict, optimizer=opt.state_dict(), scaler={}, step=0, epoch=0, pos=0,
                 config=dataclasses.asdict(model.cfg),
                 vocab=dict(alphabet=alphabet, vocab_size=vocab_size, space_id=alphabet.index(' ')),
                 args=dict(boundary=mode, data='data/text8', layers='1,1,1', seed=1337),
                 schedule=dict(lr=1e-3, warmup=2, max_steps=10),
                 rng=dict(torch=torch.get_rng_state(), numpy=np.random.get_state(), python=random.getstate(),
                          cuda=None))
    path.parent.mkdir(parents=True, exist_ok=True)
    return _write_ckpt(state, path)


@pytest.fixture(scope='module')
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp('sample_runs')
    return {mode: _save_ckpt(root / f'tiny-{mode}' / 'ckpt.pt', mode) for mode in MODES}


def _env():
    return dict(os.environ, OMP_NUM_THREADS='1', MKL_NUM_THREADS='1')


def _main(argv, capsys):
    """sample.main in this process → (exit code, stdout, stderr); a bad flag's SystemExit too."""
    return run_main(sample.main, argv, capsys)


def _one_error_line(err):
    """stderr ends in exactly one `error:` line and holds no traceback."""
    lines = err.splitlines()
    return bool(lines) and lines[-1].startswith('error: ') and sum(ln.startswith('error') for ln in lines) == 1 \
        and 'Traceback' not in err


def test_sample_cli_cleans_the_prompt_and_says_how(ckpts, capsys):
    rc, out, err = _main(['--ckpt', ckpts['whitespace'], '--prompt', 'Hello, World 42!', '--chars', 5], capsys)
    assert rc == 0, err
    assert out.startswith('hello world four two') and len(out) == len('hello world four two') + 5 + 1
    assert err.count('\n') == 1 and err.startswith('prompt cleaned (prepare_data.clean, en, from text8')
    assert err.rstrip('\n').endswith('"Hello, World 42!" -> "hello world four two"')
    rc, out, err = _main(['--ckpt', ckpts['whitespace'], '--prompt', 'the cat ', '--chars', 5], capsys)
    assert rc == 0 and out.startswith('the cat ') and err == ''        # clean already: nothing said


def test_sample_cli_cleans_a_finnish_prompt(tmp_path, capsys):
    alphabet = ['\n', ' '] + list(LANGS['fi']['letters'])
    ckpt = _save_ckpt(tmp_path / 'fi' / 'ckpt.pt', 'whitespace', vocab_size=len(alphabet), alphabet=alphabet)
    rc, out, err = _main(['--ckpt', ckpt, '--prompt', 'Äiti 5', '--chars', 3, '--show-segments'], capsys)
    assert rc == 0, err
    assert out.startswith('äiti |viisi' + sample.PROMPT_MARK) and 'prepare_data.clean, fi' in err


def test_sample_cli_characters_outside_an_unknown_alphabet_are_one_line_error(tmp_path, capsys):
    """An alphabet of no language is only lower-cased: the rest outside it is refused in one line."""
    alphabet = ALPHABET[:20]
    ckpt = _save_ckpt(tmp_path / 'custom' / 'ckpt.pt', 'whitespace', vocab_size=20, alphabet=alphabet)
    rc, out, err = _main(['--ckpt', ckpt, '--prompt', 'Née 1999!'], capsys)
    assert rc == 1 and out == '' and _one_error_line(err)
    for c in ("'é'", "'1'", "'9'", "'!'"):
        assert c in err.splitlines()[-1]
    assert "'N'" not in err and "'n'" not in err  # 'N' is lower-cased first: the alphabet is lower-case
    # The same through a real process: exit code and stderr of the command line.
    p = subprocess.run([sys.executable, 'sample.py', '--ckpt', str(ckpt), '--prompt', 'ça'],
                       cwd=ROOT, capture_output=True, text=True, timeout=120, env=_env())
    assert p.returncode == 1 and p.stdout == '' and _one_error_line(p.stderr) and "'ç'" in p.stderr


# ---------------------------------------------------------------------------------------------
# sample.py end to end
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize('mode', MODES)
def test_sample_cli_every_mode_shows_segments_that_reassemble(mode, ckpts, capsys):
    prompt = 'The History of'
    rc, out, err = _main(['--ckpt', ckpts[mode], '--prompt', prompt, '--chars', 40, '--seed', 3,
                          '--temperature', 0.8, '--top-k', 20, '--show-segments', '--device', 'cpu'], capsys)
    assert rc == 0, err
    shown = out.rstrip('\n')
    marked = shown.replace('|', '')
    assert marked.count(sample.PROMPT_MARK) == 1 and marked.index(sample.PROMPT_MARK) == len(prompt)
    text = marked.replace(sample.PROMPT_MARK, '')
    assert text.startswith(prompt.lower()) and len(text) == len(prompt) + 40
    assert set(text) <= set(ALPHABET)
    rc, plain, _ = _main(['--ckpt', ckpts[mode], '--prompt', prompt, '--chars', 40, '--seed', 3,
                          '--temperature', 0.8, '--top-k', 20], capsys)
    assert plain.rstrip('\n') == text                     # marking segments does not change the text
    if mode == 'none':
        assert '|' not in shown and 'no segments' in err and 'segments:' not in err
        return
    assert shown.count('|') > 0
    model = tiny_model(mode, vocab=27, seed=1, rate=0.3)
    ids = torch.tensor([[ALPHABET.index(c) for c in text]])
    _, b, _ = full_forward(model, ids)
    b = b[0].tolist()
    want = sample.show_segments(text, b, prompt_len=len(prompt))
    assert want == shown, "the marks are not the model's boundaries"
    closed, in_prompt = sum(map(bool, b)), sum(map(bool, b[:len(prompt)]))
    summary = next(ln for ln in err.splitlines() if ln.startswith('segments: '))
    assert f'{len(text)} characters ({len(prompt)} of the prompt), {closed} segments closed ({in_prompt} in ' \
           f'the prompt)' in summary and f'shortening factor {len(text) / closed:.2f}' in summary
    if mode == 'whitespace':
        assert shown.count('|') == text.count(' ') and ' |' * text.count(' ') == re.sub(r'[^ |]', '', shown)


def test_sample_cli_seed_reproducible_across_processes(ckpts, capsys):
    """Same --seed → same text, in this process and in a fresh `python sample.py` process; another seed
    gives another text; several samples come as one batch, separated by a line of dashes."""
    argv = ['--ckpt', ckpts['entropy'], '--prompt', 'anarchism', '--chars', 60, '--seed', 9,
            '--num-samples', 2, '--temperature', 1.0, '--device', 'cpu']
    rc, first, _ = _main(argv, capsys)
    assert rc == 0
    rc, again, _ = _main(argv, capsys)
    assert again == first
    samples = first.rstrip('\n').split('\n' + '-' * 40 + '\n')
    assert len(samples) == 2 and all(s.startswith('anarchism') and len(s) == 69 for s in samples)
    assert samples[0] != samples[1]
    rc, other, _ = _main(argv[:-4] + ['--seed', 10, '--device', 'cpu'], capsys)
    assert other != first
    p = subprocess.run([sys.executable, 'sample.py'] + [str(a) for a in argv], cwd=ROOT,
                       capture_output=True, text=True, timeout=120, env=_env())
    assert p.returncode == 0, p.stderr
    assert p.stdout == first


def test_sample_cli_greedy_is_generate_greedy(ckpts, capsys):
    rc, out, _ = _main(['--ckpt', ckpts['gumbel'], '--prompt', 'the', '--chars', 30, '--greedy', '--seed', 1], capsys)
    assert rc == 0
    rc, out0, _ = _main(['--ckpt', ckpts['gumbel'], '--prompt', 'the', '--chars', 30, '--temperature', 0,
                         '--seed', 2], capsys)
    assert out0 == out
    model = tiny_model('gumbel', vocab=27, seed=1, rate=0.3)
    x = torch.tensor([[ALPHABET.index(c) for c in 'the']])
    want = ''.join(ALPHABET[i] for i in model.generate(x, 30, greedy=True)[0].tolist())
    assert out == want + '\n'


def test_sample_cli_entropy_trace(ckpts, capsys, tmp_path):
    ckpt = ckpts['entropy']
    argv = ['--ckpt', ckpt, '--prompt', 'the cat', '--chars', 30, '--seed', 4]
    rc, shown, _ = _main(argv + ['--show-segments'], capsys)
    rc, tsv, _ = _main(argv + ['--entropy-trace'], capsys)
    assert rc == 0
    lines = tsv.rstrip('\n').split('\n')
    assert lines[0].split('\t') == ['pos', 'char', 'entropy_bits', 'boundary']
    rows = [line.split('\t') for line in lines[1:]]
    assert len(rows) == 37 and all(len(r) == 4 for r in rows)
    assert [int(r[0]) for r in rows] == list(range(37))
    text = ''.join(r[1] for r in rows)
    assert sample.show_segments(text, [r[3] == '1' for r in rows], prompt_len=7) == shown.rstrip('\n')
    assert all(0.0 <= float(r[2]) <= math.log2(27) + 1e-3 for r in rows)
    # To a file, the text still printed.
    rc, out, _ = _main(argv + ['--entropy-trace', tmp_path / 't.tsv'], capsys)
    assert (tmp_path / 't.tsv').read_text() == tsv and out == text + '\n'


@pytest.mark.plots
def test_sample_cli_entropy_plot(ckpts, capsys, tmp_path):
    pytest.importorskip('matplotlib')
    rc, out, err = _main(['--ckpt', ckpts['entropy'], '--prompt', 'the cat', '--chars', 100, '--seed', 4,
                          '--entropy-plot', tmp_path / 'fig.png'], capsys)
    assert rc == 0, err
    assert (tmp_path / 'fig.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n' and os.listdir(tmp_path) == ['fig.png']


def test_sample_cli_checkpoint_errors_are_one_line(ckpts, capsys, tmp_path):
    good = torch.load(ckpts['fixed'], weights_only=False)
    corrupt = tmp_path / 'corrupt.pt'
    corrupt.write_bytes(ckpts['fixed'].read_bytes()[:2000])
    (tmp_path / 'text.pt').write_text('not a checkpoint')
    _write_ckpt({k: v for k, v in good.items() if k != 'vocab'}, tmp_path / 'novocab.pt')
    _write_ckpt(dict(good, config=dict(good['config'], boundary='entropy')), tmp_path / 'mismatch.pt')
    _write_ckpt(dict(good, config=dict(good['config'], layers=(1, 0, 1))), tmp_path / 'badcfg.pt')
    _write_ckpt(dict(good, config=dict(good['config'], d_inner=48)), tmp_path / 'shapes.pt')
    _write_ckpt([1, 2, 3], tmp_path / 'list.pt')
    cases = {tmp_path / 'missing' / 'ckpt.pt': 'no such file', tmp_path / 'empty-run-dir': 'ckpt.pt: no such file',
             corrupt: 'corrupt', tmp_path / 'text.pt': 'corrupt', tmp_path / 'novocab.pt': 'vocab',
             tmp_path / 'mismatch.pt': 'do not fit', tmp_path / 'badcfg.pt': 'invalid', tmp_path / 'list.pt': 'dict',
             tmp_path / 'shapes.pt': 'size mismatch'}
    (tmp_path / 'empty-run-dir').mkdir()
    for path, words in cases.items():
        rc, out, err = _main(['--ckpt', path, '--prompt', 'a'], capsys)
        assert rc == 1 and out == '', path
        assert err.count('\n') == 1 and err.startswith('error: ') and words in err, (path, err)
    # A run directory works as --ckpt.
    rc, out, err = _main(['--ckpt', ckpts['fixed'].parent, '--prompt', 'a', '--chars', 5], capsys)
    assert rc == 0 and len(out) == 7


@pytest.mark.parametrize('greedy', [False, True])
@pytest.mark.parametrize('weights', ['nan', 'huge'])
def test_sample_cli_checkpoint_with_non_finite_weights_or_predictions_is_one_line(tmp_path, capsys, greedy, weights):
    """NaN weights (refused when read) or finite ones whose predictions overflow to NaN: one line,
    exit 1; never a traceback, never text made of NaN (greedy's argmax of NaN would print one)."""
    ckpt = _save_ckpt(tmp_path / 'bad' / 'ckpt.pt', 'entropy', nan=weights == 'nan',
                      scale=3e38 if weights == 'huge' else None)
    rc, out, err = _main(['--ckpt', ckpt, '--prompt', 'the', '--chars', 10] + (['--greedy'] if greedy else []),
                         capsys)
    assert rc == 1 and out == '' and err.count('\n') == 1 and err.startswith('error: ') and 'NaN' in err, err


def _odd_paths(root):
    """conftest's odd_paths and a run folder whose ckpt.pt is a directory."""
    (root / 'run-with-dir' / 'ckpt.pt').mkdir(parents=True)
    return dict(odd_paths(root), **{'run-dir-whose-ckpt-is-a-dir': root / 'run-with-dir'})


@pytest.mark.parametrize('case, words', [('too-long', '300 bytes'), ('too-deep', 'no such file'),
                                         ('through-a-file', 'not a directory'), ('fifo', 'FIFO'),
                                         ('dir', 'ckpt.pt: no such file'),
                                         ('run-dir-whose-ckpt-is-a-dir', 'is a directory')])
def test_sample_cli_odd_checkpoint_paths_are_one_line(tmp_path, capsys, case, words):
    path = _odd_paths(tmp_path)[case]
    with no_hang():
        rc, out, err = _main(['--ckpt', path, '--chars', 3], capsys)
    assert rc == 1 and out == '' and err.count('\n') == 1 and err.startswith('error: --ckpt ') and words in err, err


def test_sample_cli_unreadable_checkpoint_is_one_line(ckpts, capsys, monkeypatch):
    """A checkpoint this user may not read (simulated: tests may run as root, who reads everything)."""
    real = os.access
    monkeypatch.setattr(os, 'access', lambda p, mode, **kw: False if str(p) == str(ckpts['fixed']) else real(p, mode))
    rc, out, err = _main(['--ckpt', ckpts['fixed'], '--chars', 3], capsys)
    assert rc == 1 and out == '' and err.count('\n') == 1 and 'permission denied' in err, err


@pytest.mark.parametrize('flag', ['--entropy-trace', '--entropy-plot'])
@pytest.mark.parametrize('case, words', [('too-long', '300 bytes'), ('too-deep', 'does not exist'),
                                         ('through-a-file', 'not a directory'), ('fifo', 'FIFO'),
                                         ('dir', 'a directory')])
def test_sample_cli_odd_output_paths_are_refused_at_parse_time(ckpts, tmp_path, capsys, flag, case, words):
    """An output that cannot be written whole: exit 2 naming the flag, before any model is read; a FIFO
    or a device is never written through (nor replaced)."""
    path = _odd_paths(tmp_path)[case]
    before = sorted(os.listdir(tmp_path))
    with no_hang():
        rc, out, err = _main(['--ckpt', ckpts['fixed'], '--chars', 3, flag, path], capsys)
    assert rc == 2 and out == '' and err.count('\n') == 1 and err.startswith(f'error: argument {flag}: '), err
    assert words in err and sorted(os.listdir(tmp_path)) == before


def test_sample_cli_unavailable_device_is_one_line(ckpts, capsys):
    if torch.cuda.is_available():
        pytest.skip('CUDA is available here')
    rc, out, err = _main(['--ckpt', ckpts['fixed'], '--device', 'cuda'], capsys)
    assert rc == 2 and err.count('\n') == 1 and err.startswith('error: --device cuda') and 'CUDA' in err


def test_sample_cli_empty_prompt_and_zero_chars(ckpts, capsys):
    rc, out, _ = _main(['--ckpt', ckpts['unigram'], '--prompt', '', '--chars', 10], capsys)
    assert rc == 0 and len(out) == 12 and out[0] == ' '
    rc, out, _ = _main(['--ckpt', ckpts['unigram'], '--prompt', 'abc', '--chars', 0], capsys)
    assert rc == 0 and out == 'abc\n'
    rc, out, err = _main(['--ckpt', ckpts['unigram'], '--prompt', '?!', '--chars', 2], capsys)   # cleans to ''
    assert rc == 0 and len(out) == 4 and out[0] == ' ' and '"?!" -> ""' in err


def test_sample_cli_reads_a_checkpoint_written_by_train_py(tmp_path, capsys):
    """The contract with train.py: a 2-step tiny run's ckpt.pt samples, segments shown."""
    data = tmp_path / 'data'
    data.mkdir()
    text = ('the quick brown fox jumps over the lazy dog ' * 60).encode('ascii')
    alphabet = sorted(set(text.decode()))
    ids = np.array([alphabet.index(chr(c)) for c in text], dtype=np.uint8)
    for name, part in (('train', ids[:2000]), ('valid', ids[2000:2300]), ('test', ids[2300:])):
        part.tofile(data / f'{name}.bin')
    (data / 'meta.json').write_text(json.dumps(dict(alphabet=alphabet, vocab_size=len(alphabet),
                                                    space_id=alphabet.index(' '), dtype='uint8')))
    run = tmp_path / 'run'
    try:
        train.main(['--data', str(data), '--out', str(run), '--boundary', 'whitespace', '--device', 'cpu',
                    '--d-model', '32', '--n-head', '2', '--d-head', '16', '--d-inner', '64', '--layers', '1,1,1',
                    '--seq-len', '32', '--batch-size', '2', '--max-steps', '2', '--warmup', '1',
                    '--eval-interval', '2', '--eval-window', '32', '--eval-step', '8', '--eval-max-chars', '100',
                    '--eval-batch-size', '8', '--log-interval', '1'])
    except SystemExit as e:
        assert not e.code, capsys.readouterr().err
    capsys.readouterr()
    assert (run / 'ckpt.pt').is_file()
    rc, out, err = _main(['--ckpt', run / 'ckpt.pt', '--prompt', 'The lazy', '--chars', 30,
                          '--show-segments', '--seed', 0], capsys)
    assert rc == 0, err
    text = out.rstrip('\n').replace('|', '').replace(sample.PROMPT_MARK, '')
    assert text.startswith('the lazy') and len(text) == 38
    assert out.count('|') == text.count(' ')


def test_sample_cli_loads_compiled_or_ddp_state_dicts(ckpts, capsys, tmp_path):
    """Parameter names saved from a torch.compile'd or DDP-wrapped model ('_orig_mod.', 'module.') load."""
    good = torch.load(ckpts['gumbel'], weights_only=False)
    wrapped = {f'module._orig_mod.{k}': v for k, v in good['model'].items()}
    _write_ckpt(dict(good, model=wrapped), tmp_path / 'wrapped.pt')
    argv = ['--prompt', 'abc', '--chars', 20, '--seed', 2, '--show-segments']
    rc, want, _ = _main(['--ckpt', ckpts['gumbel']] + argv, capsys)
    rc, got, err = _main(['--ckpt', tmp_path / 'wrapped.pt'] + argv, capsys)
    assert rc == 0 and got == want, err


@pytest.mark.parametrize('extra', [['--top-k', '0'], ['--chars', '-3'], ['--temperature', '-1'],
                                   ['--temperature', 'nan'], ['--temperature', 'inf'], ['--temperature', '1e400'],
                                   ['--num-samples', 'x'], ['--seed', str(10 ** 23)], ['--threads', '100000'],
                                   ['--chars', '1e3'], ['--separator', ''], ['--separator', 'a\nb'],
                                   ['--device', 'nonsense'], ['--device', 'meta'],
                                   ['--entropy-trace', 'same.out', '--entropy-plot', 'same.out'],
                                   ['--entropy-plot', '-']])
def test_sample_cli_bad_flags_are_one_line(ckpts, capsys, extra):
    rc, out, err = _main(['--ckpt', ckpts['fixed']] + extra, capsys)
    assert rc == 2 and out == '' and err.count('\n') == 1 and err.startswith('error: ') and extra[0] in err, err


# ---------------------------------------------------------------------------------------------
# Requests too large for memory, running out of memory, Ctrl-C
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize('request_', [['--chars', '1000000000'], ['--num-samples', '100000000', '--chars', '50']])
def test_sample_cli_request_beyond_memory_is_refused_in_one_line(ckpts, tmp_path, capsys, monkeypatch, request_):
    """--chars 1e9 or --num-samples 1e8 is refused before anything is allocated or written, naming
    the flags and the most that fits (the first through a real `python sample.py`)."""
    argv = ['--ckpt', ckpts['entropy'], '--prompt', 'the', '--entropy-trace', 't.tsv'] + request_
    if request_[0] == '--chars':
        p = subprocess.run([sys.executable, str(ROOT / 'sample.py')] + [str(a) for a in argv],
                           cwd=tmp_path, capture_output=True, text=True, timeout=120, env=_env())
        rc, out, err = p.returncode, p.stdout, p.stderr
    else:
        monkeypatch.chdir(tmp_path)
        rc, out, err = _main(argv, capsys)
    assert rc == 1 and out == '', err
    assert err.count('\n') == 1 and err.startswith('error: ') and 'GiB' in err, err
    most = re.search(r'at most ([\d,]+) --chars with --num-samples \d+, or at most ([\d,]+) --num-samples', err)
    assert most, err
    allowed = int(most.group(1 if request_[0] == '--chars' else 2).replace(',', ''))
    assert 0 < allowed < int(request_[1])       # a smaller request of the same kind would fit
    assert os.listdir(tmp_path) == []           # no trace, no temporary file


def test_sample_memory_estimate_covers_the_caches():
    """The estimate behind the refusal counts at least the key/value caches prefill allocates."""
    model = tiny_model('whitespace', vocab=27)
    x = torch.randint(1, 27, (32, 7))
    _, state = model.prefill(x, capacity=7 + 50)
    # one KVCache per stage (dict), or per layer in a list per stack
    caches = state.caches.values() if isinstance(state.caches, dict) else [c for s in state.caches for c in s]
    cache_bytes = sum((c.k.numel() + c.v.numel()) * c.k.element_size() for c in caches)
    est = sample.generation_bytes(model.cfg, 32, 7, 50)
    assert cache_bytes <= est <= 2 * cache_bytes
    assert sample.generation_bytes(model.cfg, 32, 7, 100) > est and sample.generation_bytes(model.cfg, 64, 7, 50) > est


def test_sample_out_of_memory_is_one_line(ckpts, capsys, monkeypatch):
    """Where the estimate lets a request through that still cannot be allocated: one line, exit 1."""
    monkeypatch.setattr(sample, 'check_request', lambda *a: None)
    rc, out, err = _main(['--ckpt', ckpts['fixed'], '--prompt', 'a', '--chars', 10 ** 12], capsys)
    assert rc == 1 and out == '' and err.count('\n') == 1 and err.startswith('error: out of memory'), err


def test_sample_cli_ctrl_c_exits_130_keeping_only_finished_files(ckpts, tmp_path, capsys, monkeypatch):
    """Ctrl-C while generating: exit 130, one line, no file. Ctrl-C while the plot is drawn: the
    finished trace is kept whole, no plot and no temporary file. (The plot itself is stood in for:
    matplotlib, the optional extra, is not needed.)"""
    argv = ['--ckpt', ckpts['entropy'], '--prompt', 'the', '--chars', 20, '--seed', 1,
            '--entropy-trace', 't.tsv', '--entropy-plot', 'fig.png']

    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt

    def half_plot(path, *args, **kwargs):
        open(path, 'w').write('half a plot')
        raise KeyboardInterrupt

    def main(argv):
        try:
            return _main(argv, capsys)
        except KeyboardInterrupt:
            pytest.fail('Ctrl-C escaped sample.main')
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sample, 'plot_formats', lambda: {'png': 'Portable Network Graphics'})
    with monkeypatch.context() as m:
        m.setattr(sample, 'sample', ctrl_c)
        rc, out, err = main(argv)
    assert rc == 130 and out == '' and err == 'error: interrupted (Ctrl-C); no file written\n'
    assert os.listdir(tmp_path) == []
    monkeypatch.setattr(sample, 'entropy_plot', half_plot)
    rc, out, err = main(argv)
    assert rc == 130 and err.count('\n') == 1 and err.startswith('error: interrupted') and 't.tsv' in err
    assert os.listdir(tmp_path) == ['t.tsv']
    rows = (tmp_path / 't.tsv').read_text().splitlines()
    assert rows[0] == 'pos\tchar\tentropy_bits\tboundary' and len(rows) == 1 + 3 + 20


@pytest.mark.parametrize('flag, path', [('--entropy-plot', 'no/such/folder/fig.png'),
                                        ('--entropy-trace', 'no/such/folder/t.tsv')])
def test_sample_cli_output_in_a_missing_folder_is_refused_before_generating(ckpts, tmp_path, capsys, monkeypatch,
                                                                          flag, path):
    monkeypatch.chdir(tmp_path)
    rc, out, err = _main(['--ckpt', ckpts['fixed'], '--chars', 5, flag, path], capsys)
    assert rc == 2 and out == '' and err.count('\n') == 1 and err.startswith(f'error: argument {flag}')
    assert 'does not exist' in err and os.listdir(tmp_path) == []


def test_sample_cli_plot_without_matplotlib_is_one_line(ckpts, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, 'matplotlib', None)    # as if it were not installed
    monkeypatch.setitem(sys.modules, 'matplotlib.backend_bases', None)
    monkeypatch.chdir(tmp_path)
    rc, out, err = _main(['--ckpt', ckpts['fixed'], '--chars', 5, '--entropy-plot', 'fig.png'], capsys)
    assert rc == 1 and out == '' and err == 'error: --entropy-plot needs matplotlib: pip install matplotlib\n'
    assert os.listdir(tmp_path) == []


@pytest.mark.plots
def test_sample_cli_plot_in_an_unknown_format_is_refused_before_generating(ckpts, tmp_path, capsys, monkeypatch):
    pytest.importorskip('matplotlib')
    monkeypatch.chdir(tmp_path)
    rc, out, err = _main(['--ckpt', ckpts['fixed'], '--chars', 5, '--entropy-plot', 'fig.notaformat'], capsys)
    assert rc == 1 and out == '' and err.count('\n') == 1 and 'writes no .notaformat' in err, err
    assert os.listdir(tmp_path) == []


@pytest.mark.plots
def test_sample_cli_plot_without_extension_is_a_png(ckpts, tmp_path, capsys, monkeypatch):
    pytest.importorskip('matplotlib')
    monkeypatch.chdir(tmp_path)
    rc, out, err = _main(['--ckpt', ckpts['fixed'], '--chars', 5, '--entropy-plot', 'fig'], capsys)
    assert rc == 0, err
    assert os.listdir(tmp_path) == ['fig'] and (tmp_path / 'fig').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


class _Pickled:
    """A Python object beyond tensors and containers, as a checkpoint might carry."""


def test_sample_cli_unsafe_checkpoint_names_the_flag_that_lifts_the_refusal(ckpts, tmp_path, capsys):
    good = torch.load(ckpts['fixed'], weights_only=False)
    _write_ckpt(dict(good, extra=_Pickled()), tmp_path / 'pickled.pt')
    rc, out, err = _main(['--ckpt', tmp_path / 'pickled.pt', '--chars', 5], capsys)
    assert rc == 1 and out == '' and err.count('\n') == 1 and '_Pickled' in err and '--trust-ckpt' in err, err
    rc, out, err = _main(['--ckpt', tmp_path / 'pickled.pt', '--chars', 5, '--trust-ckpt'], capsys)
    assert rc == 0 and len(out) == 7, err


# ---------------------------------------------------------------------------------------------
# Fuzz: random flags and damaged checkpoints keep the command line's contract
# ---------------------------------------------------------------------------------------------
# flag: (values that run, values that must be refused); an example takes a refused one in four times
_FLAG_VALUES = {
    '--chars': (['0', '7', '3'], ['-1', 'x', 'nan', '1e3', str(10 ** 12), '']),
    '--num-samples': (['1', '2'], ['0', '-2', 'inf', str(10 ** 9)]),
    '--temperature': (['0', '0.5', '1', '1e-300', '1e308'], ['nan', 'inf', '-inf', '-1', '1e400', 'abc']),
    '--top-k': (['1', '5', '100000'], ['0', '-1', 'nan']),
    '--seed': (['0', '1', str(2 ** 63 - 1)], [str(2 ** 63), '-1', 'nan', str(10 ** 30)]),
    '--separator': (['|', sample.PROMPT_MARK, 'a', '||'], ['', '\n']),
    '--device': (['cpu'], ['cuda:7', 'nonsense', 'meta', 'mps']),
    '--threads': (['1'], ['0', str(10 ** 6), '1.5']),
}
_OUTPUTS = (['out.tsv', 'fig.png', '-'], ['fig.xyz', ''])
_SWITCHES = ['--greedy', '--show-segments', '--color', '--trust-ckpt']


def _damaged_checkpoint(data, good, root, odd):
    """A checkpoint path: the good one, cut short, with flipped bytes, or an odd path."""
    kind = data.draw(st.sampled_from(['good'] * 3 + ['cut', 'flipped', 'unsealed-flipped', 'unsealed-flipped', 'odd']),
                     label='checkpoint')
    if kind == 'good':
        return good
    if kind == 'odd':
        return odd[data.draw(st.sampled_from(sorted(odd)), label='odd path')]
    raw = bytearray(good.read_bytes())
    if kind == 'unsealed-flipped':   # no checksum to catch the damage: it reaches the loading and the weights
        raw = bytearray(_write_ckpt(torch.load(good, weights_only=False), root / 'unsealed.pt', sealed=False)
                        .read_bytes())
    if kind == 'cut':
        raw = raw[:data.draw(st.integers(0, len(raw) - 1), label='cut at')]
    else:
        for at in data.draw(st.lists(st.integers(0, len(raw) - 1), min_size=1, max_size=8), label='flipped'):
            raw[at] ^= data.draw(st.integers(1, 255))
    (root / 'damaged.pt').write_bytes(bytes(raw))
    return root / 'damaged.pt'


def _ctrl_c(*args, **kwargs):
    raise KeyboardInterrupt


@settings(max_examples=20, **HYPOTHESIS_FIXTURES)
@given(data=st.data())
def test_sample_fuzz_keeps_the_contract(ckpts, data, capsys, monkeypatch):
    """Random flags (non-finite, huge, negative, odd strings and paths) and random damage to the
    checkpoint (cut short, flipped bytes): sample.main ends with exit 0, 1, 2 or 130, never an
    uncaught exception; a failure is one `error:` line; no temporary file is left, and an output file
    that exists is whole."""
    with tempfile.TemporaryDirectory() as tmp, no_hang(60):
        root = Path(tmp)
        monkeypatch.chdir(root)   # '-' and '' name files here, if anything
        odd = _odd_paths(root)
        ckpt = _damaged_checkpoint(data, ckpts[data.draw(st.sampled_from(MODES), label='mode')], root, odd)
        argv = ['--ckpt', str(ckpt), '--prompt', data.draw(st.text(max_size=12), label='prompt'), '--chars', '7']
        for flag in data.draw(st.lists(st.sampled_from(sorted(_FLAG_VALUES)), unique=True, max_size=4)):
            good, bad = _FLAG_VALUES[flag]
            refused = data.draw(st.integers(0, 3), label=f'{flag} refused') == 0
            argv += [flag, data.draw(st.sampled_from(bad if refused else good), label=flag)]
        outputs = {}
        for flag in ('--entropy-trace', '--entropy-plot'):
            if data.draw(st.booleans(), label=f'use {flag}'):
                refused = data.draw(st.integers(0, 3), label=f'{flag} refused') == 0
                name = data.draw(st.sampled_from(_OUTPUTS[1] + sorted(odd) if refused else _OUTPUTS[0]), label=flag)
                outputs[flag] = str(odd.get(name, root / name)) if name not in ('-', '') else name
                argv += [flag, outputs[flag]]
        argv += data.draw(st.lists(st.sampled_from(_SWITCHES), unique=True, max_size=3))
        if data.draw(st.integers(0, 9), label='Ctrl-C') == 0:
            monkeypatch.setattr(sample, 'sample', _ctrl_c)
        try:
            rc, out, err = _main(argv, capsys)
        finally:
            monkeypatch.undo()
        event(f'exit {rc}')   # --hypothesis-show-statistics: how many examples got how far
        assert_cli_contract(rc, err, argv)
        assert rc or 'error:' not in err, (argv, err)
        left = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if '.tmp' in f]
        assert not left, (argv, left)
        whole = {'--entropy-trace': lambda b: b.startswith((b'pos\t', b'# sample')) and b.endswith(b'\n'),
                 '--entropy-plot': lambda b: b.startswith(b'\x89PNG')}
        for flag, path in outputs.items():
            if path.startswith(str(root / 'fig')) or path.startswith(str(root / 'out')):
                assert not os.path.exists(path) or whole[flag](Path(path).read_bytes()), (argv, flag)
