"""dynpool: the dynamic-pooling Transformer in one file.

"Efficient Transformers with Dynamic Token Pooling" (Nawrot, Chorowski, Łańcucki, Ponti,
ACL 2023): an hourglass Transformer for character-level language modelling. A few layers run
at full length, the sequence is then pooled into variable-length segments, most layers run on
the short sequence, and the result is upsampled back, without leaking the future, for a few
final layers.

    tokens ─ embed ─ pre ─┬─ source ─ pooling.down ─ shortened ─ pooling.up ─┐
                          └─────────────── skip connection ──────────────── + ─ post ─ logits

Conventions: tensors are batch-first (tokens x [B, L], hidden states h [B, L, D]); boundaries
b are [B, L] with b[n, t] = 1 meaning a segment ends at token t (t is its last token, t+1
starts the next); token t belongs to segment c_t = Σ_{i<t} b_i; only segments closed by a
boundary are pooled.

    model = DynamicPoolingLM(Config(vocab_size=27, boundary='whitespace', whitespace_id=0))
    out = model(x, targets=y)   # out.loss, out.logits, out.boundaries, out.shortening_factor

Reading map. The file runs from small to large, and the paper's method first:
  1. Config: the hyper-parameters (the defaults are the paper's model).
  2. segments, boundary_matrix, downsample, upsample: pooling through the boundary matrix,
     and back to tokens (§2.2); MeanPooling.down and .up, the pooling unit the model calls.
  3. BoundarySource, then FixedBoundaries, WhitespaceBoundaries, UnigramBoundaries (§3.1),
     EntropyBoundaries (§3.2), GumbelBoundaries (§3.3): where segments end, and how each
     source learns it; count_segments, the segments the text alone decides.
  4. Transformer-XL's layers (RelativeAttention, FeedForward, Stage): standard machinery,
     not the paper's.
  5. DynamicPoolingLM.trunk and .forward: the hourglass drawn above, and the losses.
The training forward pass carries no decoding state. Skip on a first reading:
  - cached generation: the section of that name at the end (KV caches, stage_prefill,
    stage_step, the pooling units' running states), DynamicPoolingLM's prefill, decode,
    steps and generate, every source's step and late_boundary, and
    MeanPooling.prefill_state; it is held equal to the forward pass by the tests;
  - speed only, each giving the values of the plain way: RelativeAttention.fused, .attend
    and the query blocks in its forward, rel_shift's view, Routing.n_segments and
    seg_bucket (no device reads, shapes that repeat); Dropout (cheaper CPU masks);
  - measurement: BoundarySource.statistics, step_flops and shortened_length.
Other sources plug in through BoundarySource's hooks and register_source; hnet.py (H-Net's
chunking) is one. This file imports none: `import hnet` adds 'hnet' to BOUNDARY_MODES.
"""
import math
import numbers
from dataclasses import asdict, dataclass, field, fields

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor


# -----------------------------------------------------------------------------
# Configuration: what the model is
def require(ok, message):
    """The one way this file refuses a Config or an input: a ValueError saying what."""
    if not ok:
        raise ValueError(message)


@dataclass
class Config:
    """Hyper-parameters; the defaults build the paper's ~41M-parameter model (appendix).
    `options` holds the chosen source's own hyper-parameters, the fields of its `Options`
    dataclass (e.g. hnet.py's ratio_target), every one filled in with its default."""
    vocab_size: int = 27
    d_model: int = 512
    n_head: int = 8
    d_head: int = 64
    d_inner: int = 2048
    dropout: float = 0.1
    dropatt: float = 0.1
    layers: tuple = (2, 8, 2)          # (pre, shortened, post); vanilla: all at full length
    boundary: str = 'none'             # one of BOUNDARY_MODES
    pooling: str = 'mean'              # or 'last': a segment is its last token (Table 2)
    whitespace_id: int | None = None   # the space's id (whitespace; gumbel's recall)
    fixed_factor: int = 2              # segment length k of fixed pooling
    temperature: float = 0.5           # Gumbel-sigmoid temperature
    prior: float = 0.2                 # Binomial prior α: expected boundary rate of gumbel
    entropy_window: int = 2            # k of entropy spikes
    threshold: float = 0.5             # predictor probability above which a segment ends
    double_sigmoid: bool = False       # unigram/entropy: the released code's BCE of σ(logit)
    attention: str = 'auto'            # 'sdpa' | 'blocked' | 'auto' (GPU: sdpa, CPU: blocked)
    attn_chunk: int = 128              # queries per block of 'blocked' attention: not results
    seg_bucket: int = 0                # S rounded up to a multiple (0: 64 on CUDA, 1 elsewhere)
    options: dict = field(default_factory=dict)   # the source's Options fields by name

    def __post_init__(self):
        self.layers = tuple(self.layers)
        mode = self.boundary
        require(mode in BOUNDARY_MODES,
                f"unknown boundary mode {mode!r}; choose one of {', '.join(BOUNDARY_MODES)}")
        require(len(self.layers) == 3 and all(int(n) == n >= 0 for n in self.layers),
                f'layers must be three counts (pre, shortened, post), got {self.layers!r}')
        require(mode == 'none' or self.layers[1] > 0,
                f'boundary {mode!r} needs shortened layers')
        require(self.pooling == 'mean' or (self.pooling == 'last' and mode != 'none'),
                "pooling must be 'mean' or 'last' (not 'last' for boundary 'none')")
        require(mode != 'whitespace' or self.whitespace_id is not None,
                "boundary 'whitespace' needs whitespace_id (the token id of the space)")
        require(self.attention in ('auto', 'sdpa', 'blocked') and self.attn_chunk >= 1
                and self.seg_bucket >= 0,
                "attention must be 'auto', 'sdpa' or 'blocked', attn_chunk >= 1 and "
                'seg_bucket >= 0')
        require(not self.double_sigmoid or mode in ('unigram', 'entropy'),
                'double_sigmoid is a loss of the unigram and entropy predictors only')
        require(self.vocab_size >= 1 and self.d_model % 2 == 0 and self.fixed_factor >= 1
                and 0 < self.prior < 1,
                'vocab_size and fixed_factor must be positive, d_model even (sinusoidal '
                'positions) and prior in (0, 1)')
        # The source's own hyper-parameters: those given, then its Options' defaults.
        require(isinstance(self.options, dict),
                f'options must be a dict, got {self.options!r}')
        source = SOURCES.get(mode)   # None for vanilla
        Options = source and source.Options
        names = [f.name for f in fields(Options)] if Options else []
        unknown = sorted(set(self.options) - set(names))
        require(not unknown,
                f"boundary {mode!r} has no option {', '.join(map(repr, unknown))}; its "
                f"options: {', '.join(names) or 'none'}")
        if Options:
            self.options = asdict(Options(**self.options))
        if source:
            source.check_config(self)


# -----------------------------------------------------------------------------
# Pooling through the boundary matrix (paper §2.2)
def segments(b):
    """From the hard decisions of b [B, L]: (c, m), int64 [B, L]. m_t = Σ_{i≤t} b_i
    counts the segments complete at t; c_t = Σ_{i<t} b_i is token t's segment."""
    # int64, exact in any dtype: a bf16 running sum is not exact past 256.
    hard = (b.detach() > 0.5).long()
    m = hard.cumsum(1)
    return m - hard, m


def padded_count(n_segments, bucket, device):
    """S, the rows that n_segments segments take, rounded up to a multiple of `bucket`
    (Config.seg_bucket; 0 means 64 on CUDA, 1 elsewhere): compiled shapes repeat."""
    if bucket == 0:
        bucket = 64 if device.type == 'cuda' else 1
    return -(-n_segments // bucket) * bucket


def boundary_matrix(b, bucket=1, n_segments=None):
    """B [B, L, S]: B[n, t, j] = 1 iff token t is in complete segment j; differentiable
    in b. S: the most complete segments of a row (n_segments if counted on the host),
    padded_count's rows."""
    c, m = segments(b)
    count = m[:, -1:]  # [B, 1] complete segments per row
    if n_segments is None:
        n_segments = int(count.max()) if b.numel() else 0   # the one device → host read
    S = padded_count(n_segments, bucket, b.device)
    # [B, L, S]
    hit = (c[..., None] == torch.arange(S, device=b.device)) & (c < count)[..., None]
    # The entry is 1 + c_t - stopgrad(c_t): exactly 1 in value, with derivative 1 in
    # c_t, so that a straight-through Gumbel boundary receives gradient through the
    # running sum (paper §3.3).
    soft_c = b.float().cumsum(1) - b.float()
    one = 1 + soft_c - soft_c.detach()
    return torch.where(hit, one[..., None], 0.0)


def downsample(h, b, null, bucket=1, n_segments=None, pooling='mean'):
    """Each complete segment of h [B, L, D] → one vector, after the null group →
    [B, 1+S, D]: the segment's mean (§2.2), or with pooling='last' its last token
    (sub-sampling, Table 2)."""
    Bm = boundary_matrix(b, bucket, n_segments).to(h.dtype)  # [B, L, S]
    if pooling == 'last':
        # The last token of a segment is its one token with b_t = 1, so B weighted by b
        # selects it: exactly h_t in value, and a straight-through Gumbel b_t receives
        # the LM loss's gradient through the selected vector (d/db_t = h_t), as the
        # mean's b does through B.
        pooled = torch.einsum('bls,bld->bsd', Bm * b[..., None].to(h.dtype), h)
    else:
        # divided by the segment lengths [B, S, 1]
        pooled = torch.einsum('bls,bld->bsd', Bm, h) / Bm.sum(1).clamp(min=1)[..., None]
    null_row = null.to(h.dtype).expand(h.size(0), 1, -1)   # [B, 1, D]
    return torch.cat([null_row, pooled], 1)


def gather_rows(s, index):
    """out[n, t] = s[n, index[n, t]]: s [B, S, D], index [B, L] int64 → [B, L, D]."""
    return s.gather(1, index[..., None].expand(-1, -1, s.size(-1)))


def upsample(s, b):
    """Token t receives s[:, m_t], m_t = Σ_{i≤t} b_i: the last segment complete at t
    (0: the null group)."""
    # No gradient flows to b through upsampling: in the paper's row-normalised matrix,
    # it cancels.
    return gather_rows(s, segments(b)[1])        # [B, L, D]


class MeanPooling(nn.Module):
    """The paper's pooling unit (§2.2): segment means (or last tokens) after a learnable
    null group, and back to tokens, each seeing only segments complete at t."""
    def __init__(self, cfg):
        super().__init__()
        self.null_group = nn.Parameter(torch.randn(cfg.d_model))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.cfg = cfg

    def down(self, h, routing):
        """h [B, L, D] → [B, 1+S, D]: null group, segment means, zero rows padding S to a bucket."""
        return self.norm(downsample(h, routing.b, self.null_group, self.cfg.seg_bucket,
                                    routing.n_segments, self.cfg.pooling))

    def up(self, s, routing, h):
        """s [B, 1+S, D] → post-stage input [B, L, D]; h [B, L, D], the skip connection."""
        return upsample(s, routing.b) + h

    def prefill_state(self, h, s, routing):
        """Cached generation: the state after a prompt (h, s as in down and up)."""
        c, m = segments(routing.b)
        n_closed = m[:, -1]                                                # [B]
        open_segment = c == n_closed[:, None]  # [B, L] after the last b
        seg_sum = (h * open_segment[..., None]).sum(1)
        last = gather_rows(s, n_closed[:, None])[:, 0]   # s[n, n_closed[n]]
        return MeanPoolingState(self, 1 + n_closed, seg_sum, open_segment.sum(1), last)


# -----------------------------------------------------------------------------
# Boundary sources (paper §3): each decides where segments end, trains that decision (its
# auxiliary loss) and names the targets its decisions are measured against.
def entropy_spikes(H, k=2):
    """b_t = 1 iff H_t > H_i for every i in t-k … t-1 that exists (a local entropy peak, §3.2)."""
    spikes = torch.ones_like(H, dtype=torch.bool)
    for i in range(1, k + 1):  # loop over the window, not over time (i >= L: empty slices)
        spikes[:, i:] &= H[:, i:] > H[:, :-i]
    return spikes


def gumbel_sigmoid(logits, temperature, noise=None):
    """Relaxed Bernoulli sample, hard straight-through (Jang et al. 2017; §3.3); noise: uniform."""
    # in bf16, hard + soft - soft.detach() can read 0.996 instead of 1
    logits = logits.float()
    if noise is None:
        noise = torch.rand_like(logits)
    noise = noise.clamp(1e-6, 1 - 1e-6)
    soft = torch.sigmoid((logits + noise.log() - (-noise).log1p()) / temperature)
    return (soft > 0.5).to(soft.dtype) + soft - soft.detach()


def binomial_prior_loss(b, prior):
    """-log Binomial(k; L, α) / L with k = Σ_t b_t, batch mean: keeps the rate near α (§3.3)."""
    L = b.size(1)
    k = b.sum(1)
    log_p = (math.lgamma(L + 1) - torch.lgamma(k + 1) - torch.lgamma(L - k + 1)
             + k * math.log(prior) + (L - k) * math.log(1 - prior))
    return -(log_p / L).mean()


class BoundaryPredictor(nn.Module):
    """MLP d_model → d_inner → 1 on the pre stage's output: the logit of 'a segment ends here'."""
    def __init__(self, cfg):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(cfg.d_model, cfg.d_inner), nn.GELU(),
                                 nn.Linear(cfg.d_inner, 1))

    def forward(self, h):
        return self.net(h).squeeze(-1)                   # [B, L]


@dataclass
class Routing:
    """A boundary source's decisions for the tokens at positions offset … offset+L-1."""
    b: Tensor                      # [B, L] float 0/1 (straight-through for gumbel)
    logits: Tensor | None = None   # [B, L] the predictor's logits, if it has one
    n_segments: int | None = None  # S counted on the host (external boundaries), if known

    @property
    def hard(self):
        return self.b.detach() > 0.5       # [B, L] bool decisions


class BoundarySource(nn.Module):
    """Where segments end: a source decides in `forward`, learns through `loss` and pools
    with its `Pooling` unit. Subclass it for a new source and register_source it
    (README, "Adding a boundary source"); the hooks with a default serve sources unlike
    the paper's (hnet.py)."""
    Pooling = MeanPooling  # the pooling unit: down, up; prefill_state for generation
    Options = None         # a dataclass of the source's hyper-parameters (Config.options)

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        # the source's own hyper-parameters, an Options instance (None without Options)
        self.options = self.Options and self.Options(**cfg.options)

    @staticmethod
    def check_config(cfg):
        """Raise ValueError for a Config this source cannot be built from."""

    def init_model(self, model):
        """Re-initialise, after the model's init, what the source's method draws its own way."""

    @staticmethod
    def flops_per_token(cfg):
        """Forward FLOPs per token of the source's and its pooling's matmuls (step_flops)."""
        return 0

    def forward(self, h, x, boundaries=None, offset=0):
        """Routing of tokens x [B, L] at positions offset … from the pre stage's output h
        [B, L, D]; boundaries [B, L]: given ones, where the source takes them."""
        raise NotImplementedError

    def step(self, h, x, state):
        """Cached generation: routing of one token per row, h [B, 1, D], x [B, 1]."""
        return self(h, x, offset=state.length)

    def late_boundary(self, routing):
        """[B, 1] bool: b of the token before routing's first if x_{t+1} decides b_t, else None."""
        return None

    def loss(self, routing, logits, x, boundaries):
        """(auxiliary loss, bool targets [B, L] to measure against or None); logits [B, L, V]."""
        return torch.zeros((), device=logits.device), None

    def spaces(self, x):
        """The targets of sources measured against the spaces: bool [B, L], None without an id."""
        return None if self.cfg.whitespace_id is None else x == self.cfg.whitespace_id

    @staticmethod
    def statistics(routing, targets):
        """(shortening factor, precision, recall) of the decisions; the last two need targets."""
        b = routing.b.detach()
        sf = b.numel() / b.sum().clamp(min=1)
        if targets is None:
            return sf, None, None
        pred = routing.hard
        tp = (pred & targets).sum()
        return sf, tp / pred.sum().clamp(min=1), tp / targets.sum().clamp(min=1)


class ExternalBoundaries(BoundarySource):
    """Boundaries given, else `derive`d from the tokens: known as the batch is cut (n_segments)."""
    def forward(self, h, x, boundaries=None, offset=0):
        b = self.derive(x, offset) if boundaries is None else boundaries.detach()
        return Routing(b.float())


class FixedBoundaries(ExternalBoundaries):
    """b_t = 1 iff (t + 1) % k == 0: segments of k tokens."""
    def derive(self, x, offset):
        t = torch.arange(offset, offset + x.size(-1), device=x.device)
        return ((t + 1) % self.cfg.fixed_factor == 0).expand_as(x)


class WhitespaceBoundaries(ExternalBoundaries):
    """b_t = 1 iff x_t is the space: the space closes its word."""
    def derive(self, x, offset):
        return self.spaces(x)


class PredictedBoundaries(BoundarySource):
    """A boundary predictor on the pre stage's output; pools with its own decisions,
    rounded at the threshold, so a decision at t depends on x_{<=t} only."""
    def __init__(self, cfg):
        super().__init__(cfg)
        self.predictor = BoundaryPredictor(cfg)

    @staticmethod
    def flops_per_token(cfg):
        return 2 * (cfg.d_model * cfg.d_inner + cfg.d_inner)  # the MLP d -> d_inner -> 1

    def forward(self, h, x, boundaries=None, offset=0):
        logits = self.predictor(h)                       # [B, L]
        return Routing(self.decide(logits, offset), logits)

    def decide(self, logits, offset):
        return (torch.sigmoid(logits.float()) > self.cfg.threshold).float()

    def bce(self, routing, targets):
        """The predictor's cross-entropy against bool targets [B, L], and the targets."""
        logits = routing.logits.float()
        # The paper's released code feeds σ(logit) to a loss that applies σ again: the
        # loss cannot fall below 0.31 (target 1) and 0.69 (target 0), and p > 0.5 only
        # where the target rate is above σ(0.5) = 0.62. It is off by default, since the
        # paper's text says cross-entropy.
        if self.cfg.double_sigmoid:
            logits = torch.sigmoid(logits)
        return F.binary_cross_entropy_with_logits(logits, targets.float()), targets


class UnigramBoundaries(PredictedBoundaries):
    """Trained towards SentencePiece Unigram boundaries, given as `boundaries` (paper §3.1)."""
    def loss(self, routing, logits, x, boundaries):
        require(boundaries is not None,
                "boundary 'unigram' trains its predictor towards Unigram boundaries: pass "
                'boundaries= with targets')
        return self.bce(routing, boundaries.bool())


class EntropyBoundaries(PredictedBoundaries):
    """Trained towards spikes of the model's own next-character entropy (paper §3.2)."""
    def loss(self, routing, logits, x, boundaries):
        # no gradient through the targets
        logp = F.log_softmax(logits.detach().float(), -1)
        H = -(logp.exp() * logp).sum(-1)  # [B, L] entropy of each prediction
        return self.bce(routing, entropy_spikes(H, self.cfg.entropy_window))


class GumbelBoundaries(PredictedBoundaries):
    """Straight-through Gumbel-sigmoid decisions held near the rate α by a Binomial
    prior (§3.3); measured against the spaces when whitespace_id is set, never trained
    on them."""
    def __init__(self, cfg):
        super().__init__(cfg)
        noise = torch.rand(2 ** 16, generator=torch.Generator().manual_seed(0))
        self.register_buffer('eval_noise', noise, persistent=False)

    def decide(self, logits, offset):
        if self.training:
            return gumbel_sigmoid(logits, self.cfg.temperature)
        # Evaluation samples as training does (so does the paper's code; the noiseless
        # rounding of a predictor held near the prior α rarely fires), but with one
        # fixed noise value per position: deterministic, and the decision at t still
        # depends on x_{<=t} only.
        positions = torch.arange(offset, offset + logits.size(1), device=logits.device)
        noise = self.eval_noise[positions % self.eval_noise.numel()]
        return gumbel_sigmoid(logits, self.cfg.temperature, noise).detach()

    def loss(self, routing, logits, x, boundaries):
        return binomial_prior_loss(routing.b, self.cfg.prior), self.spaces(x)


# the sources by Config.boundary; 'none' (vanilla) has no source and no pooling
SOURCES = {}


def register_source(name, source):
    """Make the BoundarySource subclass `source` Config.boundary=name: it joins SOURCES
    and the mode lists; Config(options=...) takes its Options' fields. A name taken is
    refused. `from dynpool import BOUNDARY_MODES` copies the tuple as it is then: import
    a source's file (e.g. `import hnet`) first."""
    global BOUNDARY_MODES, PREDICTOR_MODES, EXTERNAL_MODES
    require(name not in ('none', *SOURCES),
            f'boundary source {name!r} is registered already')
    SOURCES[name] = source
    BOUNDARY_MODES = ('none', *SOURCES)
    PREDICTOR_MODES = tuple(m for m, s in SOURCES.items()
                            if issubclass(s, PredictedBoundaries))
    EXTERNAL_MODES = tuple(m for m, s in SOURCES.items()
                           if issubclass(s, ExternalBoundaries))


def count_segments(cfg, x):
    """Complete segments per row of tokens x [..., L] (int64) → int64 [...], for sources
    whose boundaries the text alone decides (EXTERNAL_MODES, by their own rule); None
    where a network decides (or no source: vanilla)."""
    if cfg.boundary not in EXTERNAL_MODES:
        return None
    # a source derives rows [B, L], as in the model's forward
    rows = torch.as_tensor(x).reshape(-1, x.shape[-1])
    source = SOURCES[cfg.boundary](cfg)
    return source.derive(rows, 0).long().sum(-1).reshape(x.shape[:-1])


def shortened_length(seq_len, sf):
    """The length the shortened stage runs at for shortening factor sf: the null group and
    seq_len / sf segments (step_flops' n_short)."""
    return 1 + seq_len / sf


register_source('fixed', FixedBoundaries)
register_source('whitespace', WhitespaceBoundaries)
register_source('unigram', UnigramBoundaries)
register_source('entropy', EntropyBoundaries)
register_source('gumbel', GumbelBoundaries)


# -----------------------------------------------------------------------------
# Relative attention (Transformer-XL, Dai et al. 2019 §3.3). Its two global biases, u
# (content) and v (position), are content_bias and position_bias here: q, k, v are
# queries, keys, values.
def sinusoids(distances, dim):
    """Sinusoidal embeddings [N, dim] of relative distances [N]."""
    freq = torch.arange(0, dim, 2, device=distances.device, dtype=torch.float32) / dim
    angles = distances.float()[:, None] * (1.0 / 10000 ** freq)
    return torch.cat([angles.sin(), angles.cos()], -1)


def rel_shift(x):
    """Scores of queries e-m … e-1 against distances e-1 … 0 (x [..., m, e+1], last
    column zero) → scores against keys 0 … e-1: out[..., i, j] = x[..., i, j + m-1-i],
    distance (e-m+i) - j."""
    # Transformer-XL's padding trick as a view, no copy: read the rows of e+1 as one flat
    # run from offset m-1 in rows of e, and row i starts m-1-i columns further right than
    # its own start. Entries for future keys (j > e-m+i) come out as garbage and are
    # masked by the caller.
    m, e = x.size(-2), x.size(-1) - 1
    return x.flatten(-2)[..., m - 1:m - 1 + m * e].view(*x.shape[:-2], m, e)


class RelativeAttention(nn.Module):
    """Causal multi-head attention with learnable relative positions, post-norm residual."""
    def __init__(self, cfg):
        super().__init__()
        self.n_head = cfg.n_head
        self.d_head = cfg.d_head
        inner = cfg.n_head * cfg.d_head
        self.qkv = nn.Linear(cfg.d_model, 3 * inner)
        self.r_net = nn.Linear(cfg.d_model, inner, bias=False)
        self.out = nn.Linear(inner, cfg.d_model)
        self.drop = Dropout(cfg.dropout)
        self.dropatt = Dropout(cfg.dropatt)
        self.chunk = cfg.attn_chunk
        self.attention = cfg.attention
        self.norm = nn.LayerNorm(cfg.d_model)

    def fused(self, h):
        """Whether to make one scaled_dot_product_attention call. 'auto': on GPUs and
        under torch.compile (no loop over L, no recompile per length), and blocked on
        CPU, where that is faster."""
        if self.attention == 'auto':
            return h.device.type != 'cpu' or torch.compiler.is_compiling()
        return self.attention == 'sdpa'

    def heads(self, h, content_bias, position_bias):
        """h [B, L, D] → (q + u)/√d, (q + v)/√d, k, v, each [B, H, L, d_head] and
        contiguous, in h's dtype (the float32 u, v must not promote a bf16 q)."""
        qkv = self.qkv(h).unflatten(-1, (3, self.n_head, self.d_head))
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        scale = self.d_head ** -0.5
        q_content = ((q + content_bias.to(q.dtype)[:, None]) * scale).contiguous()
        q_position = (q + position_bias.to(q.dtype)[:, None]) * scale
        return q_content, q_position, k.contiguous(), v.contiguous()

    def position_keys(self, emb):
        """Position embeddings emb [N, D] → per-head keys r [H, N, d_head]."""
        return self.r_net(emb).view(-1, self.n_head, self.d_head).transpose(0, 1)

    def attend(self, q, k, v, bias, fused):
        """softmax(q·kᵀ + bias)·v with attention dropout: q [B, H, m, d] (scaled), k, v
        [B, H, n, d], bias [B, H, m, n] (-inf where masked) → [B, H, m, d]."""
        if fused:
            p = self.dropatt.p if self.training else 0.0
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=p,
                                                  scale=1.0)
        # [B*H, m, n]: the bias and the content term added by one matmul
        scores = torch.baddbmm(bias.flatten(0, 1), q.flatten(0, 1),
                               k.flatten(0, 1).mT)
        return (self.dropatt(scores.softmax(-1)) @ v.flatten(0, 1)).view_as(q)

    def merge(self, h, y):
        """Heads y [B, H, L, d_head] → output projection, dropout, residual and norm → [B, L, D]."""
        # y as [B, L, H*d_head]
        return self.norm(h + self.drop(self.out(y.transpose(1, 2).flatten(2))))

    def forward(self, h, pos_emb, content_bias, position_bias):
        """Causal attention over h [B, L, D]; pos_emb [L, D] embeds distances L-1 … 0."""
        L = h.size(1)
        # each [B, H, L, d_head]
        q_content, q_pos, k, v = self.heads(h, content_bias, position_bias)
        # [H, L+1, d_head], a zero row last
        r = F.pad(self.position_keys(pos_emb), (0, 0, 0, 1))
        # Speed only: queries in blocks [a, e) that see keys 0 … e-1 only, so the future
        # half of the score matrix is never computed, and each block's scores [B, H, e-a, e]
        # stay small enough for cache. Fused: one block, one call for all L queries, and no
        # Python loop. Either way the values are those of one block of L queries.
        fused = self.fused(h)
        chunk = L if fused else self.chunk
        ys = []
        for a in range(0, L, chunk):
            e = min(a + chunk, L)
            # the position term (q_i + v)·r_{i-j} [B, H, e-a, e], and -inf on future keys
            scores = rel_shift(q_pos[:, :, a:e] @ r[:, L - e:].mT)
            # [e-a, e]: -inf where key j > query a+i (j - i > a), else 0. Added, not
            # masked_fill, so that the backward passes the gradient through untouched.
            causal = scores.new_full((e - a, e), float('-inf')).triu(a + 1)
            ys.append(self.attend(q_content[:, :, a:e], k[:, :, :e], v[:, :, :e],
                                  scores + causal, fused))
        return self.merge(h, torch.cat(ys, 2))

# -----------------------------------------------------------------------------
# Feed-forward, stage (layers that share one position grid)
class FeedForward(nn.Module):
    """Position-wise MLP with GELU, post-norm residual."""
    def __init__(self, cfg):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(cfg.d_model, cfg.d_inner), nn.GELU(),
                                 Dropout(cfg.dropout),
                                 nn.Linear(cfg.d_inner, cfg.d_model), Dropout(cfg.dropout))
        self.norm = nn.LayerNorm(cfg.d_model)

    def forward(self, h):
        return self.norm(h + self.net(h))


class Stage(nn.Module):
    """Layers that share one relative-position grid of their own sequence length."""
    def __init__(self, cfg, n_layers):
        super().__init__()
        self.d_model = cfg.d_model
        self.layers = nn.ModuleList(   # a layer: relative attention, then feed-forward
            nn.ModuleDict(dict(attn=RelativeAttention(cfg), ff=FeedForward(cfg)))
            for _ in range(n_layers))
        self.drop = Dropout(cfg.dropout)

    def positions(self, h):
        """Embeddings [L, D] of the distances L-1 … 0 of h [B, L, D], after dropout."""
        distances = torch.arange(h.size(1) - 1, -1, -1, device=h.device)
        return self.drop(sinusoids(distances, self.d_model).to(h.dtype))

    def forward(self, h, content_bias, position_bias):
        """h [B, L, D] → [B, L, D]."""
        pos_emb = self.positions(h)
        for layer in self.layers:
            h = layer.ff(layer.attn(h, pos_emb, content_bias, position_bias))
        return h

# -----------------------------------------------------------------------------
# The model
@dataclass
class ModelOutput:
    """What a forward pass returns; losses are None without targets."""
    logits: Tensor                           # [B, L, V]
    loss: Tensor | None = None               # scalar: lm_loss + boundary_loss
    lm_loss: Tensor | None = None            # scalar: mean nats per character
    boundary_loss: Tensor | None = None      # scalar: the source's loss (0 if none)
    boundaries: Tensor | None = None         # [B, L] used for pooling (None: vanilla)
    boundary_targets: Tensor | None = None   # [B, L] bool, what they are measured against
    shortening_factor: Tensor | None = None  # scalar: tokens / complete segments
    boundary_logits: Tensor | None = None    # [B, L] a predictor's logit of b_t = 1
    precision: Tensor | None = None          # scalar: against boundary_targets
    recall: Tensor | None = None             # scalar: against boundary_targets

class DynamicPoolingLM(nn.Module):
    """Hourglass LM: pre stage, pooling, shortened stage, upsampling, post; vanilla: one stage."""
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.drop = Dropout(cfg.dropout)
        # Transformer-XL's global content (u) and position (v) biases, shared by all layers.
        self.u = nn.Parameter(torch.zeros(cfg.n_head, cfg.d_head))
        self.v = nn.Parameter(torch.zeros(cfg.n_head, cfg.d_head))
        self.source = None
        if cfg.boundary == 'none':
            self.full_stack = Stage(cfg, sum(cfg.layers))
        else:
            # the three stages from the three layer counts, made (and initialised) in order
            self.pre, self.shortened, self.post = [Stage(cfg, n) for n in cfg.layers]
            source_class = SOURCES[cfg.boundary]
            self.pooling = source_class.Pooling(cfg)
            self.source = source_class(cfg)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size)
        # The released code's init: weights N(0, 0.02), LayerNorm gains N(1, 0.02),
        # biases 0, u and v N(0, 0.02); the null group keeps its N(0, 1).
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.LayerNorm):
                nn.init.normal_(module.weight, 1.0, 0.02)
            if isinstance(module, (nn.Linear, nn.LayerNorm)) and module.bias is not None:
                nn.init.zeros_(module.bias)
        nn.init.normal_(self.u, std=0.02)
        nn.init.normal_(self.v, std=0.02)
        if self.source is not None:
            self.source.init_model(self)

    def num_params(self):
        return sum(p.numel() for p in self.parameters())

    def check_inputs(self, x, targets=None, boundaries=None, n_segments=None):
        """A ValueError naming a mistake in forward's arguments, before any layer runs."""
        require(torch.is_tensor(x) and x.dim() == 2 and x.size(1) > 0
                and x.dtype in (torch.int64, torch.int32),
                f'x must be integer token ids [B, L], L >= 1, got {getattr(x, "dtype", type(x))} '
                f'{tuple(getattr(x, "shape", ()))}')
        # Values are read back on CPU only: on a GPU that is a sync (and train.py checks
        # the data when it loads it).
        read_values = x.device.type == 'cpu' and not torch.compiler.is_compiling()
        V = self.cfg.vocab_size
        require(not read_values or not x.numel()
                or 0 <= int(x.min()) <= int(x.max()) < V,
                f'token ids must lie in [0, {V})')
        require(targets is None or getattr(targets, 'shape', None) == x.shape,
                f'targets must have the shape of x {tuple(x.shape)}')
        require(boundaries is None
                or (torch.is_tensor(boundaries) and boundaries.shape == x.shape
                    and not boundaries.is_complex()
                    and (not read_values
                         or ((boundaries == 0) | (boundaries == 1)).all())),
                f'boundaries must be 0/1 values of the shape of x {tuple(x.shape)}')
        if n_segments is not None:
            require(self.cfg.boundary in EXTERNAL_MODES
                    and isinstance(n_segments, numbers.Integral)
                    and not isinstance(n_segments, bool) and n_segments >= 0,
                    f"n_segments is for boundaries known when the batch is cut "
                    f"({', '.join(EXTERNAL_MODES)}), a non-negative integer: got {n_segments!r} "
                    f"with boundary {self.cfg.boundary!r}")

    def trunk(self, x, boundaries=None, n_segments=None):
        """Embedding to the last stage → (h [B, L, D], Routing or None)."""
        biases = (self.u, self.v)
        h = self.drop(self.embed(x))                                      # [B, L, D]
        if self.source is None:
            return self.full_stack(h, *biases), None
        h = self.pre(h, *biases)
        routing = self.source(h, x, boundaries)
        routing.n_segments = n_segments   # counted with the batch: no device read for S
        s = self.shortened(self.pooling.down(h, routing), *biases)        # [B, 1+S, D]
        h = self.pooling.up(s, routing, h)
        return self.post(h, *biases), routing

    def forward(self, x, targets=None, boundaries=None, n_segments=None):
        """x [B, L] → ModelOutput; targets [B, L] next tokens; boundaries [B, L] external
        ones; n_segments: S (fixed, whitespace) counted on the host, so that pooling reads
        nothing back from the device."""
        self.check_inputs(x, targets, boundaries, n_segments)
        h, routing = self.trunk(x, boundaries, n_segments)
        out = ModelOutput(logits=self.lm_head(h))                        # [B, L, V]
        if targets is not None:
            out.lm_loss = F.cross_entropy(out.logits.flatten(0, 1).float(),
                                          targets.flatten())
            out.boundary_loss = torch.zeros((), device=x.device)
            if routing is not None:
                out.boundary_loss, out.boundary_targets = self.source.loss(
                    routing, out.logits, x, boundaries)
            out.loss = out.lm_loss + out.boundary_loss
        if routing is not None:
            out.boundaries = routing.b
            # unigram, entropy, gumbel (before its noise)
            out.boundary_logits = routing.logits
            out.shortening_factor, out.precision, out.recall = self.source.statistics(
                routing, out.boundary_targets)
        return out

    # -------------------------------------------------------------------------
    # Cached generation: the trunk again, keeping what the next token needs (the section
    # "Cached generation" below), then one token at a time.
    @torch.no_grad()
    def prefill(self, x, capacity=0):
        """Run the prompt x [B, L] in parallel → (logits [B, L, V], GenerationState for decode)."""
        require(not self.training, 'generation needs eval mode: call model.eval() first')
        self.check_inputs(x)
        capacity = max(capacity, x.size(1) + 1)
        state = GenerationState(caches={}, length=x.size(1))
        caches = state.caches

        def run(name, h):
            # the stage as in trunk, keeping each layer's keys and values
            out, caches[name] = stage_prefill(getattr(self, name), h, self.u, self.v, capacity)
            return out

        h = self.embed(x)                                                 # [B, L, D]
        if self.source is None:
            return self.lm_head(run('full_stack', h)), state
        h = run('pre', h)
        routing = self.source(h, x)
        s = run('shortened', self.pooling.down(h, routing))               # [B, 1+S, D]
        state.pooling = self.pooling.prefill_state(h, s, routing)
        # the rows that hold segments, not the padding (Config.seg_bucket)
        caches['shortened'].length = state.pooling.rows
        h = run('post', self.pooling.up(s, routing, h))
        state.boundaries = routing.hard
        return self.lm_head(h), state

    @torch.no_grad()
    def decode(self, token, state):
        """Consume one token [B] per row → logits [B, V] for the next; updates state in place."""
        def run(name, h, advance=1):
            # one position of the stage, kept where `advance`
            stage = getattr(self, name)
            return stage_step(stage, h, self.u, self.v, state.caches[name], advance)

        h = self.embed(token)[:, None]                                    # [B, 1, D]
        if self.source is None:
            h = run('full_stack', h)
        else:
            h = run('pre', h)
            routing = self.source.step(h, token[:, None], state)
            segment, closed = state.pooling.step_down(h, routing)
            # The shortened stage runs only when some row closed a segment, and its result
            # is kept only in those rows.
            s = None
            if closed.any():
                s = run('shortened', segment, closed)
            h = run('post', state.pooling.step_up(s, routing, h))
            state.boundaries = routing.hard
            state.late_boundary = self.source.late_boundary(routing)
        state.length += 1
        return self.lm_head(h[:, 0])

    def steps(self, x, n, temperature=1.0, top_k=None, greedy=False, generator=None,
              n_valid=None):
        """Prefill x [B, L], then pick (next_token) and consume n tokens: yields a
        GenerationStep for the prompt, then one per token once its b is final
        (late_boundary): a token behind."""
        logits, state = self.prefill(x, capacity=x.size(1) + n)
        step = GenerationStep(x, logits, state.boundaries)
        for _ in range(n):
            token = next_token(step.logits[:, -1], temperature, top_k, greedy, generator,
                               n_valid)
            logits = self.decode(token, state)[:, None]
            if state.late_boundary is not None:  # this token decided the last one's b
                step.boundaries = torch.cat([step.boundaries[:, :-1], state.late_boundary], 1)
            yield step
            step = GenerationStep(token[:, None], logits, state.boundaries)
        yield step

    def generate(self, x, n, temperature=1.0, top_k=None, greedy=False, generator=None):
        """Continue the prompt x [B, L] by n tokens → [B, L+n], cached and incremental."""
        was_training = self.training
        try:
            steps = self.eval().steps(x, n, temperature, top_k, greedy, generator)
            return torch.cat([s.tokens for s in steps], 1)
        finally:
            self.train(was_training)


def step_flops(cfg, batch, seq_len, n_short=None):
    """Model FLOPs of one training step, 3 x forward (the usual MFU convention):
    projections, all n^2 attention terms, logits, the source's flops_per_token; no
    pooling, norms or softmax. The shortened stage at n_short = 1 + segments (float or
    tensor; shortened_length(seq_len, sf)), the rest (all if None): seq_len."""
    d = cfg.d_model
    H = cfg.n_head
    dh = cfg.d_head
    n_pre, n_mid, n_post = cfg.layers
    stages = [(sum(cfg.layers), seq_len)]
    if cfg.boundary != 'none' and n_short is not None:
        stages = [(n_pre + n_post, seq_len), (n_mid, n_short)]
    # the source's own matmuls (vanilla: BoundarySource's 0)
    own = SOURCES.get(cfg.boundary, BoundarySource).flops_per_token(cfg)
    fwd = batch * seq_len * (2 * d * cfg.vocab_size + own)
    # a layer's qkv, output and feed-forward projections, per token
    projections = 3 * d * H * dh + H * dh * d + 2 * d * cfg.d_inner
    for layers, n in stages:
        # per layer: projections (per token); position keys; scores and values
        fwd += layers * (batch * n * 2 * projections
                         + n * 2 * d * H * dh + batch * H * n * n * 2 * dh * 3)
    return 3 * fwd


# -----------------------------------------------------------------------------
# Cached generation (docs/generation.md). Apart from the forward pass above and equal to
# it (the cache-parity tests): prefill runs a prompt as trunk does and keeps each layer's
# keys and values; decode then runs one token per row through each unit's step.
@dataclass
class KVCache:
    """Keys and values of one stage's layers during generation; rows may hold different lengths."""
    kv: Tensor                  # [n_layers, 2, B, H, capacity, d_head]: keys, values
    length: Tensor              # [B] int64: valid positions per row, alike in every layer
    r: list | None = None       # per layer [H, capacity, d_head]: keys by distance

    def reserve(self, capacity):
        """Room for `capacity` positions, grown geometrically: amortised O(1) copies per token."""
        C = self.kv.size(-2)
        if capacity > C:
            self.kv = F.pad(self.kv, (0, 0, 0, max(capacity, 2 * C) - C))
            self.r = None


def stage_prefill(stage, h, content_bias, position_bias, capacity):
    """Stage.forward of h [B, L, D] → (its output, a KVCache of each layer's keys and values
    with room for `capacity` positions, or L if more, in the biases' dtype)."""
    B, L = h.shape[:2]
    H, d_head = content_bias.shape
    # L may pass capacity: the shortened stage's rows, padded to a bucket (Config.seg_bucket)
    kv = content_bias.new_zeros(len(stage.layers), 2, B, H, max(capacity, L), d_head)
    pos_emb = stage.positions(h)
    for layer, layer_kv in zip(stage.layers, kv):
        _, _, k, v = layer.attn.heads(h, content_bias, position_bias)
        layer_kv[:, :, :, :L] = torch.stack((k, v))
        h = layer.ff(layer.attn(h, pos_emb, content_bias, position_bias))
    return h, KVCache(kv, torch.full((B,), L, device=h.device))


def stage_step(stage, h, content_bias, position_bias, cache, advance=1):
    """One new position per row through a stage, h [B, 1, D], at the rows' own positions
    at = cache.length [B]: each layer's attention writes its k, v into the cache there and
    attends to positions 0 … at. Kept where `advance` [B] bool (default: everywhere)."""
    at = cache.length
    cache.reserve(int(at.max()) + 1)
    C = cache.kv.size(-2)
    # position keys once per cache size, not per token
    if cache.r is None:
        emb = sinusoids(torch.arange(C, device=h.device), stage.d_model).to(h.dtype)
        cache.r = [layer.attn.position_keys(emb) for layer in stage.layers]
    rows = torch.arange(h.size(0), device=h.device)
    # [B, 1, 1, C]: the distance to each key (< 0: a future key)
    dist = (at[:, None] - torch.arange(C, device=h.device))[:, None, None]
    for layer, kv, r in zip(stage.layers, cache.kv, cache.r):
        attn = layer.attn
        # each [B, H, 1, d_head]
        q_content, q_pos, k, v = attn.heads(h, content_bias, position_bias)
        kv[0][rows, :, at] = k[:, :, 0]
        kv[1][rows, :, at] = v[:, :, 0]
        # einsum, not a broadcast @, so that r is not copied once per row
        bias = torch.einsum('bhqd,hcd->bhqc', q_pos, r)  # [B, H, 1, C] by distance
        # [B, H, 1, C] by key
        bias = bias.gather(-1, dist.clamp(min=0).expand_as(bias))
        bias = bias.masked_fill(dist < 0, float('-inf'))
        y = attn.attend(q_content, kv[0], kv[1], bias, attn.fused(h))
        h = layer.ff(attn.merge(h, y))
    cache.length = at + advance   # int64 + bool: int64
    return h


@dataclass
class MeanPoolingState:
    """MeanPooling's running state from one generated token to the next."""
    unit: MeanPooling  # its norm and Config
    rows: Tensor       # [B] rows of down()'s output that the shortened stage keeps
    seg_sum: Tensor    # [B, D] sum of the pre stage's outputs over the open segment
    seg_len: Tensor    # [B] tokens in the open segment
    last: Tensor       # [B, D] shortened-stage output of the last closed segment (or null)

    def step_down(self, h, routing):
        """h [B, 1, D] joins the open segment → (the segment it closes, pooled; closing rows)."""
        closed = routing.hard[:, 0]
        self.seg_sum += h[:, 0]
        self.seg_len += 1
        # seg_len >= 1: h has just joined the segment
        pooled = h[:, 0]
        if self.unit.cfg.pooling == 'mean':
            pooled = self.seg_sum / self.seg_len[:, None]
        self.seg_sum = torch.where(closed[:, None], 0.0, self.seg_sum)
        self.seg_len = torch.where(closed, 0, self.seg_len)
        return self.unit.norm(pooled)[:, None], closed

    def step_up(self, s, routing, h):
        """s [B, 1, D] (None: no row closed a segment), h [B, 1, D] → post-stage input [B, 1, D]."""
        if s is not None:
            self.last = torch.where(routing.hard[:, :1], s[:, 0], self.last)
        return self.last[:, None] + h


@dataclass
class GenerationState:
    """Everything decoding carries from one token to the next."""
    caches: dict                         # stage name → KVCache
    length: int                          # tokens consumed so far
    pooling: object = None               # the pooling unit's running state (None for vanilla)
    boundaries: Tensor | None = None     # [B, n] bool decisions of the last call's tokens
    late_boundary: Tensor | None = None  # [B, 1] bool: b of the token before, if late


@dataclass
class GenerationStep:
    """One yield of DynamicPoolingLM.steps: tokens just consumed and what the model made of them."""
    tokens: Tensor             # [B, n]: the prompt, then one token at a time
    logits: Tensor             # [B, n, V]: the prediction after each of them
    boundaries: Tensor | None  # [B, n] bool: b_t of each (None for vanilla)


def next_token(logits, temperature, top_k, greedy, generator, n_valid):
    """Next token [B] from logits [B, V]: argmax, or sampled among the top k; no id >= n_valid."""
    if n_valid is not None:
        logits = logits.clone()
        logits[:, n_valid:] = float('-inf')
    if greedy:
        return logits.argmax(-1)
    logits = logits.float() / max(temperature, 1e-6)
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float('-inf'))
    return torch.multinomial(F.softmax(logits, -1), 1, generator=generator)[:, 0]


# -----------------------------------------------------------------------------
# Speed only: a cheaper CPU dropout. nn.Dropout works as well (only the random masks
# would change).
class Dropout(nn.Dropout):
    """nn.Dropout whose CPU mask comes from 16-bit slices of 64-bit random integers (one
    draw for four elements, cheaper than bernoulli_; p rounded to a multiple of 2^-16);
    on GPUs, nn.Dropout itself."""
    def forward(self, x):
        if (not self.training or self.p == 0 or x.device.type != 'cpu' or x.numel() % 4
                or torch.compiler.is_compiling()):
            return super().forward(x)
        bits = torch.empty(x.numel() // 4, dtype=torch.int64).random_(-2 ** 63, None)
        keep = bits.view(torch.int16).view(x.shape) >= round(self.p * 2 ** 16) - 2 ** 15
        # x * mask in x's dtype: masked_fill and x * bool are not vectorised on CPU
        return x * keep.to(x.dtype).mul_(1 / (1 - self.p))

