"""hnet: H-Net's dynamic chunking (Hwang, Wang, Gu 2025, §2.2) as boundary='hnet', added
through the hooks of BoundarySource so that dynpool.py stays the paper's model
(docs/hnet.md). Importing this file registers it (`import hnet`: the scripts through
flags.import_sources, the tests through conftest.py); dynpool.py imports no source.

Causality: token t reads its own chunk, whose vector was selected at its start, so logits
at t depend on x_{<=t}. b_t = start_{t+1} (the project's convention) is decided by x_{t+1},
never read by token t, 0 for the last token; generation reports it a token later
(late_boundary).
"""
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from dynpool import (BoundarySource, Routing, gather_rows, padded_count, register_source,
                     require)


@dataclass
class HNetOptions:
    """hnet's own hyper-parameters: Config(options=...), a source's `self.options`."""
    ratio_target: float = 6.0  # target compression N of the ratio loss (text8: ~6)
    ratio_weight: float = 1.0  # α (H-Net: 0.03, which left SF 3.69 at N = 6 on our CPU)


def start_probability(q, k):
    """p = ½(1 − cos(q, k)) in [0, 1] for q, k [..., D]: how far a token turns from the last one."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    q = F.normalize(q.to(dtype), dim=-1)
    k = F.normalize(k.to(dtype), dim=-1)
    return ((1 - (q * k).sum(-1)) / 2).clamp(0, 1)


def select_starts(h, start, S):
    """h [B, L, D] at chunk starts (start [B, L] bool) → [B, S, D], zero rows after the last."""
    L = h.size(1)
    # the positions of the starts, in order, then L (no start) for the rows' missing ones
    where = torch.where(start, torch.arange(L, device=h.device), L).sort(1).values[:, :S]
    z = gather_rows(h, where.clamp(max=L - 1))
    return z * (where < L)[..., None].to(h.dtype)


def smooth_chunks(z, P):
    """EMA over chunks z [B, S, D] at rates P [B, S]: z̄_j = P_j z_j + (1 − P_j) z̄_{j−1}, from 0."""
    # Closed form, parallel over j: z̄_j = Σ_{i<=j} P_i Π_{i<k<=j} (1 − P_k) z_i.
    # P_k = 1 would put −inf into the log sums, and NaN into their gradient even where
    # masked: it is read as 1 − 1e-6.
    S = z.size(1)
    log_keep = torch.log1p(-P.clamp(max=1 - 1e-6))  # [B, S] log(1 − P_k)
    later = torch.ones(S, S, dtype=torch.bool, device=z.device).tril(-1)  # [k, i]: k > i
    # [B, j, i]: Σ_{i<k<=j} log(1 − P_k)
    decay = log_keep[:, :, None].masked_fill(~later, 0).cumsum(1)
    # [B, j, i]: the weight of z_i in z̄_j, 0 where i > j
    weight = decay.masked_fill(later.T, float('-inf')).exp() * P[:, None]
    return weight.to(z.dtype) @ z  # [B, S, D]


def ratio_loss(start, p, N):
    """N/(N−1)·((N−1)·F·G + (1−F)·(1−G)), F the fraction of starts, G the mean p over the batch."""
    frac = start.float().mean()
    mean_p = p.float().mean()
    return N / (N - 1) * ((N - 1) * frac * mean_p + (1 - frac) * (1 - mean_p))


@dataclass
class ChunkRouting(Routing):
    """The router's output: b in the project's meaning (b_t = start_{t+1}), and the chunk starts."""
    p: Tensor | None = None      # [B, L] start probabilities p_t (p_0 = 1)
    start: Tensor | None = None  # [B, L] bool: a chunk starts at t (p_t > ½)


class ChunkPooling(nn.Module):
    """Down: the vectors at chunk starts. Up: token t gets its chunk's z̄ times STE(c_t)
    (value 1, gradient of c_t = p_t at a start, 1 − p_t elsewhere) plus W_r h_t."""
    def __init__(self, cfg):
        super().__init__()
        self.residual = nn.Linear(cfg.d_model, cfg.d_model)
        self.bucket = cfg.seg_bucket

    def down(self, h, routing):
        """h [B, L, D] → [B, S, D], zero rows padding S to a bucket."""
        # the one host sync
        S = padded_count(int(routing.start.sum(1).max()), self.bucket, h.device)
        return select_starts(h, routing.start, S)

    def up(self, s, routing, h):
        """Shortened-stage output s [B, S, D], pre-stage output h [B, L, D] → [B, L, D]."""
        chunk = routing.start.long().cumsum(1) - 1  # [B, L] token t's chunk
        out = gather_rows(self.smooth(s, routing), chunk)
        confidence = torch.where(routing.start, routing.p, 1 - routing.p)
        # 1 in value, with the gradient of c
        one = (confidence - confidence.detach() + 1)[..., None].to(out.dtype)
        return out * one + self.residual(h)

    def smooth(self, s, routing):
        """z̄ [B, S, D] at the rates P_j = p at chunk j's start."""
        # [B, S, 1], zero on the padding rows
        P = select_starts(routing.p[..., None], routing.start, s.size(1))
        return smooth_chunks(s, P[..., 0])

    def prefill_state(self, h, s, routing):
        """Cached generation: the state after a prompt (h, s as in down and up)."""
        rows = routing.start.sum(1)
        z_bar = gather_rows(self.smooth(s, routing), rows[:, None] - 1)[:, 0]
        return ChunkPoolingState(self, rows, h[:, -1], z_bar)


@dataclass
class ChunkPoolingState:
    """ChunkPooling's running state from one generated token to the next."""
    unit: ChunkPooling  # its residual projection W_r
    rows: Tensor        # [B] chunks so far: the rows the shortened stage keeps
    last_h: Tensor      # [B, D] the last token's pre-stage output (the router's h_{t-1})
    z_bar: Tensor       # [B, D] the smoothed output of the last token's chunk

    def step_down(self, h, routing):
        """h [B, 1, D] → (shortened-stage input: h itself; rows where it starts a chunk [B])."""
        # the router compares the next token with this one
        self.last_h = h[:, 0]
        return h, routing.start[:, 0]

    def step_up(self, s, routing, h):
        """s [B, 1, D] (None: no row started a chunk), h [B, 1, D] → post-stage input [B, 1, D]."""
        if s is not None:
            p = routing.p[:, :1].to(h.dtype)
            z_bar = p * s[:, 0] + (1 - p) * self.z_bar
            self.z_bar = torch.where(routing.start[:, :1], z_bar, self.z_bar)
        return (self.z_bar + self.unit.residual(h[:, 0]))[:, None]


class HNetBoundaries(BoundarySource):
    """H-Net's router: p_t = ½(1 − cos(W_q h_{t−1}, W_k h_t)), p_0 = 1, a chunk starts
    where p_t > ½; measured against the spaces (whitespace_id), never trained on them."""
    Pooling = ChunkPooling
    Options = HNetOptions

    def __init__(self, cfg):
        super().__init__(cfg)
        self.q = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.k = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    @staticmethod
    def check_config(cfg):
        require(cfg.pooling == 'mean',
                "boundary 'hnet' pools chunk starts: no pooling 'last'")
        options = HNetOptions(**cfg.options)
        require(options.ratio_target > 1 and options.ratio_weight >= 0,
                f'ratio_target must be > 1 and ratio_weight >= 0, got {options.ratio_target} '
                f'and {options.ratio_weight}')

    def init_model(self, model):
        """H-Net's init: W_q = W_k = I, W_r = 0, embeddings std 1 (0.02 stopped the chunking)."""
        nn.init.eye_(self.q.weight)
        nn.init.eye_(self.k.weight)
        nn.init.zeros_(model.pooling.residual.weight)
        nn.init.normal_(model.embed.weight, std=1.0)

    @staticmethod
    def flops_per_token(cfg):
        return 2 * 3 * cfg.d_model * cfg.d_model  # W_q, W_k and the residual W_r

    def forward(self, h, x, boundaries=None, offset=0):
        # [B, L-1], for t = 1 … L-1
        p = start_probability(self.q(h[:, :-1]), self.k(h[:, 1:]))
        return self.route(F.pad(p, (1, 0), value=1.0))

    def step(self, h, x, state):
        p = start_probability(self.q(state.pooling.last_h), self.k(h[:, 0]))   # [B]
        return self.route(p[:, None])

    def late_boundary(self, routing):
        # a chunk starts at t: the token before ends a segment
        return routing.start[:, :1]

    @staticmethod
    def route(p):
        """ChunkRouting from start probabilities p [B, L]; b_{L-1} = 0: not decided yet."""
        start = p > 0.5
        return ChunkRouting(b=F.pad(start[:, 1:], (0, 1)).float(), p=p, start=start)

    def loss(self, routing, logits, x, boundaries):
        ratio = ratio_loss(routing.start, routing.p, self.options.ratio_target)
        return self.options.ratio_weight * ratio, self.spaces(x)


register_source('hnet', HNetBoundaries)
