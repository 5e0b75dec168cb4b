"""Tests of the model (dynpool.py), read as the paper's claims: leakage-freedom, pooling invariants,
gradients through the boundary matrix, boundary sources, losses, exact attention variants, learning,
size and FLOPs, errors, determinism, cached generation, host reads and torch.compile, GPU steps. The
mode lists include hnet (conftest.py imports hnet.py); H-Net's own mechanisms are in test_hnet.py.

Run:   python -m pytest -q test_dynpool.py     (CI=1: hypothesis derandomized, the same examples)
One part:  python -m pytest -q test_dynpool.py -k "leak or pooling"
Also:  --slow adds the torch.compile tests (minutes on a CPU); `gpu` tests run where CUDA is.

Every reference below (segments, B-matrix pooling, upsampling, entropy spikes, boundary patterns,
FLOPs) is written here from the project's conventions (docs/design.md) and the paper, not copied
from the code under test. Shared helpers (tiny_model, random_tokens, full_forward, ...) live in
conftest.py; tiny_model returns a fresh copy. Nothing here reads files outside the repository.
"""


import math
import re
import traceback
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import sample
from conftest import (HYPOTHESIS_FIXTURES, MODE_VARIANTS, MODES, POOLED_LAST, PREDICTOR_MODES,
                      SPACE, V, assert_close, full_forward, predictor_linear, random_tokens,
                      tiny_config, tiny_model)
from dynpool import (EXTERNAL_MODES, Config, DynamicPoolingLM, RelativeAttention, Routing, Stage,
                     binomial_prior_loss, boundary_matrix, downsample, entropy_spikes, padded_count,
                     step_flops, upsample)


# ---------------------------------------------------------------------------------------------
# Plain-Python references (loops over lists; obviously correct, slow, only for tiny inputs)
# ---------------------------------------------------------------------------------------------
def ref_segments(row):
    """Complete segments of one row of boundaries: lists of token indices. b_t = 1 closes the
    segment holding t; tokens after the last boundary form no (complete) segment."""
    segs, cur = [], []
    for t, v in enumerate(row):
        cur.append(t)
        if v:
            segs.append(cur)
            cur = []
    return segs


def ref_boundary_matrix(b):
    rows = [ref_segments([int(v) for v in r]) for r in b.tolist()]
    n, L = b.shape
    S = max(len(s) for s in rows)
    out = torch.zeros(n, L, S)
    for i, segs in enumerate(rows):
        for j, seg in enumerate(segs):
            for t in seg:
                out[i, t, j] = 1.0
    return out


def ref_downsample(h, b, null):
    rows = [ref_segments([int(v) for v in r]) for r in b.tolist()]
    n, L, D = h.shape
    S = max(len(s) for s in rows)
    out = torch.zeros(n, 1 + S, D, dtype=h.dtype)
    for i, segs in enumerate(rows):
        out[i, 0] = null
        for j, seg in enumerate(segs):
            acc = torch.zeros(D, dtype=h.dtype)
            for t in seg:
                acc += h[i, t]
            out[i, 1 + j] = acc / len(seg)
    return out


def ref_upsample(s, b):
    n, L = b.shape
    out = torch.zeros(n, L, s.shape[-1], dtype=s.dtype)
    for i in range(n):
        m = 0
        for t in range(L):
            m += int(b[i, t])          # m_t = sum_{i<=t} b_i: segments complete at t
            out[i, t] = s[i, m]
    return out


def ref_entropy_spikes(H, k):
    out = []
    for row in H.tolist():
        out.append([all(row[t] > row[i] for i in range(max(0, t - k), t)) for t in range(len(row))])
    return torch.tensor(out, dtype=torch.bool).reshape(H.shape)


# ---------------------------------------------------------------------------------------------
# Independent differentiable B-matrix pooling, as in the paper (pooling via the boundary matrix) and
# its reference code: c_t = cumsum(b) - b, B[n,t,j] = 1 - (j - c_t) where c_t == j (value 1, but
# differentiable in b), else 0; only complete segments (j < number of boundaries of the row). Means
# divide by column sums. Upsampling: one-hot of m_t = cumsum(b), built the same way and row-
# normalised.
# ---------------------------------------------------------------------------------------------
def paper_boundary_matrix(b):
    hard = b.detach().round()
    S = int(hard.sum(1).max().item())
    c = b.cumsum(1) - b                                            # [B, L] segment of token t
    j = torch.arange(S, dtype=b.dtype).view(1, 1, S)
    d = j - c.unsqueeze(-1)                                        # [B, L, S]
    complete = j < hard.sum(1).view(-1, 1, 1)                      # segment j closed in this row
    hit = (d.detach().round() == 0) & complete
    return torch.where(hit, 1 - d, torch.zeros_like(d))


def paper_downsample(h, b, null):
    Bm = paper_boundary_matrix(b)                                  # [B, L, S]
    sums = Bm.sum(1)                                               # [B, S] segment lengths
    sums = torch.where(sums.detach() > 0.5, sums, torch.ones_like(sums))
    pooled = torch.einsum('nls,nld->nsd', Bm, h) / sums.unsqueeze(-1)
    nulls = null.view(1, 1, -1).expand(h.shape[0], 1, h.shape[-1])
    return torch.cat([nulls, pooled], 1)


def paper_downsample_last(h, b, null):
    """Sub-sampling through the same B: each segment's tokens weighted by b, which is 1 at the
    segment's last token only (in value; its gradient is b's)."""
    pooled = torch.einsum('nls,nld->nsd', paper_boundary_matrix(b) * b.unsqueeze(-1), h)
    nulls = null.view(1, 1, -1).expand(h.shape[0], 1, h.shape[-1])
    return torch.cat([nulls, pooled], 1)


def ref_downsample_last(h, b, null):
    """Loop reference of sub-sampling: segment j is its last token's h (the one with b_t = 1)."""
    n, L, D = h.shape
    ends = [[t for t in range(L) if b[i, t] > 0.5] for i in range(n)]
    out = torch.zeros(n, 1 + max(len(e) for e in ends), D, dtype=h.dtype)
    for i, e in enumerate(ends):
        out[i, 0] = null
        for j, t in enumerate(e):
            out[i, 1 + j] = h[i, t]
    return out


def paper_upsample(s, b):
    m = b.cumsum(1)                                                # [B, L]
    j = torch.arange(s.shape[1], dtype=b.dtype).view(1, 1, -1)
    d = j - m.unsqueeze(-1)
    U = torch.where(d.detach().round() == 0, 1 - d, torch.zeros_like(d))
    U = U / U.sum(-1, keepdim=True)
    return torch.einsum('nls,nsd->nld', U, s)


# ---------------------------------------------------------------------------------------------
# Running a model
# ---------------------------------------------------------------------------------------------
def forward(model, x, training, seed=1234, **kw):
    """model(x, **kw) without grad, in train or eval mode, the global RNG (gumbel noise) fixed."""
    model.train(training)
    torch.manual_seed(seed)          # fixes the gumbel noise (same shape -> same noise)
    with torch.no_grad():
        return model(x, **kw)


def loss_and_grads(model, x, y, b=None, seed=1, **kw):
    """Training loss and every parameter's gradient (None where it got none), RNG fixed."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = model(x, targets=y, boundaries=b, **kw)
    out.loss.backward()
    return out, {n: p.grad for n, p in model.named_parameters()}


# Hypothesis examples of the costly model properties: few under the default profiles ('dev', 'ci':
# the same examples every CI run), many under 'explore', which draws fresh ones each run.
EXPLORE = settings._current_profile == 'explore'


def examples(default, explore):
    return explore if EXPLORE else default


def gold_for(mode, x, gen):
    """Unigram needs boundary targets to train; other modes take none."""
    return (torch.rand(x.shape, generator=gen) < 0.3) if mode.startswith('unigram') else None


# The alphabets the properties run on: (vocab size, space id) of the tiny characters, and of
# bytes (prepare_data.py --bytes: vocab 256, whitespace pooling at the space byte 32).
ALPHABETS = {'chars': (V, SPACE), 'bytes': (256, 32)}


def tiny_on(tiny, mode, alphabet):
    """The tiny model of a mode on an alphabet."""
    vocab, space = ALPHABETS[alphabet]
    return tiny(mode, vocab=vocab, whitespace_id=space)


def tokens_on(alphabet, gen, n, L, p_space):
    """random_tokens on an alphabet: on bytes, ids XOR 32 move its space (id 0) to the byte 32
    and spread the others over every byte but 32."""
    if alphabet == 'chars':
        return random_tokens(gen, n, L, p_space=p_space)
    return random_tokens(gen, n, L, 256, p_space) ^ 32


@st.composite
def leak_cases(draw, max_len=300):
    """(alphabet, batch, length, seed, space probability, per-row cut t): row i's tokens after
    cuts[i] change."""
    alphabet = draw(st.sampled_from(sorted(ALPHABETS)))
    n = draw(st.integers(1, 3))
    L = draw(st.integers(1, max_len))
    seed = draw(st.integers(0, 2**31 - 1))
    p_space = draw(st.sampled_from([0.0, 0.15, 0.3, 0.6, 1.0]))
    cuts = draw(st.lists(st.integers(0, L - 1), min_size=n, max_size=n))
    return alphabet, n, L, seed, p_space, cuts


# =============================================================================================
# 1. Leakage-freedom: logits at t depend on x_{<=t} only (paper: boundaries are predicted "in an
#    autoregressive fashion"): an autoregressive LM may use only x_{<=t} to predict x_{t+1}.
#    Pooling is where this breaks easily: a segment's mean includes tokens up to its end, so a token
#    may only read segments complete at t, and boundaries must be decided causally. We change every
#    row's suffix (rows cut at different t) and demand identical logits up to t, position by
#    position; the batch's max segment count S changes too, which must not matter.
# =============================================================================================
@pytest.mark.parametrize('training', [False, True], ids=['eval', 'train'])
@pytest.mark.parametrize('mode', MODES)
@settings(max_examples=examples(15, 40), **HYPOTHESIS_FIXTURES)
@given(case=leak_cases())
def test_no_leakage_from_future_tokens(tiny, mode, training, case):
    check_no_leakage(tiny, mode, training, case)


@pytest.mark.parametrize('training', [False, True], ids=['eval', 'train'])
@pytest.mark.parametrize('mode', POOLED_LAST)
@settings(max_examples=examples(6, 15), **HYPOTHESIS_FIXTURES)
@given(case=leak_cases())
def test_no_leakage_with_sub_sampling(tiny, mode, training, case):
    """Pooling by the last token (Table 2) reads a segment only once it is complete, too; fewer
    examples than above, as the boundaries and the rest of the model are the mean-pooled ones."""
    check_no_leakage(tiny, mode, training, case)


def check_no_leakage(tiny, mode, training, case):
    alphabet, n, L, seed, p_space, cuts = case
    model = tiny_on(tiny, mode, alphabet)
    gen = torch.Generator().manual_seed(seed)
    x = tokens_on(alphabet, gen, n, L, p_space)
    x2 = x.clone()
    for i, t in enumerate(cuts):
        x2[i, t + 1:] = tokens_on(alphabet, gen, 1, L - t - 1, p_space)[0]
    out1, out2 = forward(model, x, training), forward(model, x2, training)
    assert out1.logits.shape == (n, L, ALPHABETS[alphabet][0])
    for i, t in enumerate(cuts):
        assert_close(out1.logits[i, :t + 1], out2.logits[i, :t + 1], atol=1e-5,
                     msg=f'[{mode} {alphabet} training={training}] row {i}, logits up to t={t} '
                         f'of L={L}:')
        if out1.boundaries is not None:     # hard decisions equal; straight-through values close
            # hnet's b_t (a chunk starts at t+1) is decided by x_{t+1}; token t never reads it.
            upto = t if mode == 'hnet' else t + 1
            b1, b2 = out1.boundaries[i, :upto].float(), out2.boundaries[i, :upto].float()
            where = f'[{mode} training={training}] row {i}, boundaries up to t={t}:'
            assert_close(b1.round(), b2.round(), atol=0, msg=where)
            assert_close(b1, b2, atol=1e-5, msg=where)


@pytest.mark.parametrize('training', [False, True], ids=['eval', 'train'])
@pytest.mark.parametrize('mode', ['fixed', 'whitespace'])
@settings(max_examples=examples(10, 25), **HYPOTHESIS_FIXTURES)
@given(case=leak_cases(), density=st.sampled_from([0.0, 0.2, 0.5, 1.0]))
def test_no_leakage_from_future_external_boundaries(tiny, mode, training, case, density):
    """External boundaries are an input too: changing b (and x) after t leaves logits up to t
    alone."""
    alphabet, n, L, seed, p_space, cuts = case
    model = tiny_on(tiny, mode, alphabet)
    gen = torch.Generator().manual_seed(seed)
    x = tokens_on(alphabet, gen, n, L, p_space)
    b = torch.rand(n, L, generator=gen) < density
    x2, b2 = x.clone(), b.clone()
    for i, t in enumerate(cuts):
        x2[i, t + 1:] = tokens_on(alphabet, gen, 1, L - t - 1, p_space)[0]
        b2[i, t + 1:] = torch.rand(L - t - 1, generator=gen) < 0.5
    out1 = forward(model, x, training, boundaries=b)
    out2 = forward(model, x2, training, boundaries=b2)
    for i, t in enumerate(cuts):
        assert_close(out1.logits[i, :t + 1], out2.logits[i, :t + 1], atol=1e-5,
                     msg=f'[{mode} training={training}] row {i}, logits up to t={t} of L={L}:')


@pytest.mark.parametrize('mode', PREDICTOR_MODES + ['hnet'])
def test_predictor_modes_make_mixed_boundaries(mode):
    """Guards the leakage test above: the tiny predictor models really pool (mix of 0 and 1)."""
    model = tiny_model(mode)
    x = random_tokens(torch.Generator().manual_seed(7), 8, 64)
    for training in (False, True):
        b = forward(model, x, training).boundaries.float()
        # {0, 1} up to float error (straight-through: hard - soft.detach() + soft)
        assert ((b - b.round()).abs() < 1e-5).all()
        assert set(b.round().unique().tolist()) <= {0.0, 1.0}
        b = b.round()
        frac = b.mean().item()
        assert 0.1 < frac < 0.6, f'{mode} training={training}: boundary fraction {frac:.2f}'
        mixed = ((b.sum(1) > 0) & (b.sum(1) < b.shape[1])).float().mean().item()
        assert mixed >= 0.75, \
            f'{mode} training={training}: only {mixed:.0%} of rows mix 0/1 boundaries'


@pytest.mark.parametrize('mode', PREDICTOR_MODES + ['hnet'])
def test_predictor_modes_pool_with_their_own_decisions(mode):
    """docs/design.md: unigram / entropy / gumbel pool with the predictor's rounded decisions;
    boundaries passed in (Unigram gold: training targets only) depend on the future and must not
    reach the logits."""
    model = tiny_model(mode)
    gen = torch.Generator().manual_seed(3)
    x = random_tokens(gen, 2, 50)
    gold1 = torch.rand(2, 50, generator=gen) < 0.3
    gold2 = ~gold1
    for training in (False, True):
        o1 = forward(model, x, training, targets=x, boundaries=gold1)
        o2 = forward(model, x, training, targets=x, boundaries=gold2)
        assert_close(o1.logits, o2.logits, atol=1e-6, msg=f'{mode} training={training}:')
        assert torch.equal(o1.boundaries.float(), o2.boundaries.float())

# =============================================================================================
# 2. Pooling invariants: segment means behind a null group, and upsampling from the last segment
#    complete at t (paper: pooling by averaging, up-sampling by duplication; docs/design.md
#    "Segments"): token t belongs to segment c_t = sum_{i<t} b_i; only complete segments are pooled;
#    downsample is the mean over a segment behind a null group; upsample gives token t the last
#    segment complete at t. Checked against the loop references above, on hand-picked and
#    hypothesis-drawn patterns.
# =============================================================================================
@st.composite
def boundary_batches(draw, max_n=3, max_len=24):
    """Float {0,1} boundaries [n, L]; rows are random, all-zero or all-one, so one batch can mix
    rows with very different segment counts (S is the batch max)."""
    n = draw(st.integers(1, max_n))
    L = draw(st.integers(1, max_len))
    rows = []
    for _ in range(n):
        kind = draw(st.sampled_from(['random', 'random', 'zeros', 'ones']))
        if kind == 'random':
            rows.append(draw(st.lists(st.booleans(), min_size=L, max_size=L)))
        else:
            rows.append([kind == 'ones'] * L)
    return torch.tensor(rows, dtype=torch.float32)


HAND_PICKED = [
    [[0, 0, 0, 0]],                              # no boundary: S = 0, nothing pooled
    [[1, 1, 1, 1]],                              # every token its own segment
    [[0, 1, 0, 0, 1, 0, 0]],                     # trailing incomplete segment (tokens 5, 6)
    [[1, 0, 0, 1, 0], [0, 0, 0, 0, 0]],          # rows with different segment counts
    [[0, 0, 1, 1, 0, 1], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1]],
    [[1]], [[0]],
]


def _hand(p):
    return torch.tensor(p, dtype=torch.float32)


def _show(b, n=120):
    """A boundary pattern for failure messages, cut short."""
    text = str(b.int().tolist())
    return text if len(text) <= n else text[:n] + '...]'


def check_boundary_matrix(b):
    Bm = boundary_matrix(b)
    ref = ref_boundary_matrix(b)
    assert Bm.shape == ref.shape, f'b={_show(b)}'
    assert Bm.is_floating_point()
    assert_close(Bm, ref, atol=1e-6, msg=f'b={_show(b)}:')
    # one-hot or zero per token; column sums are segment lengths; zero after the last boundary
    per_token = Bm.sum(-1)
    assert ((per_token.round() == 0) | (per_token.round() == 1)).all()
    for i, row in enumerate(b.tolist()):
        segs = ref_segments(row)
        lengths = [len(s) for s in segs] + [0] * (Bm.shape[-1] - len(segs))
        assert_close(Bm[i].sum(0), torch.tensor(lengths, dtype=torch.float32), atol=1e-6)
        last = max([t for t, v in enumerate(row) if v], default=-1)
        assert_close(Bm[i, last + 1:], torch.zeros_like(Bm[i, last + 1:]), atol=0,
                     msg=f'tokens after the last boundary must be in no pooled segment, row {row}:')


def check_downsample(b, D=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*b.shape, D, generator=g)
    null = torch.randn(D, generator=g)
    out = downsample(h, b, null)
    ref = ref_downsample(h, b, null)
    assert out.shape == ref.shape, f'b={_show(b)}'
    assert_close(out, ref, atol=1e-5, msg=f'downsample b={_show(b)}:')


def check_upsample(b, D=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    S = int(b.sum(1).max())
    s = torch.randn(b.shape[0], 1 + S, D, generator=g)
    out = upsample(s, b)
    assert_close(out, ref_upsample(s, b), atol=1e-6, msg=f'upsample b={_show(b)}:')


def check_no_future_in_pooled_path(b):
    """up(down(identity)): token t's vector is a mix of one-hot token positions; it must carry no
    mass on any position > t (no token ever receives a segment holding a later token)."""
    n, L = b.shape
    h = torch.eye(L).expand(n, L, L).contiguous()
    z = upsample(downsample(h, b, torch.zeros(L)), b)        # [n, L(token), L(source position)]
    future = torch.triu(torch.ones(L, L, dtype=torch.bool), diagonal=1)
    leak = z.abs() * future
    assert leak.max().item() == 0, f"b={_show(b)}: token receives a later token's state"


@pytest.mark.parametrize('pattern', HAND_PICKED)
def test_pooling_invariants_hold_on_hand_picked_boundaries(pattern):
    b = _hand(pattern)
    check_boundary_matrix(b)
    check_downsample(b)
    check_upsample(b)
    check_no_future_in_pooled_path(b)


def test_pooling_worked_example_by_hand():
    """b = 0 1 0 0 1 0: segments {0,1}, {2,3,4}; tokens 5 is in no pooled segment."""
    b = _hand([[0, 1, 0, 0, 1, 0]])
    h = torch.arange(6, dtype=torch.float32).view(1, 6, 1)
    null = torch.tensor([-1.0])
    assert_close(downsample(h, b, null), torch.tensor([[[-1.0], [0.5], [3.0]]]), atol=1e-6)
    s = torch.tensor([[[10.0], [20.0], [30.0]]])
    assert_close(upsample(s, b), torch.tensor([[[10.0], [20.0], [20.0], [20.0], [30.0], [30.0]]]),
                 atol=1e-6)


@given(b=boundary_batches())
def test_boundary_matrix_matches_loop_reference(b):
    check_boundary_matrix(b)


@given(b=boundary_batches(), seed=st.integers(0, 1000))
def test_downsample_matches_loop_reference(b, seed):
    check_downsample(b, seed=seed)


@given(b=boundary_batches(), seed=st.integers(0, 1000))
def test_upsample_matches_loop_reference(b, seed):
    check_upsample(b, seed=seed)


@given(b=boundary_batches())
def test_pooled_path_never_reads_the_future(b):
    check_no_future_in_pooled_path(b)


def test_pooling_accepts_bool_boundaries():
    """docs/design.md: boundaries are bool where no gradient is needed."""
    b = _hand([[0, 1, 1, 0, 1], [1, 0, 0, 0, 0]])
    check_boundary_matrix(b)
    assert_close(boundary_matrix(b.bool()), boundary_matrix(b), atol=0)
    h, null = torch.randn(2, 5, 3), torch.randn(3)
    assert_close(downsample(h, b.bool(), null), downsample(h, b, null), atol=1e-6)
    s = torch.randn(2, 4, 3)
    assert_close(upsample(s, b.bool()), upsample(s, b), atol=1e-6)


# Low precision. Under torch.autocast the predictor's logits, hence its boundaries, are bfloat16.
# Segment indices are integers up to L (2048 in the paper); they must not be taken from a running
# sum in a format that cannot count that far (bfloat16 is exact only up to 256) or that
# accumulates the straight-through rounding error of `hard + soft - soft.detach()`.


def test_segment_indices_stay_exact_in_bfloat16_past_256():
    """Exact 0/1 boundaries, but bfloat16 and more than 256 of them."""
    b = (torch.rand(1, 700, generator=torch.Generator().manual_seed(0)) < 0.6).float()
    assert b.sum() > 300
    check_boundary_matrix(b.bfloat16())
    check_downsample(b.bfloat16())
    check_upsample(b.bfloat16())


def test_gumbel_training_under_bfloat16_autocast_pools_causally():
    """The boundaries the gumbel model actually pools with in AMP training: the pooled path
    up(down(.)) must follow their hard values and never hand a token a later token's state."""
    model = tiny_model('gumbel').train()
    x = random_tokens(torch.Generator().manual_seed(0), 1, 1200)
    torch.manual_seed(0)
    with torch.no_grad(), torch.autocast('cpu', dtype=torch.bfloat16):
        b = model(x).boundaries
    model.eval()
    assert b.round().sum() > 300
    assert_close(boundary_matrix(b).float(), ref_boundary_matrix(b.float().round()), atol=1e-6,
                 msg='segments of the pooled boundaries vs their hard values:')
    check_no_future_in_pooled_path(b)



def test_bucketed_segments_are_zero_rows_after_the_real_ones():
    """S rounded up to a bucket (GPU shapes): the extra rows are zeros after every real segment, so
    the real rows, the null group and upsampling are untouched."""
    b = _hand([[0, 1, 0, 0, 1, 0, 1], [1, 0, 0, 0, 0, 0, 0]])
    h, null = torch.randn(2, 7, 3), torch.randn(3)
    plain, padded = downsample(h, b, null), downsample(h, b, null, bucket=8)
    assert plain.shape == (2, 4, 3) and padded.shape == (2, 9, 3)
    assert_close(padded[:, :4], plain, atol=0)
    assert_close(padded[:, 4:], torch.zeros(2, 5, 3), atol=0)
    assert_close(upsample(padded, b), upsample(plain, b), atol=0)


def test_segment_count_rounding_is_one_rule():
    """padded_count is the one rounding of S (segments for MeanPooling, chunks for hnet.py): up to
    a multiple of the bucket, and bucket 0 (Config.seg_bucket's default) means 64 on CUDA, 1
    elsewhere; hnet's pooling pads its chunks by it as the mean pooling pads its segments."""
    cpu, cuda = torch.device('cpu'), torch.device('cuda')     # a device object needs no GPU
    for n in range(0, 140, 9):
        for bucket in (1, 3, 8, 64):
            assert padded_count(n, bucket, cpu) == math.ceil(n / bucket) * bucket
        assert padded_count(n, 0, cpu) == n
        assert padded_count(n, 0, cuda) == math.ceil(n / 64) * 64
    x = random_tokens(torch.Generator().manual_seed(3), 2, 40)
    for mode, null_rows in (('whitespace', 1), ('hnet', 0)):
        model = tiny_model(mode, seg_bucket=8)
        with torch.no_grad():
            h = model.pre(model.embed(x), model.u, model.v)
            routing = model.source(h, x)
            pooled = model.pooling.down(h, routing)
            rows = pooled.size(1) - null_rows
            # the rows generation keeps: the null group (if any) and the real segments
            kept = model.pooling.prefill_state(h, pooled, routing).rows
        real = int(kept.max()) - null_rows
        assert rows == padded_count(real, 8, cpu) and rows > real, (mode, rows, real)


# =============================================================================================
# 3. Gradients reach the boundaries through the boundary matrix (paper: Gumbel-sigmoid boundaries
#    learnt end-to-end): with Gumbel-sigmoid / straight-through boundaries the predictor learns
#    from the LM loss only through the pooling, i.e. through the running sum c_t that assigns
#    tokens to segments in B. dynpool's pooling must agree
#    with the independent B-matrix implementation above in values AND in gradients w.r.t. h, null, s
#    and the float boundaries.
# =============================================================================================
def _grads(f, inputs, g):
    out = f(*inputs)
    gr = torch.autograd.grad((out * g).sum(), inputs, allow_unused=True)
    return out, [torch.zeros_like(x) if d is None else d for x, d in zip(inputs, gr)]


def check_pooling_gradients(b_hard, seed, straight_through, pooling='mean'):
    n, L = b_hard.shape
    D = 4
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n, L, D, generator=gen)
    null = torch.randn(D, generator=gen)
    S = int(b_hard.sum(1).max())
    s = torch.randn(n, 1 + S, D, generator=gen)
    g_down = torch.randn(n, 1 + S, D, generator=gen)
    g_up = torch.randn(n, L, D, generator=gen)
    # soft probabilities on the right side of 0.5, so hard == round(soft)
    p = torch.rand(n, L, generator=gen) * 0.45
    soft_logit = torch.logit(torch.where(b_hard > 0, 1 - p, p))

    def make_b(z):
        if not straight_through:
            return z
        soft = torch.sigmoid(z)
        return b_hard - soft.detach() + soft

    leaf_b = (soft_logit if straight_through else b_hard).clone()
    results = {}
    ours = lambda h_, b_, n_: downsample(h_, b_, n_, pooling=pooling)  # noqa: E731
    paper = paper_downsample_last if pooling == 'last' else paper_downsample
    for name, (down, up) in {'dynpool': (ours, upsample), 'paper': (paper, paper_upsample)}.items():
        hh, nn_, ss, bb = (t.clone().requires_grad_(True) for t in (h, null, s, leaf_b))
        o_down, gr_down = _grads(lambda h_, n_, b_: down(h_, make_b(b_), n_), [hh, nn_, bb], g_down)
        o_up, gr_up = _grads(lambda s_, b_: up(s_, make_b(b_)), [ss, bb], g_up)
        results[name] = (o_down, gr_down, o_up, gr_up)
    d, p_ = results['dynpool'], results['paper']
    ctx = f'b={_show(b_hard)} straight_through={straight_through}'
    assert_close(d[0], p_[0], atol=1e-5, msg=f'downsample value {ctx}:')
    for what, a, r in zip(['h', 'null', 'b'], d[1], p_[1]):
        assert_close(a, r, atol=1e-4, rtol=1e-4, msg=f'downsample d/d{what} {ctx}:')
    assert_close(d[2], p_[2], atol=1e-5, msg=f'upsample value {ctx}:')
    for what, a, r in zip(['s', 'b'], d[3], p_[3]):
        assert_close(a, r, atol=1e-4, rtol=1e-4, msg=f'upsample d/d{what} {ctx}:')
    return results


@given(b=boundary_batches(max_len=16), seed=st.integers(0, 1000), st_=st.booleans(),
       pooling=st.sampled_from(['mean', 'last']))
def test_pooling_gradients_match_paper_b_matrix(b, seed, st_, pooling):
    check_pooling_gradients(b, seed, st_, pooling)


@pytest.mark.parametrize('pooling', ['mean', 'last'])
@pytest.mark.parametrize('st_', [False, True], ids=['float-b', 'straight-through'])
def test_gradient_reaches_boundaries_through_b_matrix(st_, pooling):
    """Segments of several tokens with different states: d(pooled)/d b_i is non-zero for the
    boundaries inside a segment (moving the running sum moves tokens between segments; with
    sub-sampling, b_t also weights the token it selects)."""
    b = _hand([[0, 0, 1, 0, 0, 0, 1, 0], [0, 1, 0, 0, 1, 1, 0, 0]])
    res = check_pooling_gradients(b, seed=5, straight_through=st_, pooling=pooling)
    grad_b = res['dynpool'][1][2]
    assert grad_b.abs().max().item() > 1e-3, 'downsample gives no gradient to the boundaries'


@given(b=boundary_batches(), seed=st.integers(0, 1000))
def test_sub_sampling_takes_each_segments_last_token(b, seed):
    """Paper Table 2: with pooling='last' a segment is represented by its last token's vector."""
    g = torch.Generator().manual_seed(seed)
    h, null = torch.randn(*b.shape, 5, generator=g), torch.randn(5, generator=g)
    assert_close(downsample(h, b, null, pooling='last'), ref_downsample_last(h, b, null),
                 atol=1e-6, msg=f'b={_show(b)}:')


def test_pooling_is_checked_by_config():
    """Sub-sampling needs segments pooled by the boundary matrix: not vanilla, not H-Net's
    chunks; an unknown pooling is refused by name."""
    for mode in ('none', 'hnet'):
        with pytest.raises(ValueError, match="pooling.*'last'"):
            Config(boundary=mode, pooling='last')
    with pytest.raises(ValueError, match='pooling must be'):
        Config(boundary='fixed', pooling='max')



@pytest.mark.parametrize('mode', MODE_VARIANTS)
def test_every_parameter_gets_a_gradient(mode):
    """DDP runs with find_unused_parameters=False, static_graph=True: every parameter must take part
    in every mode's training loss, and with a gradient that is not all zeros."""
    model = tiny_model(mode, dropout=0.1)
    gen = torch.Generator().manual_seed(4)
    x = random_tokens(gen, 2, 40)
    _, grads = loss_and_grads(model.train(), x, torch.roll(x, -1, 1), gold_for(mode, x, gen))
    missing = [n for n, g in grads.items() if g is None or not g.abs().sum() > 0]
    assert not missing, f'{mode}: no gradient for {missing}'


# =============================================================================================
# 4. Each boundary source decides as the paper says (whitespace, fixed, entropy-spike, Unigram,
#    Gumbel boundaries; docs/design.md "Conventions"), and its loss is the paper's: whitespace
#    closes its word (b_t = 1 iff x_t is a space), fixed pooling closes every k-th token
#    ((t+1) % k == 0), and entropy spikes are strict local maxima over the previous k entropies.
# =============================================================================================
@settings(**HYPOTHESIS_FIXTURES)
@given(case=leak_cases(max_len=80))
def test_whitespace_boundaries_are_the_spaces(tiny, case):
    alphabet, n, L, seed, p_space, _ = case
    x = tokens_on(alphabet, torch.Generator().manual_seed(seed), n, L, p_space)
    out = forward(tiny_on(tiny, 'whitespace', alphabet), x, training=False)
    space = ALPHABETS[alphabet][1]
    assert torch.equal(out.boundaries.bool(), x == space), f'x={x.tolist()}'


@pytest.mark.parametrize('k', [1, 2, 3, 5])
def test_fixed_boundaries_close_every_kth_token(k):
    torch.manual_seed(0)
    model = DynamicPoolingLM(tiny_config('fixed', fixed_factor=k)).eval()
    L = 13
    x = random_tokens(torch.Generator().manual_seed(k), 2, L)
    out = forward(model, x, training=False)
    expected = torch.tensor([[(t + 1) % k == 0 for t in range(L)]] * 2)
    assert torch.equal(out.boundaries.bool(), expected)


def test_external_boundaries_are_used_for_pooling():
    """Given boundaries (fixed / whitespace) are the ones pooled with, and they matter."""
    gen = torch.Generator().manual_seed(11)
    x = random_tokens(gen, 2, 40)
    b = torch.rand(2, 40, generator=gen) < 0.3
    for mode in ('fixed', 'whitespace'):
        model = tiny_model(mode)
        out = forward(model, x, False, boundaries=b)
        assert torch.equal(out.boundaries.bool(), b)
        assert not torch.allclose(out.logits, forward(model, x, False, boundaries=~b).logits)


@given(H=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=3)
       .filter(lambda rows: len({len(r) for r in rows}) == 1),
       k=st.integers(1, 14))
def test_entropy_spikes_match_loop_reference(H, k):
    """Small integer entropies make ties common: a tie is not a spike (strict >)."""
    Ht = torch.tensor(H, dtype=torch.float32)
    got = entropy_spikes(Ht, k)
    assert got.dtype == torch.bool and got.shape == Ht.shape
    assert torch.equal(got, ref_entropy_spikes(Ht, k)), f'H={H} k={k}'


@given(n=st.integers(1, 3), L=st.integers(1, 200), k=st.integers(1, 6), seed=st.integers(0, 10**6))
def test_entropy_spikes_random_floats(n, L, k, seed):
    Ht = torch.rand(n, L, generator=torch.Generator().manual_seed(seed)) * 3
    got, want = entropy_spikes(Ht, k), ref_entropy_spikes(Ht, k)
    assert torch.equal(got, want), \
        f'k={k}: first mismatch at {tuple((got != want).nonzero()[0].tolist())}'


def test_entropy_spikes_edge_cases():
    H = torch.tensor([[1.0, 2.0, 2.0, 3.0, 0.5, 0.7, 0.6]])
    # t=0 always (nothing before it); ties (t=2) are no spikes.
    assert entropy_spikes(H, 1).tolist() == [[True, True, False, True, False, True, False]]
    assert entropy_spikes(H, 2).tolist() == [[True, True, False, True, False, False, False]]
    # window at least as long as the row: spike iff greater than everything before it
    assert entropy_spikes(H, 7).tolist() == [[True, True, False, True, False, False, False]]
    assert entropy_spikes(H, 100).tolist() == entropy_spikes(H, 7).tolist()
    assert entropy_spikes(torch.tensor([[5.0]]), 2).tolist() == [[True]]
    assert entropy_spikes(torch.zeros(2, 4), 2).tolist() == [[True, False, False, False]] * 2
    # default window is 2
    assert torch.equal(entropy_spikes(H), entropy_spikes(H, 2))


@pytest.mark.parametrize('mode', MODES)
def test_losses_targets_and_metrics_are_the_papers(mode):
    """What the model reports with targets, recomputed here: LM loss in nats/char, total = LM +
    boundary loss, the predictor's targets (gold Unigram / spikes of the model's own next-char
    entropy H_t), precision and recall of the pooled boundaries, and the shortening factor."""
    model = tiny_model(mode)
    gen = torch.Generator().manual_seed(21)
    x = random_tokens(gen, 3, 60)
    y = torch.roll(x, -1, 1)
    gold = torch.rand(3, 60, generator=gen) < 0.3
    kw = dict(boundaries=gold) if mode == 'unigram' else {}
    out = forward(model, x, False, targets=y, **kw)
    logp = torch.log_softmax(out.logits.double(), -1)
    assert_close(out.lm_loss, -logp.gather(-1, y[..., None]).mean(), atol=1e-5, msg='lm_loss:')
    assert_close(out.loss, out.lm_loss + out.boundary_loss, atol=1e-6, msg='loss:')
    if mode == 'none':
        assert out.boundaries is None
        return
    b = out.boundaries.float().round().bool()
    assert_close(out.shortening_factor, b.numel() / b.sum(), atol=1e-4, msg='shortening factor:')
    if mode in ('unigram', 'entropy'):
        assert out.boundary_loss.item() > 0
        if mode == 'unigram':
            expected = gold
        else:
            H = -(logp.exp() * logp).sum(-1)          # entropy of the prediction of x_{t+1}
            expected = ref_entropy_spikes(H, model.cfg.entropy_window)
        assert torch.equal(out.boundary_targets.bool(), expected)
        tp = (b & expected).sum().item()
        assert b.sum() > 0 and expected.sum() > 0
        assert_close(out.precision, tp / b.sum().item(), atol=1e-6, msg='precision:')
        assert_close(out.recall, tp / expected.sum().item(), atol=1e-6, msg='recall:')




def test_gumbel_evaluation_samples_with_fixed_noise():
    """Gumbel in eval mode pools with one fixed noise draw per position (training samples; so did
    the paper's code at evaluation): a predictor held at the prior α = 0.2 still closes ~20% of
    segments, where noiseless rounding would close none, and the same ones on every call."""
    model = DynamicPoolingLM(tiny_config('gumbel')).eval()
    lin = predictor_linear(model)
    with torch.no_grad():
        lin.weight.zero_()
        lin.bias.fill_(math.log(0.2 / 0.8))
    x = random_tokens(torch.Generator().manual_seed(0), 2, 2000)
    b1, b2 = model(x).boundaries, model(x).boundaries
    assert torch.equal(b1, b2), 'eval mode must be deterministic'
    assert torch.equal(b1[0], b1[1]), 'the noise depends on the position only, not on the row'
    assert 0.15 < b1.mean().item() < 0.25, f'boundary rate {b1.mean().item():.3f}, expected ~0.2'


@pytest.mark.parametrize('prior', [0.05, 0.2, 0.6])
def test_binomial_prior_loss_is_the_binomial_log_likelihood(prior):
    """binomial_prior_loss(b, α) = -log Binomial(Σ_t b_t; L, α) / L averaged over rows, in value
    and in its gradient through straight-through boundaries (rows with no and all boundaries
    too)."""
    L = 30
    z = torch.randn(4, L, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    z[2], z[3] = -1.0, 1.0                               # k = 0 and k = L
    z.requires_grad_(True)
    soft = torch.sigmoid(z)
    b = (soft > 0.5).double() + soft - soft.detach()     # 0/1 in value, differentiable
    got = binomial_prior_loss(b, prior)
    binomial = torch.distributions.Binomial(L, probs=torch.tensor(prior, dtype=torch.float64),
                                            validate_args=False)   # k is integral only to 1e-16
    want = -(binomial.log_prob(b.sum(1)) / L).mean()
    assert_close(got, want, atol=1e-12, msg='value:')
    g_got, = torch.autograd.grad(got, z, retain_graph=True)   # the graph through b is shared
    g_want, = torch.autograd.grad(want, z)
    assert g_want.abs().max() > 1e-4
    assert_close(g_got, g_want, atol=1e-12, msg='gradient:')



@pytest.mark.parametrize('mode', ['unigram', 'entropy'])
def test_double_sigmoid_is_the_released_codes_predictor_loss(mode):
    """Config.double_sigmoid: BCEWithLogitsLoss of σ(logit), as the paper's released code, with its
    floors -log σ(1) (target 1) and log 2 (target 0); off: the cross-entropy of σ(logit)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 40, generator=gen, dtype=torch.float64) * 4
    targets = torch.rand(3, 40, generator=gen) < 0.3
    paper = DynamicPoolingLM(tiny_config(mode)).source
    released = DynamicPoolingLM(tiny_config(mode, double_sigmoid=True)).source
    r = Routing((logits > 0).double(), logits)
    want = F.binary_cross_entropy(torch.sigmoid(logits).float(), targets.float())
    assert_close(paper.bce(r, targets)[0], want)
    want = torch.nn.BCEWithLogitsLoss()(torch.sigmoid(logits).float(), targets.float())
    assert_close(released.bce(r, targets)[0], want)
    sure = Routing(targets.double(), torch.where(targets, 50.0, -50.0).double())
    rate = targets.double().mean().item()
    floor = rate * -math.log(1 / (1 + math.exp(-1))) + (1 - rate) * math.log(2)
    assert abs(released.bce(sure, targets)[0].item() - floor) < 1e-5
    assert paper.bce(sure, targets)[0].item() < 1e-6


def test_double_sigmoid_only_for_trained_predictors():
    with pytest.raises(ValueError, match='double_sigmoid'):
        tiny_config('gumbel', double_sigmoid=True)

# =============================================================================================
# 5. The attention paths and S buckets compute the same function (docs/design.md:
#    Config.attention): 'sdpa' (one fused call), 'blocked' (query blocks) and 'auto', with or
#    without S rounded up to a bucket, give the same values and gradients in every mode, training
#    and evaluation. float64, several attention blocks (attn_chunk 5).
# =============================================================================================
VARIANTS = [dict(attention='blocked'), dict(attention='sdpa'),
            dict(attention='blocked', seg_bucket=16)]


@pytest.mark.parametrize('training', [False, True], ids=['eval', 'train'])
@pytest.mark.parametrize('mode', MODES)
def test_attention_paths_and_buckets_agree(mode, training):
    base = tiny_model(mode, attn_chunk=5).double()
    gen = torch.Generator().manual_seed(6)
    x = random_tokens(gen, 3, 23)
    y, b = torch.roll(x, -1, 1), gold_for(mode, x, gen)
    results = []
    for kw in VARIANTS:
        model = DynamicPoolingLM(tiny_config(mode, attn_chunk=5, **kw)).double().train(training)
        model.load_state_dict(base.state_dict())
        out, grads = loss_and_grads(model, x, y, b)
        results.append((kw, out, grads))
    _, ref, ref_grads = results[0]
    for kw, out, grads in results[1:]:
        assert_close(out.logits, ref.logits, atol=1e-10, msg=f'{mode} {kw} logits:')
        assert_close(out.loss, ref.loss, atol=1e-6, msg=f'{mode} {kw} loss:')  # float32 CE
        for name, g in grads.items():
            assert (g is None) == (ref_grads[name] is None), f'{mode} {kw} d/d{name}'
            if g is not None:      # None: the predictor in evaluation (gumbel: fixed noise)
                assert_close(g, ref_grads[name], atol=1e-10, msg=f'{mode} {kw} d/d{name}:')


def test_auto_attention_is_blocked_on_cpu_and_fused_elsewhere():
    """The choice behind 'auto' (README, Performance): blocked was faster on CPU."""
    attn = RelativeAttention(tiny_config('none', attention='auto'))
    assert not attn.fused(torch.zeros(1, device='cpu'))
    assert attn.fused(torch.zeros(1, device='meta'))


def test_attention_queries_stay_bfloat16_under_autocast():
    """The float32 biases u, v must not promote a bf16 q to float32 (a cast per block)."""
    attn = RelativeAttention(tiny_config('none'))
    with torch.autocast('cpu', dtype=torch.bfloat16):
        q_content, q_pos, k, _ = attn.heads(torch.randn(2, 5, 32), torch.randn(2, 16),
                                            torch.randn(2, 16))
    assert q_content.dtype == q_pos.dtype == k.dtype == torch.bfloat16
# =============================================================================================
# 6. Every mode learns: each fits a 64-character English string in a few dozen Adam steps (all
#    gradient paths are wired up: LM, predictor, pooling, upsampling). The text is carried here, so
#    the test runs in a fresh clone.
# =============================================================================================
ENGLISH = """
A river begins as rain on the hills. It runs down through small streams, gathers in the valley
below the old mill, and turns slowly towards the sea, carrying sand, leaves and the noise of every
town it passes on the way.
"""


def english_snippet(n):
    """The first n characters of ENGLISH in text8's alphabet: lower case, spaces, nothing else."""
    text = ' '.join(re.sub(r'[^a-z]+', ' ', ENGLISH.lower()).split())
    assert len(text) >= n
    return text[:n]


@pytest.mark.parametrize('mode', MODES)
def test_each_mode_overfits_a_short_string(mode):
    text = english_snippet(65)
    ids = torch.tensor([[0 if c == ' ' else ord(c) - ord('a') + 1 for c in text]])
    assert 0 <= ids.min() and ids.max() < 27
    x, y = ids[:, :-1], ids[:, 1:]
    gold = x == 0                          # words as Unigram targets (each space ends a piece)
    torch.manual_seed(0)
    space = 0 if mode in ('whitespace', 'gumbel') else None
    model = DynamicPoolingLM(tiny_config(mode, vocab=27, whitespace_id=space)).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    kw = dict(boundaries=gold) if mode == 'unigram' else {}
    losses = []
    for step in range(40):
        torch.manual_seed(step)
        out = model(x, targets=y, **kw)
        assert torch.isfinite(out.loss), f'{mode}: loss {out.loss} at step {step}'
        losses.append(out.lm_loss.item())
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    assert losses[-1] < 0.5 * losses[0], f'{mode}: lm loss {losses[0]:.3f} -> {losses[-1]:.3f}'


# =============================================================================================
# 7. Size and cost: the defaults are the paper's character-level model (12 layers, d_model 512,
#    ~41M), and step_flops counts what the model computes.
# =============================================================================================
@pytest.mark.parametrize('mode', ['none', 'gumbel'])
def test_default_config_is_the_papers_41M_model(mode):
    cfg = Config(vocab_size=27, boundary=mode)
    try:
        with torch.device('meta'):
            model = DynamicPoolingLM(cfg)
    except Exception:                      # meta device unsupported by some init: build for real
        model = DynamicPoolingLM(cfg)
    n = sum(p.numel() for p in model.parameters())
    assert 39e6 <= n <= 43e6, f'{mode}: {n / 1e6:.2f}M parameters'


def test_initialisation_is_the_released_codes():
    """The released code's init (utils/init.py there): Linear and Embedding weights N(0, 0.02),
    LayerNorm gains N(1, 0.02), every bias 0, the relative-attention biases u, v N(0, 0.02), the
    null group N(0, 1). Widths large enough that each std is measured to a few percent."""
    torch.manual_seed(0)
    cfg = Config(vocab_size=27, boundary='gumbel', d_model=128, n_head=8, d_head=32, d_inner=256,
                 layers=(1, 2, 1))
    model = DynamicPoolingLM(cfg)
    norms = [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    gains = torch.cat([m.weight.detach() for m in norms])
    weights = torch.cat([m.weight.detach().flatten() for m in linears]
                        + [model.embed.weight.detach().flatten()])
    u_v = torch.cat([model.u.detach().flatten(), model.v.detach().flatten()])
    for name, values, mean, std in (('LayerNorm gains', gains, 1.0, 0.02),
                                    ('Linear/Embedding weights', weights, 0.0, 0.02),
                                    ('u, v', u_v, 0.0, 0.02),
                                    ('null group', model.pooling.null_group.detach(), 0.0, 1.0)):
        assert abs(values.mean().item() - mean) < 4 * std / values.numel() ** 0.5, name
        assert 0.85 * std < values.std().item() < 1.15 * std, f'{name}: std {values.std():.4f}'
    biases = [m.bias for m in norms + linears if m.bias is not None]
    assert len(biases) > len(norms) and all((b == 0).all() for b in biases)


@pytest.mark.parametrize('mode', MODES)
def test_count_segments_is_the_sources_own_rule(mode):
    """count_segments (train.py, bench.py, study.sh) = the complete segments of the boundaries
    the model derives in its forward, for the sources the text decides; None where a network
    does. shortened_length(L, sf) is then the length the shortened stage runs at."""
    from dynpool import count_segments, shortened_length
    model = tiny_model(mode)
    x = random_tokens(torch.Generator().manual_seed(3), 6, 26)
    counts = count_segments(model.cfg, x)
    if mode not in EXTERNAL_MODES:
        assert counts is None
        return
    out = model(x)
    assert counts.dtype == torch.int64 and torch.equal(counts, out.boundaries.sum(1).long())
    assert torch.equal(count_segments(model.cfg, x.view(2, 3, 26)), counts.view(2, 3))
    # the shortened stage's input: the null group and the batch's most segments
    routing = model.source(torch.zeros(6, 26, 32), x)
    sf = 26 / counts.max().item()
    assert model.pooling.down(torch.zeros(6, 26, 32), routing).size(1) == shortened_length(26, sf)


def independent_step_flops(model, batch, seq_len, n_short):
    """Training FLOPs of the model's matmuls, counted from its modules: 2·rows·in·out for every
    Linear (rows: batch × positions; r_net, the position projection, once per sequence), 3 ×
    2·B·H·n²·d_head per attention layer (content scores, position scores, weights × values), all
    times 3 (backward = 2 × forward)."""
    cfg, fwd = model.cfg, 0
    n_of = {'shortened': n_short}
    for name, module in model.named_modules():
        n = n_of.get(name.split('.')[0], seq_len)
        if isinstance(module, torch.nn.Linear):
            rows = n if name.endswith('r_net') else batch * n
            fwd += 2 * rows * module.in_features * module.out_features
        if isinstance(module, RelativeAttention):
            fwd += 3 * 2 * batch * cfg.n_head * n * n * cfg.d_head
    return 3 * fwd


@pytest.mark.parametrize('mode', MODES)
def test_step_flops_counts_every_matmul_of_the_model(mode):
    """dynpool.step_flops (train.py's FLOP budget, README's MFU) = the count over the model's own
    modules, with d_model != n_head·d_head so that no two terms can stand in for each other."""
    cfg = Config(vocab_size=29, d_model=24, n_head=3, d_head=10, d_inner=56, layers=(1, 3, 2),
                 boundary=mode, whitespace_id=0)
    model = DynamicPoolingLM(cfg)
    batch, L, n_short = 3, 40, 1 + 40 / 3.5
    want = independent_step_flops(model, batch, L, L if mode == 'none' else n_short)
    assert math.isclose(step_flops(cfg, batch, L, n_short), want, rel_tol=1e-12)
    # n_short=None: every layer at full length
    assert math.isclose(step_flops(cfg, batch, L), independent_step_flops(model, batch, L, L),
                        rel_tol=1e-12)


# =============================================================================================
# 8. Bad arguments fail early with a ValueError that says what is wrong.
# =============================================================================================
def test_unknown_mode_raises():
    with pytest.raises(ValueError, match='(?i)boundary|mode'):
        DynamicPoolingLM(Config(vocab_size=V, boundary='wordpiece'))


def test_whitespace_without_whitespace_id_raises():
    with pytest.raises(ValueError, match='(?i)whitespace'):
        DynamicPoolingLM(Config(vocab_size=V, boundary='whitespace', layers=(1, 1, 1), d_model=32,
                                n_head=2, d_head=16, d_inner=64))


@pytest.mark.parametrize('mode', ['fixed', 'whitespace', 'unigram'])
def test_bad_boundaries_raise(mode):
    model = tiny_model(mode)
    x = torch.randint(0, V, (2, 10))
    for bad in (torch.zeros(2, 11, dtype=torch.bool),           # wrong length
                torch.zeros(10, dtype=torch.bool),              # not 2-D
                torch.zeros(3, 10, dtype=torch.bool),           # wrong batch
                torch.zeros(2, 10, dtype=torch.complex64),      # wrong dtype
                torch.full((2, 10), 0.5)):                      # not 0/1
        with pytest.raises(ValueError, match='(?i)boundar'):
            model(x, targets=x, boundaries=bad)


def test_unigram_targets_without_boundaries_raise():
    model = tiny_model('unigram').train()
    x = torch.randint(0, V, (2, 10))
    with pytest.raises(ValueError, match='(?i)boundar'):
        model(x, targets=x)


@pytest.mark.parametrize('mode', ['none', 'gumbel'])
def test_x_not_2d_raises(mode):
    model = tiny_model(mode)
    for bad in (torch.randint(0, V, (10,)), torch.randint(0, V, (2, 3, 4))):
        with pytest.raises(ValueError):
            model(bad)


def test_bad_attention_and_bucket_raise():
    with pytest.raises(ValueError, match='attention'):
        tiny_config('none', attention='flash')
    with pytest.raises(ValueError, match='seg_bucket'):
        tiny_config('fixed', seg_bucket=-1)


def test_bad_segment_counts_raise():
    """n_segments is for boundaries known when the batch is cut, an integer, never below a row's
    complete segments (that row's upsampling would read past the pooled rows); more only pads."""
    x = random_tokens(torch.Generator().manual_seed(1), 2, 30)
    S = int((x == SPACE).sum(1).max())
    model = tiny_model('whitespace')
    for bad, words in ((-1, 'non-negative'), (2.0, 'integer'), (True, 'integer')):
        with pytest.raises(ValueError, match=words):
            model(x, n_segments=bad)
    with pytest.raises(RuntimeError, match='out of bounds'):
        model(x, n_segments=S - 1)
    for mode in [m for m in MODES if m not in EXTERNAL_MODES]:
        with pytest.raises(ValueError, match='n_segments is for boundaries known'):
            tiny_model(mode)(x, n_segments=S)



# =============================================================================================
# 9. Eval mode is deterministic (docs/design.md), with dropout > 0 in the config: no dropout and
#    no fresh Gumbel noise in evaluation, so a different global RNG state changes nothing.
# =============================================================================================
@pytest.mark.parametrize('mode', MODES)
def test_eval_is_deterministic_with_dropout(mode):
    model = tiny_model(mode, dropout=0.3)
    x = random_tokens(torch.Generator().manual_seed(5), 3, 57)
    a, b = forward(model, x, False, seed=1), forward(model, x, False, seed=2)
    assert torch.equal(a.logits, b.logits)
    assert (a.boundaries is None) == (mode == 'none')
    if a.boundaries is not None:
        assert torch.equal(a.boundaries, b.boundaries)
    # ... while the same model in training mode does drop (so the test above means something)
    train1, train2 = forward(model, x, True, seed=1), forward(model, x, True, seed=2)
    assert not torch.equal(train1.logits, train2.logits)


# =============================================================================================
# 10. Generation parity: cached, incremental generation (docs/design.md) agrees with the full
#     forward pass:
#     prefill + one decode per token gives the full forward's logits and boundaries, and greedy
#     decoding equals taking the argmax of model(prefix) again and again. Incremental pooling (an
#     open segment, the last closed one, rows closing segments at different times) is easy to get
#     subtly wrong.
# =============================================================================================
def no_threshold_ties(model, bp_logits):
    """False when a predictor logit lies within float noise of the threshold: it may round either
    way in two equal computations, and such inputs say nothing about the cache."""
    if bp_logits is None:
        return True
    edge = math.log(model.cfg.threshold / (1 - model.cfg.threshold))
    return bool(((bp_logits - edge).abs() > 1e-4).all())


def must_hold(ok):
    assert ok, 'a predictor logit sits on the threshold: pick another seed'


def settle(model, seen, state):
    """After a decode: hnet decides the b of the token before (state.late_boundary), which decode
    reports apart instead of rewriting the [B, 1] it handed out; put it in place in `seen`. The
    other sources decide b_t with x_t and report no late boundary."""
    late = state.late_boundary
    assert (late is None) == (model.cfg.boundary != 'hnet')
    if late is not None:
        seen[-1] = torch.cat([seen[-1][:, :-1], late], 1)


def check_cache_parity(model, x, L, skip_ties=assume, atol=1e-5):
    """Prefill x[:, :L], decode the rest one token at a time; compare with the full forward of x.
    Returns the number of segments closed."""
    full, full_b, bp = full_forward(model, x)
    skip_ties(no_threshold_ties(model, bp))
    logits, state = model.prefill(x[:, :L])
    assert_close(logits, full[:, :L], atol=atol, msg='prefill:')
    seen = [state.boundaries]
    for t in range(L, x.size(1)):
        assert_close(model.decode(x[:, t], state), full[:, t], atol=atol, msg=f'decode at t={t}:')
        settle(model, seen, state)
        seen.append(state.boundaries)
    assert state.length == x.size(1)
    if full_b is None:
        assert all(b is None for b in seen)
        return 0
    got = torch.cat(seen, 1)
    assert torch.equal(got, full_b.bool()), f'decoded {got.int()} != forward {full_b.int()}'
    return int(full_b.sum())


@st.composite
def parity_cases(draw):
    alphabet = draw(st.sampled_from(sorted(ALPHABETS)))
    vocab, space = ALPHABETS[alphabet]
    B = draw(st.integers(1, 3))
    L = draw(st.integers(1, 20))
    n = draw(st.integers(1, 60))
    # spaces about 4 in 11: the ids past the vocabulary are spaces too
    tok = st.integers(0, vocab * 11 // 8 - 1).map(lambda t: space if t >= vocab else t)
    rows = draw(st.lists(st.lists(tok, min_size=L + n, max_size=L + n), min_size=B, max_size=B))
    return alphabet, torch.tensor(rows, dtype=torch.long), L


@pytest.mark.parametrize('mode', MODES + POOLED_LAST[:2])   # sub-sampling: the short test below
@settings(max_examples=examples(5, 10), **HYPOTHESIS_FIXTURES)
@given(case=parity_cases())
def test_cache_parity_with_full_forward(tiny, mode, case):
    alphabet, x, L = case
    check_cache_parity(tiny_on(tiny, mode, alphabet), x, L)


@pytest.mark.parametrize('mode', MODE_VARIANTS)
def test_cache_parity_short_prompt_many_segments(mode):
    """A one-character prompt that closes no segment, then 80 characters that close many; rows
    that close segments at different times (and a row that closes none in the prompt while
    another does)."""
    model = tiny_model(mode)
    x = random_tokens(torch.Generator().manual_seed(7), 3, 81, p_space=0.3)
    # Pick first characters that do not close a segment on their own (in every mode).
    _, b, _ = full_forward(model, torch.arange(V)[:, None])
    opening = [t for t in range(V) if b is None or not b[t, 0]]
    assert opening, 'every single character closes a segment: the test model is degenerate'
    x[:, 0] = opening[-1]
    n_closed = check_cache_parity(model, x, 1, must_hold)
    if mode != 'none':
        assert n_closed >= 3 * 10, f'only {n_closed} segments closed: pooling not exercised'
    for L in (4, 17):     # prompts longer than one segment too
        check_cache_parity(model, x, L, must_hold)


@pytest.mark.parametrize('mode, extra', [
    ('none', dict(attn_chunk=5)), ('whitespace', dict(attn_chunk=5)),
    ('entropy', dict(attn_chunk=5)),
    ('whitespace', dict(attn_chunk=5, seg_bucket=8)), ('entropy', dict(attention='sdpa'))],
    ids=['none', 'whitespace', 'entropy', 'whitespace-bucket', 'entropy-sdpa'])
def test_cache_parity_long_prompts(mode, extra):
    """Prompts several attention blocks long (attn_chunk 5), S rounded up to a bucket, or one
    fused call: the prefill and the cache it leaves agree with decode and the full forward."""
    model = tiny_model(mode, **extra)
    x = random_tokens(torch.Generator().manual_seed(13), 2, 60, p_space=0.3)
    for L in (4, 5, 23, 59):
        check_cache_parity(model, x, L, must_hold)


def test_cache_parity_cache_growth():
    """decode beyond the capacity prefill reserved must grow the caches without changing results."""
    model = tiny_model('entropy')
    x = random_tokens(torch.Generator().manual_seed(3), 2, 70, p_space=0.3)
    full, full_b, _ = full_forward(model, x)
    logits, state = model.prefill(x[:, :3], capacity=4)
    seen = [state.boundaries]
    for t in range(3, 70):
        assert_close(model.decode(x[:, t], state), full[:, t], atol=1e-5, msg=f't={t}:')
        settle(model, seen, state)
        seen.append(state.boundaries)
    assert torch.equal(torch.cat(seen, 1), full_b.bool())


def cyclic_model(mode):
    """A tiny model whose output layer reads back the embedding of the next token in the cycle
    0 -> 1 -> ... -> V-1 -> 0, so greedy text varies, holds spaces, and crosses many boundaries
    (a plain tiny model's greedy text repeats one token)."""
    model = tiny_model(mode)
    with torch.no_grad():
        model.lm_head.weight.copy_(50 * model.embed.weight.roll(1, 0))
    return model


@pytest.mark.parametrize('prompt_len', [1, 7])
@pytest.mark.parametrize('mode', MODES)
def test_greedy_generation_matches_full_forward(mode, prompt_len):
    model = cyclic_model(mode).train()          # generate() evaluates, then restores the mode
    n = 40
    x = random_tokens(torch.Generator().manual_seed(9), 3, prompt_len)
    got = model.generate(x, n, greedy=True)
    assert model.training
    model.eval()
    assert got.shape == (3, prompt_len + n) and torch.equal(got[:, :prompt_len], x)
    seq = x
    with torch.no_grad():
        for _ in range(n):
            logits = model(seq).logits[:, -1]
            top2 = logits.topk(2).values
            assert bool((top2[:, 0] - top2[:, 1] > 1e-4).all()), 'argmax tie: pick another seed'
            seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], 1)
        out = model(seq)
    assert torch.equal(got, seq), f'{mode}: generate {got.tolist()} vs full forward {seq.tolist()}'
    if out.boundaries is not None:      # the decoding crossed segment ends (and stayed in sync)
        assert out.boundaries[:, prompt_len:].sum() >= 3, f'{mode}: too few boundaries'


def run_sample(model, prompt, n, seed, **kw):
    """sample.py's generation (sample.generate) of n characters after prompt [L] (a list of ids),
    for 2 samples → (tokens [2, L+n], boundaries [2, L+n] bool or None, entropies [2, L+n])."""
    args = SimpleNamespace(num_samples=2, device='cpu', seed=seed, chars=n, greedy=False,
                           spike_window=None, **{'temperature': 1.0, 'top_k': None, **kw})
    alphabet = [chr(ord('a') + i) for i in range(model.cfg.vocab_size)]
    got = sample.generate(args, model, prompt, {'vocab': {'alphabet': alphabet}, 'path': 'tiny'})
    tokens = torch.tensor([[alphabet.index(c) for c in p] for p in got.pieces])
    b = None if got.boundaries is None else torch.tensor(got.boundaries, dtype=torch.bool)
    return tokens, b, torch.tensor(got.entropy)


@pytest.mark.parametrize('mode', ['none', 'whitespace', 'gumbel', 'hnet'])
def test_sample_is_generate_plus_what_the_model_did(mode):
    """sample.py's generation (model.steps) = model.generate for the same generator seed, plus
    boundaries and entropies that match the full forward of the generated text."""
    model = tiny_model(mode)
    prompt = random_tokens(torch.Generator().manual_seed(5), 1, 4, p_space=0.3)[0].tolist()
    kw = dict(temperature=0.8, top_k=5)
    want = model.generate(torch.tensor([prompt] * 2), 50,
                          generator=torch.Generator().manual_seed(42), **kw)
    tokens, b, ent = run_sample(model, prompt, 50, 42, **kw)
    assert torch.equal(tokens, want)
    full, full_b, _ = full_forward(model, tokens)
    logp = torch.log_softmax(full, -1)
    assert_close(ent, -(logp.exp() * logp).sum(-1) / math.log(2), atol=1e-4, msg='entropy:')
    assert (b is None) == (full_b is None)
    if b is not None:
        assert torch.equal(b, full_b.bool())


@pytest.mark.parametrize('mode', ['whitespace', 'hnet'])
def test_generation_never_rewrites_what_it_yielded(mode):
    """Each GenerationStep's boundaries are final when yielded: nothing changes them afterwards
    (hnet decides b_t with token t+1, so its steps come one token late), and together they are the
    full forward's boundaries of the generated text."""
    model = cyclic_model(mode)
    x = random_tokens(torch.Generator().manual_seed(9), 3, 5)
    yielded = [(step.boundaries, step.boundaries.clone())
               for step in model.steps(x, 40, greedy=True)]
    for i, (now, then) in enumerate(yielded):
        assert torch.equal(now, then), f'step {i}: boundaries changed after they were yielded'
    tokens = model.generate(x, 40, greedy=True)
    _, full_b, _ = full_forward(model, tokens)
    assert full_b.sum() >= 10
    assert torch.equal(torch.cat([now for now, _ in yielded], 1), full_b.bool())


def test_generation_never_picks_ids_beyond_n_valid():
    model = tiny_model('whitespace')
    x = torch.zeros(4, 1, dtype=torch.long)
    tokens = torch.cat([step.tokens for step in model.steps(
        x, 60, temperature=5.0, generator=torch.Generator().manual_seed(0), n_valid=3)], 1)
    assert int(tokens.max()) < 3 and int(tokens[:, 1:].max()) == 2   # masked, yet sampling


# =============================================================================================
# 11. No host sync where the boundaries are known on the host, and torch.compile. A forward reads
#     the device once, for S (the most segments of a row: the pooled length); fixed and whitespace
#     boundaries are known when the batch is cut, so S can come with the batch (n_segments), and
#     then nothing is read back: no sync on GPUs, no graph break under torch.compile. The compile
#     tests proper are marked slow (minutes on a shared 2-core CPU; run them with --slow): no graph
#     break inside a layer in training (the CPU dropout steps aside), and compiled losses and
#     gradients equal eager ones.
# =============================================================================================
class HostReads(TorchDispatchMode):
    """Every device → host read of a tensor (aten._local_scalar_dense: .item(), int(), bool()),
    with the dynpool.py functions on the stack when it happened."""

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads.append([f'{f.name}:{f.lineno}' for f in traceback.extract_stack()
                               if f.filename.endswith('dynpool.py')])
        return func(*args, **(kwargs or {}))


def model_host_reads(step):
    """The host reads of step() other than input validation, which reads values on CPU only."""
    with HostReads() as seen:
        step()
    return [stack for stack in seen.reads if not any(f.startswith('check_') for f in stack)]


@pytest.mark.parametrize('given', [False, True], ids=['derived', 'given'])
@pytest.mark.parametrize('mode', ['fixed', 'whitespace'])
def test_external_boundaries_need_no_host_read_when_the_batch_counts_segments(mode, given):
    """A training step (forward + backward) reads the device once, for S, and not at all with
    n_segments; the outputs and gradients are the same, and (dropout off: padding rows draw masks
    too) close with a count above S."""
    model = tiny_model(mode, dropout=0.1).train()
    gen = torch.Generator().manual_seed(3)
    x = random_tokens(gen, 3, 47, p_space=0.2)
    b = (torch.rand(3, 47, generator=gen) < 0.3) if given else None
    fixed = torch.tensor([[(t + 1) % 3 == 0 for t in range(47)]] * 3)      # tiny_config: k = 3
    pattern = b if given else (x == SPACE) if mode == 'whitespace' else fixed
    S = max(len(ref_segments(row)) for row in pattern.int().tolist())
    runs = {}
    for n_segments in (None, S, S + 5):
        def step():
            runs[n_segments] = loss_and_grads(model, x, torch.roll(x, -1, 1), b,
                                              n_segments=n_segments)
        reads = model_host_reads(step)
        assert len(reads) == (1 if n_segments is None else 0), f'n_segments={n_segments}: {reads}'
    (ref, ref_grads), (out, grads) = runs[None], runs[S]
    assert torch.equal(out.logits, ref.logits) and torch.equal(out.loss, ref.loss)
    for name, g in grads.items():
        assert torch.equal(g, ref_grads[name]), name
    model.eval()
    (ref, ref_grads), (out, grads) = (loss_and_grads(model, x, torch.roll(x, -1, 1), b,
                                                     n_segments=n) for n in (None, S + 5))
    assert_close(out.logits, ref.logits, atol=1e-5, msg='padded logits:')
    for name, g in grads.items():
        assert_close(g, ref_grads[name], atol=1e-5, msg=f'padded d/d{name}:')


def test_whitespace_forward_is_one_graph_when_the_batch_counts_segments():
    """torch._dynamo traces a whitespace forward and loss into one graph with no break when S
    comes with the batch (without it, reading S breaks the graph in every frame on the stack)."""
    model = tiny_model('whitespace', dropout=0.1).train()
    x = random_tokens(torch.Generator().manual_seed(4), 2, 24)
    S = int((x == SPACE).sum(1).max())
    torch._dynamo.reset()
    try:
        explained = torch._dynamo.explain(
            lambda x, y: model(x, targets=y, n_segments=S).loss)(x, torch.roll(x, -1, 1))
    finally:
        torch._dynamo.reset()
    reasons = [str(r.reason).splitlines()[0] for r in explained.break_reasons]
    assert explained.graph_break_count == 0 and explained.graph_count == 1, reasons


@pytest.mark.slow
def test_layer_compiles_without_graph_breaks_in_training():
    stage = Stage(tiny_config('none', dropout=0.1), 1).train()
    compiled = torch.compile(stage, backend='eager', fullgraph=True, dynamic=True)
    for L in (10, 17):
        x = torch.randn(2, L, 32, requires_grad=True)
        compiled(x, torch.zeros(2, 16), torch.zeros(2, 16)).sum().backward()
        assert x.grad is not None


@pytest.mark.slow
@pytest.mark.parametrize('mode', ['none', 'whitespace', 'entropy'])
def test_compiled_and_eager_losses_and_gradients_agree(mode):
    model = tiny_model(mode).train()
    compiled = torch.compile(model)
    gen = torch.Generator().manual_seed(2)
    for L in (40, 52):
        x = random_tokens(gen, 2, L)
        (eager, g_eager), (comp, g_comp) = (loss_and_grads(m, x, torch.roll(x, -1, 1))
                                            for m in (model, compiled))
        # float32, and compiled 'auto' attention is one fused call where eager CPU runs blocks
        assert_close(comp.loss, eager.loss, atol=1e-5, msg=f'L={L} loss:')
        g_comp = {name.removeprefix('_orig_mod.'): g for name, g in g_comp.items()}
        for name, g in g_eager.items():
            assert_close(g_comp[name], g, atol=1e-5, rtol=1e-5, msg=f'L={L} d/d{name}:')


# =============================================================================================
# 12. On a GPU (marked gpu, skipped without CUDA): a bf16 training step in every mode, SDPA
#     against blocked attention, cached against full logits, and host syncs in a training step.
# =============================================================================================
def cuda_batch(mode, B=4, L=96, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = random_tokens(gen, B, L, p_space=0.2)
    b = gold_for(mode, x, gen)
    return x.cuda(), torch.roll(x, -1, 1).cuda(), None if b is None else b.cuda()


@pytest.mark.gpu
@pytest.mark.parametrize('mode', MODES)
def test_gpu_bf16_training_step(mode):
    model = tiny_model(mode, dropout=0.1).cuda().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y, b = cuda_batch(mode)
    with torch.autocast('cuda', dtype=torch.bfloat16):
        out = model(x, targets=y, boundaries=b)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    opt.step()


@pytest.mark.gpu
@pytest.mark.parametrize('mode', MODES)
def test_gpu_sdpa_matches_blocked(mode):
    torch.backends.cuda.matmul.allow_tf32 = False
    x, y, b = cuda_batch(mode, L=200)
    runs = []
    for attention in ('blocked', 'sdpa'):
        model = tiny_model(mode, attention=attention, attn_chunk=64).cuda().train()
        runs.append(loss_and_grads(model, x, y, b))
    (ref, g_ref), (out, g_out) = runs
    assert_close(out.logits, ref.logits, atol=1e-4, msg='logits:')
    for name, g in g_out.items():
        assert_close(g, g_ref[name], atol=1e-4, rtol=1e-3, msg=f'd/d{name}:')


@pytest.mark.gpu
@pytest.mark.parametrize('mode', MODES)
def test_gpu_cached_logits_match_full(mode):
    torch.backends.cuda.matmul.allow_tf32 = False
    model = tiny_model(mode).cuda()
    x = random_tokens(torch.Generator().manual_seed(13), 3, 70, p_space=0.3).cuda()
    check_cache_parity(model, x, 9, must_hold, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize('mode', MODES)
def test_gpu_training_step_reads_the_device_at_most_once(mode):
    """One host sync at most (the segment count S) in a forward + backward; none for vanilla, and
    none for fixed and whitespace when S comes with the batch (n_segments)."""
    import warnings
    model = tiny_model(mode, dropout=0.1).cuda().train()
    x, y, b = cuda_batch(mode)
    counts = [None]
    if mode in EXTERNAL_MODES:
        counts.append(int(model(x, boundaries=b).boundaries.sum(1).max()))
    for n_segments in counts:
        model(x, targets=y, boundaries=b, n_segments=n_segments).loss.backward()  # warm-up
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode('warn')
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter('always')
                model(x, targets=y, boundaries=b, n_segments=n_segments).loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode('default')
        syncs = [str(w.message) for w in caught if 'synchroniz' in str(w.message)]
        most = 0 if mode == 'none' or n_segments is not None else 1
        assert len(syncs) <= most, (n_segments, syncs)
