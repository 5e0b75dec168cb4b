"""Shared test set-up for every test module: thread count, hypothesis profiles, markers, paths,
tolerances, tiny models and inputs. Run the suite with `python -m pytest -q` (README);
`--slow` adds the torch.compile tests, and tests marked `gpu` run only where CUDA is.
"""

import contextlib
import importlib.util
import json
import math
import os
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, is_hypothesis_test, settings

# hnet.py registers boundary='hnet' (dynpool imports no plug-in): before the mode lists are read.
import hnet  # noqa: F401
from dynpool import BOUNDARY_MODES, PREDICTOR_MODES as _PREDICTOR_MODES, Config, DynamicPoolingLM

# Tiny models run fastest on one thread, and two threads on 2 shared, busy cores are ~10x slower.
# The environment's too: a script run in-process (train.main) takes the user's OMP_NUM_THREADS.
torch.set_num_threads(1)
os.environ.setdefault('OMP_NUM_THREADS', '1')

# A suite started in the background by a shell script (`pytest &`) inherits Ctrl-C ignored, and so
# would every process it starts: the Ctrl-C tests need it delivered, here and in those processes.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Hypothesis: "dev" explores new examples each run; "ci" (env var CI set) is derandomized, the
# same examples every run; "explore" (HYPOTHESIS_PROFILE=explore) draws fresh ones with no example
# database, from the seed that --hypothesis-seed gives and the header prints, so a failure found
# in CI replays exactly. CI runs the property tests both ways (README's CI blocks).
# Tests that take pytest fixtures add HYPOTHESIS_FIXTURES to their own @settings.
_common = dict(deadline=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile('dev', max_examples=25, **_common)
settings.register_profile('ci', max_examples=25, derandomize=True, database=None, **_common)
settings.register_profile('explore', max_examples=25, database=None, **_common)
settings.load_profile(os.environ.get('HYPOTHESIS_PROFILE') or ('ci' if os.environ.get('CI')
                                                                 else 'dev'))
HYPOTHESIS_FIXTURES = dict(suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                  HealthCheck.function_scoped_fixture])

MODES = list(BOUNDARY_MODES)
PREDICTOR_MODES = list(_PREDICTOR_MODES)
# Every mode, and every mean-pooled mode again with sub-sampling ('fixed+last': pooling='last',
# the paper's Table 2): the property tests (leakage, gradients, cache parity) run over all of them.
POOLED_LAST = [f'{m}+last' for m in MODES if m not in ('none', 'hnet')]
MODE_VARIANTS = MODES + POOLED_LAST
V = 8                        # tiny vocabulary of the model tests
SPACE = 0                    # its space id (drawn often, see random_tokens)
ALPHABET = [' '] + [chr(ord('a') + i) for i in range(26)]   # text8's, space id 0
ROOT = Path(__file__).parent
DATA_DIR = ROOT.parent / 'shared' / 'data'


# matplotlib is the optional extra: only the tests marked plots need it (found, not imported: fast).
_HAS_MATPLOTLIB = importlib.util.find_spec('matplotlib') is not None


def pytest_addoption(parser):
    parser.addoption('--slow', action='store_true',
                     help='also run tests marked slow (torch.compile)')


def pytest_configure(config):
    config.addinivalue_line('markers', 'gpu: needs CUDA; skipped without it')
    config.addinivalue_line('markers', 'slow: minutes on a CPU (torch.compile, long doc commands); '
                                       'run with --slow')
    config.addinivalue_line('markers', 'plots: draws with matplotlib (the optional extra); skipped '
                                       'without it; `-m plots` runs only these')
    config.addinivalue_line('markers', 'property: a hypothesis test (marked by conftest); '
                                       '`-m property` runs only these')


def pytest_report_header(config):
    seed = config.getoption('hypothesis_seed', None)
    profile = settings._current_profile
    if seed is not None:
        return (f'hypothesis profile {profile!r}, seed {seed}: replay a failure with '
                f'HYPOTHESIS_PROFILE={profile} python -m pytest --hypothesis-seed={seed} ...')
    return None


def pytest_sessionfinish(session):
    """In a pytest-xdist worker whose results are sent: SIGINT ignored from here to its
    exit. The controller closes a worker's connection once the results are in, and
    execnet interrupts a worker still busy 5 s later (on a busy machine: pytest's last
    garbage collection) with a SIGINT to itself. Its KeyboardInterrupt lands wherever
    the worker is, e.g. in hypothesis's garbage-collection callback, and pytest prints
    it with its traceback as a warning although every test passed. Nothing is left to
    interrupt; the worker ends by itself."""
    if hasattr(session.config, 'workerinput'):
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if is_hypothesis_test(getattr(item, 'obj', None)):
            item.add_marker(pytest.mark.property)
        if 'gpu' in item.keywords and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason='needs CUDA'))
        if 'slow' in item.keywords and not config.getoption('--slow'):
            item.add_marker(pytest.mark.skip(reason='slow: run with --slow'))
        if 'plots' in item.keywords and not _HAS_MATPLOTLIB:
            item.add_marker(pytest.mark.skip(
                reason='needs matplotlib: pip install "matplotlib>=3.6"'))


def assert_close(a, b, atol=1e-5, rtol=0.0, msg=''):
    """torch.allclose with a useful failure message: max / mean abs difference and where."""
    a = torch.as_tensor(a).detach().double()
    b = torch.as_tensor(b).detach().double()
    assert a.shape == b.shape, f'{msg} shape {tuple(a.shape)} != {tuple(b.shape)}'
    if a.numel() == 0:
        return
    diff = (a - b).abs()
    bad = diff > atol + rtol * b.abs()
    if bad.any():
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise AssertionError(
            f'{msg} not close: max abs diff {diff.max().item():.3e}, mean abs diff '
            f'{diff.mean().item():.3e}, {int(bad.sum())}/{a.numel()} elements over atol={atol} '
            f'rtol={rtol}; first at {first}: {a[first].item():.6g} vs {b[first].item():.6g}')


def shared_data(name):
    """The path of `name` in ../shared/data; the test skips, saying so, where it is absent."""
    path = DATA_DIR / name
    if not path.is_file():
        pytest.skip(f"{path} is absent (real text beside the repo, in this project's CI only)")
    return path


# ---------------------------------------------------------------------------------------------
# The command-line contract: exit codes, one `error:` line, odd paths, no hang
# ---------------------------------------------------------------------------------------------
def run_main(main, argv, capsys):
    """main(argv) in this process as its command line runs it → (exit code, stdout, stderr): the
    code it returns (None is 0) or its SystemExit's (a bad flag's included)."""
    try:
        code = main([str(a) for a in argv])
        code = 0 if code is None else code
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def assert_cli_contract(code, err, argv):
    """Exit 0, 1, 2 or 130, never a traceback; a failure ends with its one `error: ` line and a
    success has none."""
    lines = err.splitlines()
    errors = [ln for ln in lines if ln.startswith('error')]
    assert code in (0, 1, 2, 130), (argv, code, err)
    assert 'Traceback' not in err and (code == 0) == (not errors), (argv, err)
    if code:
        assert lines[-1].startswith('error: ') and len(errors) == 1, (argv, err)


@contextlib.contextmanager
def no_hang(seconds=30):
    """Fail instead of hanging (a FIFO opened waits for the other end forever)."""
    def hung(*_):
        raise TimeoutError(f'hung for {seconds} s')
    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def odd_paths(root, leaf='x'):
    """{name: path} of the paths a user can get wrong, made below root: too long, too deep (`leaf`
    under 25 missing folders), through a file, a FIFO, a directory."""
    (root / 'a-file').write_text('x')
    (root / 'a-dir').mkdir()
    os.mkfifo(root / 'a-fifo')
    return {'too-long': root / ('n' * 300), 'too-deep': root.joinpath(*['d'] * 25) / leaf,
            'through-a-file': root / 'a-file' / leaf, 'fifo': root / 'a-fifo',
            'dir': root / 'a-dir'}


# ---------------------------------------------------------------------------------------------
# Tiny models and inputs
# ---------------------------------------------------------------------------------------------
def random_tokens(gen, n, L, vocab=V, p_space=0.25):
    """[n, L] ids in [0, vocab): the space (id 0) with probability p_space, else uniform."""
    x = torch.randint(1, vocab, (n, L), generator=gen)
    return torch.where(torch.rand(n, L, generator=gen) < p_space, torch.zeros_like(x), x)


def tiny_config(mode, vocab=V, dropout=0.0, **kw):
    """d_model 32, 2 heads x 16, d_inner 64, layers (1, 1, 1), fixed k 3, space id 0."""
    args = dict(vocab_size=vocab, d_model=32, n_head=2, d_head=16, d_inner=64, dropout=dropout,
                dropatt=dropout, layers=(1, 1, 1), boundary=mode, fixed_factor=3,
                whitespace_id=SPACE)
    args.update(kw)
    return Config(**args)


def predictor_linear(model):
    """The boundary predictor's final Linear(d_inner, 1)."""
    return model.source.predictor.net[-1]


_CALIBRATED = {}


def tiny_model(mode, vocab=V, seed=0, rate=0.3, **extra):
    """A fresh copy (mutate it freely) of a tiny eval-mode model, dropout off unless `extra` says.
    Peaked predictions (argmax ties out of reach); predictor modes get strong predictor weights and
    a bias found by bisection so that about `rate` of tokens close a segment (a fresh predictor
    says all-0 or all-1, and no test would exercise pooling). `extra`: Config fields that leave
    the weights alone (attention, attn_chunk, seg_bucket, dropout, pooling, ...); a mode
    'fixed+last' is mode 'fixed' with pooling='last' (the same weights as 'fixed')."""
    mode, _, pooling = mode.partition('+')
    if pooling:
        extra['pooling'] = pooling
    key = (mode, vocab, seed, rate)
    if key not in _CALIBRATED:
        torch.manual_seed(seed)
        model = DynamicPoolingLM(tiny_config(mode, vocab)).eval()
        with torch.no_grad():
            model.lm_head.weight.normal_(0.0, 0.5)
            if mode in PREDICTOR_MODES:
                lin = predictor_linear(model)
                lin.weight.normal_(0.0, 3.0 / math.sqrt(lin.in_features))
                x = random_tokens(torch.Generator().manual_seed(seed + 1), 4, 128, vocab, 0.3)
                lo, hi = -20.0, 20.0
                for _ in range(30):
                    lin.bias.fill_((lo + hi) / 2)
                    frac = model(x).boundaries.float().mean().item()
                    lo, hi = ((lo + hi) / 2, hi) if frac < rate else (lo, (lo + hi) / 2)
                # Bisection ends where one calibration token sits exactly on the threshold; step
                # off it, or that token (same id at position 0 in any input) would tie every test.
                lin.bias.fill_((lo + hi) / 2 + 0.01)
        if mode == 'hnet':
            draw_hnet_weights(model)
        _CALIBRATED[key] = model
    model = DynamicPoolingLM(tiny_config(mode, vocab, **extra)).eval()
    model.load_state_dict(_CALIBRATED[key].state_dict())
    return model


def draw_hnet_weights(model, scale=0.5):
    """hnet starts with an identity router and a zero residual projection, which would leave the
    router's weights and the residual path out of the tests: draw all three near the identity."""
    D = model.cfg.d_model
    with torch.no_grad():
        for w in (model.source.q.weight, model.source.k.weight, model.pooling.residual.weight):
            w.copy_(torch.eye(D) + torch.randn(D, D) * scale / math.sqrt(D))


@pytest.fixture
def tiny():
    """tiny_model for one test: made once per test (its hypothesis examples share it), never
    shared with another test."""
    made = {}

    def get(mode, **kw):
        key = (mode, tuple(sorted(kw.items())))
        if key not in made:
            made[key] = tiny_model(mode, **kw)
        return made[key]
    return get


def full_forward(model, x):
    """Uncached forward → (logits, boundaries or None, predictor logits or None), no grad."""
    with torch.no_grad():
        h, r = model.trunk(x)
        return model.lm_head(h), None if r is None else r.b, None if r is None else r.logits


# ---------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------
def checkpoint_state(mode='fixed', vocab=27, step=3):
    """A checkpoint dict with train.py's keys (a tiny model, Adam's state in its state_dict layout,
    RNG states, counters); write it with checkpoint.save_checkpoint(path, state, None)."""
    import dataclasses
    import random

    import numpy as np
    model = tiny_model(mode, vocab=vocab, seed=1)
    # Adam's state_dict made by hand: building torch.optim.Adam first imports torch._dynamo (~5 s)
    params = list(model.parameters())
    adam = {i: dict(step=torch.tensor(1.0), exp_avg=torch.randn_like(p) * 1e-3,
                    exp_avg_sq=torch.rand_like(p) * 1e-6) for i, p in enumerate(params)}
    groups = [dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False,
                   maximize=False, foreach=None, capturable=False, differentiable=False,
                   fused=None, params=list(range(len(params))))]
    return dict(model=model.state_dict(), optimizer=dict(state=adam, param_groups=groups),
                scaler={}, step=step, epoch=0,
                pos=4 * step, train_chars=128 * step, train_flops=1e6 * step, train_time=0.5 * step,
                warmup_flops=None, config=dataclasses.asdict(model.cfg),
                vocab=dict(alphabet=ALPHABET[:vocab], vocab_size=vocab, space_id=0),
                args=dict(boundary=mode, data='data/text8', layers=(1, 1, 1), seed=1337),
                schedule=dict(lr=1e-3, warmup=2, max_steps=10, flop_budget=None),
                rng=dict(torch=torch.get_rng_state(), numpy=np.random.get_state(),
                         python=random.getstate(), cuda=None))


def write_dataset(root, text, valid=0.1, test=0.1, unigram=True, encoding=None):
    """A dataset in prepare_data.py's layout; Unigram labels are the whitespace labels (each space
    closes its word, which is also a Unigram boundary), enough to exercise the label plumbing.
    encoding='bytes': the UTF-8 bytes of text, vocabulary 256 (meta.json's "encoding": "bytes")."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    if encoding == 'bytes':
        alphabet = [chr(i) for i in range(256)]
        ids = np.frombuffer(text.encode('utf-8'), dtype=np.uint8)
    else:
        alphabet = sorted(set(text))
        ids = np.frombuffer(text.encode('latin-1'), dtype=np.uint8)
        ids = np.searchsorted(np.array([ord(c) for c in alphabet]), ids).astype(np.uint8)
    n_va, n_te = int(len(ids) * valid), int(len(ids) * test)
    parts = dict(train=ids[:len(ids) - n_va - n_te],
                 valid=ids[len(ids) - n_va - n_te:len(ids) - n_te],
                 test=ids[len(ids) - n_te:])
    space = alphabet.index(' ') if ' ' in alphabet else None
    for name, arr in parts.items():
        arr.tofile(root / f'{name}.bin')
        if unigram:
            (arr == space).astype(np.uint8).tofile(root / f'{name}.unigram-1000.bin')
    meta = dict(alphabet=alphabet, vocab_size=len(alphabet), space_id=space, encoding=encoding,
                newline_id=alphabet.index('\n') if '\n' in alphabet else None, dtype='uint8',
                sizes={k: len(v) for k, v in parts.items()},
                mean_word_length=len(text) / max(1, text.count(' ')),
                unigram={'vocab_size': 1000, 'model': None,
                         'shortening_factor': {}} if unigram else None)
    if encoding is None:   # (today's datasets: no field, the paper's cleaned characters)
        del meta['encoding']
    (root / 'meta.json').write_text(json.dumps(meta))
    return root


def random_words(n_chars, seed=0, letters='abcdefgh'):
    """Random 'words' from a small alphabet: text that needs no shared data."""
    rng = np.random.default_rng(seed)
    words = [''.join(rng.choice(list(letters),
                                size=rng.integers(1, 7))) for _ in range(n_chars // 3)]
    return ' '.join(words)[:n_chars]
