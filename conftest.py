"""Shared test set-up and helpers for every test module: hypothesis profiles, thread count,
paths, tolerances and tiny models. Run the suite with `python -m pytest -q` (README)."""


import math
import os
from pathlib import Path

import torch
import torch.nn as nn
from hypothesis import HealthCheck, settings

from dynpool import Config, DynamicPoolingLM

# Tiny models run fastest on one thread, and two threads on 2 shared, busy cores are ~10x slower.
torch.set_num_threads(1)

# ---------------------------------------------------------------------------------------------
# Hypothesis profiles: "dev" explores new examples each run; "ci" (env var CI set) is derandomized.
# ---------------------------------------------------------------------------------------------
_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
               print_blob=True)
settings.register_profile("dev", max_examples=25, **_common)
settings.register_profile("ci", max_examples=25, derandomize=True, database=None, **_common)
settings.load_profile("ci" if os.environ.get("CI") else "dev")

MODES = ["none", "fixed", "whitespace", "unigram", "entropy", "gumbel", "hnet"]
PREDICTOR_MODES = ["unigram", "entropy", "gumbel"]
V = 8          # tiny vocabulary for the leakage tests
SPACE = 0      # its space id (drawn often, see random_tokens)
DATA_DIR = Path(__file__).parent.parent / "shared" / "data"
ROOT = Path(__file__).parent


def assert_close(a, b, atol=1e-5, rtol=0.0, msg=""):
    """torch.allclose with a useful failure message: max / mean abs difference and where."""
    a = torch.as_tensor(a).detach().double()
    b = torch.as_tensor(b).detach().double()
    assert a.shape == b.shape, f"{msg} shape {tuple(a.shape)} != {tuple(b.shape)}"
    if a.numel() == 0:
        return
    diff = (a - b).abs()
    bad = diff > atol + rtol * b.abs()
    if bad.any():
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise AssertionError(
            f"{msg} not close: max abs diff {diff.max().item():.3e}, mean abs diff {diff.mean().item():.3e}, "
            f"{int(bad.sum())}/{a.numel()} elements over atol={atol} rtol={rtol}; first at {first}: "
            f"{a[first].item():.6g} vs {b[first].item():.6g}")

_SAMPLE_ROOT = Path(__file__).parent
_SAMPLE_MODES = ['none', 'fixed', 'whitespace', 'unigram', 'entropy', 'gumbel', 'hnet']
_SAMPLE_PREDICTOR_MODES = ['unigram', 'entropy', 'gumbel']
_SAMPLE_V = 8        # vocabulary of the parity tests; id 0 is the space
_SAMPLE_ALPHABET = [' '] + [chr(ord('a') + i) for i in range(26)]   # text8's, space_id 0
_SAMPLE_SETTINGS = dict(deadline=None, derandomize=bool(os.environ.get('CI')), print_blob=True,
                        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                               HealthCheck.function_scoped_fixture])


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
    if mode == 'hnet':
        draw_hnet_weights(model)
    _SAMPLE_MODEL_CACHE[key] = model
    return model


def draw_hnet_weights(model, scale=0.5):
    """hnet starts with an identity router and a zero residual projection, which would leave the
    router's weights and the residual path out of the tests: draw all three near the identity."""
    D = model.cfg.d_model
    with torch.no_grad():
        for w in (model.source.q.weight, model.source.k.weight, model.pooling.residual.weight):
            w.copy_(torch.eye(D) + torch.randn(D, D) * scale / math.sqrt(D))


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
