"""Tests of H-Net's dynamic chunking (hnet.py, boundary='hnet'): its registration through the
source interface, routing, selection, EMA, confidence, ratio loss and the project's boundary
convention (b_t = 1 iff a chunk starts at t+1), each against a loop or a hand computation. Leakage,
cache parity, gradients and losses: the mode lists of test_dynpool.py, which include hnet.

Run:   python -m pytest -q test_hnet.py
"""

import dataclasses
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hnet
from conftest import (ROOT, assert_close, draw_hnet_weights, random_tokens, tiny_config,
                      tiny_model)
from dynpool import Config, DynamicPoolingLM, step_flops
from hnet import ratio_loss, smooth_chunks
from test_dynpool import english_snippet


def test_hnet_is_registered_through_the_source_interface():
    """Importing hnet.py makes boundary='hnet' a mode like the paper's: the last of BOUNDARY_MODES,
    its Options in Config.options (defaults filled in, asdict, unknown keys refused), its
    initialisation and its router in step_flops, each through a hook of BoundarySource."""
    import dynpool
    assert dynpool.BOUNDARY_MODES[-1] == 'hnet' and dynpool.SOURCES['hnet'] is hnet.HNetBoundaries
    assert 'hnet' not in dynpool.PREDICTOR_MODES + dynpool.EXTERNAL_MODES
    cfg = tiny_config('hnet', options={'ratio_target': 4.0})
    assert cfg.options == {'ratio_target': 4.0, 'ratio_weight': 1.0}
    saved = dataclasses.asdict(cfg)
    assert Config(**saved) == cfg and saved['options']['ratio_weight'] == 1.0
    assert tiny_config('hnet').options == dataclasses.asdict(hnet.HNetOptions())
    with pytest.raises(ValueError, match="no option 'ratio'"):
        tiny_config('hnet', options={'ratio': 4.0})
    with pytest.raises(ValueError, match='ratio_target must be > 1'):
        tiny_config('hnet', options={'ratio_target': 1.0})
    with pytest.raises(ValueError, match="no option 'ratio_target'"):
        tiny_config('gumbel', options={'ratio_target': 4.0})
    with pytest.raises(ValueError, match="'hnet' is registered already"):
        dynpool.register_source('hnet', hnet.HNetBoundaries)
    torch.manual_seed(0)
    model = DynamicPoolingLM(cfg)
    assert model.source.options == hnet.HNetOptions(ratio_target=4.0)
    assert 0.9 < model.embed.weight.std().item() < 1.1              # H-Net's embedding init
    assert (model.pooling.residual.weight == 0).all()
    d, n = cfg.d_model, 3 * 40
    router = 2 * 3 * d * d * n * 3                                   # forward and backward
    assert step_flops(cfg, 3, 40, 5.0) - router == step_flops(tiny_config('fixed'), 3, 40, 5.0)


def test_dynpool_imports_no_plug_in():
    """dynpool.py imports no source file (issue 40): a fresh process that imports dynpool alone
    has no 'hnet' and no hnet module; `import hnet` then registers it, whatever came first."""
    code = ('import sys\n'
            'from dynpool import BOUNDARY_MODES\n'
            "print('hnet' in BOUNDARY_MODES, 'hnet' in sys.modules)\n"
            'import hnet, dynpool\n'
            "print(dynpool.Config(boundary='hnet').options['ratio_target'])\n")
    run = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    alone, ratio_target = run.stdout.splitlines()
    assert alone == 'False False' and ratio_target == str(hnet.HNetOptions.ratio_target)


def hnet_routing_of(model, x, **kw):
    """(model output, the ChunkRouting the forward pooled with)."""
    seen = []
    hook = model.source.register_forward_hook(lambda m, i, o: seen.append(o))
    try:
        with torch.no_grad():
            out = model(x, **kw)
    finally:
        hook.remove()
    return out, seen[0]


def ref_ema(z, P):
    """z̄_j = P_j z_j + (1 − P_j) z̄_{j−1}, z̄_{−1} = 0, one chunk at a time."""
    out, prev = [], torch.zeros_like(z[:, 0])
    for j in range(z.size(1)):
        prev = P[:, j, None] * z[:, j] + (1 - P[:, j, None]) * prev
        out.append(prev)
    return torch.stack(out, 1)


@settings(max_examples=30)
@given(S=st.integers(1, 40), seed=st.integers(0, 2**31 - 1), n_ones=st.integers(0, 3))
def test_hnet_smoothing_matches_loop(S, seed, n_ones):
    """The closed-form EMA equals the loop, rates of exactly 1 included (a start that turns fully
    away, cos = −1), with finite gradients."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(2, S, 3, generator=gen, dtype=torch.float64)
    P = 0.5 + 0.5 * torch.rand(2, S, generator=gen, dtype=torch.float64)
    P[:, torch.randint(0, S, (n_ones,), generator=gen)] = 1.0
    P[:, 0] = 1.0
    P.requires_grad_(True)
    got = smooth_chunks(z, P)
    assert_close(got, ref_ema(z, P.detach()), atol=1e-5, msg='EMA:')
    got.sum().backward()
    assert torch.isfinite(P.grad).all()


@settings(max_examples=15)
@given(L=st.integers(1, 30), seed=st.integers(0, 2**31 - 1))
def test_hnet_selection_and_upsampling_match_loop(L, seed):
    """The router compares neighbours; the shortened sequence is the vectors at chunk starts; token
    t receives z̄ of the last chunk started at or before t (confidence of value 1) plus W_r h_t."""
    gen = torch.Generator().manual_seed(seed)
    model = tiny_model('hnet')
    h = torch.randn(2, L, 32, generator=gen)
    with torch.no_grad():
        routing = model.source(h, None)
        s = model.pooling.down(h, routing)
        z = torch.randn(s.shape, generator=gen)
        y = model.pooling.up(z, routing, h)
        q, k = model.source.q(h), model.source.k(h)
        for n in range(2):
            p = [1.0] + [(1 - torch.cosine_similarity(q[n, t - 1], k[n, t], 0).item()) / 2
                         for t in range(1, L)]
            assert_close(routing.p[n], p, atol=1e-5, msg='p:')
            starts = [t for t in range(L) if routing.p[n, t] > 0.5]
            assert routing.start[n].nonzero().flatten().tolist() == starts and starts[0] == 0
            assert torch.equal(s[n, :len(starts)], h[n, starts]) and (s[n, len(starts):] == 0).all()
            z_bar = ref_ema(z[n:n + 1, :len(starts)], routing.p[n:n + 1, starts])[0]
            for t in range(L):
                j = sum(1 for st_ in starts if st_ <= t) - 1
                expect = z_bar[j] + model.pooling.residual(h[n, t])
                assert_close(y[n, t], expect, atol=1e-5, msg=f'row {n} token {t}:')


def test_hnet_confidence_is_straight_through():
    """Value 1, gradient of c_t = p_t at chunk starts and 1 − p_t elsewhere. With every chunk output
    equal, z̄ is that output whatever the rates, so p reaches the loss only through c."""
    model = tiny_model('hnet')
    gen = torch.Generator().manual_seed(4)
    h = torch.randn(1, 40, 32, generator=gen)
    routing = model.source(h, None)
    p = routing.p.detach().requires_grad_(True)
    routing = type(routing)(b=routing.b, p=p, start=routing.start)
    assert 0 < routing.start.sum() < 40
    z = torch.randn(1, 1, 32, generator=gen).expand(1, int(routing.start.sum()), 32)
    y = model.pooling.up(z, routing, h)
    with torch.no_grad():
        assert_close(y - model.pooling.residual(h), z[:, :1].expand(1, 40, 32), atol=1e-6)
    g = torch.randn(y.shape, generator=gen)
    (y * g).sum().backward()
    expect = torch.where(routing.start, 1.0, -1.0) * (g * z[:, :1]).sum(-1)
    # t = 0 left out: p_0 = 1 is a constant in the model (here a leaf, and z̄_0 = p_0 z_0 uses it).
    assert_close(p.grad[:, 1:], expect[:, 1:], atol=1e-5, msg='d loss / d p:')


def test_hnet_ratio_loss_by_hand():
    """L_ratio = N/(N−1)·((N−1)·F·G + (1−F)·(1−G)): a hand-computed value, its minimum 1 at
    F = G = 1/N, and the model's boundary loss = ratio_weight × L_ratio of its own routing."""
    start = torch.tensor([[1, 0, 0, 1], [1, 1, 0, 0]]).bool()
    p = torch.tensor([[1.0, 0.2, 0.3, 0.7], [1.0, 0.6, 0.1, 0.4]])
    # F = 4/8, G = 4.3/8, N = 3: 3/2 · (2 · 0.5 · 0.5375 + 0.5 · 0.4625) = 1.153125
    assert_close(ratio_loss(start, p, 3.0), 1.153125, atol=1e-6)
    assert_close(ratio_loss(start[:1, :3], torch.full((1, 3), 1 / 3), 3.0), 1.0, atol=1e-6)
    model = tiny_model('hnet')
    x = random_tokens(torch.Generator().manual_seed(5), 2, 30)
    out, routing = hnet_routing_of(model, x, targets=x)
    N, weight = model.cfg.options['ratio_target'], model.cfg.options['ratio_weight']
    Fr, G = routing.start.float().mean().item(), routing.p.mean().item()
    expect = weight * N / (N - 1) * ((N - 1) * Fr * G + (1 - Fr) * (1 - G))
    assert_close(out.boundary_loss, expect, atol=1e-6, msg='boundary loss:')


def test_hnet_boundaries_follow_the_project_convention():
    """out.boundaries keeps the project's meaning: b_t = 1 iff a chunk starts at t+1, so
    b_{L-1} = 0; b_t is decided by x_{t+1} and never read by token t: the forward of x_{<=t} has the
    same b_{<t} and logits, with b_t = 0 for now. Generation hands b_t out as 0 and reports it a
    token later, apart (state.late_boundary), never by rewriting what it handed out."""
    model = tiny_model('hnet')
    x = random_tokens(torch.Generator().manual_seed(6), 2, 50)
    out, routing = hnet_routing_of(model, x)
    assert torch.equal(out.boundaries[:, :-1].bool(), routing.start[:, 1:])
    assert (out.boundaries[:, -1] == 0).all()
    assert set(out.boundaries.unique().tolist()) == {0.0, 1.0}
    assert_close(out.shortening_factor, 100 / out.boundaries.sum(), atol=1e-5)
    with torch.no_grad():
        for t in (0, 9, 30):
            part = model(x[:, :t + 1])
            assert torch.equal(part.boundaries[:, :t], out.boundaries[:, :t])
            assert (part.boundaries[:, t] == 0).all()
            assert_close(part.logits, out.logits[:, :t + 1], atol=1e-5)
        # n: b_{n-1} = 1 in some row
        n = next(t for t in range(10, 50) if out.boundaries[:, t - 1].any())
        _, state = model.prefill(x[:, :n])
        prompt_b = state.boundaries
        assert (prompt_b[:, -1] == 0).all() and state.late_boundary is None
        model.decode(x[:, n], state)
        assert (prompt_b[:, -1] == 0).all(), 'decode rewrote the boundaries prefill handed out'
        settled = torch.cat([prompt_b[:, :-1], state.late_boundary], 1)
        assert torch.equal(settled, out.boundaries[:, :n].bool())
        assert (state.boundaries == 0).all() and state.boundaries.shape == (2, 1)


def test_hnet_every_parameter_learns_from_its_init():
    """From H-Net's initialisation (identity router, zero residual projection) every parameter gets
    a gradient: the router through the confidence, the EMA rates and the ratio loss."""
    torch.manual_seed(0)
    model = DynamicPoolingLM(tiny_config('hnet')).train()
    eye = torch.eye(32)
    assert torch.equal(model.source.q.weight, eye) and torch.equal(model.source.k.weight, eye)
    assert (model.pooling.residual.weight == 0).all()
    x = random_tokens(torch.Generator().manual_seed(8), 2, 40)
    model(x, targets=torch.roll(x, -1, 1)).loss.backward()
    silent = [n for n, p in model.named_parameters()
              if p.grad is None or not p.grad.abs().sum() > 0]
    assert not silent, f'no gradient: {silent}'


def test_hnet_bucketed_chunks_change_nothing():
    """Zero rows padding the chunks to a bucket (as on GPUs) leave logits and gradients alone."""
    x = random_tokens(torch.Generator().manual_seed(9), 3, 50)
    grads = []
    for bucket in (1, 64):
        torch.manual_seed(0)
        model = DynamicPoolingLM(tiny_config('hnet', seg_bucket=bucket))
        draw_hnet_weights(model)
        out = model(x, targets=torch.roll(x, -1, 1))
        out.loss.backward()
        grads.append([out.logits.detach()] + [p.grad for p in model.parameters()])
    assert int(out.boundaries.sum(1).max()) + 1 < 64       # padding rows were there
    for a, b in zip(*grads):
        assert_close(a, b, atol=1e-6)


@pytest.mark.parametrize('bad', [dict(ratio_target=1.0), dict(ratio_weight=-0.1)])
def test_hnet_bad_ratio_flags_raise(bad):
    with pytest.raises(ValueError, match='ratio_target must be > 1 and ratio_weight >= 0'):
        tiny_config('hnet', options=bad)


def test_hnet_router_keeps_chunking_early_in_training():
    """H-Net's embedding init (std 1): in the first steps the pre stage's outputs gain a component
    shared by all tokens; next to embeddings of std 0.02 it soon makes neighbours look alike and the
    router stops chunking (SF far above its target N = 6). With std 1 it keeps chunking."""
    text = english_snippet(200)
    ids = torch.tensor([0 if c == ' ' else ord(c) - ord('a') + 1 for c in text])

    def sf_after_warm_up_steps(embed_std):
        torch.manual_seed(0)
        cfg = Config(vocab_size=27, d_model=64, n_head=2, d_head=32, d_inner=256, layers=(1, 2, 1),
                     dropout=0.0, dropatt=0.0, boundary='hnet', whitespace_id=0)
        model = DynamicPoolingLM(cfg).train()
        if embed_std is not None:
            torch.nn.init.normal_(model.embed.weight, std=embed_std)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(0)
        for step in range(20):
            for group in opt.param_groups:
                group['lr'] = 1e-3 * (step + 1) / 50   # the CPU preset's warm-up
            starts = torch.randint(0, len(ids) - 33, (2,), generator=gen)   # batch 2 × 32
            chunk = torch.stack([ids[s:s + 33] for s in starts])
            out = model(chunk[:, :-1], targets=chunk[:, 1:])
            opt.zero_grad()
            out.loss.backward()
            opt.step()
        return float(out.shortening_factor)

    default, small = sf_after_warm_up_steps(None), sf_after_warm_up_steps(0.02)
    assert default < 12, 'the default init stopped chunking'
    assert small > 12, 'std 0.02 no longer shows the collapse this guards'
