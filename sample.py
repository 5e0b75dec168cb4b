"""Generate text from a dynpool checkpoint; show the segments the model chose (docs/generation.md).

    python sample.py --ckpt out/text8-whitespace --prompt "The History of" --show-segments
    python sample.py --ckpt out/text8-entropy --chars 120 --entropy-plot fig2.png
"""
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

ANSI = ('\033[48;5;153m\033[38;5;16m', '\033[48;5;223m\033[38;5;16m', '\033[0m')  # 2 colours, reset
PROMPT_MARK = '»'   # --show-segments: where the prompt ends and the continuation begins


def clean_prompt(text, vocab):
    """The prompt cleaned as the training text was → (text, how, in words): cleaning.clean in the
    checkpoint's recorded language, else the one whose alphabet it has; else lower case only. Line
    breaks become spaces where the alphabet has none; a trailing space or break is kept."""
    alphabet, rec = vocab['alphabet'], vocab.get('cleaning')
    if isinstance(rec, dict) and rec.get('lang') in LANGS:
        lang, fold, src = rec['lang'], bool(rec.get('fold_accents')), 'recorded in the checkpoint'
    elif set(alphabet) == set(TEXT8_ALPHABET):
        lang, fold, src = 'en', False, "text8's alphabet"
    else:
        lang = next((lang for lang, spec in LANGS.items()
                     if set(alphabet) == {'\n', ' '} | set(spec['letters'])), None)
        fold, src = False, f'the {lang} alphabet'
    if lang is None:
        lowered = text if any(c != c.lower() for c in alphabet) else text.lower()
        return lowered, 'lower-cased only: an alphabet of no language prepare_data.py knows'
    out = clean(text, lang, fold)
    if '\n' not in alphabet:
        out = ' '.join(out.split())
    tail = text[len(text.rstrip()):]
    if out and tail:
        out += '\n' if '\n' in tail and '\n' in alphabet else ' '
    return out, f'cleaning.clean, {lang}' + ', accents folded' * fold + f', from {src}'


@torch.no_grad()
def generate(args, model, ids, ckpt):
    """args.num_samples continuations of `ids` by model.steps → per sample, by position t: texts;
    entropy H_t in bits after t (§3.2; temperature 1, no top-k); spikes, the rule of window k
    (--spike-window, else the checkpoint's entropy_window); boundaries, the model's b_t or None."""
    alphabet = ckpt['vocab']['alphabet']
    x = torch.tensor([ids], device=args.device).repeat(args.num_samples, 1)
    torch.manual_seed(args.seed)
    gen = torch.Generator(device=args.device).manual_seed(args.seed)
    tokens, b, entropy = [], [], []
    try:
        for step in model.eval().steps(x, args.chars, args.temperature, args.top_k,
                                       args.greedy or args.temperature == 0, gen, len(alphabet)):
            logp = F.log_softmax(step.logits.float(), -1)
            tokens.append(step.tokens)
            b.append(step.boundaries)
            entropy.append(-(logp.exp() * logp).sum(-1) / math.log(2))
    except RuntimeError as e:   # sampling from NaN probabilities: refused below, as greedy's NaN
        if 'probability tensor' not in str(e):
            raise
        entropy = [torch.tensor([[math.nan]])]
    entropy = torch.cat(entropy, 1)
    if not torch.isfinite(entropy).all():
        raise UserError(f"the model's predictions are not finite (NaN or inf): checkpoint "
                        f"{ckpt['path']} holds damaged weights")
    k = args.spike_window or model.cfg.entropy_window
    texts = [''.join(alphabet[i] for i in row) for row in torch.cat(tokens, 1).tolist()]
    return SimpleNamespace(texts=texts, entropy=entropy.tolist(), k=k,
                           spikes=entropy_spikes(entropy, k).tolist(),
                           boundaries=None if b[0] is None else torch.cat(b, 1).tolist())


def show_segments(text, boundaries, sep='|', colour=False, prompt_len=None, mark=PROMPT_MARK):
    """Segment ends marked: `sep` after each b_t = 1 (or alternate ANSI colours per segment), `mark`
    after the prompt's prompt_len characters; without the marks, `text` again."""
    colour = colour and boundaries is not None
    b = [bool(v) for v in boundaries or [0] * len(text)]
    out, seg, start = [], 0, 0
    for t, bt in enumerate(b):
        if not colour:
            out.append(text[t] + (sep if bt else ''))
        elif bt or t + 1 == prompt_len or t == len(text) - 1:   # one run per segment, cut at mark
            out.append(ANSI[seg % 2] + text[start:t + 1] + ANSI[2])
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


def entropy_figure(text, entropy, spikes, boundaries, k, title='', per_row=80, prompt_len=0):
    """The paper's Figure 2 → a Figure, a row of axes per `per_row` characters: entropy (bits), red
    dashed lines after the rule's spikes, the model's segment ends in green, the prompt grey."""
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
        ax.set_xticks(xs, ['␣' if c == ' ' else repr(c)[1:-1] for c in text[lo:hi]], fontsize=7,
                      family='monospace')
        ax.tick_params(axis='x', length=0)
        ax.set(xlim=(lo - 0.5, lo + per_row - 0.5), ylim=(0, top), ylabel='bits')
    axes[0, 0].set_title(title + ('  (grey: prompt)' if prompt_len else ''), fontsize=9)
    axes[0, 0].legend(loc='lower right', fontsize=7, ncol=3, bbox_to_anchor=(1, 1.02),
                      frameon=False)
    fig.tight_layout()
    return fig


def parse_args(argv=None):
    p = common.Parser(prog='sample.py', description=__doc__.split('\n\n')[0].strip())
    add = p.add_argument
    add('--ckpt', required=True, type=nonblank, help="train.py's ckpt.pt or its run folder")
    add('--prompt', default='', help='text to continue (cleaned; empty: a single space)')
    add('--chars', type=common.non_negative_int, default=500, help='characters to generate (500)')
    add('--num-samples', type=common.positive_int, default=1, help='samples, as one batch (1)')
    add('--temperature', type=common.non_negative_float, default=0.8, help='0: greedy (0.8)')
    add('--top-k', type=common.positive_int, help='sample among the k most likely characters')
    add('--greedy', action='store_true', help='always take the most likely character (argmax)')
    add('--seed', type=common.seed_int, default=1337, help='same seed, same output (1337)')
    add('--device', help='cpu, cuda, cuda:N, mps (default: cuda if available)')
    add('--show-segments', action='store_true', help=f'SEP after segments, {PROMPT_MARK} at prompt')
    add('--separator', default='|', help='the mark of --show-segments (|), no line break')
    add('--color', '--colour', action='store_true', help='--show-segments in colours (terminal)')
    add('--entropy-trace', type=nonblank, nargs='?', const='-', metavar='FILE',
        help='TSV of pos, char, entropy (bits), boundary, spike: to stdout or FILE')
    add('--entropy-plot', type=nonblank, metavar='FILE.png', help="the paper's Figure 2")
    add('--spike-window', type=common.positive_int, metavar='K', help="the spike rule's k")
    add('--threads', type=common.int_range(1, os.cpu_count() or 1), default=1, help='threads')
    add('--trust-ckpt', action='store_true', help='load pickled objects: files you trust only')
    args = p.parse_args(argv)
    if not args.separator or {'\n', '\r'} & set(args.separator):   # the output's lines stay whole
        p.error(f'argument --separator {args.separator!r}: must be characters, no line break')
    if args.entropy_plot is not None and args.entropy_plot in ('-', args.entropy_trace):
        p.error("argument --entropy-plot: needs a file of its own, not - nor --entropy-trace's")
    try:
        args.device = pick_device(args.device)
    except UserError as e:   # a device this machine lacks is a flag mistake too: exit 2
        p.error(str(e))
    return args


def run(args):
    if args.entropy_plot:   # a format matplotlib lacks is refused before generating
        import_pyplot('--entropy-plot')
        from matplotlib.backend_bases import FigureCanvasBase
        fmt = os.path.splitext(args.entropy_plot)[1][1:].lower() or 'png'
        if fmt not in FigureCanvasBase.get_supported_filetypes():
            raise UserError(f'--entropy-plot {args.entropy_plot}: matplotlib writes no .{fmt} '
                            f'files; use .png, .pdf or .svg')
    torch.set_num_threads(args.threads)
    model, ckpt = load_checkpoint(args.ckpt, args.device, trust=args.trust_ckpt)
    text, how = clean_prompt(args.prompt, ckpt['vocab'])   # one stderr line if that changed it
    if text != args.prompt:
        print(f'prompt cleaned ({how}): {json.dumps(args.prompt, ensure_ascii=False)} -> '
              f'{json.dumps(text, ensure_ascii=False)}', file=sys.stderr)
    index = {c: i for i, c in enumerate(ckpt['vocab']['alphabet'])}
    if bad := sorted({c for c in text if c not in index}):
        raise UserError(f"the prompt has characters outside the checkpoint's alphabet: "
                        f"{', '.join(map(repr, bad))} (alphabet: {''.join(index)!r})")
    ids = [index[c] for c in text] or [ckpt['vocab'].get('space_id') or 0]   # '': a space
    out = generate(args, model, ids, ckpt)
    texts, b = out.texts, out.boundaries
    if args.entropy_trace is not None:   # per sample: pos, char, H_t, the model's b_t, spike
        lines = []
        for i, text in enumerate(texts):
            lines += [f'# sample {i}'] * (len(texts) > 1)
            lines += ['pos\tchar\tentropy_bits\tboundary\tspike']
            lines += [f'{t}\t{repr(c)[1:-1]}\t{out.entropy[i][t]:.4f}\t'   # \t, \n escaped
                      f'{"" if b is None else int(b[i][t])}\t{int(out.spikes[i][t])}'
                      for t, c in enumerate(text)]
        if args.entropy_trace == '-':
            print('\n'.join(lines))
        else:
            write_atomic(args.entropy_trace, '\n'.join(lines) + '\n')
    if args.entropy_trace != '-':   # the samples (segments marked), their counts on stderr
        if args.show_segments and b is None:
            print('note: a vanilla checkpoint has no segments to show', file=sys.stderr)
        colour = args.color and sys.stdout.isatty()   # a file or pipe gets the separators
        for i, text in enumerate(texts):
            if i:
                print('-' * 40)
            print(show_segments(text, b and b[i], args.separator, colour, len(ids))
                  if args.show_segments else text)
            if args.show_segments and b is not None:
                print(('segments: ' if len(texts) == 1 else f'segments of sample {i + 1}: ')
                      + segment_summary(text, b[i], len(ids)), file=sys.stderr)
    if args.entropy_plot:
        run_name = os.path.basename(os.path.dirname(os.path.abspath(ckpt['path'])))
        fig = entropy_figure(texts[0], out.entropy[0], out.spikes[0], b and b[0], out.k,
                             prompt_len=len(ids), title=f'{run_name}: boundary='
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
