"""
Generate text from a dynpool checkpoint and show the segments the model chose (docs/generation.md).

    python sample.py --ckpt out/text8-whitespace --prompt "The History of" --chars 500 \\
        --temperature 0.8 --top-k 20 --seed 1 --show-segments
    python sample.py --ckpt out/text8-entropy/ckpt.pt --show-segments --color   # on a terminal
    python sample.py --ckpt out/text8-entropy --greedy --num-samples 3 --device cuda
    python sample.py --ckpt out/text8-entropy --chars 120 --entropy-plot fig2.png
    python sample.py --ckpt out/text8-entropy --chars 120 --entropy-trace > trace.tsv
"""
import argparse
import json
import math
import os
import sys
from types import SimpleNamespace

import torch
import torch.nn.functional as F

import common
import hnet  # noqa: F401  (registers boundary='hnet' before dynpool's lists are read)
from checkpoint import load_checkpoint
from cleaning import LANGS, TEXT8_ALPHABET, clean
from common import UserError, import_pyplot, nonblank, write_atomic
from dynpool import entropy_spikes
from runtime import pick_device

ANSI_SEGMENT_COLOURS = ('\033[48;5;153m\033[38;5;16m', '\033[48;5;223m\033[38;5;16m')
ANSI_RESET = '\033[0m'
TSV_COLUMNS = ('pos', 'char', 'entropy_bits', 'boundary', 'spike')
PROMPT_MARK = '»'   # --show-segments: where the prompt ends and the continuation begins


# ----------------------------------------------------------------------------- the prompt
def clean_prompt(text, vocab):
    """The prompt cleaned as the training text was → (text, how, in words): cleaning.clean with
    the checkpoint's recorded language, else the language whose alphabet it has ('\n', ' ' and
    the letters; text8's ' ' and a-z); for an alphabet of no language, lower case only (where it
    has none). Line breaks become spaces where the alphabet has none; a trailing space or line
    break is kept (the continuation starts a new word)."""
    alphabet, rec = vocab['alphabet'], vocab.get('cleaning')
    known = [('en', set(TEXT8_ALPHABET), "text8's alphabet")] + [
        (lang, {'\n', ' '} | set(spec['letters']), f'the {lang} alphabet')
        for lang, spec in LANGS.items()]
    lang, fold, source = next(((lang, False, source) for lang, letters, source in known
                               if set(alphabet) == letters), (None, False, None))
    if isinstance(rec, dict) and rec.get('lang') in LANGS:
        lang, fold = rec['lang'], bool(rec.get('fold_accents'))
        source = 'recorded in the checkpoint'
    if lang is None:
        lowered = text if any(c != c.lower() for c in alphabet) else text.lower()
        return lowered, 'lower-cased only: an alphabet of no language prepare_data.py knows'
    out = clean(text, lang, fold)
    if '\n' not in alphabet:
        out = ' '.join(out.split())
    tail = text[len(text.rstrip()):]
    if out and tail:
        out += '\n' if '\n' in tail and '\n' in alphabet else ' '
    return out, f'cleaning.clean, {lang}' + ', accents folded' * fold + f', from {source}'


def prompt_ids(prompt, vocab):
    """The cleaned prompt (one stderr line where cleaning changed it) → ids; characters still
    outside the alphabet are one UserError naming each; an empty prompt is a single space."""
    text, how = clean_prompt(prompt, vocab)
    if text != prompt:
        print(f'prompt cleaned ({how}): {json.dumps(prompt, ensure_ascii=False)} -> '
              f'{json.dumps(text, ensure_ascii=False)}', file=sys.stderr)
    index = {c: i for i, c in enumerate(vocab['alphabet'])}
    bad = sorted({c for c in text if c not in index})
    if bad:
        raise UserError(f"the prompt has characters outside the checkpoint's alphabet: "
                        f"{', '.join(map(repr, bad))} (alphabet: {''.join(index)!r})")
    return [index[c] for c in text] or [vocab.get('space_id') or 0]


# ----------------------------------------------------------------------------- generation
@torch.no_grad()
def generate(args, model, ids, ckpt):
    """args.num_samples continuations of `ids` by model.steps (model.generate's tokens for the same
    generator) → lists per sample, by position t: texts; entropy, the paper's H_t (§3.2) in bits
    after t (temperature 1, no top-k); spikes, b_t = 1 iff H_t > H_i for the k previous positions
    (k: --spike-window, default the checkpoint's entropy_window); boundaries, the model's own b_t
    (None for vanilla)."""
    alphabet = ckpt['vocab']['alphabet']
    x = torch.tensor([ids], device=args.device).repeat(args.num_samples, 1)
    torch.manual_seed(args.seed)
    gen = torch.Generator(device=args.device).manual_seed(args.seed)
    damaged = UserError(f"the model's predictions are not finite (NaN or inf): checkpoint "
                        f"{ckpt['path']} holds damaged weights")
    tokens, b, entropy = [], [], []
    try:
        for step in model.eval().steps(x, args.chars, args.temperature, args.top_k,
                                       args.greedy or args.temperature == 0, gen, len(alphabet)):
            logp = F.log_softmax(step.logits.float(), -1)
            tokens.append(step.tokens)
            b.append(step.boundaries)
            entropy.append(-(logp.exp() * logp).sum(-1) / math.log(2))
    except RuntimeError as e:   # sampling from NaN probabilities (greedy's show in the entropy)
        if 'probability tensor' in str(e):
            raise damaged from None
        raise
    entropy = torch.cat(entropy, 1)
    if not torch.isfinite(entropy).all():
        raise damaged
    k = args.spike_window or model.cfg.entropy_window
    texts = [''.join(alphabet[i] for i in row) for row in torch.cat(tokens, 1).tolist()]
    return SimpleNamespace(texts=texts, entropy=entropy.tolist(), k=k,
                           spikes=entropy_spikes(entropy, k).tolist(),
                           boundaries=None if b[0] is None else torch.cat(b, 1).tolist())


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


def entropy_figure(text, entropy, spikes, boundaries, k, title='', per_row=80, prompt_len=0):
    """The paper's Figure 2 → a matplotlib Figure, one row of axes per `per_row` characters: the
    next-character entropy (bits) per character, a red dashed line after each spike of the rule
    (window k), the model's segment ends as green marks at the top (none for vanilla), the prompt
    shaded grey."""
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
        ax.set(xlim=(lo - 0.5, lo + per_row - 0.5), ylim=(0, top), ylabel='bits')
    axes[0, 0].set_title(title + ('  (grey: prompt)' if prompt_len else ''), fontsize=9)
    axes[0, 0].legend(loc='lower right', fontsize=7, ncol=3, bbox_to_anchor=(1, 1.02),
                      frameon=False)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------- command line
def one_line(s):
    """Argument type: a non-empty mark that keeps the output's lines whole."""
    if not s or '\n' in s or '\r' in s:
        raise argparse.ArgumentTypeError(f'must be characters without a line break, got {s!r}')
    return s


def parse_args(argv=None):
    p = common.Parser(prog='sample.py', description=__doc__.split('\n\n')[0].strip())
    add = p.add_argument
    add('--ckpt', required=True, type=nonblank, help="train.py's ckpt.pt or its run folder")
    add('--prompt', default='', help='text to continue (cleaned; empty: a single space)')
    add('--chars', type=common.non_negative_int, default=500, help='characters to generate (500)')
    add('--num-samples', type=common.positive_int, default=1, help='samples, as one batch (1)')
    add('--temperature', type=common.non_negative_float, default=0.8,
        help='softmax temperature of sampling (0.8); 0 means greedy')
    add('--top-k', type=common.positive_int, help='sample among the k most likely characters')
    add('--greedy', action='store_true', help='always take the most likely character (argmax)')
    add('--seed', type=common.seed_int, default=1337, help='same seed, same output (1337)')
    add('--device', help='cpu, cuda, cuda:N, mps (default: cuda if available)')
    add('--show-segments', action='store_true', help=f'SEP after each character that closes a '
        f'segment, {PROMPT_MARK} where the prompt ends; segment counts on stderr')
    add('--separator', type=one_line, default='|', help='the mark of --show-segments (|)')
    add('--color', '--colour', action='store_true', help='--show-segments in colours (terminal)')
    add('--entropy-trace', type=nonblank, nargs='?', const='-', metavar='FILE', help='TSV of pos, '
        'char, entropy (bits), boundary, spike: to stdout in place of the text, or to FILE')
    add('--entropy-plot', type=nonblank, metavar='FILE.png',
        help="the paper's Figure 2 for the first sample: entropy, spikes, the model's boundaries")
    add('--spike-window', type=common.positive_int, metavar='K',
        help="k of the entropy-spike rule (default: the checkpoint's entropy_window)")
    add('--threads', type=common.int_range(1, os.cpu_count() or 1), default=1,
        help='CPU threads for torch (1): decoding one character at a time is latency-bound')
    add('--trust-ckpt', action='store_true',
        help='load checkpoints holding arbitrary pickled Python objects (files you trust only)')
    args = p.parse_args(argv)
    if args.entropy_plot == '-':
        p.error('argument --entropy-plot: a plot is written to a file, not to stdout (-)')
    if args.entropy_plot is not None and args.entropy_plot == args.entropy_trace:
        p.error(f'--entropy-trace and --entropy-plot name the same file {args.entropy_plot}')
    try:
        args.device = pick_device(args.device)
    except UserError as e:   # a device this machine lacks is a flag mistake too: exit 2
        p.error(str(e))
    return args


# ----------------------------------------------------------------------------- run
def print_samples(args, texts, boundaries, prompt_len):
    """The samples on stdout (segments marked with --show-segments), their counts on stderr."""
    colour = args.color and sys.stdout.isatty()   # a file or pipe gets the separators
    if args.show_segments and boundaries is None:
        print("note: this checkpoint is vanilla (boundary 'none'): it has no segments to show",
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


def plot_format(path):
    """--entropy-plot's image format (its extension; png without one), checked before generating."""
    import_pyplot('--entropy-plot')
    from matplotlib.backend_bases import FigureCanvasBase
    fmt, known = os.path.splitext(path)[1][1:].lower() or 'png', \
        FigureCanvasBase.get_supported_filetypes()
    if fmt not in known:
        raise UserError(f'--entropy-plot {path}: matplotlib writes no .{fmt} files; use one of '
                        f'{", ".join(sorted(known))}')
    return fmt


def run(args):
    fmt = plot_format(args.entropy_plot) if args.entropy_plot else None
    torch.set_num_threads(args.threads)
    try:
        model, ckpt = load_checkpoint(args.ckpt, args.device, trust=args.trust_ckpt)
    except UserError as e:   # name the flag that lifts the one refusal
        raise UserError(f'{e} (--trust-ckpt)' if 'safe loading' in str(e) else str(e)) from None
    ids = prompt_ids(args.prompt, ckpt['vocab'])
    out = generate(args, model, ids, ckpt)
    texts, b = out.texts, out.boundaries
    if args.entropy_trace is not None:   # per sample: pos, char, H_t, the model's b_t, spike
        lines = []
        for i, text in enumerate(texts):
            lines += [f'# sample {i}'] * (len(texts) > 1) + ['\t'.join(TSV_COLUMNS)]
            lines += [f'{t}\t{tsv_char(c)}\t{out.entropy[i][t]:.4f}\t'
                      f'{"" if b is None else int(b[i][t])}\t{int(out.spikes[i][t])}'
                      for t, c in enumerate(text)]
        if args.entropy_trace == '-':
            print('\n'.join(lines))
        else:
            write_atomic(args.entropy_trace, '\n'.join(lines) + '\n')
    if args.entropy_trace != '-':
        print_samples(args, texts, b, len(ids))
    if args.entropy_plot:
        run_name = os.path.basename(os.path.dirname(os.path.abspath(ckpt['path'])))
        fig = entropy_figure(texts[0], out.entropy[0], out.spikes[0], None if b is None else b[0],
                             out.k, prompt_len=len(ids), title=f'{run_name}: boundary='
                             f'{model.cfg.boundary}, next-character entropy')
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
