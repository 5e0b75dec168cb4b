"""
Generate text from a dynpool checkpoint and show the segments the model chose.

    python sample.py --ckpt out/text8-whitespace/ckpt.pt --prompt "The History of" --chars 500 \\
        --temperature 0.8 --top-k 20 --seed 1
    python sample.py --ckpt out/text8-whitespace --prompt "the history of" --show-segments
    python sample.py --ckpt out/text8-entropy/ckpt.pt --show-segments --color        # colours on a terminal
    python sample.py --ckpt out/text8-entropy/ckpt.pt --greedy --chars 200
    python sample.py --ckpt out/text8-entropy/ckpt.pt --num-samples 3 --seed 7 --device cuda
    python sample.py --ckpt out/text8-entropy/ckpt.pt --chars 120 --entropy-plot entropy.png
    python sample.py --ckpt out/text8-entropy/ckpt.pt --chars 120 --entropy-trace > trace.tsv

A real one in five minutes on 2 busy CPU cores, from text8's first 4M characters
(test bpc 2.92 and shortening factor 3.9, on the first 20k test characters):

    python prepare_data.py --input ../shared/data/text8-head.txt --name text8-head --unigram 0
    OMP_NUM_THREADS=1 python train.py --data data/text8-head --boundary entropy \\
        --device cpu --d-model 128 --n-head 4 --d-head 32 --d-inner 512 --layers 1,2,1 --seq-len 256 \\
        --batch-size 16 --max-steps 250 --warmup 20 --lr 2e-3 --eval-interval 250 --eval-max-chars 20000
    python sample.py --ckpt out/text8-head-entropy --prompt "the history of" --chars 500 \\
        --temperature 0.8 --top-k 20 --seed 1 --show-segments

What is printed:
- the prompt followed by its continuation, one sample after another (a line of dashes between);
- with --show-segments, a separator (default `|`) after every character that closes a segment,
  i.e. where the model's boundary b_t = 1 (a segment ends at token t), and `»` where the prompt
  ends; deleting the separators and the `»` gives back the text exactly. With --color on a
  terminal, segments alternate in colour instead. The prompt's boundaries are the ones the model
  used when reading it. On stderr, one line per sample: its characters, the segments closed (in
  the prompt and in all) and the shortening factor (characters / closed segments). Vanilla
  checkpoints (boundary 'none') have no segments: only the prompt's end is marked.
- with --entropy-trace, a TSV (pos, char, entropy_bits, boundary) in place of the text, or
  written to FILE with --entropy-trace FILE. entropy_bits at position t is the entropy (bits) of
  the model's own next-character distribution after reading characters 0..t (temperature 1, no
  top-k): the H_t of the entropy-spike boundaries (paper §3.2).
- with --entropy-plot FILE.png, the paper's Figure 2 for the first sample: entropy per character
  with the boundaries marked beside the text (needs matplotlib).

Prompt characters: the prompt is cleaned as the training text was (prepare_data.clean: lower case,
each digit spelled as a word, punctuation to spaces, whitespace collapsed; a trailing space is
kept), and one line on stderr shows what changed, e.g.
    prompt cleaned (prepare_data.clean, en): "Hello, World 42!" -> "hello world four two"
The language comes from the checkpoint's vocab ('cleaning': {'lang', 'fold_accents'}) where it
records one; otherwise from its alphabet, which names it for every dataset prepare_data.py makes
(text8's: English, line breaks as spaces). An alphabet of no such language is only lower-cased
when it has no upper-case letters. Any character still outside the alphabet is an error, listed on
one line. An empty prompt starts from a single space.

The checkpoint is the `ckpt.pt` that train.py writes in its run directory, out/<dataset>-<boundary>
by default (--ckpt takes the file or the directory), read by operations.load_checkpoint: its
'model' (state dict), 'config' (dataclasses.asdict(Config)) and 'vocab' (alphabet: list of
characters, index = token id; space_id); the rest (optimizer, RNG states, ...) is ignored. Loading is safe (weights_only, numpy's RNG state allowed); --trust-ckpt loads any
pickle. Sampling is reproducible for a given --seed, device and torch version. On CPU one thread is the default
(--threads): decoding one character at a time is latency-bound.

Errors: one line `error: ...` on stderr, exit 2 for a bad flag (every flag and output path is
checked before anything runs), 1 otherwise (a missing or damaged checkpoint, one whose weights or
predictions are not finite), 130 on Ctrl-C. The
whole continuation stays in memory (key/value caches of every layer over prompt + --chars), so a
request that cannot fit in the free memory of the device is refused before anything is allocated,
naming the most --chars (or --num-samples) that would fit. Files are written whole or not at all.
"""

import argparse
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

from operations import (UserError, check_path, load_checkpoint, non_negative_float, non_negative_int,
                        pick_device, positive_int, seed_int, thread_count, user_path)
from cleaning import LANGS, TEXT8_ALPHABET, clean

ANSI_SEGMENT_COLOURS = ('\033[48;5;153m\033[38;5;16m', '\033[48;5;223m\033[38;5;16m')  # light blue / light orange
ANSI_RESET = '\033[0m'
PROMPT_MARK = '»'   # --show-segments: where the prompt ends and the continuation begins


# -----------------------------------------------------------------------------
# Text ↔ token ids


def prompt_cleaning(vocab):
    """(language, fold_accents, where that was read) of prepare_data's cleaning of the training
    text: the checkpoint's own record, else the language whose alphabet is the checkpoint's
    (prepare_data's alphabets are '\n', ' ' and the letters; text8's ' ' and a-z); None if none."""
    rec = vocab.get('cleaning')
    if isinstance(rec, dict) and rec.get('lang') in LANGS:
        return rec['lang'], bool(rec.get('fold_accents')), 'recorded in the checkpoint'
    alphabet = set(vocab['alphabet'])
    if alphabet == set(TEXT8_ALPHABET):
        return 'en', False, "text8's alphabet"
    for lang, spec in LANGS.items():
        if alphabet == {'\n', ' '} | set(spec['letters']):
            return lang, False, f"the {lang} alphabet"
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
    return out, f'prepare_data.clean, {lang}' + (', accents folded' if fold else '') + f', from {source}'


def encode(text, alphabet):
    """Prompt → token ids; characters outside the alphabet raise UserError naming each once."""
    index = {c: i for i, c in enumerate(alphabet)}
    bad = sorted({c for c in text if c not in index})
    if bad:
        raise UserError(f"the prompt has characters outside the checkpoint's alphabet: "
                        f"{', '.join(repr(c) for c in bad)} (alphabet: {''.join(alphabet)!r})")
    return [index[c] for c in text]


def decode_ids(ids, alphabet):
    return ''.join(alphabet[i] if i < len(alphabet) else '\ufffd' for i in ids)


# -----------------------------------------------------------------------------
# Generation that also records boundaries and entropies


def entropy_bits(logits):
    """Entropy in bits of softmax(logits) over the last dimension."""
    logp = F.log_softmax(logits.float(), -1)
    return -(logp.exp() * logp).sum(-1) / math.log(2)


@torch.no_grad()
def sample(model, x, n, temperature=1.0, top_k=None, greedy=False, generator=None, n_valid=None):
    """Continue x [B, L] by n tokens with dynpool's cached generation (DynamicPoolingLM.steps).

    Takes exactly the steps of DynamicPoolingLM.generate (same sampled tokens for the same generator),
    and also returns what the model did on the way:
      tokens      [B, L+n] int64, the prompt then the continuation
      boundaries  [B, L+n] bool, b_t = 1 where token t closed a segment (None for vanilla)
      entropy     [B, L+n] float, bits, of the next-token distribution after token t (temperature 1)
    n_valid: ids >= n_valid (vocabulary padding beyond the alphabet) are never sampled.
    """
    model.eval()
    tokens, boundaries, entropy = [], [], []
    for step in model.steps(x, n, temperature, top_k, greedy, generator, n_valid):
        tokens.append(step.tokens)
        boundaries.append(step.boundaries)
        entropy.append(entropy_bits(step.logits))
    b = None if boundaries[0] is None else torch.cat(boundaries, 1)
    return torch.cat(tokens, 1), b, torch.cat(entropy, 1)


# -----------------------------------------------------------------------------
# Display


def show_segments(text, boundaries, sep='|', colour=False, prompt_len=None, mark=PROMPT_MARK):
    """Mark segment ends: `sep` after every character with b_t = 1, or alternate ANSI colours per
    segment; with prompt_len, `mark` after the prompt (after its separator). Removing every `sep`
    and `mark` from the result gives back `text` (when neither is in the text). boundaries None
    (vanilla): no segments, only the prompt's mark."""
    colour = colour and boundaries is not None
    b = [bool(v) for v in (boundaries or [])[:len(text)]]
    b += [False] * (len(text) - len(b))
    cut = prompt_len if prompt_len else None
    out, seg, start = [], 0, 0
    for t, bt in enumerate(b):
        if not colour:
            out.append(text[t] + (sep if bt else ''))
        elif bt or t + 1 == cut or t == len(text) - 1:   # a coloured run per segment, split at the mark
            out.append(ANSI_SEGMENT_COLOURS[seg % 2] + text[start:t + 1] + ANSI_RESET)
            seg, start = seg + bt, t + 1
        if t + 1 == cut:
            out.append(mark)
    return ''.join(out)


def segment_summary(text, boundaries, prompt_len):
    """One line: characters, segments closed (in the prompt, in all), open, shortening factor."""
    b = boundaries[:len(text)]
    closed, in_prompt = sum(map(bool, b)), sum(map(bool, b[:prompt_len]))
    still_open = bool(b) and not b[-1]
    sf = f'shortening factor {len(text) / closed:.2f}' if closed else 'no segment closed yet'
    return (f'{len(text)} characters ({prompt_len} of the prompt), {closed} segments closed '
            f'({in_prompt} in the prompt)' + (' and 1 still open' if still_open else '') + f'; {sf}')


def tsv_char(c):
    return {'\t': '\\t', '\n': '\\n', '\r': '\\r', '\\': '\\\\'}.get(c, c)


def entropy_trace(text, entropy, boundaries):
    """TSV lines: pos, char, entropy_bits, boundary (0/1; empty for vanilla)."""
    lines = ['pos\tchar\tentropy_bits\tboundary']
    for t, (c, h) in enumerate(zip(text, entropy)):
        b = '' if boundaries is None else str(int(boundaries[t]))
        lines.append(f"{t}\t{tsv_char(c)}\t{h:.4f}\t{b}")
    return '\n'.join(lines) + '\n'


def entropy_plot(path, text, entropy, boundaries, title='', per_row=80, prompt_len=0, fmt=None):
    """The paper's Figure 2: next-character entropy (bits) per character, the characters along the
    x-axis, a dashed line after every character that closes a segment, the prompt shaded grey."""
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--entropy-plot needs matplotlib: pip install matplotlib") from None
    n_rows = max(1, math.ceil(len(text) / per_row))
    ymax = max(1e-3, max(entropy)) * 1.1
    fig, axes = plt.subplots(n_rows, 1, figsize=(max(8, 0.16 * min(per_row, len(text)) + 1), 1.9 * n_rows + 0.4),
                             squeeze=False)
    for r, ax in enumerate(axes[:, 0]):
        lo, hi = r * per_row, min(len(text), (r + 1) * per_row)
        xs = list(range(lo, hi))
        if prompt_len > lo:
            ax.axvspan(lo - 0.5, min(prompt_len, hi) - 0.5, color='0.9', lw=0)
        ax.plot(xs, entropy[lo:hi], '-o', ms=2.5, lw=1, color='tab:blue')
        if boundaries is not None:
            for t in xs:
                if boundaries[t]:
                    ax.axvline(t + 0.5, color='tab:red', ls='--', lw=0.8, alpha=0.8)
        ax.set_xticks(xs)
        ax.set_xticklabels(['␣' if c == ' ' else tsv_char(c) for c in text[lo:hi]], fontsize=7, family='monospace')
        ax.tick_params(axis='x', length=0)
        ax.set_xlim(lo - 0.5, lo + per_row - 0.5)
        ax.set_ylim(0, ymax)
        ax.set_ylabel('bits', fontsize=8)
    axes[0, 0].set_title(title + ('  (dashed: segment ends' if boundaries is not None else '  (')
                         + ('; grey: prompt)' if prompt_len else ')'), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=150, format=fmt)
    plt.close(fig)


# -----------------------------------------------------------------------------
# Command line


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, like every other mistake (argparse would add the usage)
        self.exit(2, f"error: {message} (see --help)\n")


def new_file(s):
    """Argument type: a file to write, checked before anything runs."""
    if s == '-':
        raise argparse.ArgumentTypeError("a plot is written to a file, not to stdout (-)")
    return str(user_path('new-file')(s))


def new_file_or_stdout(s):
    """Argument type: '-' (stdout) or a file to write."""
    return s if s == '-' else new_file(s)


def one_line(s):
    """Argument type: a non-empty mark that keeps the output's lines whole."""
    if not s or '\n' in s or '\r' in s:
        raise argparse.ArgumentTypeError(f"must be one or more characters without a line break, got {s!r}")
    return s


def parse_args(argv=None):
    p = Parser(description="Generate text from a dynpool checkpoint and show the segments it used.")
    p.add_argument('--ckpt', required=True,
                   help="the checkpoint train.py writes, out/<dataset>-<boundary>/ckpt.pt by default, or "
                        "its run directory")
    p.add_argument('--prompt', default='',
                   help="text to continue, cleaned as the training text was (lower case, digits spelled, "
                        "punctuation to spaces); empty = a single space")
    p.add_argument('--chars', type=non_negative_int, default=500, help="number of characters to generate (500)")
    p.add_argument('--num-samples', type=positive_int, default=1, help="independent samples, generated as one batch (1)")
    p.add_argument('--temperature', type=non_negative_float, default=0.8,
                   help="softmax temperature of sampling (0.8); 0 means greedy")
    p.add_argument('--top-k', type=positive_int, default=None,
                   help="sample only among the k most likely characters (default: all)")
    p.add_argument('--greedy', action='store_true', help="always take the most likely character (argmax)")
    p.add_argument('--seed', type=seed_int, default=1337, help="random seed: same seed, same output (1337)")
    p.add_argument('--device', default=None,
                   help="torch device, e.g. cpu, cuda, cuda:1, mps (default: cuda if available, else cpu)")
    p.add_argument('--show-segments', action='store_true',
                   help=f"mark the segment boundaries the model used: SEP after each character that closes a "
                        f"segment, {PROMPT_MARK} where the prompt ends; segments and shortening factor on stderr")
    p.add_argument('--separator', type=one_line, default='|',
                   help="the mark --show-segments puts after a segment's last character (|)")
    p.add_argument('--color', '--colour', action='store_true',
                   help="with --show-segments on a terminal, alternate colours per segment instead of separators")
    p.add_argument('--entropy-trace', type=new_file_or_stdout, nargs='?', const='-', default=None, metavar='FILE',
                   help="TSV of pos, char, entropy (bits) of the next-char prediction, boundary: to stdout in "
                        "place of the text, or to FILE")
    p.add_argument('--entropy-plot', type=new_file, default=None, metavar='FILE.png',
                   help="plot the per-character entropy with the boundaries marked (paper Fig. 2), first sample; "
                        "needs matplotlib")
    p.add_argument('--threads', type=thread_count, default=1,
                   help="CPU threads for torch (1): decoding one character at a time is latency-bound, and extra "
                        "threads only pay off for long prompts or many samples")
    p.add_argument('--trust-ckpt', action='store_true',
                   help="load checkpoints that hold arbitrary pickled Python objects (only for files you trust)")
    args = p.parse_args(argv)
    try:
        args.device = pick_device(args.device)
    except UserError as e:
        p.error(str(e))
    if args.entropy_plot is not None and args.entropy_plot == args.entropy_trace:
        p.error(f"--entropy-trace and --entropy-plot name the same file {args.entropy_plot}")
    return args


def free_memory(device):
    """Bytes still free for this process on `device` (CPU: MemAvailable within any cgroup limit),
    None where unknown."""
    dev = torch.device(device)
    if dev.type == 'cuda':
        return torch.cuda.mem_get_info(dev)[0]
    if dev.type != 'cpu':
        return None
    free = []
    try:
        with open('/proc/meminfo') as f:
            free += [int(ln.split()[1]) * 1024 for ln in f if ln.startswith('MemAvailable:')]
        with open('/sys/fs/cgroup/memory.max') as f, open('/sys/fs/cgroup/memory.current') as g:
            limit = f.read().strip()
            if limit != 'max':
                free.append(int(limit) - int(g.read()))
    except (OSError, ValueError):
        pass
    return min(free) if free else None


def generation_bytes(cfg, n_samples, prompt_len, n_new, elem=4):
    """Rough peak memory of generating: key/value caches (and the shared position cache) of every
    layer over the whole sequence, the prompt's activations, and the outputs kept per character."""
    T, hd = prompt_len + n_new, cfg.n_head * cfg.d_head
    caches = sum(cfg.layers) * (2 * n_samples + 1) * hd * T * elem
    block = min(getattr(cfg, 'attn_chunk', prompt_len), prompt_len)
    prefill = n_samples * prompt_len * (cfg.d_inner + 8 * cfg.d_model + 3 * cfg.vocab_size
                                        + 3 * cfg.n_head * block) * elem
    # tokens, entropies and boundaries as Python objects (~64 B per character and sample), and
    # the few small tensors each decoding step keeps (~1 KiB)
    return caches + prefill + 64 * n_samples * T + 1024 * n_new


def check_request(cfg, n_samples, prompt_len, n_new, device):
    """Refuse, in one line, a request whose caches and outputs cannot fit in free memory."""
    free = free_memory(device)
    if free is None:
        return
    budget = 0.8 * free                   # headroom for the allocator, the model and temporaries
    need = generation_bytes(cfg, n_samples, prompt_len, n_new)
    if need <= budget:
        return

    def most(f):                          # generation_bytes is affine in each count: solve for it
        return max(0, int((budget - f(0)) // max(1, f(1) - f(0))))
    max_chars = most(lambda n: generation_bytes(cfg, n_samples, prompt_len, n))
    max_samples = most(lambda b: generation_bytes(cfg, b, prompt_len, n_new))
    gib = 2 ** 30
    raise UserError(f"{n_samples} sample(s) of {n_new} characters after a {prompt_len}-character prompt "
                      f"need about {need / gib:,.1f} GiB (key/value caches of {sum(cfg.layers)} layers over "
                      f"{prompt_len + n_new:,} positions), more than the {budget / gib:,.1f} GiB free on "
                      f"{device}: ask for at most {max_chars:,} --chars with --num-samples {n_samples}, "
                      f"or at most {max_samples:,} --num-samples of {n_new} characters")


def write_atomic(path, flag, write):
    """write(tmp) beside `path`, then rename it onto `path`: a failed or interrupted write leaves
    no partial file (the temporary name keeps the extension, which matplotlib reads the format from)."""
    folder, name = os.path.split(path)
    stem, ext = os.path.splitext(name)
    tmp = os.path.join(folder, f".{stem[:200]}.tmp{ext[:20]}")   # a name the file system takes too
    try:
        write(tmp)
        os.replace(tmp, path)
    except (OSError, ValueError) as e:    # ValueError: a file format matplotlib cannot write
        raise UserError(f"cannot write {flag} {path}: {getattr(e, 'strerror', None) or e}") from None
    finally:
        if os.path.lexists(tmp):
            os.remove(tmp)


def plot_format(path):
    """The image format matplotlib writes for `path`: its extension, png without one."""
    return os.path.splitext(path)[1][1:].lower() or 'png'


def plot_formats():
    """The file formats matplotlib writes; UserError where it is not installed."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise UserError("--entropy-plot needs matplotlib: pip install matplotlib") from None
    return FigureCanvasBase.get_supported_filetypes()


def check_outputs(args):
    """Refuse, before generating, a plot matplotlib could not write (the paths were checked at parse)."""
    if args.entropy_plot:
        formats = plot_formats()
        if plot_format(args.entropy_plot) not in formats:
            raise UserError(f"--entropy-plot {args.entropy_plot}: matplotlib writes no "
                            f".{plot_format(args.entropy_plot)} files; use one of {', '.join(sorted(formats))}")


def read_model(args):
    """--ckpt → (model on args.device, checkpoint dict); one line naming the file where it cannot be."""
    path = os.path.join(args.ckpt, 'ckpt.pt') if os.path.isdir(args.ckpt) else args.ckpt
    check_path(path, 'file', '--ckpt')
    try:
        return load_checkpoint(path, args.device, trust=args.trust_ckpt)
    except UserError as e:   # name this script's flag for the one refusal it can lift
        raise UserError(f'{e} (--trust-ckpt)' if 'safe loading' in str(e) else str(e)) from None


def prompt_ids(prompt, vocab):
    """The prompt, cleaned as the training text was (one line on stderr where that changed it) → ids."""
    text, how = clean_prompt(prompt, vocab)
    if text != prompt:
        print(f"prompt cleaned ({how}): {json.dumps(prompt, ensure_ascii=False)} -> "
              f"{json.dumps(text, ensure_ascii=False)}", file=sys.stderr)
    ids = encode(text, list(vocab['alphabet']))
    return ids or [vocab.get('space_id') or 0]


def generate(args, model, ids, n_valid, path):
    """Sample args.num_samples continuations → (tokens, boundaries or None, entropy) as lists."""
    x = torch.tensor([ids], dtype=torch.long, device=args.device).repeat(args.num_samples, 1)
    torch.manual_seed(args.seed)
    gen = torch.Generator(device=args.device).manual_seed(args.seed)
    greedy = args.greedy or args.temperature == 0
    damaged = UserError(f"the model's predictions are not finite (NaN or inf): checkpoint {path} "
                        f"holds damaged weights")
    try:
        tokens, boundaries, entropy = sample(model, x, args.chars, temperature=args.temperature,
                                             top_k=args.top_k, greedy=greedy, generator=gen, n_valid=n_valid)
    except RuntimeError as e:   # sampling from NaN probabilities (greedy ones surface in the entropy)
        if 'probability tensor' in str(e):
            raise damaged from None
        raise
    if not torch.isfinite(entropy).all():
        raise damaged
    return tokens.tolist(), None if boundaries is None else boundaries.tolist(), entropy.tolist()


def print_samples(args, texts, boundaries, prompt_len, stdout):
    """The samples on stdout (segments marked with --show-segments), their segment counts on stderr."""
    colour = args.color and stdout.isatty()
    for i, text in enumerate(texts):
        if i:
            stdout.write('-' * 40 + '\n')
        row_b = None if boundaries is None else boundaries[i]
        if not args.show_segments:
            stdout.write(text + '\n')
            continue
        stdout.write(show_segments(text, row_b, args.separator, colour, prompt_len) + '\n')
        if row_b is not None:
            print(('segments: ' if len(texts) == 1 else f'segments of sample {i + 1}: ')
                  + segment_summary(text, row_b, prompt_len), file=sys.stderr)


def write_trace(args, texts, entropy, boundaries, stdout, written):
    """--entropy-trace: the TSV to stdout, or to its file (written whole)."""
    tsv = ''.join((f"# sample {i}\n" if len(texts) > 1 else '')
                  + entropy_trace(t, entropy[i], None if boundaries is None else boundaries[i])
                  for i, t in enumerate(texts))
    if args.entropy_trace == '-':
        stdout.write(tsv)
        return

    def write_tsv(tmp):
        with open(tmp, 'w', encoding='utf-8') as f:
            f.write(tsv)
    write_atomic(args.entropy_trace, '--entropy-trace', write_tsv)
    written.append(args.entropy_trace)


def run(args, stdout=None, written=None):
    """Generate and print; `written` collects the files completed so far."""
    stdout = stdout or sys.stdout
    written = [] if written is None else written
    check_outputs(args)
    torch.set_num_threads(args.threads)
    model, ckpt = read_model(args)
    alphabet = list(ckpt['vocab']['alphabet'])
    ids = prompt_ids(args.prompt, ckpt['vocab'])
    check_request(model.cfg, args.num_samples, len(ids), args.chars, args.device)
    tokens, boundaries, entropy = generate(args, model, ids, len(alphabet), ckpt['path'])
    texts = [decode_ids(row, alphabet) for row in tokens]

    if args.show_segments and boundaries is None:
        print("note: this checkpoint is vanilla (boundary 'none'): it has no segments to show", file=sys.stderr)
    for what, mark in (('separator', args.separator), ('prompt mark', PROMPT_MARK)):
        if args.show_segments and any(c in alphabet for c in mark) and not (args.color and stdout.isatty()):
            print(f"note: the {what} {mark!r} is in the alphabet" + ('; pick another with --separator'
                  if what == 'separator' else ''), file=sys.stderr)
    if args.entropy_trace is not None:
        write_trace(args, texts, entropy, boundaries, stdout, written)
    if args.entropy_trace != '-':
        print_samples(args, texts, boundaries, len(ids), stdout)
    if args.entropy_plot:
        run_dir = os.path.abspath(args.ckpt if os.path.isdir(args.ckpt) else os.path.dirname(args.ckpt) or '.')
        title = f"{os.path.basename(run_dir)}: boundary={model.cfg.boundary}, next-character entropy"
        write_atomic(args.entropy_plot, '--entropy-plot', lambda tmp: entropy_plot(
            tmp, texts[0], entropy[0], None if boundaries is None else boundaries[0], title=title,
            prompt_len=len(ids), fmt=plot_format(args.entropy_plot)))
        written.append(args.entropy_plot)
        print(f"wrote {args.entropy_plot}", file=sys.stderr)
    stdout.flush()
    return texts, boundaries, entropy


def out_of_memory(e):
    """True for the errors torch and Python raise when an allocation fails."""
    return isinstance(e, (MemoryError, torch.OutOfMemoryError)) or (
        isinstance(e, RuntimeError) and ("can't allocate memory" in str(e) or 'out of memory' in str(e)))


def main(argv=None):
    args = parse_args(argv)
    written = []
    try:
        run(args, written=written)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        kept = f"kept the finished {', '.join(written)}" if written else "no file written"
        print(f"error: interrupted (Ctrl-C); {kept}", file=sys.stderr)
        return 130
    except (MemoryError, RuntimeError) as e:
        if not out_of_memory(e):
            raise
        print(f"error: out of memory generating {args.num_samples} sample(s) of {args.chars} characters: "
              f"ask for fewer --chars or --num-samples", file=sys.stderr)
        return 1
    return 0


if __name__ == '__main__':
    sys.exit(main())
