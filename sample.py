"""Generate text from a dynpool checkpoint; show the segments the model chose
(docs/generation.md).

    python sample.py --ckpt out/text8-whitespace --prompt "The History of" \
        --show-segments
    python sample.py --ckpt out/text8-entropy --chars 120 --entropy-plot fig2.png
"""
import codecs
import math
import sys
import time
import unicodedata
from pathlib import Path
from types import SimpleNamespace

import torch
from tqdm import tqdm

import common
import dataset
import checkpoint
import flags
from cleaning import LANGS, TEXT8_ALPHABET, clean
from common import UserError, import_pyplot, nonblank, write_atomic
from dataset import is_number
from dynpool import entropy_spikes
from runtime import generation_bytes, pick_device, require_memory, setup_device

PROGRESS_SECONDS = 30
PROMPT_MARK = '»'   # --show-segments: where the prompt ends and the continuation begins
UTF8 = codecs.getincrementaldecoder('utf-8')


def say(text):
    """A note, or a progress line, on stderr at once (stdout holds the samples alone)."""
    print(text, file=sys.stderr, flush=True)


def clean_prompt(text, vocab):
    """The prompt cleaned as the training text was → (text, how, in words):
    cleaning.clean in the checkpoint's recorded language, English for text8's alphabet,
    else as it is. Line breaks become spaces where the alphabet has none; a trailing
    space or break is kept."""
    alphabet = vocab['alphabet']
    # train.py records {'lang': ...}; an earlier checkpoint, nothing (or another form)
    recorded = vocab.get('cleaning')
    if not isinstance(recorded, dict):
        recorded = {}
    lang = recorded.get('lang')
    source = 'recorded in the checkpoint'
    if lang is None and set(alphabet) == set(TEXT8_ALPHABET):
        lang = 'en'
        source = "text8's alphabet"
    if lang not in LANGS:
        return text, 'not cleaned: no language recorded in the checkpoint'
    out = clean(text, lang)
    if '\n' not in alphabet:
        out = ' '.join(out.split())
    tail = text[len(text.rstrip()):]
    if out and '\n' in tail and '\n' in alphabet:
        out += '\n'
    elif out and tail:
        out += ' '
    return out, f'cleaning.clean, {lang}, from {source}'


def encode_prompt(prompt, vocab):
    """--prompt → token ids, as the checkpoint's data was encoded: 'bytes', its UTF-8
    bytes as they are; 'chars', NFC, a character outside the alphabet as the unknown
    id 0 (a note on stderr); 'paper' (or none recorded), cleaned as the training text
    was (a note where that changed it), a prompt that keeps none of its characters or
    one outside the alphabet refused."""
    encoding = vocab.get('encoding', 'paper')
    if dataset.unit(vocab) == 'byte':
        # (surrogateescape: the bytes a terminal in another encoding passed, unchanged)
        return list(prompt.encode('utf-8', 'surrogateescape'))
    if encoding == 'chars':
        text = unicodedata.normalize('NFC', prompt)
    else:
        text, how = clean_prompt(prompt, vocab)
        if prompt.strip() and not text:
            raise UserError(f'--prompt {prompt!r} keeps none of its characters once '
                            f"cleaned ({how}): write it in the checkpoint's alphabet", code=2)
        if text != prompt:
            say(f'prompt cleaned ({how}): {prompt!r} -> {text!r}')
    index = {c: i for i, c in enumerate(vocab['alphabet'])}
    unseen = ', '.join(sorted({repr(c) for c in text if c not in index}))
    if unseen and encoding != 'chars':
        raise UserError(f"the prompt has characters outside the checkpoint's alphabet: "
                        f"{unseen} (alphabet: {''.join(index)!r})")
    if unseen:
        say(f"note: the prompt's {unseen} are not in the checkpoint's alphabet: read as "
            f'the unknown character {vocab["alphabet"][0]!r}')
    return [index.get(c, 0) for c in text]


def decode(ids, vocab):
    """Token ids → the text each one completes, a string per token (joined: the text): a
    character per token; for bytes, a character at the byte that completes its UTF-8
    sequence ('' before), bytes that never form one as U+FFFD at the last of them (a
    prompt that ends inside a character the continuation breaks: at the prompt's end)."""
    if dataset.unit(vocab) != 'byte':
        return [vocab['alphabet'][i] for i in ids]
    decoder = UTF8('replace')
    pieces = []
    for i in ids:
        pending = decoder.getstate()[0]
        piece = decoder.decode(bytes([i]))
        # A byte that breaks the sequence begun before it is read afresh: the decoder
        # writes that sequence's U+FFFD before this byte's own text, but it ends a token
        # earlier (where a prompt ended, its end mark falls between the two).
        if pending and piece == '\ufffd' + UTF8('replace').decode(bytes([i])):
            pieces[-1] += '\ufffd'
            piece = piece[1:]
        pieces.append(piece)
    if pieces:
        pieces[-1] += decoder.decode(b'', final=True)
    return pieces


@torch.no_grad()
def generate(args, model, ids, ckpt):
    """args.num_samples continuations of `ids` by model.steps → per sample, by position
    t: pieces, the text token t completes (decode); entropy H_t in bits after t (§3.2;
    temperature 1, no top-k); spikes, the rule of the checkpoint's entropy_window k;
    boundaries, the model's b_t or None. A terminal on stderr shows the progress."""
    vocab = ckpt['vocab']
    x = torch.tensor([ids] * args.num_samples, device=args.device)
    torch.manual_seed(args.seed)
    gen = torch.Generator(device=args.device).manual_seed(args.seed)
    greedy = args.greedy or args.temperature == 0
    steps = model.eval().steps(x, args.chars, args.temperature, args.top_k, greedy, gen,
                               len(vocab['alphabet']))
    tokens = []
    b = []
    entropy = []
    # where stderr is no terminal (no bar), a line every PROGRESS_SECONDS of a long run
    last_line = time.monotonic()
    try:   # (disable=None: no bar where stderr is not a terminal)
        for step in tqdm(steps, total=args.chars + 1, unit='token', disable=None,
                         leave=False):
            if not sys.stderr.isatty() and time.monotonic() - last_line >= PROGRESS_SECONDS:
                say(f'generated {len(tokens)} of {args.chars + 1} tokens')
                last_line = time.monotonic()
            tokens.append(step.tokens)
            b.append(step.boundaries)
            logp = step.logits.float().log_softmax(-1)
            entropy.append(-(logp.exp() * logp).sum(-1) / math.log(2))
    except RuntimeError as e:   # sampling from NaN probabilities: refused below
        if 'probability tensor' not in str(e):
            raise
        entropy = [torch.tensor([[math.nan]])]
    entropy = torch.cat(entropy, 1)
    if not torch.isfinite(entropy).all():
        raise UserError(f"the model's predictions are not finite (NaN or inf): checkpoint "
                        f"{ckpt['path']} holds damaged weights")
    k = model.cfg.entropy_window
    pieces = [decode(row, vocab) for row in torch.cat(tokens, 1).tolist()]
    boundaries = None
    if b[0] is not None:
        boundaries = torch.cat(b, 1).tolist()
    return SimpleNamespace(pieces=pieces, entropy=entropy.tolist(), k=k,
                           spikes=entropy_spikes(entropy, k).tolist(), boundaries=boundaries)


def show_segments(pieces, boundaries, prompt_len=None):
    """The text of `pieces` (decode's, or a string: a character a token) with | after
    each b_t = 1 and PROMPT_MARK after the prompt's prompt_len tokens; a mark that falls
    inside a character (bytes) follows the character."""
    shown = ''
    # marks that fall inside a character wait for the piece that completes it
    marks = ''
    for t, piece in enumerate(pieces):
        if boundaries is not None and boundaries[t]:
            marks += '|'
        if t + 1 == prompt_len:
            marks += PROMPT_MARK
        if piece:
            shown += piece + marks
            marks = ''
    return shown + marks


def entropy_figure(out, title, prompt_len, per_row=80):
    """The paper's Figure 2 for generate's first sample → a Figure, a row of axes per
    `per_row` tokens: entropy (bits), red dashed lines after the rule's spikes, the model's
    segment ends in green, a grey line where the prompt ends."""
    plt = import_pyplot('--entropy-plot')
    pieces = out.pieces[0]
    entropy = out.entropy[0]
    top = max(entropy) + 0.5   # room above the curve for the model's marks
    n_rows = math.ceil(len(pieces) / per_row)
    fig, axes = plt.subplots(n_rows, 1, squeeze=False, figsize=(14, 2 * n_rows + 0.5))
    for row, ax in enumerate(axes[:, 0]):
        xs = range(row * per_row, min(len(pieces), (row + 1) * per_row))
        if prompt_len - 1 in xs:
            ax.axvline(prompt_len - 0.5, color='grey')
        ax.plot(xs, entropy[xs.start:xs.stop], '.-', label='entropy H_t (bits)')
        spikes = [t + 0.5 for t in xs if out.spikes[0][t]]
        ax.vlines(spikes, 0, top, colors='red', linestyles='--', label=f'entropy spike (k={out.k})')
        if out.boundaries is not None:
            ends = [t + 0.5 for t in xs if out.boundaries[0][t]]
            ax.plot(ends, [top] * len(ends), 'gv', label="the model's segment ends")
        labels = [repr(pieces[t])[1:-1].replace(' ', '␣') for t in xs]
        ax.set_xticks(xs, labels, fontsize=7)
    axes[0, 0].set_title(title + '  (grey: the prompt ends)', fontsize=9)
    axes[0, 0].legend(fontsize=7, ncol=3)
    fig.tight_layout()
    return fig


def parse_args(argv=None):
    """The flags, after the --import'ed files have registered their sources."""
    if argv is None:
        argv = sys.argv[1:]
    flags.import_sources(argv)
    p = common.Parser(prog='sample.py', description=__doc__.split('\n\n')[0])
    p.add_argument('--ckpt', required=True, type=nonblank,
                   help="train.py's ckpt.pt or its run folder")
    flags.add_import_flag(p)
    p.add_argument('--prompt', default='',
                   help="text to continue, encoded as the checkpoint's data (cleaned for the "
                        "paper's; empty: a single space; kept: the last tokens, as many as "
                        'the model trained on)')
    p.add_argument('--chars', type=common.non_negative_int, default=500,
                   help='tokens to generate: characters, or bytes for a byte-level '
                        'checkpoint (500)')
    p.add_argument('--num-samples', type=common.positive_int, default=1,
                   help='samples, as one batch (1)')
    p.add_argument('--temperature', type=common.non_negative_float, default=0.8,
                   help='0: greedy (0.8)')
    p.add_argument('--top-k', type=common.positive_int,
                   help='sample among the k most likely tokens')
    p.add_argument('--greedy', action='store_true',
                   help='always take the most likely token (argmax)')
    p.add_argument('--seed', type=common.seed_int, default=1337,
                   help='same seed, same output (1337)')
    flags.add_device_flag(p)
    p.add_argument('--show-segments', action='store_true',
                   help=f'| after each segment, {PROMPT_MARK} after the prompt')
    p.add_argument('--entropy-plot', type=nonblank, metavar='FILE.png',
                   help="the paper's Figure 2")
    p.add_argument('--trust-ckpt', action='store_true',
                   help='load pickled objects: files you trust only')
    args = p.parse_args(argv)
    if args.entropy_plot == '-':
        p.error('argument --entropy-plot: needs a file, not -')
    args.device = pick_device(args.device)
    return args


def prompt_ids(args, ckpt):
    """--prompt encoded (encode_prompt), kept to the last seq_len tokens the model
    trained on (a note where cut) → token ids."""
    ids = encode_prompt(args.prompt, ckpt['vocab'])
    seq_len = ckpt.get('args', {}).get('seq_len')   # (read_checkpoint: args is a dict)
    # Attention over more than the model trained on costs memory and time with the
    # length's square and goes past the distances it learnt: the end of a longer prompt
    # is what it continues.
    if isinstance(seq_len, int) and 0 < seq_len < len(ids):
        say(f'note: the prompt is cut to its last {seq_len} tokens (of {len(ids)}), the '
            'length the model trained on')
        ids = ids[-seq_len:]
    if not ids:   # '': a space
        return [ckpt['vocab'].get('space_id') or 0]
    return ids


def note_unfinished(ckpt):
    """A note on stderr where the checkpoint's run stopped before its end
    (checkpoint.finished: train.py's own rule)."""
    saved_args = ckpt.get('args', {})
    step = ckpt.get('step')
    spent = ckpt.get('train_flops', 0)
    budget = saved_args.get('flop_budget')
    # an earlier train.py's checkpoint may not say where its run ends
    if not (is_number(step) and is_number(saved_args.get('max_steps'))):
        return
    if checkpoint.finished(step, spent, saved_args):
        return
    where = f'step {step} of {saved_args["max_steps"]}'
    if budget is not None:
        where = f'step {step}, {spent:.3g} of {budget:.3g} FLOPs'
    say(f'note: checkpoint at {where} (unfinished run)')


def print_samples(args, out, prompt_len):
    """The samples on stdout, segments marked with --show-segments."""
    b = out.boundaries
    if args.show_segments and b is None:
        say('note: a vanilla checkpoint has no segments to show')
    for i, pieces in enumerate(out.pieces):
        if i:
            print('-' * 40)
        if args.show_segments:
            print(show_segments(pieces, b and b[i], prompt_len))
        else:
            print(''.join(pieces))


def plot_format(path):
    """--entropy-plot's format, refused before generating where
    matplotlib cannot write it."""
    import_pyplot('--entropy-plot')
    from matplotlib.backend_bases import FigureCanvasBase
    fmt = Path(path).suffix[1:].lower() or 'png'
    if fmt not in FigureCanvasBase.get_supported_filetypes():
        raise UserError(f'--entropy-plot {path}: matplotlib writes no .{fmt} files; use .png, '
                        '.pdf or .svg')
    return fmt


def run(args):
    fmt = None
    if args.entropy_plot:
        fmt = plot_format(args.entropy_plot)
    setup_device(args.device, args.threads)
    model, ckpt = checkpoint.load_checkpoint(args.ckpt, args.device, trust=args.trust_ckpt)
    note_unfinished(ckpt)
    unit = dataset.unit(ckpt['vocab'])
    ids = prompt_ids(args, ckpt)
    need = generation_bytes(model.cfg, args.num_samples, len(ids), args.chars)
    what = f'{args.num_samples} sample(s) of {len(ids)} + {args.chars} {unit}s'
    require_memory(need, what, args.device, 'lower --chars or --num-samples, or shorten '
                   '--prompt')
    out = generate(args, model, ids, ckpt)
    print_samples(args, out, len(ids))
    if args.entropy_plot:
        run_name = Path(ckpt['path']).absolute().parent.name   # (a link's own name)
        title = f'{run_name}: boundary={model.cfg.boundary}, next-{unit} entropy'
        fig = entropy_figure(out, title, len(ids))
        try:
            write_atomic(args.entropy_plot,
                         lambda tmp: fig.savefig(tmp, dpi=150, format=fmt))
        finally:
            import_pyplot('--entropy-plot').close(fig)
        say(f'wrote {args.entropy_plot}')
    return out



def main(argv=None):
    return common.main(lambda: run(parse_args(argv)))


if __name__ == '__main__':
    sys.exit(main())
