"""
dynpool: the dynamic-pooling Transformer in one file.

"Efficient Transformers with Dynamic Token Pooling" (Nawrot, Chorowski, Łańcucki, Ponti, ACL 2023):
an hourglass Transformer for character-level language modelling. A few layers run at full length,
the sequence is then pooled into variable-length segments, most layers run on the short sequence,
and the result is upsampled back, without leaking the future, for a few final layers.

    tokens ─ embed ─ pre stack ─┬─ boundary source ─ downsample ─ shortened stack ─ upsample ─┐
                                └────────────────────── skip connection ──────────────────── + ─ post stack ─ logits

Notable features:
- six boundary sources behind one switch, `Config.boundary`:
  none (vanilla), fixed, whitespace, unigram, entropy, gumbel (paper §3);
- Transformer-XL relative attention (Dai et al. 2019) in query blocks that skip the masked future,
  the relative-position term aligned to keys by a copy-free shift;
- pooling through the boundary matrix B, differentiable in the boundaries (paper §2.2);
- upsampling that gives token t only the last segment complete at t, so nothing leaks;
- cached, incremental generation that runs the shortened stack once per closed segment.

Conventions (DESIGN.md): batch-first; b[n, t] = 1 means a segment ends at token t.

    from dynpool import Config, DynamicPoolingLM
    model = DynamicPoolingLM(Config(vocab_size=27, boundary='whitespace', whitespace_id=0))
    out = model(x, targets=y)          # out.loss, out.logits, out.boundaries, out.shortening_factor
"""

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

BOUNDARY_MODES = ('none', 'fixed', 'whitespace', 'unigram', 'entropy', 'gumbel')
PREDICTOR_MODES = ('unigram', 'entropy', 'gumbel')

# -----------------------------------------------------------------------------
# Relative attention (Transformer-XL, Dai et al. 2019 §3.3)


class Dropout(nn.Dropout):
    """nn.Dropout whose CPU mask comes from 16-bit slices of 64-bit random integers: one draw of
    PyTorch's serial CPU generator then serves four elements: ~3× cheaper than F.dropout's bernoulli_
    mask, a CPU training step ~10% faster. The drop probability is rounded to a multiple of 2^-16."""

    def forward(self, x):
        if not self.training or self.p == 0 or x.device.type != 'cpu' or x.numel() % 4:
            return super().forward(x)
        bits = torch.empty(x.numel() // 4, dtype=torch.int64).random_(-2 ** 63, None)
        keep = bits.view(torch.int16).view(x.shape) >= round(self.p * 2 ** 16) - 2 ** 15
        return x * keep.to(x.dtype).mul_(1 / (1 - self.p))  # masked_fill or x * bool: not vectorised on CPU


def sinusoids(distances, dim):
    """Sinusoidal embeddings [N, dim] of relative distances [N]."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, device=distances.device, dtype=torch.float32) / dim))
    angles = distances.float()[:, None] * inv_freq[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


def rel_shift(x):
    """Scores of queries e-m … e-1 against distances e-1 … 0 (x [..., m, e+1], last column zero)
    → scores against keys 0 … e-1: out[..., i, j] = x[..., i, j + m-1-i], distance (e-m+i) - j."""
    # Transformer-XL's padding trick as a view, no copy: read the rows of e+1 as one flat run from
    # offset m-1 in rows of e, and row i starts m-1-i columns further right than its own start.
    # Entries for future keys (j > e-m+i) come out as garbage and are masked by the caller.
    m, e = x.size(-2), x.size(-1) - 1
    return x.flatten(-2)[..., m - 1:m - 1 + m * e].view(*x.shape[:-2], m, e)


@dataclass
class KVCache:
    """Keys and values of one attention layer during generation; rows may hold different lengths."""
    k: torch.Tensor       # [B, H, capacity, d_head]
    v: torch.Tensor       # [B, H, capacity, d_head]
    length: torch.Tensor  # [B] int64, valid positions per row
    r: Optional[torch.Tensor] = None  # [H, capacity, d_head] projected position embeddings by distance


class RelativeAttention(nn.Module):
    """Causal multi-head attention with learnable relative positions, post-norm residual."""

    def __init__(self, cfg):
        super().__init__()
        self.n_head, self.d_head = cfg.n_head, cfg.d_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.n_head * cfg.d_head)
        self.r_net = nn.Linear(cfg.d_model, cfg.n_head * cfg.d_head, bias=False)
        self.out = nn.Linear(cfg.n_head * cfg.d_head, cfg.d_model)
        self.drop = Dropout(cfg.dropout)
        self.dropatt = Dropout(cfg.dropatt)
        self.chunk = cfg.attn_chunk
        self.norm = nn.LayerNorm(cfg.d_model)

    def heads(self, x):
        """x [B, L, D] → q, k, v, each [B, H, L, d_head]."""
        B, L, _ = x.shape
        return self.qkv(x).view(B, L, 3, self.n_head, self.d_head).permute(2, 0, 3, 1, 4).unbind(0)

    def forward(self, x, pos, u, v, cache=None):
        """Full causal attention over x [B, L, D]; pos [L, D] embeds distances L-1 … 0."""
        B, L, _ = x.shape
        q, k, val = self.heads(x)                                               # [B, H, L, d_head]
        if cache is not None:
            cache_write(cache, k, val)
        r = self.r_net(pos).view(L, self.n_head, self.d_head).transpose(0, 1)  # [H, L, d_head]
        r = F.pad(r, (0, 0, 0, 1))                                              # + a zero row for rel_shift
        scale = self.d_head ** -0.5
        q_content = ((q + u[:, None]) * scale).flatten(0, 1)                   # [B*H, L, d_head]
        q_pos = (q + v[:, None]) * scale                                        # [B, H, L, d_head]
        k, val = k.flatten(0, 1), val.flatten(0, 1)                             # [B*H, L, d_head]
        ys = []
        # Queries in blocks [a, e) that see keys 0 … e-1 only: the future half of the score matrix is
        # never computed, and each block's scores [B*H, e-a, e] stay small enough to live in cache.
        for a in range(0, L, self.chunk):
            e = min(a + self.chunk, L)
            # Position term (q_i + v)·r_{i-j}: against distances e-1 … 0, then aligned to keys.
            pos_scores = rel_shift(q_pos[:, :, a:e] @ r[:, L - e:].transpose(1, 2)).flatten(0, 1)
            # Content term (q_i + u)·k_j, added to it by the same matmul.
            scores = torch.baddbmm(pos_scores, q_content[:, a:e], k[:, :e].transpose(1, 2))  # [B*H, e-a, e]
            future = torch.full((e - a, e), float('-inf'), dtype=scores.dtype, device=x.device).triu(a + 1)
            p = self.dropatt((scores + future).softmax(-1))                    # -inf where key j > query i
            ys.append(p @ val[:, :e])                                           # [B*H, e-a, d_head]
        y = torch.cat(ys, 1).view(B, self.n_head, L, -1).transpose(1, 2).reshape(B, L, -1)  # [B, L, H*d_head]
        return self.norm(x + self.drop(self.out(y)))

    def step(self, x, u, v, cache):
        """One new position per row, x [B, 1, D], attending to the cache; writes its k, v at row length."""
        q, k, val = self.heads(x)                                               # [B, H, 1, d_head]
        pos = cache.length                                                      # position of the new token
        cache_write(cache, k, val, at=pos)
        C = cache.k.size(2)
        dist = pos[:, None] - torch.arange(C, device=x.device)                  # [B, C] distance to each key
        scale = self.d_head ** -0.5
        # einsum, not a broadcast @, so that r is not copied once per row (2.3× faster decoding at B=4)
        pos_scores = torch.einsum('bhqd,hcd->bhqc', (q + v[:, None]) * scale, cache.r)  # [B, H, 1, C] by distance
        pos_scores = pos_scores.gather(-1, dist.clamp(min=0)[:, None, None, :].expand_as(pos_scores))
        scores = ((q + u[:, None]) * scale) @ cache.k.transpose(2, 3) + pos_scores       # [B, H, 1, C] by key
        p = scores.masked_fill((dist < 0)[:, None, None, :], float('-inf')).softmax(-1)
        y = (p @ cache.v).transpose(1, 2).reshape(x.size(0), 1, -1)
        return self.norm(x + self.out(y))


def cache_write(cache, k, v, at=None):
    """Write k, v [B, H, n, d_head] into the cache at per-row offsets `at` (default: the start)."""
    n = k.size(2)
    start = torch.zeros_like(cache.length) if at is None else at
    rows = torch.arange(k.size(0), device=k.device)[:, None]
    cols = start[:, None] + torch.arange(n, device=k.device)                   # [B, n]
    cache.k[rows, :, cols] = k.transpose(1, 2)
    cache.v[rows, :, cols] = v.transpose(1, 2)


# -----------------------------------------------------------------------------
# Feed-forward, layer, stack


class FeedForward(nn.Module):
    """Position-wise MLP with GELU, post-norm residual."""

    def __init__(self, cfg):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(cfg.d_model, cfg.d_inner), nn.GELU(), Dropout(cfg.dropout),
                                 nn.Linear(cfg.d_inner, cfg.d_model), Dropout(cfg.dropout))
        self.norm = nn.LayerNorm(cfg.d_model)

    def forward(self, x):
        return self.norm(x + self.net(x))


class Layer(nn.Module):
    """Relative attention then feed-forward."""

    def __init__(self, cfg):
        super().__init__()
        self.attn = RelativeAttention(cfg)
        self.ff = FeedForward(cfg)

    def forward(self, x, pos, u, v, cache=None):
        return self.ff(self.attn(x, pos, u, v, cache))

    def step(self, x, u, v, cache):
        return self.ff(self.attn.step(x, u, v, cache))


class Stack(nn.Module):
    """Layers that share one relative-position grid of their own sequence length."""

    def __init__(self, cfg, n_layers):
        super().__init__()
        self.d_model = cfg.d_model
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(n_layers))
        self.drop = Dropout(cfg.dropout)

    def forward(self, x, u, v, caches=None):
        L = x.size(1)
        pos = self.drop(sinusoids(torch.arange(L - 1, -1, -1, device=x.device), self.d_model).to(x.dtype))
        for i, layer in enumerate(self.layers):
            x = layer(x, pos, u, v, None if caches is None else caches[i])
        return x

    def step(self, x, u, v, caches):
        for layer, cache in zip(self.layers, caches):
            need = int(cache.length.max()) + 1
            if need > cache.k.size(2):  # grow geometrically: amortised O(1) copies per token
                grow = max(need, 2 * cache.k.size(2)) - cache.k.size(2)
                cache.k, cache.v, cache.r = F.pad(cache.k, (0, 0, 0, grow)), F.pad(cache.v, (0, 0, 0, grow)), None
            if cache.r is None:  # project position embeddings once per cache size, not once per token
                dist = torch.arange(cache.k.size(2), device=x.device)
                r = layer.attn.r_net(sinusoids(dist, self.d_model).to(x.dtype))
                cache.r = r.view(-1, layer.attn.n_head, layer.attn.d_head).transpose(0, 1)
            x = layer.step(x, u, v, cache)
        return x

    def empty_caches(self, B, capacity, ref):
        """One empty KVCache per layer, shaped like `ref`'s attention."""
        return [KVCache(k=ref.new_zeros(B, l.attn.n_head, capacity, l.attn.d_head),
                        v=ref.new_zeros(B, l.attn.n_head, capacity, l.attn.d_head),
                        length=torch.zeros(B, dtype=torch.long, device=ref.device)) for l in self.layers]


# -----------------------------------------------------------------------------
# Pooling through the boundary matrix (paper §2.2)


def boundary_matrix(b):
    """B [B, L, S]: B[n, t, j] = 1 iff token t is in complete segment j; differentiable in b."""
    # Segment indices come from the hard decisions in int64, exact in any dtype (a bf16 running sum
    # is not exact past 256); the float32 running sum below only carries the gradient.
    hard = (b.detach() > 0.5).long()
    seg = hard.cumsum(1) - hard                          # [B, L] c_t = Σ_{i<t} b_i, the segment of token t
    n_seg = hard.sum(1, keepdim=True)                    # [B, 1] complete segments per row
    S = int(n_seg.max()) if b.numel() else 0
    hit = (seg[..., None] == torch.arange(S, device=b.device)) & (seg < n_seg)[..., None]  # [B, L, S]
    # The entry is 1 + c_t - stopgrad(c_t): exactly 1 in value, with derivative 1 in c_t, so a
    # straight-through Gumbel boundary receives gradient through the running sum (paper §3.3).
    c = b.float().cumsum(1) - b.float()
    return torch.where(hit, (1 + c - c.detach())[..., None], torch.zeros((), device=b.device))


def downsample(h, b, null):
    """Mean of h [B, L, D] over each complete segment, after the null group → [B, 1+S, D]."""
    Bm = boundary_matrix(b).to(h.dtype)                  # [B, L, S]
    counts = Bm.sum(1)                                   # [B, S] segment lengths
    seg = torch.einsum('bls,bld->bsd', Bm, h) / counts.clamp(min=1)[..., None]
    return torch.cat([null.reshape(1, 1, -1).expand(h.size(0), 1, -1).to(h.dtype), seg], 1)


def upsample(s, b):
    """Token t receives s[:, m_t], m_t = Σ_{i≤t} b_i: the last segment complete at t (0 = null group)."""
    m = (b.detach() > 0.5).long().cumsum(1)                                   # [B, L], exact as above
    out = s.gather(1, m[..., None].expand(-1, -1, s.size(-1)))                # [B, L, D]
    if b.requires_grad:
        # No gradient flows to b through upsampling (in the paper's row-normalised B it cancels);
        # this zero term only keeps b in the graph so autograd can be asked for it.
        out = out + 0 * b.float().cumsum(1)[..., None].to(out.dtype)
    return out


# -----------------------------------------------------------------------------
# Boundary sources (paper §3)


def entropy_spikes(H, k=2):
    """b_t = 1 iff H_t > H_i for every i in t-k … t-1 that exists (a local entropy peak, §3.2)."""
    spikes = torch.ones_like(H, dtype=torch.bool)
    for i in range(1, min(k, H.size(1) - 1) + 1):        # loop over the window, not over time
        spikes[:, i:] &= H[:, i:] > H[:, :-i]
    return spikes


def gumbel_sigmoid(logits, temperature, u=None):
    """Relaxed Bernoulli sample with a hard straight-through decision (Jang et al. 2017; paper §3.3).
    u: the uniform noise (broadcast to logits), drawn fresh when None."""
    logits = logits.float()  # in bf16, hard + soft - soft.detach() can read 0.996 instead of 1
    u = (torch.rand_like(logits) if u is None else u.expand_as(logits)).clamp(1e-6, 1 - 1e-6)
    soft = torch.sigmoid((logits + u.log() - (-u).log1p()) / temperature)
    hard = (soft > 0.5).to(soft.dtype)
    return hard + soft - soft.detach()


def binomial_prior_loss(b, prior):
    """-log Binomial(Σ_t b_t; L, α) / L, mean over the batch: keeps the boundary rate near α (§3.3)."""
    L, n = b.size(1), b.sum(1)
    log_p = (math.lgamma(L + 1) - torch.lgamma(n + 1) - torch.lgamma(L - n + 1)
             + n * math.log(prior) + (L - n) * math.log(1 - prior))
    return -(log_p / L).mean()


class BoundaryPredictor(nn.Module):
    """MLP d_model → d_inner → 1 on the pre stack's output: the logit of 'a segment ends here'."""

    def __init__(self, cfg):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(cfg.d_model, cfg.d_inner), nn.GELU(), nn.Linear(cfg.d_inner, 1))

    def forward(self, h):
        return self.net(h).squeeze(-1)                   # [B, L]


# -----------------------------------------------------------------------------
# The model


@dataclass
class Config:
    """Hyper-parameters; the defaults build the paper's ~41M-parameter model (appendix)."""
    vocab_size: int = 27
    d_model: int = 512
    n_head: int = 8
    d_head: int = 64
    d_inner: int = 2048
    dropout: float = 0.1
    dropatt: float = 0.1
    layers: tuple = (2, 8, 2)          # (pre, shortened, post); vanilla runs sum(layers) at full length
    boundary: str = 'none'             # one of BOUNDARY_MODES
    whitespace_id: Optional[int] = None  # token id of the space (whitespace mode; gumbel precision/recall)
    fixed_factor: int = 2              # segment length k of fixed pooling
    temperature: float = 0.5           # Gumbel-sigmoid temperature
    prior: float = 0.2                 # Binomial prior α: expected boundary rate of gumbel
    entropy_window: int = 2            # k of entropy spikes
    threshold: float = 0.5             # predictor probability above which a segment ends
    attn_chunk: int = 128              # queries per attention block: speed and memory only, not results

    def __post_init__(self):
        self.layers = tuple(self.layers)
        if self.boundary not in BOUNDARY_MODES:
            raise ValueError(f"unknown boundary mode {self.boundary!r}; choose one of {', '.join(BOUNDARY_MODES)}")
        if len(self.layers) != 3 or any(int(n) != n or n < 0 for n in self.layers):
            raise ValueError(f"layers must be three counts (pre, shortened, post), got {self.layers!r}")
        if self.boundary != 'none' and self.layers[1] == 0:
            raise ValueError(f"boundary {self.boundary!r} needs shortened layers, got layers={self.layers}")
        if self.boundary == 'whitespace' and self.whitespace_id is None:
            raise ValueError("boundary 'whitespace' needs whitespace_id (the token id of the space)")
        if self.boundary == 'fixed' and self.fixed_factor < 1:
            raise ValueError(f"fixed_factor must be >= 1, got {self.fixed_factor}")
        if self.attn_chunk < 1:
            raise ValueError(f"attn_chunk must be >= 1, got {self.attn_chunk}")
        if not 0 < self.prior < 1:
            raise ValueError(f"prior must be in (0, 1), got {self.prior}")
        if self.vocab_size < 1 or self.d_model % 2:
            raise ValueError("vocab_size must be positive and d_model even (sinusoidal positions)")


@dataclass
class ModelOutput:
    """What a forward pass returns; losses are None without targets."""
    logits: torch.Tensor                               # [B, L, V]
    loss: Optional[torch.Tensor] = None                # scalar: lm_loss + boundary_loss
    lm_loss: Optional[torch.Tensor] = None             # scalar: mean nats per character
    boundary_loss: Optional[torch.Tensor] = None       # scalar: BCE (unigram, entropy) or prior (gumbel), else 0
    boundaries: Optional[torch.Tensor] = None          # [B, L] boundaries used for pooling (None for vanilla)
    boundary_targets: Optional[torch.Tensor] = None    # [B, L] bool, what the predictor is measured against
    shortening_factor: Optional[torch.Tensor] = None   # scalar: tokens / complete segments
    precision: Optional[torch.Tensor] = None           # scalar: predictor precision against boundary_targets
    recall: Optional[torch.Tensor] = None              # scalar: predictor recall against boundary_targets


def next_token(logits, temperature=1.0, top_k=None, greedy=False, generator=None):
    """Pick the next token [B] from logits [B, V]: argmax, or a sample at temperature among the top k."""
    if greedy:
        return logits.argmax(-1)
    logits = logits.float() / max(temperature, 1e-6)
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float('-inf'))
    return torch.multinomial(F.softmax(logits, -1), 1, generator=generator)[:, 0]


@dataclass
class GenerationState:
    """Everything decoding carries from one character to the next."""
    caches: list                     # [pre, shortened, post] lists of KVCache, one per layer
    length: int                      # characters consumed so far
    seg_sum: torch.Tensor            # [B, D] sum of pre-stack outputs of the open segment
    seg_len: torch.Tensor            # [B] tokens in the open segment
    upsampled: torch.Tensor          # [B, D] shortened-stack output of the last closed segment (or null group)
    boundaries: list = field(default_factory=list)  # [B] bool decision per consumed character


class DynamicPoolingLM(nn.Module):
    """Hourglass character LM: pre stack, pooling, shortened stack, causal upsampling, post stack."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.drop = Dropout(cfg.dropout)
        # Transformer-XL's global content (u) and position (v) biases, shared by every layer.
        self.u = nn.Parameter(torch.zeros(cfg.n_head, cfg.d_head))
        self.v = nn.Parameter(torch.zeros(cfg.n_head, cfg.d_head))
        pre, short, post = cfg.layers
        if cfg.boundary == 'none':
            self.stacks = nn.ModuleList([Stack(cfg, pre + short + post)])
        else:
            self.stacks = nn.ModuleList([Stack(cfg, pre), Stack(cfg, short), Stack(cfg, post)])
            self.null_group = nn.Parameter(torch.randn(cfg.d_model))
            self.down_norm = nn.LayerNorm(cfg.d_model)
            if cfg.boundary in PREDICTOR_MODES:
                self.predictor = BoundaryPredictor(cfg)
            if cfg.boundary == 'gumbel':  # the fixed evaluation noise, see decide()
                noise = torch.rand(2 ** 16, generator=torch.Generator().manual_seed(0))
                self.register_buffer('eval_noise', noise, persistent=False)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def num_params(self):
        return sum(p.numel() for p in self.parameters())

    # --- boundaries -------------------------------------------------------------

    def external_boundaries(self, x, boundaries, start=0):
        """Boundaries from outside the network for x [B, L] at positions start …: given, or derived
        for fixed and whitespace."""
        if boundaries is not None:
            return boundaries.detach().float()
        if self.cfg.boundary == 'whitespace':
            return (x == self.cfg.whitespace_id).float()
        t = torch.arange(start, start + x.size(1), device=x.device)
        return ((t + 1) % self.cfg.fixed_factor == 0).float().expand_as(x)

    def decide(self, logits, start=0):
        """The predictor's own boundaries for logits [B, L] of positions start … start+L-1."""
        if self.cfg.boundary != 'gumbel':
            return (torch.sigmoid(logits.float()) > self.cfg.threshold).float()
        if self.training:
            return gumbel_sigmoid(logits, self.cfg.temperature)
        # Evaluation samples as training does (so does the paper's code; the noiseless rounding of a
        # predictor held near the prior α rarely fires), but with one fixed noise value per
        # position: deterministic, and the decision at t still depends on x_{<=t} only.
        pos = torch.arange(start, start + logits.size(1), device=logits.device) % self.eval_noise.numel()
        return gumbel_sigmoid(logits, self.cfg.temperature, u=self.eval_noise[pos]).detach()

    def check_inputs(self, x, targets, boundaries):
        """Turn shape and dtype mistakes into one clear ValueError before any layer runs."""
        if not torch.is_tensor(x) or x.dim() != 2 or x.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"x must be an integer tensor [B, L], got {getattr(x, 'dtype', type(x))} "
                             f"of shape {tuple(getattr(x, 'shape', ()))}")
        if x.size(1) == 0:
            raise ValueError("x must hold at least one token")
        if x.numel() and (int(x.min()) < 0 or int(x.max()) >= self.cfg.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.cfg.vocab_size}), got [{int(x.min())}, {int(x.max())}]")
        if targets is not None and (not torch.is_tensor(targets) or targets.shape != x.shape):
            raise ValueError(f"targets must have the shape of x {tuple(x.shape)}, got {tuple(getattr(targets, 'shape', ()))}")
        if boundaries is not None:
            if not torch.is_tensor(boundaries) or boundaries.shape != x.shape:
                raise ValueError(f"boundaries must have the shape of x {tuple(x.shape)}, "
                                 f"got {tuple(getattr(boundaries, 'shape', ()))}")
            if boundaries.dtype.is_complex or not (boundaries.dtype == torch.bool or boundaries.is_floating_point()
                                                   or boundaries.dtype in (torch.int64, torch.int32, torch.uint8)):
                raise ValueError(f"boundaries must be bool, integer or float 0/1, got {boundaries.dtype}")
            if boundaries.dtype != torch.bool and not ((boundaries == 0) | (boundaries == 1)).all():
                raise ValueError("boundaries must hold only 0 and 1")
        if self.cfg.boundary == 'unigram' and targets is not None and boundaries is None:
            raise ValueError("boundary 'unigram' trains its predictor towards Unigram boundaries: "
                             "pass boundaries= with targets")

    # --- forward ---------------------------------------------------------------

    def trunk(self, x, boundaries=None, caches=None):
        """Embedding to post stack → (h [B, L, D], b [B, L], predictor logits, pre-stack h, shortened s)."""
        cfg, c = self.cfg, caches or (None, None, None)
        h = self.drop(self.embed(x))                                    # [B, L, D]
        if cfg.boundary == 'none':
            return self.stacks[0](h, self.u, self.v, c[0]), None, None, None, None
        h = self.stacks[0](h, self.u, self.v, c[0])
        bp_logits = None
        if cfg.boundary in PREDICTOR_MODES:
            bp_logits = self.predictor(h)                               # [B, L]
            b = self.decide(bp_logits)
        else:
            b = self.external_boundaries(x, boundaries)
        s = self.down_norm(downsample(h, b, self.null_group))          # [B, 1+S, D]
        s = self.stacks[1](s, self.u, self.v, c[1])
        # Skip connection: the pre stack's output carries each token's own identity past the pooling.
        y = self.stacks[2](upsample(s, b) + h, self.u, self.v, c[2])
        return y, b, bp_logits, h, s

    def forward(self, x, targets=None, boundaries=None):
        """x [B, L] → ModelOutput; targets [B, L] next tokens; boundaries [B, L] external ones."""
        self.check_inputs(x, targets, boundaries)
        cfg = self.cfg
        h, b, bp_logits, _, _ = self.trunk(x, boundaries)
        out = ModelOutput(logits=self.lm_head(h), boundaries=b)        # logits [B, L, V]
        if b is not None:
            out.shortening_factor = b.numel() / b.detach().sum().clamp(min=1)
        if targets is None:
            return out

        out.lm_loss = F.cross_entropy(out.logits.flatten(0, 1).float(), targets.flatten())
        out.boundary_loss = out.lm_loss.new_zeros(())
        target_b = None
        if cfg.boundary == 'unigram':
            target_b = boundaries.bool()
        elif cfg.boundary == 'entropy':
            # Targets are spikes of the model's own next-character entropy (§3.2); no gradient through them.
            logp = F.log_softmax(out.logits.detach().float(), -1)
            target_b = entropy_spikes(-(logp.exp() * logp).sum(-1), cfg.entropy_window)
        elif cfg.boundary == 'gumbel':
            out.boundary_loss = binomial_prior_loss(out.boundaries, cfg.prior)
            if cfg.whitespace_id is not None:  # measured against words, never trained towards them
                target_b = x == cfg.whitespace_id
        if cfg.boundary in ('unigram', 'entropy'):
            out.boundary_loss = F.binary_cross_entropy_with_logits(bp_logits.float(), target_b.float())
        if target_b is not None:
            pred = out.boundaries.detach() > 0.5
            tp = (pred & target_b).sum()
            out.boundary_targets = target_b
            out.precision = tp / pred.sum().clamp(min=1)
            out.recall = tp / target_b.sum().clamp(min=1)
        out.loss = out.lm_loss + out.boundary_loss
        return out

    # --- generation --------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, x, capacity=None):
        """Run the prompt x [B, L] in parallel → (logits [B, L, V], GenerationState for decode)."""
        if self.training:
            raise ValueError("generation needs eval mode: call model.eval() first")
        B, L = x.shape
        capacity = max(capacity or 0, L + 1)
        caches = [stack.empty_caches(B, capacity, self.u) for stack in self.stacks]
        self.check_inputs(x, None, None)
        h, b, _, h_pre, s = self.trunk(x, caches=caches)
        logits = self.lm_head(h)
        for stack_caches in caches:
            for c in stack_caches:
                c.length.fill_(L)
        D = self.cfg.d_model
        state = GenerationState(caches=caches, length=L, seg_sum=self.u.new_zeros(B, D),
                                seg_len=torch.zeros(B, dtype=torch.long, device=x.device),
                                upsampled=self.u.new_zeros(B, D))
        if b is not None:
            b = b.bool()
            n_seg = b.sum(1)                                             # [B] complete segments per row
            for c in caches[1]:
                c.length.copy_(1 + n_seg)                                # the null group + closed segments
            # The open segment: tokens after the last boundary, whose sum decode keeps extending.
            open_mask = b.flip(1).cumsum(1).flip(1) == 0                 # [B, L]
            state.seg_sum = (h_pre * open_mask[..., None]).sum(1)
            state.seg_len = open_mask.sum(1)
            state.upsampled = s[torch.arange(B, device=x.device), n_seg]
            state.boundaries = list(b.unbind(1))
        return logits, state

    @torch.no_grad()
    def decode(self, token, state):
        """Consume one token [B] per row → logits [B, V] for the next; updates state in place."""
        cfg, t = self.cfg, state.length
        h = self.embed(token)[:, None]                                   # [B, 1, D]
        if cfg.boundary == 'none':
            h = self.stacks[0].step(h, self.u, self.v, state.caches[0])
        else:
            h = self.stacks[0].step(h, self.u, self.v, state.caches[0])
            if cfg.boundary in PREDICTOR_MODES:
                b = self.decide(self.predictor(h), start=t)[:, 0] > 0.5
            else:
                b = self.external_boundaries(token[:, None], None, start=t)[:, 0] > 0.5
            state.seg_sum += h[:, 0]
            state.seg_len += 1
            if b.any():
                # Run the shortened stack once for the segment just closed, only where one closed.
                mean = state.seg_sum / state.seg_len.clamp(min=1)[:, None]
                s = self.stacks[1].step(self.down_norm(mean)[:, None], self.u, self.v, state.caches[1])
                for c in state.caches[1]:
                    c.length += b.long()
                state.upsampled = torch.where(b[:, None], s[:, 0], state.upsampled)
                state.seg_sum = torch.where(b[:, None], 0.0, state.seg_sum)
                state.seg_len = torch.where(b, 0, state.seg_len)
            state.boundaries.append(b)
            h = self.stacks[2].step(state.upsampled[:, None] + h, self.u, self.v, state.caches[2])
        for stack_caches in state.caches[:1] if cfg.boundary == 'none' else state.caches[::2]:
            for c in stack_caches:
                c.length += 1
        state.length = t + 1
        return self.lm_head(h[:, 0])

    @torch.no_grad()
    def generate(self, x, n, temperature=1.0, top_k=None, greedy=False, generator=None):
        """Continue the prompt x [B, L] by n tokens → [B, L+n], cached and incremental."""
        was_training = self.training
        self.eval()
        logits, state = self.prefill(x, capacity=x.size(1) + n)
        logits, out = logits[:, -1], [x]
        for _ in range(n):
            nxt = next_token(logits, temperature, top_k, greedy, generator)
            out.append(nxt[:, None])
            logits = self.decode(nxt, state)
        self.train(was_training)
        return torch.cat(out, 1)
