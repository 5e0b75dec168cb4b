"""Generate text from a dynpool checkpoint; show the segments the model chose
(docs/generation.md).

    python sample.py --ckpt out/text8-whitespace --prompt "The History of" \
        --show-segments
    python sample.py --ckpt out/text8-entropy --chars 120 --entropy-plot fig2.png
"""
import json
import math
import os
import sys
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from tqdm import tqdm

import common
from checkpoint import load_checkpoint
from cleaning import LANGS, TEXT8_ALPHABET, clean
from common import UserError, import_pyplot, nonblank, write_atomic
from dynpool import entropy_spikes
from runtime import generation_bytes, pick_device, require_memory

# --color: two colours, then the reset
ANSI = ('\033[48;5;153m\033[38;5;16m', '\033[48;5;223m\033[38;5;16m', '\033[0m')
PROMPT_MARK = '»'   # --show-segments: where the prompt ends and the continuation begins


def clean_prompt(text, vocab):
    """The prompt cleaned as the training text was → (text, how, in words):
    cleaning.clean in the checkpoint's recorded language, else the one whose alphabet it
    has; else lower case only. Line breaks become spaces where the alphabet has none; a
    trailing space or break is kept."""
    alphabet = vocab['alphabet']
    recorded = vocab.get('cleaning')
    fold = False
    if isinstance(recorded, dict) and recorded.get('lang') in LANGS:
        lang = recorded['lang']
        fold = bool(recorded.get('fold_accents'))
        source = 'recorded in the checkpoint'
    elif set(alphabet) == set(TEXT8_ALPHABET):
        lang = 'en'
        source = "text8's alphabet"
    else:
        lang = next((lang for lang, spec in LANGS.items()
                     if set(alphabet) == {'\n', ' '} | set(spec['letters'])), None)
        source = f'the {lang} alphabet'
    if lang is None:
        if all(c == c.lower() for c in alphabet):
            text = text.lower()
        return text, 'lower-cased only: an alphabet of no language prepare_data.py knows'
    out = clean(text, lang, fold)
    if '\n' not in alphabet:
        out = ' '.join(out.split())
    tail = text[len(text.rstrip()):]
    if out and '\n' in tail and '\n' in alphabet:
        out += '\n'
    elif out and tail:
        out += ' '
    how = f'cleaning.clean, {lang}'
    if fold:
        how += ', accents folded'
    return out, f'{how}, from {source}'


@torch.no_grad()
def generate(args, model, ids, ckpt):
    """args.num_samples continuations of `ids` by model.steps → per sample, by position
    t: texts; entropy H_t in bits after t (§3.2; temperature 1, no top-k); spikes, the
    rule of window k (--spike-window, else the checkpoint's entropy_window); boundaries,
    the model's b_t or None. A terminal on stderr shows the progress."""
    alphabet = ckpt['vocab']['alphabet']
    x = torch.tensor([ids], device=args.device).repeat(args.num_samples, 1)
    torch.manual_seed(args.seed)
    gen = torch.Generator(device=args.device).manual_seed(args.seed)
    greedy = args.greedy or args.temperature == 0
    steps = model.eval().steps(x, args.chars, args.temperature, args.top_k, greedy, gen,
                               len(alphabet))
    tokens = []
    b = []
    entropy = []
    try:   # (disable=None: no bar where stderr is not a terminal)
        for step in tqdm(steps, total=args.chars + 1, unit='char', disable=None,
                         leave=False):
            logp = F.log_softmax(step.logits.float(), -1)
            tokens.append(step.tokens)
            b.append(step.boundaries)
            entropy.append(-(logp.exp() * logp).sum(-1) / math.log(2))
    except RuntimeError as e:   # sampling from NaN probabilities: refused below
        if 'probability tensor' not in str(e):
            raise
        entropy = [torch.tensor([[math.nan]])]
    entropy = torch.cat(entropy, 1)
    if not torch.isfinite(entropy).all():
        raise UserError(f"the model's predictions are not finite (NaN or inf): checkpoint "
                        f"{ckpt['path']} holds damaged weights")
    k = args.spike_window or model.cfg.entropy_window
    texts = [''.join(alphabet[i] for i in row) for row in torch.cat(tokens, 1).tolist()]
    boundaries = None
    if b[0] is not None:
        boundaries = torch.cat(b, 1).tolist()
    return SimpleNamespace(texts=texts, entropy=entropy.tolist(), k=k,
                           spikes=entropy_spikes(entropy, k).tolist(), boundaries=boundaries)


def show_segments(text, boundaries, sep='|', colour=False, prompt_len=None,
                  mark=PROMPT_MARK):
    """Segment ends marked: `sep` after each b_t = 1 (or alternate ANSI
    colours per segment), `mark` after the prompt's prompt_len
    characters; without the marks, `text` again."""
    colour = colour and boundaries is not None
    b = [bool(v) for v in boundaries or [0] * len(text)]
    out = []
    segment = 0
    start = 0
    for t, bt in enumerate(b):
        if not colour:
            out.append(text[t] + (sep if bt else ''))
        elif bt or t + 1 == prompt_len or t == len(text) - 1:   # a run per segment
            out.append(ANSI[segment % 2] + text[start:t + 1] + ANSI[2])
            segment += bt
            start = t + 1
        if prompt_len and t + 1 == prompt_len:
            out.append(mark)
    return ''.join(out)


def segment_summary(text, boundaries, prompt_len):
    """One line: characters, segments closed (in the prompt, in all),
    open, shortening factor."""
    b = boundaries[:len(text)]
    closed = sum(map(bool, b))
    in_prompt = sum(map(bool, b[:prompt_len]))
    still_open = ' and 1 still open' if b and not b[-1] else ''
    sf = 'no segment closed yet'
    if closed:
        sf = f'shortening factor {len(text) / closed:.2f}'
    return (f'{len(text)} characters ({prompt_len} of the prompt), {closed} segments closed '
            f'({in_prompt} in the prompt){still_open}; {sf}')


def entropy_figure(text, entropy, spikes, boundaries, k, title='', per_row=80, prompt_len=0):
    """The paper's Figure 2 → a Figure, a row of axes per `per_row`
    characters: entropy (bits), red dashed lines after the rule's
    spikes, the model's segment ends in green, the prompt grey."""
    plt = import_pyplot('--entropy-plot')
    n_rows = max(1, math.ceil(len(text) / per_row))
    top = max(1e-3, max(entropy)) * 1.2   # room above the curve for the model's row
    width = max(8, 0.16 * min(per_row, len(text)) + 1)
    fig, axes = plt.subplots(n_rows, 1, squeeze=False, figsize=(width, 1.9 * n_rows + 0.6))
    for r, ax in enumerate(axes[:, 0]):
        lo = r * per_row
        hi = min(len(text), (r + 1) * per_row)
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
        labels = ['␣' if c == ' ' else repr(c)[1:-1] for c in text[lo:hi]]
        ax.set_xticks(xs, labels, fontsize=7, family='monospace')
        ax.tick_params(axis='x', length=0)
        ax.set(xlim=(lo - 0.5, lo + per_row - 0.5), ylim=(0, top), ylabel='bits')
    axes[0, 0].set_title(title + ('  (grey: prompt)' if prompt_len else ''), fontsize=9)
    axes[0, 0].legend(loc='lower right', fontsize=7, ncol=3, bbox_to_anchor=(1, 1.02),
                      frameon=False)
    fig.tight_layout()
    return fig


def parse_args(argv=None):
    p = common.Parser(prog='sample.py', description=__doc__.split('\n\n')[0].strip())
    p.add_argument('--ckpt', required=True, type=nonblank,
                   help="train.py's ckpt.pt or its run folder")
    p.add_argument('--prompt', default='',
                   help='text to continue (cleaned; empty: a single space; kept: the last '
                        'characters, as many as the model trained on)')
    p.add_argument('--chars', type=common.non_negative_int, default=500,
                   help='characters to generate (500)')
    p.add_argument('--num-samples', type=common.positive_int, default=1,
                   help='samples, as one batch (1)')
    p.add_argument('--temperature', type=common.non_negative_float, default=0.8,
                   help='0: greedy (0.8)')
    p.add_argument('--top-k', type=common.positive_int,
                   help='sample among the k most likely characters')
    p.add_argument('--greedy', action='store_true',
                   help='always take the most likely character (argmax)')
    p.add_argument('--seed', type=common.seed_int, default=1337,
                   help='same seed, same output (1337)')
    p.add_argument('--device', help='cpu, cuda, cuda:N, mps (default: cuda if any)')
    p.add_argument('--show-segments', action='store_true',
                   help=f'SEP after segments, {PROMPT_MARK} at prompt')
    p.add_argument('--separator', default='|',
                   help='the mark of --show-segments (|), no line break')
    p.add_argument('--color', '--colour', action='store_true',
                   help='--show-segments in colours (terminal)')
    p.add_argument('--entropy-trace', type=nonblank, nargs='?', const='-', metavar='FILE',
                   help='TSV of pos, char, entropy (bits), boundary, spike: to stdout or FILE')
    p.add_argument('--entropy-plot', type=nonblank, metavar='FILE.png',
                   help="the paper's Figure 2")
    p.add_argument('--spike-window', type=common.positive_int, metavar='K',
                   help="the spike rule's k")
    p.add_argument('--threads', type=common.int_range(1, os.cpu_count() or 1), default=1,
                   help='threads')
    p.add_argument('--trust-ckpt', action='store_true',
                   help='load pickled objects: files you trust only')
    args = p.parse_args(argv)
    # the output's lines stay whole
    if not args.separator or {'\n', '\r'} & set(args.separator):
        p.error(f'argument --separator {args.separator!r}: must be characters, no line break')
    if args.entropy_plot is not None and args.entropy_plot in ('-', args.entropy_trace):
        p.error("argument --entropy-plot: needs a file of its own, not - nor --entropy-trace's")
    args.device = pick_device(args.device)
    return args


def prompt_ids(args, ckpt):
    """--prompt cleaned as the training text was (a note on stderr where
    that changed it), kept to the last seq_len characters the model
    trained on (a note where cut) → token ids; a prompt that keeps none
    of its characters, or one outside the alphabet, is refused."""
    text, how = clean_prompt(args.prompt, ckpt['vocab'])
    if args.prompt.strip() and not text:
        raise UserError(f'--prompt {json.dumps(args.prompt, ensure_ascii=False)} keeps none of '
                        f"its characters once cleaned ({how}): write it in the checkpoint's "
                        'alphabet', code=2)
    if text != args.prompt:
        print(f'prompt cleaned ({how}): {json.dumps(args.prompt, ensure_ascii=False)} -> '
              f'{json.dumps(text, ensure_ascii=False)}', file=sys.stderr)
    index = {c: i for i, c in enumerate(ckpt['vocab']['alphabet'])}
    bad = sorted({c for c in text if c not in index})
    if bad:
        raise UserError(f"the prompt has characters outside the checkpoint's alphabet: "
                        f"{', '.join(map(repr, bad))} (alphabet: {''.join(index)!r})")
    seq_len = ckpt.get('args', {}).get('seq_len')   # (read_checkpoint: args is a dict)
    # Attention over more than the model trained on costs memory and time with the
    # length's square and goes past the distances it learnt: the end of a longer prompt
    # is what it continues.
    if isinstance(seq_len, int) and 0 < seq_len < len(text):
        print(f'note: the prompt is cut to its last {seq_len} characters (of {len(text)}), the '
              'length the model trained on', file=sys.stderr)
        text = text[-seq_len:]
    if not text:   # '': a space
        return [ckpt['vocab'].get('space_id') or 0]
    return [index[c] for c in text]


def write_trace(args, out):
    """--entropy-trace: per sample, per position: pos, char, H_t, the
    model's b_t, spike."""
    lines = []
    for i, text in enumerate(out.texts):
        if len(out.texts) > 1:
            lines.append(f'# sample {i}')
        lines.append('pos\tchar\tentropy_bits\tboundary\tspike')
        for t, c in enumerate(text):
            b = '' if out.boundaries is None else int(out.boundaries[i][t])
            # the character as repr writes it: \t, \n escaped
            lines.append(f'{t}\t{repr(c)[1:-1]}\t{out.entropy[i][t]:.4f}\t{b}\t'
                         f'{int(out.spikes[i][t])}')
    trace = '\n'.join(lines) + '\n'
    if args.entropy_trace == '-':
        print(trace, end='')
    else:
        write_atomic(args.entropy_trace, trace)


def print_samples(args, out, prompt_len):
    """The samples on stdout (segments marked with --show-segments),
    their counts on stderr."""
    b = out.boundaries
    if args.show_segments and b is None:
        print('note: a vanilla checkpoint has no segments to show', file=sys.stderr)
    colour = args.color and sys.stdout.isatty()   # a file or pipe gets the separators
    for i, text in enumerate(out.texts):
        if i:
            print('-' * 40)
        if not args.show_segments:
            print(text)
            continue
        print(show_segments(text, b and b[i], args.separator, colour, prompt_len))
        if b is None:
            continue
        which = 'segments: '
        if len(out.texts) > 1:
            which = f'segments of sample {i + 1}: '
        print(which + segment_summary(text, b[i], prompt_len), file=sys.stderr)


def plot_format(path):
    """--entropy-plot's format, refused before generating where
    matplotlib cannot write it."""
    import_pyplot('--entropy-plot')
    from matplotlib.backend_bases import FigureCanvasBase
    fmt = os.path.splitext(path)[1][1:].lower() or 'png'
    if fmt not in FigureCanvasBase.get_supported_filetypes():
        raise UserError(f'--entropy-plot {path}: matplotlib writes no .{fmt} files; use .png, '
                        '.pdf or .svg')
    return fmt


def run(args):
    fmt = plot_format(args.entropy_plot) if args.entropy_plot else None
    torch.set_num_threads(args.threads)
    model, ckpt = load_checkpoint(args.ckpt, args.device, trust=args.trust_ckpt)
    ids = prompt_ids(args, ckpt)
    need = generation_bytes(model.cfg, args.num_samples, len(ids), args.chars)
    what = f'{args.num_samples} sample(s) of {len(ids)} + {args.chars} characters'
    require_memory(need, what, args.device, 'lower --chars or --num-samples, or shorten '
                   '--prompt')
    out = generate(args, model, ids, ckpt)
    if args.entropy_trace is not None:
        write_trace(args, out)
    if args.entropy_trace != '-':
        print_samples(args, out, len(ids))
    if args.entropy_plot:
        run_name = os.path.basename(os.path.dirname(os.path.abspath(ckpt['path'])))
        title = f'{run_name}: boundary={model.cfg.boundary}, next-character entropy'
        fig = entropy_figure(out.texts[0], out.entropy[0], out.spikes[0],
                             out.boundaries and out.boundaries[0], out.k, prompt_len=len(ids),
                             title=title)
        try:
            write_atomic(args.entropy_plot,
                         lambda tmp: fig.savefig(tmp, dpi=150, format=fmt))
        finally:
            import_pyplot('--entropy-plot').close(fig)
        print(f'wrote {args.entropy_plot}', file=sys.stderr)
    return out


def main(argv=None):
    return common.main(lambda: run(parse_args(argv)))


if __name__ == '__main__':
    sys.exit(main())
