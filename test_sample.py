"""Tests of sample.py: segment display, prompt cleaning, the CLI end to end (in this process:
sample.main, except where the process itself matters), its errors, paths and flags, and a fuzz test
of its contract.

Run:   python -m pytest -q test_sample.py
"""

import dataclasses
import errno
import io
import json
import math
import os
import random
import re
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

import checkpoint
import runtime
import sample
import train
from conftest import (ALPHABET, HYPOTHESIS_FIXTURES, MODES, ROOT, assert_cli_contract,
                      full_forward, no_hang,
                      odd_paths, run_main, tiny_config, tiny_model)
from cleaning import LANGS


# ---------------------------------------------------------------------------------------------
# Segment display
# ---------------------------------------------------------------------------------------------
@settings(max_examples=50, **HYPOTHESIS_FIXTURES)
@given(data=st.data())
def test_sample_segment_display_reassembles(data):
    text = data.draw(st.text(alphabet=''.join(ALPHABET), max_size=60))
    b = data.draw(st.lists(st.booleans(), min_size=len(text), max_size=len(text)))
    shown = sample.show_segments(text, b)
    assert shown.replace('|', '') == text
    assert shown.count('|') == sum(b)
    pieces = shown.split('|')            # each closed segment, then the open one
    assert len(pieces) == sum(b) + 1
    ends = [i for i, bi in enumerate(b) if bi]
    starts = [0] + [e + 1 for e in ends]
    assert pieces == [text[s:e + 1] for s, e in zip(starts, ends)] + [text[starts[-1]:]]
    assert sample.show_segments(text, None) == text
    # the prompt's end: one mark, after the prompt's last character and its separator
    n = data.draw(st.integers(1, max(1, len(text))))
    marked = sample.show_segments(text, b, prompt_len=n)
    assert marked.replace('|', '').replace(sample.PROMPT_MARK, '') == text
    if text:
        assert marked.count(sample.PROMPT_MARK) == 1
        before = marked.split(sample.PROMPT_MARK)[0]
        assert before.replace('|', '') == text[:n]
        assert before.endswith('|') == b[n - 1]
    want = text[:n] + (sample.PROMPT_MARK if text else '') + text[n:]
    assert sample.show_segments(text, None, prompt_len=n) == want


# ---------------------------------------------------------------------------------------------
# Prompt cleaning: the training text's own
# ---------------------------------------------------------------------------------------------
def test_prompt_is_cleaned_as_the_training_text_was():
    text8 = dict(alphabet=[' '] + list('abcdefghijklmnopqrstuvwxyz'))
    assert sample.clean_prompt('Hello, World 42!', text8)[0] == 'hello world four two'
    assert sample.clean_prompt('Line one.\nLine 2 ', text8)[0] == 'line one line two '  # no \n
    how = sample.clean_prompt('x', text8)[1]
    assert 'en' in how and "text8's alphabet" in how
    fi = dict(alphabet=['\n', ' '] + list(LANGS['fi']['letters']),
              cleaning=dict(lang='fi'))
    assert sample.clean_prompt('Äiti 5\n', fi)[0] == 'äiti viisi\n'
    assert sample.clean_prompt('Éclair',
                               fi)[0] == 'clair'                   # é is no Finnish letter
    text, how = sample.clean_prompt('Éclair', fi)
    assert text == 'clair' and 'recorded in the checkpoint' in how
    other = dict(alphabet=list(' abcdefghijklmnopqrs'))   # no language recorded
    text, how = sample.clean_prompt('Née 1999!', other)
    assert text == 'Née 1999!' and 'not cleaned' in how


def _write_ckpt(state, path, sealed=True):
    """torch.save to path, with the checksum train.py's checkpoints carry (checkpoint.write_sealed)
    unless sealed=False (a checkpoint from before checksums)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    with open(path, 'wb') as f:
        if sealed and hasattr(checkpoint, 'write_sealed'):
            checkpoint.write_sealed(f, buf.getbuffer())
        else:
            f.write(buf.getvalue())
    return path


def _save_ckpt(path, mode, vocab_size=27, alphabet=None, rate=0.3, nan=False, scale=None,
               model=None, **vocab):
    """A checkpoint with train.py's keys: model, optimizer, scaler, step, epoch, pos, config
    (asdict), vocab (alphabet, vocab_size, space_id), args, schedule, rng (numpy's state
    included); of `model` where given, else of conftest's calibrated tiny model; `vocab`: more
    of the vocab dict (encoding, cleaning)."""
    alphabet = alphabet or ALPHABET[:vocab_size]
    model = model or tiny_model(mode, vocab=vocab_size, seed=1, rate=rate,
                                whitespace_id=alphabet.index(' '))
    state_dict = model.state_dict()
    if nan:
        state_dict['lm_head.weight'] = state_dict['lm_head.weight'].clone()
        state_dict['lm_head.weight'][3, 5] = float('nan')
    if scale:   # finite weights whose logits overflow to +-inf on the way
        w = state_dict['lm_head.weight']
        state_dict['lm_head.weight'] = torch.where(torch.arange(w.numel()) % 2 == 0, scale,
                                                   -scale).view_as(w)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    state = dict(model=state_dict, optimizer=opt.state_dict(), scaler={}, step=0, epoch=0, pos=0,
                 config=dataclasses.asdict(model.cfg),
                 vocab=dict(alphabet=alphabet, vocab_size=vocab_size,
                            space_id=alphabet.index(' '), **vocab),
                 args=dict(boundary=mode, data='data/text8', layers='1,1,1', seed=1337),
                 schedule=dict(lr=1e-3, warmup=2, max_steps=10),
                 rng=dict(torch=torch.get_rng_state(), numpy=np.random.get_state(),
                          python=random.getstate(),
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
    return (bool(lines) and lines[-1].startswith('error: ') and 'Traceback' not in err
            and sum(ln.startswith('error') for ln in lines) == 1)


def test_sample_cli_cleans_the_prompt_and_says_how(ckpts, capsys):
    rc, out, err = _main(['--ckpt', ckpts['whitespace'], '--prompt', 'Hello, World 42!', '--chars',
                          5], capsys)
    assert rc == 0, err
    assert out.startswith('hello world four two') and len(out) == len('hello world four two') + 6
    assert err.count('\n') == 1
    assert err.startswith('prompt cleaned (cleaning.clean, en, from text8')
    assert err.rstrip('\n').endswith("'Hello, World 42!' -> 'hello world four two'")
    rc, out, err = _main(['--ckpt', ckpts['whitespace'], '--prompt', 'the cat ', '--chars', 5],
                         capsys)
    assert rc == 0 and out.startswith('the cat ') and err == ''        # clean already: nothing said


def test_sample_cli_cleans_a_finnish_prompt(tmp_path, capsys):
    alphabet = ['\n', ' '] + list(LANGS['fi']['letters'])
    ckpt = _save_ckpt(tmp_path / 'fi' / 'ckpt.pt', 'whitespace', vocab_size=len(alphabet),
                      alphabet=alphabet, cleaning=dict(lang='fi'))
    rc, out, err = _main(['--ckpt', ckpt, '--prompt', 'Äiti 5', '--chars', 3, '--show-segments'],
                         capsys)
    assert rc == 0, err
    assert out.startswith('äiti |viisi' + sample.PROMPT_MARK) and 'cleaning.clean, fi' in err


def test_sample_cli_characters_outside_an_unknown_alphabet_are_one_line_error(tmp_path, capsys):
    """A checkpoint with no language recorded: the prompt is not cleaned, and the characters
    outside its alphabet are refused in one line."""
    alphabet = ALPHABET[:20]
    ckpt = _save_ckpt(tmp_path / 'custom' / 'ckpt.pt', 'whitespace', vocab_size=20,
                      alphabet=alphabet)
    rc, out, err = _main(['--ckpt', ckpt, '--prompt', 'Née 1999!'], capsys)
    assert rc == 1 and out == '' and _one_error_line(err)
    for c in ("'N'", "'é'", "'1'", "'9'", "'!'"):
        assert c in err.splitlines()[-1]
    assert "'e'" not in err


# ---------------------------------------------------------------------------------------------
# sample.py end to end
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize('mode', MODES)
def test_sample_cli_every_mode_shows_segments_that_reassemble(mode, ckpts, capsys):
    prompt = 'The History of'
    rc, out, err = _main(['--ckpt', ckpts[mode], '--prompt', prompt, '--chars', 40, '--seed', 3,
                          '--temperature', 0.8, '--top-k', 20, '--show-segments',
                          '--device', 'cpu'], capsys)
    assert rc == 0, err
    shown = out.rstrip('\n')
    marked = shown.replace('|', '')
    assert marked.count(sample.PROMPT_MARK) == 1 and marked.index(sample.PROMPT_MARK) == len(prompt)
    text = marked.replace(sample.PROMPT_MARK, '')
    assert text.startswith(prompt.lower()) and len(text) == len(prompt) + 40
    assert set(text) <= set(ALPHABET)
    rc, plain, _ = _main(['--ckpt', ckpts[mode], '--prompt', prompt, '--chars', 40, '--seed', 3,
                          '--temperature', 0.8, '--top-k', 20], capsys)
    assert plain.rstrip('\n') == text   # marking segments does not change the text
    if mode == 'none':
        assert '|' not in shown and 'no segments' in err
        return
    assert shown.count('|') > 0
    model = tiny_model(mode, vocab=27, seed=1, rate=0.3)
    ids = torch.tensor([[ALPHABET.index(c) for c in text]])
    _, b, _ = full_forward(model, ids)
    b = b[0].tolist()
    want = sample.show_segments(text, b, prompt_len=len(prompt))
    assert want == shown, "the marks are not the model's boundaries"
    if mode == 'whitespace':
        assert shown.count('|') == text.count(' ')
        assert ' |' * text.count(' ') == re.sub(r'[^ |]', '', shown)


def test_sample_cli_seed_reproducible(ckpts, capsys):
    """Same --seed → same text (in a fresh process too: test_sample_as_a_process); another seed
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


def test_sample_cli_greedy_is_generate_greedy(ckpts, capsys):
    rc, out, _ = _main(['--ckpt', ckpts['gumbel'], '--prompt', 'the', '--chars', 30, '--greedy',
                        '--seed', 1], capsys)
    assert rc == 0
    rc, out0, _ = _main(['--ckpt', ckpts['gumbel'], '--prompt', 'the', '--chars', 30,
                         '--temperature', 0,
                         '--seed', 2], capsys)
    assert out0 == out
    model = tiny_model('gumbel', vocab=27, seed=1, rate=0.3)
    x = torch.tensor([[ALPHABET.index(c) for c in 'the']])
    want = ''.join(ALPHABET[i] for i in model.generate(x, 30, greedy=True)[0].tolist())
    assert out == want + '\n'


def _spikes_by_loop(H, k):
    """The entropy-spike rule written out: b_t = 1 iff H_t > H_i for every i in t-k .. t-1 >= 0."""
    return [all(H[t] > H[i] for i in range(max(0, t - k), t)) for t in range(len(H))]


@pytest.mark.parametrize('mode, window', [('entropy', 3), ('none', 4), ('gumbel', 1)])
def test_sample_entropy_marks_the_spike_rule_and_the_models_boundaries(
        ckpts, tmp_path, capsys, mode, window):
    """Figure 2's data for any model: entropies in bits, the spikes the rule on them (k = the
    checkpoint's entropy_window), the boundaries the model's b_t (None for vanilla); the text is
    printed."""
    good = torch.load(ckpts[mode], weights_only=False)
    ckpt = _write_ckpt(dict(good, config=dict(good['config'], entropy_window=window)),
                       tmp_path / 'w.pt')
    argv = ['--ckpt', ckpt, '--prompt', 'the cat sat', '--chars', 40, '--seed', 5, '--device',
            'cpu']
    out = sample.run(sample.parse_args([str(a) for a in argv]))
    text = ''.join(out.pieces[0])
    assert capsys.readouterr().out == text + '\n' and len(text) == 51
    assert out.k == window and out.spikes[0] == _spikes_by_loop(out.entropy[0], window)
    assert 0 < sum(out.spikes[0]) < len(text)
    assert all(0.0 <= h <= math.log2(27) + 1e-3 for h in out.entropy[0])
    if mode == 'none':
        assert out.boundaries is None
    else:
        _, b, _ = full_forward(tiny_model(mode, vocab=27, seed=1, rate=0.3),
                               torch.tensor([[ALPHABET.index(c) for c in text]]))
        assert out.boundaries[0] == b[0].bool().tolist()


@pytest.mark.plots
@pytest.mark.parametrize('mode', ['entropy', 'none'])
def test_sample_cli_entropy_plot_draws_spikes_and_the_models_boundaries_apart(
        ckpts, capsys, tmp_path, monkeypatch, mode):
    """The PNG's figure: a red dashed line after every spike of the rule, a row of marks at the
    model's own segment ends (none for vanilla), over rows of 80 characters. A name without an
    extension gets a PNG."""
    pytest.importorskip('matplotlib')
    from matplotlib.collections import LineCollection
    figures = []
    real = sample.entropy_figure
    monkeypatch.setattr(sample, 'entropy_figure',
                        lambda *a, **kw: figures.append(real(*a, **kw)) or figures[-1])
    name = 'fig' if mode == 'entropy' else 'fig.png'
    out = sample.run(sample.parse_args(['--ckpt', str(ckpts[mode]), '--prompt', 'the cat',
                                        '--chars', '100', '--seed', '4', '--entropy-plot',
                                        str(tmp_path / name)]))
    assert capsys.readouterr().err.endswith(f'wrote {tmp_path / name}\n')
    assert (tmp_path / name).read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    assert os.listdir(tmp_path) == [name]
    spikes, ends = [], []
    for ax in figures[-1].axes:
        for artist in ax.get_children():
            if isinstance(artist,
                          LineCollection) and artist.get_label().startswith('entropy spike'):
                spikes += [seg[0][0] for seg in artist.get_segments()]
            elif artist.get_label() == "the model's segment ends":
                ends += list(artist.get_xdata())
    assert len(figures[-1].axes) == 2
    assert spikes == [t + 0.5 for t, s in enumerate(out.spikes[0]) if s] and spikes
    want = [] if mode == 'none' else [t + 0.5 for t, b in enumerate(out.boundaries[0]) if b]
    assert ends == want and (mode == 'none' or ends)
    assert ends != spikes


def test_sample_cli_model_without_pre_or_post_layers_generates(tmp_path, capsys):
    """layers (0, 1, 0), degenerate but valid: cached generation runs, its segments are the full
    forward's (dynpool's Stage with no layers)."""
    from dynpool import DynamicPoolingLM
    torch.manual_seed(0)
    model = DynamicPoolingLM(tiny_config('entropy', vocab=27, layers=(0, 1, 0))).eval()
    ckpt = _save_ckpt(tmp_path / 'zero' / 'ckpt.pt', 'entropy', model=model)
    argv = ['--ckpt', ckpt, '--prompt', 'the cat', '--chars', 30, '--seed', 2]
    rc, shown, err = _main(argv + ['--show-segments'], capsys)
    assert rc == 0, err
    text = shown.rstrip('\n').replace('|', '').replace(sample.PROMPT_MARK, '')
    assert len(text) == 37 and text.startswith('the cat')
    _, b, _ = full_forward(model, torch.tensor([[ALPHABET.index(c) for c in text]]))
    assert sample.show_segments(text, b[0].tolist(), prompt_len=7) == shown.rstrip('\n')


def test_sample_cli_checkpoint_errors_are_one_line(ckpts, capsys, tmp_path):
    good = torch.load(ckpts['fixed'], weights_only=False)
    corrupt = tmp_path / 'corrupt.pt'
    corrupt.write_bytes(ckpts['fixed'].read_bytes()[:2000])
    (tmp_path / 'text.pt').write_text('not a checkpoint')
    _write_ckpt({k: v for k, v in good.items() if k != 'vocab'}, tmp_path / 'novocab.pt')
    _write_ckpt(dict(good, config=dict(good['config'], boundary='entropy')),
                tmp_path / 'mismatch.pt')
    _write_ckpt(dict(good, config=dict(good['config'], layers=(1, 0, 1))), tmp_path / 'badcfg.pt')
    _write_ckpt(dict(good, config=dict(good['config'], d_inner=48)), tmp_path / 'shapes.pt')
    _write_ckpt([1, 2, 3], tmp_path / 'list.pt')
    cases = {tmp_path / 'missing' / 'ckpt.pt': 'missing/ckpt.pt',
             tmp_path / 'empty-run-dir': 'empty-run-dir/ckpt.pt',
             corrupt: 'corrupt', tmp_path / 'text.pt': 'corrupt', tmp_path / 'novocab.pt': 'vocab',
             tmp_path / 'mismatch.pt': 'do not fit', tmp_path / 'badcfg.pt': 'invalid',
             tmp_path / 'list.pt': 'train.py',
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
def test_sample_cli_checkpoint_with_non_finite_weights_or_predictions_is_one_line(
        tmp_path, capsys, greedy, weights):
    """NaN weights (refused when read) or finite ones whose predictions overflow to NaN: one line,
    exit 1; never a traceback, never text made of NaN (greedy's argmax of NaN would print one)."""
    ckpt = _save_ckpt(tmp_path / 'bad' / 'ckpt.pt', 'entropy', nan=weights == 'nan',
                      scale=3e38 if weights == 'huge' else None)
    rc, out, err = _main(['--ckpt', ckpt, '--prompt', 'the', '--chars',
                          10] + (['--greedy'] if greedy else []),
                         capsys)
    assert rc == 1 and out == '' and _one_error_line(err) and 'NaN' in err, err


def _odd_paths(root):
    """conftest's odd_paths and a run folder whose ckpt.pt is a directory."""
    (root / 'run-with-dir' / 'ckpt.pt').mkdir(parents=True)
    return dict(odd_paths(root), **{'run-dir-whose-ckpt-is-a-dir': root / 'run-with-dir'})


def test_sample_cli_odd_checkpoint_paths_are_one_line(tmp_path, capsys):
    """No checkpoint there (the reader's words): one line naming the path, exit 1, a FIFO never
    opened (it would wait for a writer)."""
    for case, path in _odd_paths(tmp_path).items():
        with no_hang():
            rc, out, err = _main(['--ckpt', path, '--chars', 3], capsys)
        assert rc == 1 and out == '' and _one_error_line(err) and str(path) in err, (case, err)


def test_sample_cli_unreadable_checkpoint_is_one_line(ckpts, capsys, monkeypatch):
    """A checkpoint this user may not read (simulated: tests may run as root, who reads
    everything)."""
    real = io.open

    def denied(file, *args, **kwargs):
        if str(file) == str(ckpts['fixed']):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(file))
        return real(file, *args, **kwargs)
    monkeypatch.setattr(io, 'open', denied)   # Path.read_bytes' way in
    rc, out, err = _main(['--ckpt', ckpts['fixed'], '--chars', 3], capsys)
    assert rc == 1 and out == '' and _one_error_line(err), err
    assert 'permission denied' in err.lower(), err


_ODD_OUTPUTS = {'too-long': 'too long', 'too-deep': 'no such file',
                'through-a-file': 'not a directory', 'fifo': 'not a regular file',
                'dir': 'not a regular file'}


@pytest.mark.plots
def test_sample_cli_odd_output_paths_are_one_line(ckpts, tmp_path, capsys):
    """A plot that cannot be written whole (a missing folder, a FIFO, ...): the operating
    system's word (common.main) naming it, exit 1, nothing left behind; a FIFO is never written
    through nor replaced (common.write_atomic)."""
    pytest.importorskip('matplotlib')
    flag = '--entropy-plot'
    paths = _odd_paths(tmp_path)
    before = sorted(os.listdir(tmp_path))
    for case, words in _ODD_OUTPUTS.items():
        with no_hang():
            rc, out, err = _main(['--ckpt', ckpts['fixed'], '--chars', 3, flag, paths[case]],
                                 capsys)
        assert rc == 1 and _one_error_line(err) and words in err.lower(), (case, err)
        assert paths[case].name in err, (case, err)
        assert sorted(os.listdir(tmp_path)) == before, case
    assert stat.S_ISFIFO(os.stat(tmp_path / 'a-fifo').st_mode)


def test_sample_as_a_process(ckpts, tmp_path, capsys):
    """`python sample.py` as README runs it: the same --seed gives in a fresh process the text it
    gives in this one; a reader that leaves (here before the first line, as a pipe's buffer may
    hold all that follows one) is one `error:` line through common.main, exit 1, never a
    traceback."""
    argv = ['--ckpt', ckpts['entropy'], '--prompt', 'anarchism', '--chars', 60, '--seed', 9,
            '--num-samples', 2, '--temperature', 1.0, '--device', 'cpu']
    command = [sys.executable, 'sample.py'] + [str(a) for a in argv]
    p = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=_env())
    p.stdout.close()   # long before torch is imported
    rc, want, _ = _main(argv, capsys)
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 1 and _one_error_line(err) and 'broken pipe' in err, err
    fresh = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=_env())
    assert rc == 0 and fresh.returncode == 0 and fresh.stdout == want and '-' * 40 in want


def test_sample_cli_full_stdout_is_one_line(ckpts, capsys, monkeypatch):
    """`> /dev/full`: one `error:` line through common.main, exit 1."""
    if not os.path.exists('/dev/full'):
        pytest.skip('no /dev/full here')
    full = open('/dev/full', 'w')
    monkeypatch.setattr(sys, 'stdout', full)
    rc, _, err = _main(['--ckpt', ckpts['fixed'], '--chars', 20], capsys)
    monkeypatch.undo()
    try:
        full.close()
    except OSError:   # what it still holds cannot be written either
        pass
    assert rc == 1 and _one_error_line(err) and 'No space left' in err, err


def test_sample_cli_unavailable_device_is_one_line(ckpts, capsys):
    if torch.cuda.is_available():
        pytest.skip('CUDA is available here')
    rc, out, err = _main(['--ckpt', ckpts['fixed'], '--device', 'cuda'], capsys)
    assert rc == 2 and _one_error_line(err) and err.startswith('error: --device cuda')
    assert 'CUDA' in err


def test_sample_cli_empty_prompt_and_zero_chars(ckpts, capsys):
    rc, out, _ = _main(['--ckpt', ckpts['unigram'], '--prompt', '', '--chars', 10], capsys)
    assert rc == 0 and len(out) == 12 and out[0] == ' '
    rc, out, _ = _main(['--ckpt', ckpts['unigram'], '--prompt', 'abc', '--chars', 0], capsys)
    assert rc == 0 and out == 'abc\n'
    rc, out, _ = _main(['--ckpt', ckpts['unigram'], '--prompt', '  ', '--chars', 2], capsys)
    assert rc == 0 and len(out) == 4 and out[0] == ' '   # blank: as empty, a space


@pytest.mark.parametrize('prompt', ['###', '?!'])
def test_sample_cli_prompt_that_cleans_to_nothing_is_refused(ckpts, capsys, prompt):
    """A prompt none of whose characters survive the cleaning would generate unconditioned text
    as if it were the continuation: refused, one line naming --prompt, exit 2, nothing on stdout."""
    rc, out, err = _main(['--ckpt', ckpts['unigram'], '--prompt', prompt, '--chars', 2], capsys)
    assert rc == 2 and out == '' and _one_error_line(err), err
    assert err.startswith('error: --prompt') and 'keeps none of its characters' in err


def _train_tiny(root, capsys, *flags):
    """A tiny whitespace run of train.py (its own command line, in this process) on a small
    text → its ckpt.pt."""
    data = root / 'data'
    data.mkdir(exist_ok=True)
    text = ('the quick brown fox jumps over the lazy dog ' * 60).encode('ascii')
    alphabet = sorted(set(text.decode()))
    ids = np.array([alphabet.index(chr(c)) for c in text], dtype=np.uint8)
    for name, part in (('train', ids[:2000]), ('valid', ids[2000:2300]), ('test', ids[2300:])):
        part.tofile(data / f'{name}.bin')
    (data / 'meta.json').write_text(json.dumps(dict(alphabet=alphabet, vocab_size=len(alphabet),
                                                    space_id=alphabet.index(' '), dtype='uint8')))
    run = root / f'run{len(list(root.iterdir()))}'
    try:
        train.main(['--data', str(data), '--out', str(run), '--boundary', 'whitespace',
                    '--device', 'cpu', '--d-model', '32', '--n-head', '2', '--d-head', '16',
                    '--d-inner', '64', '--layers', '1,1,1', '--seq-len', '32', '--batch-size', '2',
                    '--warmup', '1', '--eval-interval', '2',
                    '--eval-window', '32', '--eval-step', '8', '--eval-max-chars', '100',
                    '--eval-batch-size', '8', '--log-interval', '1', *flags])
    except SystemExit as e:
        assert not e.code, capsys.readouterr().err
    capsys.readouterr()
    assert (run / 'ckpt.pt').is_file()
    return run / 'ckpt.pt'


def test_sample_cli_reads_a_checkpoint_written_by_train_py(tmp_path, capsys):
    """The contract with train.py: a 2-step tiny run's ckpt.pt samples, segments shown; the run
    is finished, so no note says otherwise."""
    ckpt = _train_tiny(tmp_path, capsys, '--max-steps', '2')
    rc, out, err = _main(['--ckpt', ckpt, '--prompt', 'The lazy', '--chars', 30,
                          '--show-segments', '--seed', 0], capsys)
    assert rc == 0 and 'unfinished' not in err, err
    text = out.rstrip('\n').replace('|', '').replace(sample.PROMPT_MARK, '')
    assert text.startswith('the lazy') and len(text) == 38
    assert out.count('|') == text.count(' ')


@pytest.mark.parametrize('flags, note', [
    (['--max-steps', '3'], r'note: checkpoint at step 1 of 3 \(unfinished run\)'),
    (['--flop-budget', '1e15'],
     r'note: checkpoint at step 1, (\S+) of 1e\+15 FLOPs \(unfinished run\)')])
def test_sample_cli_says_when_the_checkpoint_is_unfinished(tmp_path, capsys, flags, note):
    """A run stopped (--stop-step) before its --max-steps or --flop-budget: sampling its checkpoint
    says so in one stderr line (the FLOPs it spent, as train.py counted them), and still samples."""
    ckpt = _train_tiny(tmp_path, capsys, '--stop-step', '1', *flags)
    rc, out, err = _main(['--ckpt', ckpt, '--prompt', 'the', '--chars', 5], capsys)
    assert rc == 0 and len(out) == len('the') + 5 + 1
    said = re.fullmatch(note, err.strip())
    assert said, err
    if said.groups():
        spent = torch.load(ckpt, weights_only=False)['train_flops']
        assert float(said[1]) == pytest.approx(spent, rel=1e-2)


def test_sample_cli_loads_compiled_or_ddp_state_dicts(ckpts, capsys, tmp_path):
    """Parameter names saved from a torch.compile'd or DDP-wrapped model ('_orig_mod.',
    'module.') load."""
    good = torch.load(ckpts['gumbel'], weights_only=False)
    wrapped = {f'module._orig_mod.{k}': v for k, v in good['model'].items()}
    _write_ckpt(dict(good, model=wrapped), tmp_path / 'wrapped.pt')
    argv = ['--prompt', 'abc', '--chars', 20, '--seed', 2, '--show-segments']
    rc, want, _ = _main(['--ckpt', ckpts['gumbel']] + argv, capsys)
    rc, got, err = _main(['--ckpt', tmp_path / 'wrapped.pt'] + argv, capsys)
    assert rc == 0 and got == want, err


def test_sample_cli_bad_flags_are_one_line(ckpts, capsys):
    for extra in (['--top-k', '0'], ['--chars', '-3'], ['--temperature', '-1'],
                  ['--temperature', 'nan'], ['--temperature', 'inf'], ['--temperature', '1e400'],
                  ['--num-samples', 'x'], ['--seed', str(10 ** 23)], ['--threads', '100000'],
                  ['--chars', '1e3'], ['--device', 'nonsense'], ['--device', 'meta'],
                  ['--entropy-plot', '-']):
        rc, out, err = _main(['--ckpt', ckpts['fixed']] + extra, capsys)
        assert rc == 2 and out == '' and _one_error_line(err) and extra[0] in err, (extra, err)


# ---------------------------------------------------------------------------------------------
# Running out of memory, Ctrl-C
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize('flags', [['--chars', 10 ** 12], ['--num-samples', 10 ** 9]])
def test_sample_memory_is_priced_before_it_is_spent(ckpts, capsys, monkeypatch, flags):
    """A request whose key/value caches cannot fit (10^12 positions, 10^9 samples) is refused
    before any allocation: one line naming the flags to lower, exit 2."""
    def nothing_allocated(*args, **kwargs):
        raise AssertionError('generated')
    monkeypatch.setattr(sample, 'generate', nothing_allocated)
    rc, out, err = _main(['--ckpt', ckpts['fixed'], '--prompt', 'a'] + flags, capsys)
    assert rc == 2 and out == '' and _one_error_line(err), err
    assert 'GiB of memory' in err and 'free' in err and 'lower --chars or --num-samples' in err, err


def test_generation_bytes_bound_what_generating_takes(ckpts):
    """The price is an upper bound of what generating takes beyond the weights (peak CPU memory
    allocated by torch while the model generates), and grows with the prompt's square."""
    from torch.profiler import profile
    model, ckpt = checkpoint.load_checkpoint(ckpts['whitespace'])
    x = torch.randint(1, 27, (3, 300))
    with profile(profile_memory=True) as prof:
        model.generate(x, 50)
    peak = max(e.cpu_memory_usage for e in prof.key_averages())
    need = runtime.generation_bytes(model.cfg, 3, 300, 50)
    assert 0 < peak < need
    assert runtime.generation_bytes(model.cfg, 3, 600, 50) > 3 * need


def test_a_prompt_longer_than_the_training_sequences_keeps_its_end(ckpts, tmp_path, capsys):
    """A prompt longer than the checkpoint's training seq_len is cut to its last seq_len
    tokens, with a note: the sample continues the prompt's end."""
    state = checkpoint.read_checkpoint(ckpts['whitespace'])
    del state['path']
    state['args']['seq_len'] = 8
    path = _write_ckpt(state, tmp_path / 'ckpt.pt')
    rc, out, err = _main(['--ckpt', path, '--prompt', 'abc defgh ijklmnop', '--chars', 3,
                          '--greedy'], capsys)
    assert rc == 0 and out.startswith('ijklmnop') and len(out) == 8 + 3 + 1, (out, err)
    assert 'cut to its last 8 tokens (of 18)' in err


def test_sample_cli_ctrl_c_exits_130_keeping_only_finished_files(ckpts, tmp_path, capsys,
                                                                monkeypatch):
    """Ctrl-C while generating: exit 130, one line, no file. Ctrl-C while the plot is drawn: no
    plot and no temporary file. (The plot itself is stood in for: matplotlib, the optional extra,
    is not needed.)"""
    argv = ['--ckpt', ckpts['entropy'], '--prompt', 'the', '--chars', 20, '--seed', 1,
            '--entropy-plot', 'fig.png']

    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt

    class HalfPlot:   # a figure whose saving is interrupted half-way
        def savefig(self, path, **kwargs):
            open(path, 'w').write('half a plot')
            raise KeyboardInterrupt

    def main(argv):
        try:
            return _main(argv, capsys)
        except KeyboardInterrupt:
            pytest.fail('Ctrl-C escaped sample.main')
    monkeypatch.chdir(tmp_path)
    formats = SimpleNamespace(get_supported_filetypes=lambda: {'png': 'Portable Network Graphics'})
    monkeypatch.setitem(sys.modules, 'matplotlib.backend_bases',
                        SimpleNamespace(FigureCanvasBase=formats))
    monkeypatch.setattr(sample, 'import_pyplot', lambda flag: type('plt', (), {'close': print}))
    with monkeypatch.context() as m:
        m.setattr(sample, 'generate', ctrl_c)
        rc, out, err = main(argv)
    assert rc == 130 and out == '' and _one_error_line(err) and 'interrupted' in err, err
    assert os.listdir(tmp_path) == []
    monkeypatch.setattr(sample, 'entropy_figure', lambda *a, **kw: HalfPlot())
    rc, out, err = main(argv)
    assert rc == 130 and _one_error_line(err) and 'interrupted' in err.splitlines()[-1], err
    assert os.listdir(tmp_path) == []


def test_sample_cli_plot_without_matplotlib_is_one_line(ckpts, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, 'matplotlib', None)    # as if it were not installed
    monkeypatch.setitem(sys.modules, 'matplotlib.backend_bases', None)
    monkeypatch.chdir(tmp_path)
    rc, out, err = _main(['--ckpt', ckpts['fixed'], '--chars', 5, '--entropy-plot', 'fig.png'],
                         capsys)
    assert rc == 1 and out == '' and _one_error_line(err), err
    assert '--entropy-plot needs matplotlib' in err and 'pip install' in err
    assert os.listdir(tmp_path) == []


@pytest.mark.plots
def test_sample_cli_plot_in_an_unknown_format_is_refused_before_generating(
        ckpts, tmp_path, capsys, monkeypatch):
    pytest.importorskip('matplotlib')
    monkeypatch.chdir(tmp_path)
    rc, out, err = _main(['--ckpt', ckpts['fixed'], '--chars', 5, '--entropy-plot',
                          'fig.notaformat'], capsys)
    assert rc == 1 and out == '' and err.count('\n') == 1 and 'writes no .notaformat' in err, err
    assert os.listdir(tmp_path) == []


class _Pickled:
    """A Python object beyond tensors and containers, as a checkpoint might carry."""


def test_sample_cli_unsafe_checkpoint_names_the_flag_that_lifts_the_refusal(ckpts, tmp_path,
                                                                            capsys):
    good = torch.load(ckpts['fixed'], weights_only=False)
    _write_ckpt(dict(good, extra=_Pickled()), tmp_path / 'pickled.pt')
    rc, out, err = _main(['--ckpt', tmp_path / 'pickled.pt', '--chars', 5], capsys)
    assert rc == 1 and out == '' and _one_error_line(err), err
    assert '_Pickled' in err and '--trust-ckpt' in err, err
    rc, out, err = _main(['--ckpt', tmp_path / 'pickled.pt', '--chars', 5, '--trust-ckpt'], capsys)
    assert rc == 0 and len(out) == 7, err


# ---------------------------------------------------------------------------------------------
# Fuzz: random flags and damaged checkpoints keep the command line's contract
# ---------------------------------------------------------------------------------------------
# flag: (values that run, values that must be refused); an example takes a refused one in four times
_FLAG_VALUES = {
    '--chars': (['0', '7', '3'], ['-1', 'x', 'nan', '1e3', str(10 ** 12), '']),
    '--num-samples': (['1', '2'], ['0', '-2', 'inf', str(10 ** 9)]),
    '--temperature': (['0', '0.5', '1', '1e-300', '1e308'],
                      ['nan', 'inf', '-inf', '-1', '1e400', 'abc']),
    '--top-k': (['1', '5', '100000'], ['0', '-1', 'nan']),
    '--seed': (['0', '1', str(2 ** 63 - 1)], [str(2 ** 63), '-1', 'nan', str(10 ** 30)]),
    '--device': (['cpu'], ['cuda:7', 'nonsense', 'meta', 'mps']),
    '--threads': (['1'], ['0', str(10 ** 6), '1.5']),
}
_OUTPUTS = (['fig.png'], ['fig.xyz', '', '-'])
_SWITCHES = ['--greedy', '--show-segments', '--trust-ckpt']


def _damaged_checkpoint(data, good, root, odd):
    """A checkpoint path: the good one, cut short, with flipped bytes, or an odd path."""
    kind = data.draw(st.sampled_from(['good'] * 3 + ['cut', 'flipped', 'unsealed-flipped',
                                                     'unsealed-flipped', 'odd']),
                     label='checkpoint')
    if kind == 'good':
        return good
    if kind == 'odd':
        return odd[data.draw(st.sampled_from(sorted(odd)), label='odd path')]
    raw = bytearray(good.read_bytes())
    if kind == 'unsealed-flipped':   # no checksum to catch the damage: it reaches the weights
        raw = bytearray(_write_ckpt(torch.load(good, weights_only=False), root / 'unsealed.pt',
                                    sealed=False)
                        .read_bytes())
    if kind == 'cut':
        raw = raw[:data.draw(st.integers(0, len(raw) - 1), label='cut at')]
    else:
        for at in data.draw(st.lists(st.integers(0, len(raw) - 1), min_size=1, max_size=8),
                            label='flipped'):
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
    uncaught exception; a failure is one `error:` line; no temporary file is left, and an output
    file that exists is whole."""
    with tempfile.TemporaryDirectory() as tmp, no_hang(60):
        root = Path(tmp)
        monkeypatch.chdir(root)   # '-' and '' name files here, if anything
        odd = _odd_paths(root)
        ckpt = _damaged_checkpoint(data, ckpts[data.draw(st.sampled_from(MODES), label='mode')],
                                   root, odd)
        argv = ['--ckpt', str(ckpt), '--prompt', data.draw(st.text(max_size=12), label='prompt'),
                '--chars', '7']
        for flag in data.draw(st.lists(st.sampled_from(sorted(_FLAG_VALUES)), unique=True,
                                       max_size=4)):
            good, bad = _FLAG_VALUES[flag]
            refused = data.draw(st.integers(0, 3), label=f'{flag} refused') == 0
            argv += [flag, data.draw(st.sampled_from(bad if refused else good), label=flag)]
        outputs = {}
        for flag in ['--entropy-plot']:
            if data.draw(st.booleans(), label=f'use {flag}'):
                refused = data.draw(st.integers(0, 3), label=f'{flag} refused') == 0
                names = _OUTPUTS[1] + sorted(odd) if refused else _OUTPUTS[0]
                name = data.draw(st.sampled_from(names), label=flag)
                outputs[flag] = str(odd.get(name, root / name)) if name not in ('-', '') else name
                argv += [flag, outputs[flag]]
        argv += data.draw(st.lists(st.sampled_from(_SWITCHES), unique=True, max_size=3))
        if data.draw(st.integers(0, 9), label='Ctrl-C') == 0:
            monkeypatch.setattr(sample, 'generate', _ctrl_c)
        try:
            rc, out, err = _main(argv, capsys)
        finally:
            monkeypatch.undo()
        event(f'exit {rc}')   # --hypothesis-show-statistics: how many examples got how far
        assert_cli_contract(rc, err, argv)
        assert rc or 'error:' not in err, (argv, err)
        left = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if '.tmp' in f]
        assert not left, (argv, left)
        whole = {'--entropy-plot': lambda b: b.startswith(b'\x89PNG')}
        for flag, path in outputs.items():
            if path.startswith(str(root / 'fig')):
                ok = not os.path.exists(path) or whole[flag](Path(path).read_bytes())
                assert ok, (argv, flag)


def test_sample_shows_progress_on_a_terminal_only(ckpts, capsys, monkeypatch):
    """Generating shows a progress bar (tqdm) where stderr is a terminal, and none in a file."""
    argv = ['--ckpt', ckpts['whitespace'], '--prompt', 'the', '--chars', 30]
    rc, out, err = _main(argv, capsys)
    assert rc == 0 and 'token/s' not in err, err
    monkeypatch.setattr(sys.stderr, 'isatty', lambda: True)
    rc, out, err = _main(argv, capsys)
    assert rc == 0 and '/31 [' in err and 'token/s' in err, err


# ---------------------------------------------------------------------------------------------
# Encodings: bytes and text as it is
# ---------------------------------------------------------------------------------------------
BYTES = [chr(i) for i in range(256)]


def _bytes_ckpt(root, mode='fixed'):
    """A byte-level checkpoint (vocab 256, the space byte 32) of conftest's tiny model."""
    model = tiny_model(mode, vocab=256, seed=1, whitespace_id=32)
    return _save_ckpt(root / f'bytes-{mode}' / 'ckpt.pt', mode, vocab_size=256, alphabet=BYTES,
                      model=model, encoding='bytes')


def test_bytes_are_decoded_once_their_character_completes():
    """Each byte's piece is the text it completes: '' inside a character, U+FFFD for bytes that
    never form one; a separator inside a character follows it."""
    vocab = dict(alphabet=BYTES, encoding='bytes')
    ids = sample.encode_prompt('aש', vocab)
    assert ids == list('aש'.encode()) and len(ids) == 3
    assert sample.decode(ids, vocab) == ['a', '', 'ש']
    assert sample.decode([0xFF, 0x61, 0xD7], vocab) == ['\ufffd', 'a', '\ufffd']
    assert sample.show_segments(['a', '', 'ש'], [0, 1, 0], prompt_len=2) == 'aש|»'
    assert sample.show_segments(['a', '', 'ש'], [1, 1, 1]) == 'a|ש||'


@settings(max_examples=200)
@given(data=st.data())
def test_a_prompt_ending_inside_a_character_is_marked_at_its_end(data):
    """Bytes: the pieces join to the bytes' text, and the prompt's end mark follows the prompt's
    own text: its whole characters, then one character more only where the prompt ends inside
    one (U+FFFD where the continuation breaks it, e.g. a Latin-1 'caf\\xe9' then ' ', or the
    character the continuation completes), never a character of the continuation alone."""
    vocab = dict(alphabet=BYTES, encoding='bytes')
    # UTF-8's lead, continuation and never-valid bytes, and ASCII, all likely
    byte = st.sampled_from([0x20, 0x61, 0x80, 0xA9, 0xBF, 0xC3, 0xD7, 0xE2, 0xE9, 0xF0, 0xFF])
    ids = data.draw(st.lists(byte, min_size=1, max_size=12))
    n = data.draw(st.integers(1, len(ids)))
    pieces = sample.decode(ids, vocab)
    assert ''.join(pieces) == bytes(ids).decode('utf-8', 'replace')
    shown = sample.show_segments(pieces, None, prompt_len=n)
    before = shown.split(sample.PROMPT_MARK)[0]
    decoder = sample.UTF8('replace')
    whole = decoder.decode(bytes(ids[:n]))    # the prompt's complete characters
    inside = decoder.getstate()[0] != b''     # the prompt ends inside a character
    assert before.startswith(whole) and len(before) == len(whole) + inside, (ids, n, shown)
    if inside and ids[n:n + 1] == [0x20]:
        assert before == whole + '\ufffd' and shown[len(before) + 1] == ' '
    assert sample.decode(list(b'caf\xe9 au'), vocab) == ['c', 'a', 'f', '\ufffd', ' ', 'a', 'u']


def test_sample_cli_bytes_checkpoint_prints_text(tmp_path, capsys):
    """A byte-level checkpoint: a Hebrew prompt (2 bytes a letter) is its UTF-8 bytes, not
    cleaned; the output is the generated bytes decoded, the prompt whole in it: the greedy
    continuation is model.generate's, which recomputing the whole sequence gives too. The
    segments' marks reassemble the text."""
    ckpt = _bytes_ckpt(tmp_path)
    prompt = 'שלום, עולם'
    argv = ['--ckpt', ckpt, '--prompt', prompt, '--chars', 40, '--greedy']
    rc, out, err = _main(argv, capsys)
    assert rc == 0 and err == '', err
    ids = list(prompt.encode())
    model = tiny_model('fixed', vocab=256, seed=1, whitespace_id=32)
    want = model.generate(torch.tensor([ids]), 40, greedy=True)[0].tolist()
    seq = torch.tensor([ids])   # the cached generation is the full forward's, recomputed
    with torch.no_grad():
        for _ in range(8):
            seq = torch.cat([seq, model(seq).logits[:, -1:].argmax(-1)], 1)
    assert seq[0].tolist() == want[:len(ids) + 8]
    assert out == bytes(want).decode('utf-8', 'replace') + '\n' and out.startswith(prompt)
    rc, shown, err = _main(argv + ['--show-segments'], capsys)
    assert rc == 0 and shown.replace('|', '').replace(sample.PROMPT_MARK, '') == out, err


def test_sample_cli_text_as_is_maps_unseen_characters_to_the_unknown_id(tmp_path, capsys):
    """A 'chars' checkpoint: the prompt NFC-normalised, not cleaned (case kept); a character
    outside the alphabet is id 0, the unknown, with a note."""
    alphabet = ['\ufffd', ' ', 'T', 'h', 'e', 'é'] + list('abcdfgijklmnopqrstuvwxyz')
    ckpt = _save_ckpt(tmp_path / 'chars' / 'ckpt.pt', 'whitespace', vocab_size=len(alphabet),
                      alphabet=alphabet, encoding='chars')
    vocab = torch.load(ckpt, weights_only=False)['vocab']
    assert sample.encode_prompt('The e\u0301!', vocab) == [2, 3, 4, 1, 5, 0]
    capsys.readouterr()
    rc, out, err = _main(['--ckpt', ckpt, '--prompt', 'The Café!', '--chars', 5], capsys)
    assert rc == 0 and out.startswith('The \ufffdafé\ufffd'), out
    assert err.startswith("note: the prompt's '!', 'C' are not in the checkpoint's alphabet"), err


def test_sample_cli_import_flag_is_accepted(ckpts, tmp_path, capsys):
    """--import FILE runs the file (its register_source) before the flags are read; a name that
    cannot be imported is one error line."""
    source = tmp_path / 'mine.py'
    source.write_text("print('imported', file=__import__('sys').stderr)\n")
    rc, out, err = _main(['--ckpt', ckpts['fixed'], '--chars', 3, '--import', source], capsys)
    assert rc == 0 and 'imported' in err, err
    rc, out, err = _main(['--ckpt', ckpts['fixed'], '--import', 'no_such_module_x'], capsys)
    assert rc != 0 and _one_error_line(err) and 'no_such_module_x' in err, err


def test_sample_shows_progress_lines_where_stderr_is_no_terminal(ckpts, capsys, monkeypatch):
    """With stderr a file or pipe (no progress bar), a long generation still says how far it
    is: a line every sample.PROGRESS_SECONDS (0 here: a line per token) with the count; the
    text on stdout is the same as without them."""
    argv = ['--ckpt', ckpts['fixed'], '--prompt', 'a', '--chars', '5', '--device', 'cpu']
    rc, quiet_out, quiet_err = _main(argv, capsys)
    assert rc == 0 and 'generated' not in quiet_err
    monkeypatch.setattr(sample, 'PROGRESS_SECONDS', 0)
    rc, out, err = _main(argv, capsys)
    counts = re.findall(r'^generated (\d+) of 6 tokens$', err, re.M)
    assert rc == 0 and out == quiet_out
    assert [int(c) for c in counts] == list(range(len(counts))) and len(counts) >= 5, err
