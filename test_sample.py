"""Tests of sample.py: segment display, the CLI end to end and its errors.

Run:   python -m pytest -q test_sample.py
"""


import dataclasses
import json
import math
import os
import random
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import sample
import train
from conftest import (_SAMPLE_ROOT, _SAMPLE_MODES, _SAMPLE_ALPHABET, _SAMPLE_SETTINGS, _sample_tiny_model, _sample_full_forward)


# ---------------------------------------------------------------------------------------------
# 3. Segment display
# ---------------------------------------------------------------------------------------------
@settings(max_examples=50, **_SAMPLE_SETTINGS)
@given(data=st.data())
def test_sample_segment_display_reassembles(data):
    text = data.draw(st.text(alphabet=''.join(_SAMPLE_ALPHABET), max_size=60))
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


# ---------------------------------------------------------------------------------------------
# 4. sample.py end to end
# ---------------------------------------------------------------------------------------------
def _sample_save_ckpt(path, mode, vocab_size=27, rate=0.3):
    """A checkpoint with train.py's keys: model, optimizer, scaler, step, epoch, pos, config (asdict),
    vocab (alphabet, vocab_size, space_id), args, schedule, rng (numpy's state included)."""
    model = _sample_tiny_model(mode, vocab=vocab_size, seed=1, rate=rate)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    state = dict(model=model.state_dict(), optimizer=opt.state_dict(), scaler={}, step=0, epoch=0, pos=0,
                 config=dataclasses.asdict(model.cfg),
                 vocab=dict(alphabet=_SAMPLE_ALPHABET[:vocab_size], vocab_size=vocab_size, space_id=0),
                 args=dict(boundary=mode, data='data/text8', layers='1,1,1', seed=1337),
                 schedule=dict(lr=1e-3, warmup=2, max_steps=10),
                 rng=dict(torch=torch.get_rng_state(), numpy=np.random.get_state(), python=random.getstate(),
                          cuda=None))
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)
    return path


@pytest.fixture(scope='module')
def _sample_ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp('sample_runs')
    return {mode: _sample_save_ckpt(root / f'tiny-{mode}' / 'ckpt.pt', mode) for mode in _SAMPLE_MODES}


def _sample_env():
    return dict(os.environ, OMP_NUM_THREADS='1', MKL_NUM_THREADS='1')


def _sample_main(argv, capsys):
    rc = sample.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize('mode', _SAMPLE_MODES)
def test_sample_cli_every_mode_shows_segments_that_reassemble(mode, _sample_ckpts, capsys):
    prompt = 'The History of'
    rc, out, err = _sample_main(['--ckpt', _sample_ckpts[mode], '--prompt', prompt, '--chars', 40, '--seed', 3,
                                 '--temperature', 0.8, '--top-k', 20, '--show-segments', '--device', 'cpu'],
                                capsys)
    assert rc == 0, err
    shown = out.rstrip('\n')
    text = shown.replace('|', '')
    assert text.startswith(prompt.lower()) and len(text) == len(prompt) + 40
    assert set(text) <= set(_SAMPLE_ALPHABET)
    rc, plain, _ = _sample_main(['--ckpt', _sample_ckpts[mode], '--prompt', prompt, '--chars', 40, '--seed', 3,
                                 '--temperature', 0.8, '--top-k', 20], capsys)
    assert plain.rstrip('\n') == text                     # marking segments does not change the text
    if mode == 'none':
        assert '|' not in shown and 'no segments' in err
    else:
        assert shown.count('|') > 0
        model = _sample_tiny_model(mode, vocab=27, seed=1, rate=0.3)
        ids = torch.tensor([[_SAMPLE_ALPHABET.index(c) for c in text]])
        _, b, _ = _sample_full_forward(model, ids)
        assert sample.show_segments(text, b[0].tolist()) == shown, "the marks are not the model's boundaries"
    if mode == 'whitespace':
        assert shown.count('|') == text.count(' ') and ' |' * text.count(' ') == re.sub(r'[^ |]', '', shown)


def test_sample_cli_seed_reproducible_across_processes(_sample_ckpts, capsys):
    """Same --seed → same text, in this process and in a fresh `python sample.py` process; another seed
    gives another text; several samples come as one batch, separated by a line of dashes."""
    argv = ['--ckpt', _sample_ckpts['entropy'], '--prompt', 'anarchism', '--chars', 60, '--seed', 9,
            '--num-samples', 2, '--temperature', 1.0, '--device', 'cpu']
    rc, first, _ = _sample_main(argv, capsys)
    assert rc == 0
    rc, again, _ = _sample_main(argv, capsys)
    assert again == first
    samples = first.rstrip('\n').split('\n' + '-' * 40 + '\n')
    assert len(samples) == 2 and all(s.startswith('anarchism') and len(s) == 69 for s in samples)
    assert samples[0] != samples[1]
    rc, other, _ = _sample_main(argv[:-4] + ['--seed', 10, '--device', 'cpu'], capsys)
    assert other != first
    p = subprocess.run([sys.executable, 'sample.py'] + [str(a) for a in argv], cwd=_SAMPLE_ROOT,
                       capture_output=True, text=True, timeout=120, env=_sample_env())
    assert p.returncode == 0, p.stderr
    assert p.stdout == first


def test_sample_cli_greedy_is_generate_greedy(_sample_ckpts, capsys):
    rc, out, _ = _sample_main(['--ckpt', _sample_ckpts['gumbel'], '--prompt', 'the', '--chars', 30, '--greedy',
                               '--seed', 1], capsys)
    assert rc == 0
    rc, out0, _ = _sample_main(['--ckpt', _sample_ckpts['gumbel'], '--prompt', 'the', '--chars', 30,
                                '--temperature', 0, '--seed', 2], capsys)
    assert out0 == out
    model = _sample_tiny_model('gumbel', vocab=27, seed=1, rate=0.3)
    x = torch.tensor([[_SAMPLE_ALPHABET.index(c) for c in 'the']])
    want = ''.join(_SAMPLE_ALPHABET[i] for i in model.generate(x, 30, greedy=True)[0].tolist())
    assert out == want + '\n'


def test_sample_cli_entropy_trace_and_plot(_sample_ckpts, capsys, tmp_path):
    ckpt = _sample_ckpts['entropy']
    argv = ['--ckpt', ckpt, '--prompt', 'the cat', '--chars', 30, '--seed', 4]
    rc, shown, _ = _sample_main(argv + ['--show-segments'], capsys)
    rc, tsv, _ = _sample_main(argv + ['--entropy-trace'], capsys)
    assert rc == 0
    lines = tsv.rstrip('\n').split('\n')
    assert lines[0].split('\t') == ['pos', 'char', 'entropy_bits', 'boundary']
    rows = [line.split('\t') for line in lines[1:]]
    assert len(rows) == 37 and all(len(r) == 4 for r in rows)
    assert [int(r[0]) for r in rows] == list(range(37))
    text = ''.join(r[1] for r in rows)
    assert sample.show_segments(text, [r[3] == '1' for r in rows]) == shown.rstrip('\n')
    assert all(0.0 <= float(r[2]) <= math.log2(27) + 1e-3 for r in rows)
    # To a file, the text still printed.
    rc, out, _ = _sample_main(argv + ['--entropy-trace', tmp_path / 't.tsv'], capsys)
    assert (tmp_path / 't.tsv').read_text() == tsv and out == text + '\n'
    pytest.importorskip('matplotlib')
    rc, out, err = _sample_main(argv + ['--chars', 100, '--entropy-plot', tmp_path / 'fig.png'], capsys)
    assert rc == 0, err
    assert (tmp_path / 'fig.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


def test_sample_cli_bad_prompt_is_one_line_error(_sample_ckpts, capsys):
    rc, out, err = _sample_main(['--ckpt', _sample_ckpts['whitespace'], '--prompt', 'Née 1999!'], capsys)
    assert rc == 1 and out == ''
    assert err.count('\n') == 1 and err.startswith('error: ') and 'Traceback' not in err
    for c in ("'é'", "'1'", "'9'", "'!'"):
        assert c in err
    assert "'n'" not in err                 # 'N' is lower-cased first: text8 is lower-case
    # The same through a real process: exit code and stderr of the command line.
    p = subprocess.run([sys.executable, 'sample.py', '--ckpt', str(_sample_ckpts['whitespace']), '--prompt', 'ça'],
                       cwd=_SAMPLE_ROOT, capture_output=True, text=True, timeout=120, env=_sample_env())
    assert p.returncode == 1 and p.stdout == ''
    assert p.stderr.count('\n') == 1 and p.stderr.startswith('error: ') and "'ç'" in p.stderr


def test_sample_cli_checkpoint_errors_are_one_line(_sample_ckpts, capsys, tmp_path):
    good = torch.load(_sample_ckpts['fixed'], weights_only=False)
    corrupt = tmp_path / 'corrupt.pt'
    corrupt.write_bytes(_sample_ckpts['fixed'].read_bytes()[:2000])
    (tmp_path / 'text.pt').write_text('not a checkpoint')
    torch.save({k: v for k, v in good.items() if k != 'vocab'}, tmp_path / 'novocab.pt')
    torch.save(dict(good, config=dict(good['config'], boundary='entropy')), tmp_path / 'mismatch.pt')
    torch.save(dict(good, config=dict(good['config'], layers=(1, 0, 1))), tmp_path / 'badcfg.pt')
    torch.save(dict(good, config=dict(good['config'], d_inner=48)), tmp_path / 'shapes.pt')
    torch.save([1, 2, 3], tmp_path / 'list.pt')
    cases = {tmp_path / 'missing' / 'ckpt.pt': 'no checkpoint', tmp_path / 'empty-run-dir': 'no checkpoint',
             corrupt: 'corrupt', tmp_path / 'text.pt': 'corrupt', tmp_path / 'novocab.pt': 'vocab',
             tmp_path / 'mismatch.pt': 'do not fit', tmp_path / 'badcfg.pt': 'invalid', tmp_path / 'list.pt': 'dict',
             tmp_path / 'shapes.pt': 'size mismatch'}
    (tmp_path / 'empty-run-dir').mkdir()
    for path, words in cases.items():
        rc, out, err = _sample_main(['--ckpt', path, '--prompt', 'a'], capsys)
        assert rc == 1 and out == '', path
        assert err.count('\n') == 1 and err.startswith('error: ') and words in err, (path, err)
    # A run directory works as --ckpt.
    rc, out, err = _sample_main(['--ckpt', _sample_ckpts['fixed'].parent, '--prompt', 'a', '--chars', 5], capsys)
    assert rc == 0 and len(out) == 7


def test_sample_cli_unavailable_device_is_one_line(_sample_ckpts, capsys):
    if torch.cuda.is_available():
        pytest.skip('CUDA is available here')
    rc, out, err = _sample_main(['--ckpt', _sample_ckpts['fixed'], '--device', 'cuda'], capsys)
    assert rc == 1 and err.count('\n') == 1 and err.startswith('error: ') and 'CUDA' in err


def test_sample_cli_empty_prompt_and_zero_chars(_sample_ckpts, capsys):
    rc, out, _ = _sample_main(['--ckpt', _sample_ckpts['unigram'], '--prompt', '', '--chars', 10], capsys)
    assert rc == 0 and len(out) == 12 and out[0] == ' '
    rc, out, _ = _sample_main(['--ckpt', _sample_ckpts['unigram'], '--prompt', 'abc', '--chars', 0], capsys)
    assert rc == 0 and out == 'abc\n'


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
    rc, out, err = _sample_main(['--ckpt', run / 'ckpt.pt', '--prompt', 'the lazy', '--chars', 30,
                                 '--show-segments', '--seed', 0], capsys)
    assert rc == 0, err
    text = out.rstrip('\n').replace('|', '')
    assert text.startswith('the lazy') and len(text) == 38
    assert out.count('|') == text.count(' ')


def test_sample_cli_loads_compiled_or_ddp_state_dicts(_sample_ckpts, capsys, tmp_path):
    """Parameter names saved from a torch.compile'd or DDP-wrapped model ('_orig_mod.', 'module.') load."""
    good = torch.load(_sample_ckpts['gumbel'], weights_only=False)
    wrapped = {f'module._orig_mod.{k}': v for k, v in good['model'].items()}
    torch.save(dict(good, model=wrapped), tmp_path / 'wrapped.pt')
    argv = ['--prompt', 'abc', '--chars', 20, '--seed', 2, '--show-segments']
    rc, want, _ = _sample_main(['--ckpt', _sample_ckpts['gumbel']] + argv, capsys)
    rc, got, err = _sample_main(['--ckpt', tmp_path / 'wrapped.pt'] + argv, capsys)
    assert rc == 0 and got == want, err


@pytest.mark.parametrize('extra', [['--top-k', '0'], ['--chars', '-3'], ['--temperature', '-1'],
                                   ['--num-samples', 'x'], ['--seed', str(10 ** 23)], ['--threads', '100000']])
def test_sample_cli_bad_flags_are_one_line(_sample_ckpts, capsys, extra):
    with pytest.raises(SystemExit) as e:
        sample.main(['--ckpt', str(_sample_ckpts['fixed'])] + extra)
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == '' and err.count('\n') == 1 and err.startswith('error: ')


# ---------------------------------------------------------------------------------------------
# 5. Requests too large for memory, running out of memory, Ctrl-C
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize('request_', [['--chars', '1000000000'], ['--num-samples', '100000000', '--chars', '50']])
def test_sample_cli_request_beyond_memory_is_refused_in_one_line(_sample_ckpts, tmp_path, capsys, monkeypatch,
                                                                 request_):
    """--chars 1e9 or --num-samples 1e8 is refused before anything is allocated or written, naming
    the flags and the most that fits (the first through a real `python sample.py`)."""
    argv = ['--ckpt', _sample_ckpts['entropy'], '--prompt', 'the', '--entropy-trace', 't.tsv'] + request_
    if request_[0] == '--chars':
        p = subprocess.run([sys.executable, str(_SAMPLE_ROOT / 'sample.py')] + [str(a) for a in argv],
                           cwd=tmp_path, capture_output=True, text=True, timeout=120, env=_sample_env())
        rc, out, err = p.returncode, p.stdout, p.stderr
    else:
        monkeypatch.chdir(tmp_path)
        rc, out, err = _sample_main(argv, capsys)
    assert rc == 1 and out == '', err
    assert err.count('\n') == 1 and err.startswith('error: ') and 'GiB' in err, err
    most = re.search(r'at most ([\d,]+) --chars with --num-samples \d+, or at most ([\d,]+) --num-samples', err)
    assert most, err
    allowed = int(most.group(1 if request_[0] == '--chars' else 2).replace(',', ''))
    assert 0 < allowed < int(request_[1])       # a smaller request of the same kind would fit
    assert os.listdir(tmp_path) == []           # no trace, no temporary file


def test_sample_memory_estimate_covers_the_caches():
    """The estimate behind the refusal counts at least the key/value caches prefill allocates."""
    model = _sample_tiny_model('whitespace', vocab=27)
    x = torch.randint(1, 27, (32, 7))
    _, state = model.prefill(x, capacity=7 + 50)
    # one KVCache per stage (dict), or per layer in a list per stack
    caches = state.caches.values() if isinstance(state.caches, dict) else [c for s in state.caches for c in s]
    cache_bytes = sum((c.k.numel() + c.v.numel()) * c.k.element_size() for c in caches)
    est = sample.generation_bytes(model.cfg, 32, 7, 50)
    assert cache_bytes <= est <= 2 * cache_bytes
    assert sample.generation_bytes(model.cfg, 32, 7, 100) > est and sample.generation_bytes(model.cfg, 64, 7, 50) > est


def test_sample_out_of_memory_is_one_line(_sample_ckpts, capsys, monkeypatch):
    """Where the estimate lets a request through that still cannot be allocated: one line, exit 1."""
    monkeypatch.setattr(sample, 'check_request', lambda *a: None)
    rc, out, err = _sample_main(['--ckpt', _sample_ckpts['fixed'], '--prompt', 'a', '--chars', 10 ** 12],
                                capsys)
    assert rc == 1 and out == '' and err.count('\n') == 1 and err.startswith('error: out of memory'), err


def test_sample_cli_ctrl_c_exits_130_keeping_only_finished_files(_sample_ckpts, tmp_path, capsys, monkeypatch):
    """Ctrl-C while generating: exit 130, one line, no file. Ctrl-C while the plot is drawn: the
    finished trace is kept whole, no plot and no temporary file."""
    argv = ['--ckpt', _sample_ckpts['entropy'], '--prompt', 'the', '--chars', 20, '--seed', 1,
            '--entropy-trace', 't.tsv', '--entropy-plot', 'fig.png']

    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt

    def half_plot(path, *args, **kwargs):
        open(path, 'w').write('half a plot')
        raise KeyboardInterrupt
    def main(argv):
        try:
            return _sample_main(argv, capsys)
        except KeyboardInterrupt:
            pytest.fail('Ctrl-C escaped sample.main')
    monkeypatch.chdir(tmp_path)
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


@pytest.mark.parametrize('flag, path, words', [('--entropy-plot', 'fig.notaformat', 'writes no .notaformat'),
                                               ('--entropy-plot', 'no/such/folder/fig.png', 'does not exist'),
                                               ('--entropy-trace', 'no/such/folder/t.tsv', 'does not exist')])
def test_sample_cli_unwritable_output_is_refused_before_generating(_sample_ckpts, tmp_path, capsys, monkeypatch,
                                                                   flag, path, words):
    """An output file that cannot be written is refused before any text is generated or printed."""
    pytest.importorskip('matplotlib')
    monkeypatch.chdir(tmp_path)
    rc, out, err = _sample_main(['--ckpt', _sample_ckpts['fixed'], '--chars', 5, flag, path], capsys)
    assert rc == 1 and out == '' and err.count('\n') == 1 and err.startswith('error: ') and words in err, err
    assert os.listdir(tmp_path) == []


def test_sample_cli_plot_without_extension_is_a_png(_sample_ckpts, tmp_path, capsys, monkeypatch):
    pytest.importorskip('matplotlib')
    monkeypatch.chdir(tmp_path)
    rc, out, err = _sample_main(['--ckpt', _sample_ckpts['fixed'], '--chars', 5, '--entropy-plot', 'fig'], capsys)
    assert rc == 0, err
    assert os.listdir(tmp_path) == ['fig'] and (tmp_path / 'fig').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


class _Pickled:
    """A Python object beyond tensors and containers, as a checkpoint might carry."""


def test_sample_cli_unsafe_checkpoint_names_the_flag_that_lifts_the_refusal(_sample_ckpts, tmp_path, capsys):
    good = torch.load(_sample_ckpts['fixed'], weights_only=False)
    torch.save(dict(good, extra=_Pickled()), tmp_path / 'pickled.pt')
    rc, out, err = _sample_main(['--ckpt', tmp_path / 'pickled.pt', '--chars', 5], capsys)
    assert rc == 1 and out == '' and err.count('\n') == 1 and '_Pickled' in err and '--trust-ckpt' in err, err
    rc, out, err = _sample_main(['--ckpt', tmp_path / 'pickled.pt', '--chars', 5, '--trust-ckpt'], capsys)
    assert rc == 0 and len(out) == 7, err
