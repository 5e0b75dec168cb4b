"""Tests of cached generation (dynpool prefill/decode/generate) and of sample.py.

Run:   python -m pytest -q test_sample.py        (about 20 s on 2 CPU cores)
CI:    CI=1 python -m pytest -q test_sample.py   (hypothesis derandomized)

  1. cache parity: prefill + one decode per character gives the full forward's logits and boundaries,
     for every boundary mode, across many segment closings and prompts shorter than one segment
  2. generate(greedy=True) equals an argmax loop over the full forward (no cache);
     sample.sample takes exactly generate's steps for a seed
  3. the segment display reassembles to the text
  4. sample.py end to end on tiny checkpoints in train.py's format (and one written by train.py itself):
     reproducible for a seed, all six modes, entropy trace and plot, one-line errors
"""
import dataclasses
import json
import math
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import sample
import train
from dynpool import Config, DynamicPoolingLM

_SAMPLE_ROOT = Path(__file__).parent
_SAMPLE_MODES = ['none', 'fixed', 'whitespace', 'unigram', 'entropy', 'gumbel']
_SAMPLE_PREDICTOR_MODES = ['unigram', 'entropy', 'gumbel']
_SAMPLE_V = 8        # vocabulary of the parity tests; id 0 is the space
_SAMPLE_ALPHABET = [' '] + [chr(ord('a') + i) for i in range(26)]   # text8's, space_id 0
_SAMPLE_SETTINGS = dict(deadline=None, derandomize=bool(os.environ.get('CI')), print_blob=True,
                        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                               HealthCheck.function_scoped_fixture])

# One thread: these models are tiny, and two threads on 2 shared, busy cores are ~10x slower, not faster.
torch.set_num_threads(1)


# ---------------------------------------------------------------------------------------------
# Tiny random models
# ---------------------------------------------------------------------------------------------
def _sample_predictor_linear(model):
    """The boundary predictor's final Linear(., 1)."""
    cands = [m for name, m in model.named_modules()
             if isinstance(m, nn.Linear) and m.out_features == 1 and ('pred' in name or 'bound' in name)]
    assert cands, "no boundary predictor Linear(., 1) found"
    return cands[-1]


def _sample_tokens(gen, n, L, vocab, p_space=0.3):
    x = torch.randint(1, vocab, (n, L), generator=gen)
    return torch.where(torch.rand(n, L, generator=gen) < p_space, torch.zeros_like(x), x)


_SAMPLE_MODEL_CACHE = {}


def _sample_tiny_model(mode, vocab=_SAMPLE_V, seed=0, rate=0.3, **extra):
    """d_model 32, 2 heads x 16, d_inner 64, layers (1, 1, 1), dropout off, eval mode. Predictor modes get
    strong predictor weights and a bias found by bisection so that about `rate` of tokens close a segment.
    `extra`: more Config fields."""
    key = (mode, vocab, seed, rate, tuple(sorted(extra.items())))
    if key in _SAMPLE_MODEL_CACHE:
        return _SAMPLE_MODEL_CACHE[key]
    torch.manual_seed(seed)
    cfg = Config(vocab_size=vocab, d_model=32, n_head=2, d_head=16, d_inner=64, dropout=0.0, dropatt=0.0,
                 layers=(1, 1, 1), boundary=mode, fixed_factor=3, whitespace_id=0, **extra)
    model = DynamicPoolingLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.5)     # peaked predictions: argmax ties are out of reach
        if mode in _SAMPLE_PREDICTOR_MODES:
            lin = _sample_predictor_linear(model)
            lin.weight.normal_(0.0, 3.0 / math.sqrt(lin.in_features))
            x = _sample_tokens(torch.Generator().manual_seed(seed + 1), 4, 128, vocab)
            lo, hi = -20.0, 20.0
            for _ in range(30):
                lin.bias.fill_((lo + hi) / 2)
                frac = model(x).boundaries.float().mean().item()
                lo, hi = ((lo + hi) / 2, hi) if frac < rate else (lo, (lo + hi) / 2)
            # Bisection ends where one calibration token sits exactly on the threshold; step off it, or that
            # token (same id at position 0 in any input) would be a tie for every test.
            lin.bias.fill_((lo + hi) / 2 + 0.01)
    _SAMPLE_MODEL_CACHE[key] = model
    return model


def _sample_full_forward(model, x):
    """Full (uncached) forward → (logits, boundaries or None, predictor logits or None)."""
    seen = []
    hook = None
    if model.cfg.boundary in _SAMPLE_PREDICTOR_MODES:
        hook = _sample_predictor_linear(model).register_forward_hook(lambda m, i, o: seen.append(o.detach()))
    try:
        with torch.no_grad():
            out = model(x)
    finally:
        if hook is not None:
            hook.remove()
    return out.logits, out.boundaries, (seen[-1][..., 0] if seen else None)


def _sample_no_threshold_ties(model, bp_logits):
    """False when a predictor logit lies within float noise of the threshold: it may round either way in
    two equal computations, and such inputs say nothing about the cache."""
    if bp_logits is None:
        return True
    edge = math.log(model.cfg.threshold / (1 - model.cfg.threshold))
    return bool(((bp_logits - edge).abs() > 1e-4).all())


def _sample_check_parity(model, x, L, skip_ties=assume):
    """Prefill x[:, :L], decode the rest one token at a time; compare with the full forward of x."""
    full, full_b, bp = _sample_full_forward(model, x)
    skip_ties(_sample_no_threshold_ties(model, bp))
    logits, state = model.prefill(x[:, :L])
    torch.testing.assert_close(logits, full[:, :L], atol=1e-5, rtol=0, msg=lambda m: f"prefill: {m}")
    for t in range(L, x.size(1)):
        step = model.decode(x[:, t], state)
        torch.testing.assert_close(step, full[:, t], atol=1e-5, rtol=0, msg=lambda m: f"decode at t={t}: {m}")
    assert state.length == x.size(1)
    if full_b is None:
        assert not state.boundaries
        return 0
    got = torch.stack(state.boundaries, 1)
    assert got.shape == x.shape
    assert torch.equal(got.bool(), full_b.bool()), f"decode boundaries {got.int()} != forward {full_b.int()}"
    return int(full_b.sum())


# ---------------------------------------------------------------------------------------------
# 1. Cache parity
# ---------------------------------------------------------------------------------------------
@st.composite
def _sample_parity_case(draw):
    B = draw(st.integers(1, 3))
    L = draw(st.integers(1, 20))
    n = draw(st.integers(1, 60))
    tok = st.integers(0, _SAMPLE_V + 2).map(lambda t: 0 if t >= _SAMPLE_V else t)   # spaces ~ 4 / 11
    rows = draw(st.lists(st.lists(tok, min_size=L + n, max_size=L + n), min_size=B, max_size=B))
    return torch.tensor(rows, dtype=torch.long), L


@pytest.mark.parametrize('mode', _SAMPLE_MODES)
@settings(max_examples=10, **_SAMPLE_SETTINGS)
@given(case=_sample_parity_case())
def test_sample_cache_parity_with_full_forward(mode, case):
    x, L = case
    _sample_check_parity(_sample_tiny_model(mode), x, L)


@pytest.mark.parametrize('mode', _SAMPLE_MODES)
def test_sample_cache_parity_short_prompt_many_segments(mode):
    """A one-character prompt that closes no segment, then 80 characters that close many; rows that close
    segments at different times (and a row that closes none in the prompt while another does)."""
    model = _sample_tiny_model(mode)
    gen = torch.Generator().manual_seed(7)
    x = _sample_tokens(gen, 3, 81, _SAMPLE_V)
    # Pick first characters that do not close a segment on their own (in every mode).
    _, b, _ = _sample_full_forward(model, torch.arange(_SAMPLE_V)[:, None])
    opening = [t for t in range(_SAMPLE_V) if b is None or not b[t, 0]]
    assert opening, "every single character closes a segment: the test model is degenerate"
    x[:, 0] = opening[-1]
    def no_ties(ok):
        assert ok, "a predictor logit sits on the threshold: pick another seed"
    n_closed = _sample_check_parity(model, x, 1, no_ties)
    if mode != 'none':
        assert n_closed >= 3 * 10, f"only {n_closed} segments closed: the test would not exercise pooling"
    # Prompts longer than one segment too, one step at a time across the split point.
    for L in (4, 17):
        _sample_check_parity(model, x, L, no_ties)


@pytest.mark.skipif('attn_chunk' not in {f.name for f in dataclasses.fields(Config)},
                    reason='this dynpool has no chunked attention (Config.attn_chunk)')
@pytest.mark.parametrize('mode', ['none', 'whitespace', 'entropy'])
def test_sample_cache_parity_chunked_prefill(mode):
    """Prompts several attention blocks long (attn_chunk 5): prefill's blockwise attention and the
    cache it leaves agree with decode and with the full forward."""
    model = _sample_tiny_model(mode, attn_chunk=5)
    x = _sample_tokens(torch.Generator().manual_seed(13), 2, 60, _SAMPLE_V)

    def no_ties(ok):
        assert ok, "a predictor logit sits on the threshold: pick another seed"
    for L in (4, 5, 23, 59):
        _sample_check_parity(model, x, L, no_ties)


def test_sample_cache_parity_cache_growth():
    """decode beyond the capacity prefill reserved must grow the caches without changing results."""
    model = _sample_tiny_model('entropy')
    x = _sample_tokens(torch.Generator().manual_seed(3), 2, 70, _SAMPLE_V)
    full, full_b, _ = _sample_full_forward(model, x)
    logits, state = model.prefill(x[:, :3], capacity=4)
    for t in range(3, 70):
        torch.testing.assert_close(model.decode(x[:, t], state), full[:, t], atol=1e-5, rtol=0)
    assert torch.equal(torch.stack(state.boundaries, 1), full_b.bool())


# ---------------------------------------------------------------------------------------------
# 2. generate
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize('mode', _SAMPLE_MODES)
def test_sample_generate_greedy_equals_uncached_argmax_loop(mode):
    model = _sample_tiny_model(mode)
    x = _sample_tokens(torch.Generator().manual_seed(11), 3, 6, _SAMPLE_V)
    n = 40
    got = model.generate(x, n, greedy=True)
    ref = x
    with torch.no_grad():
        for _ in range(n):
            logits = model(ref).logits[:, -1]
            top2 = logits.topk(2).values
            assert bool((top2[:, 0] - top2[:, 1] > 1e-4).all()), "argmax tie: pick another seed"
            ref = torch.cat([ref, logits.argmax(-1, keepdim=True)], 1)
    assert torch.equal(got, ref)
    assert not model.training


@pytest.mark.parametrize('mode', ['none', 'whitespace', 'gumbel'])
def test_sample_sample_takes_generates_steps_and_reports_what_the_model_did(mode):
    """sample.sample = model.generate for the same generator seed, plus boundaries and entropies that
    match the full forward of the generated text."""
    model = _sample_tiny_model(mode)
    x = _sample_tokens(torch.Generator().manual_seed(5), 2, 4, _SAMPLE_V)
    kw = dict(temperature=0.8, top_k=5)
    want = model.generate(x, 50, generator=torch.Generator().manual_seed(42), **kw)
    tokens, b, ent = sample.sample(model, x, 50, generator=torch.Generator().manual_seed(42), **kw)
    assert torch.equal(tokens, want)
    full, full_b, _ = _sample_full_forward(model, tokens)
    logp = torch.log_softmax(full, -1)
    torch.testing.assert_close(ent, -(logp.exp() * logp).sum(-1) / math.log(2), atol=1e-4, rtol=0)
    assert (b is None) == (full_b is None)
    if b is not None:
        assert torch.equal(b, full_b.bool())


def test_sample_sample_never_draws_ids_beyond_the_alphabet():
    model = _sample_tiny_model('whitespace')
    x = torch.zeros(4, 1, dtype=torch.long)
    tokens, _, _ = sample.sample(model, x, 60, temperature=5.0, generator=torch.Generator().manual_seed(0),
                                 n_valid=3)
    assert int(tokens.max()) < 3


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
    assert rc != 0 and out == ''
    assert err.count('\n') == 1 and 'Traceback' not in err
    for c in ("'é'", "'1'", "'9'", "'!'"):
        assert c in err
    assert "'n'" not in err                 # 'N' is lower-cased first: text8 is lower-case
    # The same through a real process: exit code and stderr of the command line.
    p = subprocess.run([sys.executable, 'sample.py', '--ckpt', str(_sample_ckpts['whitespace']), '--prompt', 'ça'],
                       cwd=_SAMPLE_ROOT, capture_output=True, text=True, timeout=120, env=_sample_env())
    assert p.returncode != 0 and p.stdout == ''
    assert p.stderr.count('\n') == 1 and "'ç'" in p.stderr and 'Traceback' not in p.stderr


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
    cases = {tmp_path / 'missing' / 'ckpt.pt': 'not found', tmp_path / 'empty-run-dir': 'not found',
             corrupt: 'corrupt', tmp_path / 'text.pt': 'corrupt', tmp_path / 'novocab.pt': 'vocab',
             tmp_path / 'mismatch.pt': 'do not fit', tmp_path / 'badcfg.pt': 'invalid', tmp_path / 'list.pt': 'dict',
             tmp_path / 'shapes.pt': 'size mismatch'}
    (tmp_path / 'empty-run-dir').mkdir()
    for path, words in cases.items():
        rc, out, err = _sample_main(['--ckpt', path, '--prompt', 'a'], capsys)
        assert rc != 0 and out == '', path
        assert err.count('\n') == 1 and 'Traceback' not in err and words in err, (path, err)
    # A run directory works as --ckpt.
    rc, out, err = _sample_main(['--ckpt', _sample_ckpts['fixed'].parent, '--prompt', 'a', '--chars', 5], capsys)
    assert rc == 0 and len(out) == 7


def test_sample_cli_unavailable_device_is_one_line(_sample_ckpts, capsys):
    if torch.cuda.is_available():
        pytest.skip('CUDA is available here')
    rc, out, err = _sample_main(['--ckpt', _sample_ckpts['fixed'], '--device', 'cuda'], capsys)
    assert rc != 0 and err.count('\n') == 1 and 'CUDA' in err


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
                                   ['--num-samples', 'x']])
def test_sample_cli_bad_flags_are_one_line(_sample_ckpts, capsys, extra):
    with pytest.raises(SystemExit) as e:
        sample.main(['--ckpt', str(_sample_ckpts['fixed'])] + extra)
    out, err = capsys.readouterr()
    assert e.value.code != 0 and out == '' and err.count('\n') == 1 and err.startswith('sample.py: error:')
