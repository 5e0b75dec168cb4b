"""
Generate text from a dynpool checkpoint and show the segments the model chose.

    python sample.py --ckpt out/text8-whitespace --prompt "The History of" --chars 500 \\
        --temperature 0.8 --top-k 20 --seed 1 --show-segments
    python sample.py --ckpt out/text8-entropy/ckpt.pt --show-segments --color   # on a terminal
    python sample.py --ckpt out/text8-entropy --greedy --num-samples 3 --device cuda
    python sample.py --ckpt out/text8-entropy --chars 120 --entropy-plot fig2.png
    python sample.py --ckpt out/text8-entropy --chars 120 --entropy-trace > trace.tsv

What is printed:
- the prompt followed by its continuation, one sample after another (a line of dashes between);
- with --show-segments, a separator (`|`) after every character that closes a segment (the
  model's b_t = 1) and `»` where the prompt ends; deleting both gives back the text. With --color
  on a terminal, segments alternate in colour instead. On stderr, per sample: characters,
  segments closed and the shortening factor. Vanilla checkpoints have no segments.
- with --entropy-trace [FILE], a TSV (pos, char, entropy_bits, boundary, spike) in place of the
  text, or to FILE. entropy_bits at t is the entropy of the model's next-character distribution
  after reading 0..t (temperature 1, no top-k): the paper's H_t (§3.2). spike is the entropy-spike
  rule on that trace, b_t = 1 iff H_t > H_i for the k previous positions (dynpool.entropy_spikes;
  k = --spike-window, default the checkpoint's entropy_window), for any model; boundary is where
  the model itself pools (empty for vanilla).
- with --entropy-plot FILE.png, the paper's Figure 2 for the first sample: the entropy per
  character, the spike rule's boundaries and, in a row of their own, the model's (matplotlib).

The prompt is cleaned as the training text was (cleaning.clean with the checkpoint's language:
from its record, else from its alphabet), and one stderr line shows any change; characters still
outside the alphabet are refused in one line; an empty prompt starts from a single space.

--ckpt is train.py's ckpt.pt or its run folder, loaded safely (weights_only; --trust-ckpt for any
pickle). Sampling is reproducible for a given --seed, device and torch version. Errors are one
`error: ...` line on stderr (common.main): exit 2 for a bad flag, 1 otherwise, 130 on Ctrl-C;
files are written whole or not at all.
"""

import argparse
import json
import math
import os
import sys
from typing import NamedTuple

import torch
import torch.nn.functional as F

import common
import hnet  # noqa: F401  (registers boundary='hnet' before dynpool's lists are read)
from cleaning import LANGS, TEXT8_ALPHABET, clean
from common import UserError, import_pyplot, int_range, nonblank, write_atomic
from dynpool import entropy_spikes
from checkpoint import load_checkpoint
from runtime import pick_device

ANSI_SEGMENT_COLOURS = ('\033[48;5;153m\033[38;5;16m', '\033[48;5;223m\033[38;5;16m')
ANSI_RESET = '\033[0m'
PROMPT_MARK = '»'   # --show-segments: where the prompt ends and the continuation begins


# ----------------------------------------------------------------------------- text ↔ token ids
def prompt_cleaning(vocab):
    """(language, fold_accents, where that was read) of the training text's cleaning: the
    checkpoint's record, else the language whose alphabet it is ('\n', ' ' and the letters;
    text8's ' ' and a-z); language None if none."""
    rec = vocab.get('cleaning')
    if isinstance(rec, dict) and rec.get('lang') in LANGS:
        return rec['lang'], bool(rec.get('fold_accents')), 'recorded in the checkpoint'
    alphabet = set(vocab['alphabet'])
    if alphabet == set(TEXT8_ALPHABET):
        return 'en', False, "text8's alphabet"
    for lang, spec in LANGS.items():
        if alphabet == {'\n', ' '} | set(spec['letters']):
            return lang, False, f'the {lang} alphabet'
    return None, False, 'an alphabet of no language prepare_data.py knows'


def clean_prompt(text, vocab):
    """The prompt as the training text was cleaned → (cleaned text, how, in words). Line breaks
    become spaces where the alphabet has none; a trailing space or line break is kept (the
    continuation starts a new word), which prepare_data's line-end stripping would drop."""
    alphabet = vocab['alphabet']
    lang, fold, source = prompt_cleaning(vocab)
    if lang is None:   # only what is safe for any alphabet: lower case where it has no upper case
        lowered = text.lower() if not any(c != c.lower() for c in alphabet) else text
        return lowered, f'lower-cased only: {source}'
    out = clean(text, lang, fold)
    if '\n' not in alphabet:
        out = ' '.join(out.split())
    tail = text[len(text.rstrip()):]
    if out and tail:
        out += '\n' if '\n' in tail and '\n' in alphabet else ' '
    return out, f'prepare_data.clean, {lang}' + (', accents folded' if fold else '') + \
        f', from {source}'


def encode(text, alphabet):
    """Prompt → token ids; characters outside the alphabet raise UserError naming each once."""
    index = {c: i for i, c in enumerate(alphabet)}
    bad = sorted({c for c in text if c not in index})
    if bad:
        raise UserError(f"the prompt has characters outside the checkpoint's alphabet: "
                        f"{', '.join(repr(c) for c in bad)} (alphabet: {''.join(alphabet)!r})")
    return [index[c] for c in text]


# ----------------------------------------------------------------------------- generation
def entropy_bits(logits):
    """Entropy in bits of softmax(logits) over the last dimension."""
    logp = F.log_softmax(logits.float(), -1)
    return -(logp.exp() * logp).sum(-1) / math.log(2)


@torch.no_grad()
def sample(model, x, n, temperature=1.0, top_k=None, greedy=False, generator=None, n_valid=None):
    """Continue x [B, L] by n tokens with dynpool's cached generation (DynamicPoolingLM.steps),
    the same tokens as model.generate for the same generator, and what the model did on the way:
      tokens      [B, L+n] int64, the prompt then the continuation
      boundaries  [B, L+n] bool, b_t = 1 where token t closed a segment (None for vanilla)
      entropy     [B, L+n] float, bits, of the next-token distribution after token t (temperature 1)
    n_valid: ids >= n_valid (vocabulary padding beyond the alphabet) are never sampled."""
    model.eval()
    tokens, boundaries, entropy = [], [], []
    for step in model.steps(x, n, temperature, top_k, greedy, generator, n_valid):
        tokens.append(step.tokens)
        boundaries.append(step.boundaries)
        entropy.append(entropy_bits(step.logits))
    b = None if boundaries[0] is None else torch.cat(boundaries, 1)
    return torch.cat(tokens, 1), b, torch.cat(entropy, 1)


# ----------------------------------------------------------------------------- display
def show_segments(text, boundaries, sep='|', colour=False, prompt_len=None, mark=PROMPT_MARK):
    """Mark segment ends: `sep` after every character with b_t = 1, or alternate ANSI colours per
    segment; with prompt_len, `mark` after the prompt (after its separator). Removing every `sep`
    and `mark` gives back `text`. boundaries None (vanilla): only the prompt's mark."""
    colour = colour and boundaries is not None
    b = [bool(v) for v in (boundaries or [])[:len(text)]]
    b += [False] * (len(text) - len(b))
    out, seg, start = [], 0, 0
    for t, bt in enumerate(b):
        if not colour:
            out.append(text[t] + (sep if bt else ''))
        elif bt or t + 1 == prompt_len or t == len(text) - 1:   # one run per segment, cut at mark
            out.append(ANSI_SEGMENT_COLOURS[seg % 2] + text[start:t + 1] + ANSI_RESET)
            seg, start = seg + bt, t + 1
        if prompt_len and t + 1 == prompt_len:
            out.append(mark)
    return ''.join(out)


def segment_summary(text, boundaries, prompt_len):
    """One line: characters, segments closed (in the prompt, in all), open, shortening factor."""
    b = boundaries[:len(text)]
    closed, in_prompt = sum(map(bool, b)), sum(map(bool, b[:prompt_len]))
    still_open = ' and 1 still open' if b and not b[-1] else ''
    sf = f'shortening factor {len(text) / closed:.2f}' if closed else 'no segment closed yet'
    return (f'{len(text)} characters ({prompt_len} of the prompt), {closed} segments closed '
            f'({in_prompt} in the prompt){still_open}; {sf}')


def tsv_char(c):
    return {'\t': '\\t', '\n': '\\n', '\r': '\\r', '\\': '\\\\'}.get(c, c)


def entropy_trace(text, entropy, spikes, boundaries):
    """TSV lines: pos, char, entropy_bits, boundary (the model's 0/1; empty for vanilla), spike
    (the entropy-spike rule's 0/1)."""
    lines = ['pos\tchar\tentropy_bits\tboundary\tspike']
    for t, (c, h, s) in enumerate(zip(text, entropy, spikes)):
        b = '' if boundaries is None else int(boundaries[t])
        lines.append(f'{t}\t{tsv_char(c)}\t{h:.4f}\t{b}\t{int(s)}')
    return '\n'.join(lines) + '\n'


def entropy_figure(text, entropy, spikes, boundaries, k, title='', per_row=80, prompt_len=0):
    """The paper's Figure 2: next-character entropy (bits) per character along the text; a red
    dashed line after every character where the spike rule (window k) closes a segment, and the
    model's own segment ends as a row of green marks at the top (boundaries None: vanilla, none);
    the prompt shaded grey. → the matplotlib Figure, one row of axes per `per_row` characters."""
    plt = import_pyplot('--entropy-plot')
    n_rows = max(1, math.ceil(len(text) / per_row))
    top = max(1e-3, max(entropy)) * 1.2            # room above the curve for the model's row
    fig, axes = plt.subplots(n_rows, 1, squeeze=False, figsize=(
        max(8, 0.16 * min(per_row, len(text)) + 1), 1.9 * n_rows + 0.6))
    for r, ax in enumerate(axes[:, 0]):
        lo, hi = r * per_row, min(len(text), (r + 1) * per_row)
        xs = range(lo, hi)
        if prompt_len > lo:
            ax.axvspan(lo - 0.5, min(prompt_len, hi) - 0.5, color='0.9', lw=0)
        ax.plot(xs, entropy[lo:hi], '-o', ms=2.5, lw=1, color='tab:blue', label='entropy H_t')
        ax.vlines([t + 0.5 for t in xs if spikes[t]], 0, top, colors='tab:red', linestyles='--',
                  lw=0.8, label=f'entropy spike (k={k})')
        if boundaries is not None:
            ends = [t + 0.5 for t in xs if boundaries[t]]
            ax.plot(ends, [0.94 * top] * len(ends), 'v', ms=4, color='tab:green', ls='',
                    label="the model's segment ends")
        ax.set_xticks(xs)
        ax.set_xticklabels(['␣' if c == ' ' else tsv_char(c) for c in text[lo:hi]], fontsize=7,
                           family='monospace')
        ax.tick_params(axis='x', length=0)
        ax.set(xlim=(lo - 0.5, lo + per_row - 0.5), ylim=(0, top))
        ax.set_ylabel('bits', fontsize=8)
    axes[0, 0].set_title(title + ('  (grey: prompt)' if prompt_len else ''), fontsize=9)
    axes[0, 0].legend(loc='lower right', fontsize=7, ncol=3, bbox_to_anchor=(1, 1.02),
                      frameon=False)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------- command line
def one_line(s):
    """Argument type: a non-empty mark that keeps the output's lines whole."""
    if not s or '\n' in s or '\r' in s:
        raise argparse.ArgumentTypeError(f'must be one or more characters without a line '
                                         f'break, got {s!r}')
    return s


def parse_args(argv=None):
    p = common.Parser(prog='sample.py', description='Generate text from a dynpool checkpoint and '
                      'show the segments it used.')
    add = p.add_argument
    add('--ckpt', required=True, type=nonblank,
        help="train.py's checkpoint, out/<dataset>-<boundary>/ckpt.pt, or its run folder")
    add('--prompt', default='', help='text to continue, cleaned as the training text was; '
        'empty = a single space')
    add('--chars', type=common.non_negative_int, default=500, help='characters to generate (500)')
    add('--num-samples', type=common.positive_int, default=1,
        help='independent samples, generated as one batch (1)')
    add('--temperature', type=common.non_negative_float, default=0.8,
        help='softmax temperature of sampling (0.8); 0 means greedy')
    add('--top-k', type=common.positive_int, default=None,
        help='sample only among the k most likely characters (default: all)')
    add('--greedy', action='store_true', help='always take the most likely character (argmax)')
    add('--seed', type=common.seed_int, default=1337, help='same seed, same output (1337)')
    add('--device', default=None, help='cpu, cuda, cuda:N, mps (default: cuda if available)')
    add('--show-segments', action='store_true', help=f'SEP after each character that closes a '
        f'segment, {PROMPT_MARK} where the prompt ends; segment counts on stderr')
    add('--separator', type=one_line, default='|', help='the mark of --show-segments (|)')
    add('--color', '--colour', action='store_true',
        help='with --show-segments on a terminal, alternate colours per segment')
    add('--entropy-trace', type=nonblank, nargs='?', const='-', default=None, metavar='FILE',
        help='TSV of pos, char, entropy (bits), boundary, spike: to stdout in place of the text, '
             'or to FILE')
    add('--entropy-plot', type=nonblank, default=None, metavar='FILE.png',
        help="the paper's Figure 2 for the first sample: entropy, spikes, the model's boundaries")
    add('--spike-window', type=common.positive_int, default=None, metavar='K',
        help="k of the entropy-spike rule in the trace and plot (default: the checkpoint's "
             "entropy_window)")
    add('--threads', type=int_range(1, os.cpu_count() or 1), default=1,
        help='CPU threads for torch (1): decoding one character at a time is latency-bound')
    add('--trust-ckpt', action='store_true',
        help='load checkpoints holding arbitrary pickled Python objects (files you trust only)')
    args = p.parse_args(argv)
    try:
        args.device = pick_device(args.device)
    except UserError as e:
        p.error(str(e))
    if args.entropy_plot == '-':
        p.error('argument --entropy-plot: a plot is written to a file, not to stdout (-)')
    if args.entropy_plot is not None and args.entropy_plot == args.entropy_trace:
        p.error(f'--entropy-trace and --entropy-plot name the same file {args.entropy_plot}')
    return args


# ----------------------------------------------------------------------------- run
def plot_format(path):
    """--entropy-plot's image format (its extension; png without one), checked before anything
    is generated."""
    import_pyplot('--entropy-plot')
    from matplotlib.backend_bases import FigureCanvasBase
    fmt, known = os.path.splitext(path)[1][1:].lower() or 'png', \
        FigureCanvasBase.get_supported_filetypes()
    if fmt not in known:
        raise UserError(f'--entropy-plot {path}: matplotlib writes no .{fmt} files; use one of '
                        f'{", ".join(sorted(known))}')
    return fmt


def read_model(args):
    """--ckpt → (model on args.device, checkpoint dict)."""
    try:
        return load_checkpoint(args.ckpt, args.device, trust=args.trust_ckpt)
    except UserError as e:   # name the flag that lifts the one refusal
        raise UserError(f'{e} (--trust-ckpt)' if 'safe loading' in str(e) else str(e)) from None


def prompt_ids(prompt, vocab):
    """The prompt cleaned as the training text was (one stderr line where that changed it) →
    ids."""
    text, how = clean_prompt(prompt, vocab)
    if text != prompt:
        print(f'prompt cleaned ({how}): {json.dumps(prompt, ensure_ascii=False)} -> '
              f'{json.dumps(text, ensure_ascii=False)}', file=sys.stderr)
    return encode(text, list(vocab['alphabet'])) or [vocab.get('space_id') or 0]


class Samples(NamedTuple):
    """What was generated: a list per sample, indexed by position t."""
    texts: list        # str: the prompt, then the continuation
    entropy: list      # float: H_t, bits
    spikes: list       # bool: the entropy-spike rule on H (dynpool.entropy_spikes, window k)
    boundaries: list   # bool: the model's own b_t; None for vanilla
    k: int


def generate(args, model, ids, ckpt):
    """args.num_samples continuations of the prompt ids → Samples."""
    alphabet = list(ckpt['vocab']['alphabet'])
    x = torch.tensor([ids], dtype=torch.long, device=args.device).repeat(args.num_samples, 1)
    torch.manual_seed(args.seed)
    gen = torch.Generator(device=args.device).manual_seed(args.seed)
    entropy = None
    try:
        tokens, b, entropy = sample(model, x, args.chars, args.temperature, args.top_k,
                                    args.greedy or args.temperature == 0, gen, len(alphabet))
    except RuntimeError as e:   # sampling from NaN probabilities; greedy's show in the entropy
        if 'probability tensor' not in str(e):
            raise
    if entropy is None or not torch.isfinite(entropy).all():
        raise UserError(f"the model's predictions are not finite (NaN or inf): checkpoint "
                        f"{ckpt['path']} holds damaged weights")
    k = args.spike_window or model.cfg.entropy_window
    return Samples([''.join(alphabet[i] for i in row) for row in tokens.tolist()],
                   entropy.tolist(), entropy_spikes(entropy, k).tolist(),
                   None if b is None else b.tolist(), k)


def print_samples(args, out, prompt_len, alphabet):
    """The samples on stdout (segments marked with --show-segments), their counts on stderr."""
    colour = args.color and sys.stdout.isatty()
    texts, boundaries = out.texts, out.boundaries
    if args.show_segments and boundaries is None:
        print("note: this checkpoint is vanilla (boundary 'none'): it has no segments to show",
              file=sys.stderr)
    for what, mark in (('separator', args.separator), ('prompt mark', PROMPT_MARK)):
        if args.show_segments and not colour and any(c in alphabet for c in mark):
            print(f'note: the {what} {mark!r} is in the alphabet'
                  + ('; pick another with --separator' if what == 'separator' else ''),
                  file=sys.stderr)
    for i, text in enumerate(texts):
        if i:
            sys.stdout.write('-' * 40 + '\n')
        b = None if boundaries is None else boundaries[i]
        if not args.show_segments:
            sys.stdout.write(text + '\n')
            continue
        sys.stdout.write(show_segments(text, b, args.separator, colour, prompt_len) + '\n')
        if b is not None:
            print(('segments: ' if len(texts) == 1 else f'segments of sample {i + 1}: ')
                  + segment_summary(text, b, prompt_len), file=sys.stderr)


def run(args):
    fmt = plot_format(args.entropy_plot) if args.entropy_plot else None
    torch.set_num_threads(args.threads)
    model, ckpt = read_model(args)
    ids = prompt_ids(args.prompt, ckpt['vocab'])
    out = generate(args, model, ids, ckpt)
    texts, b = out.texts, out.boundaries
    if args.entropy_trace is not None:
        tsv = ''.join((f'# sample {i}\n' if len(texts) > 1 else '') + entropy_trace(
            t, out.entropy[i], out.spikes[i], None if b is None else b[i])
            for i, t in enumerate(texts))
        if args.entropy_trace == '-':
            sys.stdout.write(tsv)
        else:
            write_atomic(args.entropy_trace, tsv)
    if args.entropy_trace != '-':
        print_samples(args, out, len(ids), ckpt['vocab']['alphabet'])
    if args.entropy_plot:
        run_name = os.path.basename(os.path.dirname(os.path.abspath(ckpt['path'])))
        fig = entropy_figure(texts[0], out.entropy[0], out.spikes[0],
                             None if b is None else b[0], out.k, prompt_len=len(ids),
                             title=f'{run_name}: boundary={model.cfg.boundary}, '
                                   f'next-character entropy')
        try:
            write_atomic(args.entropy_plot, lambda tmp: fig.savefig(tmp, dpi=150, format=fmt))
        finally:
            import_pyplot('--entropy-plot').close(fig)
        print(f'wrote {args.entropy_plot}', file=sys.stderr)
    return out


def main(argv=None):
    return common.main(lambda: run(parse_args(argv)))


if __name__ == '__main__':
    sys.exit(main())
