"""The command line: the flags every script shares, each defined once (add_*_flag(s):
train.py, sample.py and bench.py call them), train.py's flags and the presets that fill
their defaults (the paper's GPU recipe and a small CPU one), --resume's rules, --import of
a user's boundary source, and the model Config built from them (model_config). Its own
module so that bench.py and study.py read the same rules without importing train.py."""
import argparse
import contextlib
import dataclasses
import importlib.util
import io
import math
import os
import sys
import uuid
from pathlib import Path

import common
import dynpool
import hnet  # noqa: F401  (registers the project's seventh source, 'hnet')
import runtime as rt
from checkpoint import config_from_dict, import_identity, read_checkpoint
from common import (UserError, first_line, fraction, int_range, nonblank, non_negative_float,
                    non_negative_int, positive_float, positive_int, probability, seed_int)
from dataset import dataset_defaults
from dynpool import Config, step_flops

# The model's shape: Config()'s defaults are the paper's (appendix, ~41M parameters).
SHAPE = ('d_model', 'n_head', 'd_head', 'd_inner', 'layers', 'dropout', 'dropatt')
# The paper's recipe (appendix) for a GPU: its model, batch 8 x 2048 chars, Adam 2.5e-4,
# 4k warm-up steps, one cosine cycle over 200k, grad clip 0.25; bf16 (fp16 and loss
# scaling without it). It saves every 30 minutes of training besides every evaluation: a
# preemption loses little.
GPU_PRESET = dict({k: getattr(Config(), k) for k in SHAPE}, batch_size=8, seq_len=2048,
                  lr=2.5e-4, warmup=4000, max_steps=200_000, eval_interval=5000,
                  save_interval='30m', eval_window=2048, eval_step=512,
                  eval_subset_chars=300_000, eval_max_chars=0, eval_batch_size=64,
                  log_interval=100)
# A small model for 2 CPU cores that learns in a few hundred steps, which never see a
# character twice (so no dropout); the eval window keeps the 4:1 window:step ratio.
CPU_PRESET = dict(d_model=128, n_head=2, d_head=64, d_inner=512, layers=(1, 4, 1),
                  dropout=0.0, dropatt=0.0, batch_size=4, seq_len=512, lr=1e-3, warmup=50,
                  max_steps=300, eval_interval=100, save_interval=None, eval_window=512,
                  eval_step=128, eval_subset_chars=20_000, eval_max_chars=0,
                  eval_batch_size=8, log_interval=10)
COMMON = dict(data='data/text8', boundary='entropy', grad_accum=1, grad_clip=0.25,
              seed=1337, amp='auto', compile=False, attention='auto', eval_protocol='whole')
# Flags that define the model or the data order: a resumed run must keep them, and those
# of model_defaults().
KEPT_ON_RESUME = ('boundary', 'unigram', *SHAPE, 'seq_len', 'batch_size', 'seed')
# Flags of this invocation only: a resumed run does not take them from the checkpoint.
NOT_RESUMED = ('resume', 'device', 'stop_step', 'max_time', 'threads')
# A switch is None when not given: a resumed run can tell.
SWITCH = dict(action='store_true', default=None)


def import_sources(argv):
    """Import every `--import X` (or `--import=X`) of the command line argv, in order, so
    that the boundary sources it registers (dynpool.register_source) join --boundary and
    their Options fields become flags → the imports as a checkpoint records them
    (checkpoint.import_identity: X, a file by its absolute path, and its content's
    SHA-256). A script calls it before it builds its parser. One UserError line (exit 2)
    naming X where X does not import or registers a name already taken (a built-in name,
    or an earlier import's, would train and later sample as the other: register_source
    refuses it, and run_import makes that one line)."""
    p = common.Parser(add_help=False)
    add_import_flag(p)
    imported = []
    for name in p.parse_known_args(argv)[0].imports or []:
        if name.endswith('.py') or '/' in name:
            name = str(Path(name).resolve())
        run_import(name)
        imported.append(import_identity(name))
    return imported


def run_import(name):
    """Import the file (its absolute path: a name with a '/') or module `name` as a
    plug-in, contained: it sees a sys.argv of its own name alone, its file's folder is
    importable while it imports (a helper beside it), and whatever it raises or exits with
    is one UserError line (exit 2) naming the --import. A file this process imported
    already (a flag given twice, bench.py's child run in-process) is not run again."""
    if getattr(sys.modules.get(Path(name).stem), '__file__', None) == name:
        return
    argv = sys.argv
    path = list(sys.path)
    said = io.StringIO()
    sys.argv = [name]
    try:
        with contextlib.redirect_stderr(said):
            if '/' in name:
                sys.path.insert(0, str(Path(name).parent))
                spec = importlib.util.spec_from_file_location(Path(name).stem, name)
                module = importlib.util.module_from_spec(spec)
                # (registered first, as an import does: dataclasses look their module up)
                sys.modules[spec.name] = module
                spec.loader.exec_module(module)
            else:
                importlib.import_module(name)
    except (Exception, SystemExit) as e:
        why = first_line(e)
        # its own last words (argparse's "error: ..." line), else sys.exit's, say why
        if isinstance(e, SystemExit):
            last = (said.getvalue().strip().splitlines() or [str(e.code)])[-1]
            why = f'it exited while imported: {last}'
        raise UserError(f'--import {name}: {why}', code=2) from None
    finally:
        sys.argv = argv
        sys.path[:] = path
    sys.stderr.write(said.getvalue())


def add_import_flag(p):
    """--import (dest imports, a list): import_sources reads it before the parser is built."""
    p.add_argument('--import', dest='imports', action='append', metavar='FILE_OR_MODULE',
                   help='a file (.py) or module that registers a boundary source '
                   '(dynpool.register_source); repeatable (default none)')


def add_device_flag(p):
    """--device (runtime.pick_device resolves it) and --threads (runtime.cpu_threads)."""
    p.add_argument('--device', type=nonblank,
                   help='cpu, cuda, cuda:N or mps (default cuda if any; train.py: it also '
                   'picks the preset)')
    p.add_argument('--threads', type=int_range(1, os.cpu_count() or 1),
                   help='CPU threads (default OMP_NUM_THREADS, else half the CPUs)')


def add_amp_flag(p):
    """--amp (runtime.setup_precision resolves it; None when not given)."""
    p.add_argument('--amp', choices=('auto', 'bf16', 'fp16', 'off'),
                   help='autocast: auto is bf16 where the GPU has it, else fp16')


def add_size_flags(p):
    """The flags of the model's shape (SHAPE; None when not given: Config's defaults are
    the paper's)."""
    p.add_argument('--d-model', type=positive_int, help='model width')
    p.add_argument('--n-head', type=positive_int, help='attention heads')
    p.add_argument('--d-head', type=positive_int, help='width of one head')
    p.add_argument('--d-inner', type=positive_int, help='feed-forward width')
    p.add_argument('--layers', type=layer_counts,
                   help='pre,shortened,post layer counts (vanilla: all at full length)')
    p.add_argument('--dropout', type=fraction, help='dropout')
    p.add_argument('--dropatt', type=fraction, help='attention dropout')


def option_fields():
    """{field name: (source name, its dataclasses.Field)} of every registered source's
    Options (a name two sources share: the first's)."""
    found = {}
    for mode, source in dynpool.SOURCES.items():
        if source.Options is not None:
            for field in dataclasses.fields(source.Options):
                found.setdefault(field.name, (mode, field))
    return found


def model_defaults():
    """{name: default} of the model's flags that no preset sets (add_model_flags: the
    paper's sources' Config fields and every registered source's Options fields), read
    now: after import_sources."""
    p = argparse.ArgumentParser()
    add_model_flags(p)
    defaults = dataclasses.asdict(Config())
    defaults.update({name: field.default for name, (_, field) in option_fields().items()})
    return {a.dest: defaults[a.dest] for a in p._actions if a.dest in defaults}


# Argument type of a source's float option: a number, inf too (the default some options
# have), not nan; the source's check_config judges its range.
any_number = common.number_range(float, 'a number', -math.inf, math.inf)


# How a source's Options field is a flag, by its type's name: a number, text or a switch
# (a tuple, a list: set in code, not by a flag)
OPTION_FLAGS = {'bool': dict(action=argparse.BooleanOptionalAction), 'int': dict(type=int),
                'float': dict(type=any_number), 'str': dict(type=str)}


def layer_counts(value):
    """Argument type: pre,shortened,post layer counts like 2,8,2 (each 0 to 1000) → a
    tuple of three ints."""
    counts = value.split(',')
    if len(counts) != 3 or not all(n.strip().isdigit() and int(n) <= 1000 for n in counts):
        raise argparse.ArgumentTypeError(f'must be three counts like 2,8,2 (each 0 to 1000), '
                                         f'got {value!r}')
    return tuple(int(n) for n in counts)


def flop_budget(s):
    """Argument type: FLOPs, or vanilla:N (N vanilla steps of the run's shape:
    budget_flops)."""
    s = s.strip()
    if s.startswith('vanilla:'):
        return f'vanilla:{positive_int(s[8:])}'
    return positive_float(s)


def save_schedule(save_interval):
    """--save-interval, a checkpoint every N steps ('500') or every N minutes of training
    ('30m') → (every N steps, every N seconds of training); None: not so. Its argument
    type too (ArgumentTypeError where it is neither)."""
    if not save_interval:
        return None, None
    if save_interval.endswith('m'):
        return None, 60 * positive_float(save_interval[:-1])
    return positive_int(save_interval), None


def save_interval(s):
    """Argument type: save_schedule's text → the text (flags stay plain values)."""
    s = s.strip()
    save_schedule(s)
    return s


def parser():
    """train.py's flags (a switch is None when not given: a resumed run can tell); each
    help ends with the flag's default, the presets' where they differ."""
    p = common.Parser(prog='train.py', description='Train a dynamic-pooling Transformer (Nawrot '
                      'et al., ACL 2023), a character-level LM.')
    p.add_argument('--data', type=nonblank,
                   help='dataset directory written by prepare_data.py')
    p.add_argument('--boundary', choices=dynpool.BOUNDARY_MODES,
                   help='where segments end (none: a vanilla Transformer)')
    add_import_flag(p)
    p.add_argument('--out', type=nonblank,
                   help='run directory: ckpt.pt, log.jsonl (default out/<dataset>-<boundary>)')
    p.add_argument('--resume', **SWITCH,
                   help='continue the run in --out from its checkpoint')
    add_device_flag(p)
    p.add_argument('--seed', type=seed_int,
                   help='seed of initialisation, data order and dropout')
    add_size_flags(p)
    add_model_flags(p)
    add_schedule_flags(p)
    add_amp_flag(p)
    model = model_defaults()
    for action in p._actions:
        if action.dest != 'help' and 'default' not in action.help:
            gpu = show({**COMMON, **model, **GPU_PRESET}.get(action.dest))
            cpu = show({**COMMON, **model, **CPU_PRESET}.get(action.dest))
            both = f'GPU {gpu}, CPU {cpu}' if gpu != cpu else gpu
            action.help += f' (default {both})'
    return p


def add_model_flags(p):
    """The flags of the model and its boundary source; a flag for each field of a
    registered source's Options of a number, text or switch type (hnet's ratio_target:
    --ratio-target), which takes the field's default and leaves its range to the source's
    check_config."""
    p.add_argument('--pooling', choices=('mean', 'last'),
                   help="a segment's mean, or its last token (Table 2's sub-sampling)")
    p.add_argument('--fixed-factor', type=int_range(1, 2**20),
                   help='fixed: segment length k')
    p.add_argument('--temperature', type=positive_float,
                   help='gumbel: Gumbel-sigmoid temperature')
    p.add_argument('--prior', type=probability,
                   help="gumbel: prior boundary rate (default the dataset's, else 0.2)")
    p.add_argument('--entropy-window', type=int_range(1, 2**20),
                   help='entropy: k of the spike rule')
    p.add_argument('--unigram', type=positive_int,
                   help="unigram: the label set of V pieces (default the dataset's)")
    p.add_argument('--double-sigmoid', **SWITCH,
                   help="unigram/entropy: the released code's loss, BCE of sigmoid(logit)")
    p.add_argument('--attention', choices=('auto', 'sdpa', 'blocked'),
                   help='attention kernels, speed only')
    for name, (mode, field) in option_fields().items():
        flag = f'--{name.replace("_", "-")}'
        # the annotation's type (a float field may default to an int), else the default's
        annotation = getattr(field.type, '__name__', field.type)
        how = OPTION_FLAGS.get(annotation) or OPTION_FLAGS.get(type(field.default).__name__)
        if how is not None and flag not in p._option_string_actions:
            p.add_argument(flag, **how, help=f'{mode}: its option {name}')


def add_schedule_flags(p):
    """The flags of the batch, the schedule, evaluation and logging."""
    p.add_argument('--batch-size', type=positive_int,
                   help='global batch: sequences a step over processes, --grad-accum')
    p.add_argument('--seq-len', type=positive_int,
                   help='training sequence length in characters')
    p.add_argument('--grad-accum', type=positive_int,
                   help='micro-steps per optimizer step')
    p.add_argument('--max-steps', type=positive_int,
                   help='optimizer steps; the cosine ends here')
    p.add_argument('--flop-budget', type=flop_budget,
                   help='FLOPs to train, or vanilla:N: those of N vanilla steps')
    p.add_argument('--stop-step', type=positive_int,
                   help='save and exit here, unfinished, for --resume (default none)')
    p.add_argument('--max-time', type=positive_float,
                   help='seconds to train, then save and exit (default none)')
    p.add_argument('--lr', type=positive_float, help='peak learning rate')
    p.add_argument('--warmup', type=non_negative_int,
                   help='linear warm-up steps before the cosine')
    p.add_argument('--grad-clip', type=non_negative_float,
                   help='gradient norm clip, 0 = off')
    p.add_argument('--compile', **SWITCH, help='torch.compile the model for training')
    p.add_argument('--eval-interval', type=positive_int,
                   help='validate and save every N steps')
    p.add_argument('--save-interval', type=save_interval,
                   help='also save every N steps (500) or N minutes of training (30m)')
    p.add_argument('--eval-window', type=positive_int,
                   help='evaluation window in characters')
    p.add_argument('--eval-step', type=positive_int,
                   help='each window scores its last N characters')
    p.add_argument('--eval-subset-chars', type=non_negative_int,
                   help='validate on the first N chars in training, 0 = all')
    p.add_argument('--eval-max-chars', type=non_negative_int,
                   help='cap the final validation and test at N chars, 0 = all')
    p.add_argument('--eval-batch-size', type=positive_int,
                   help='windows per evaluation batch')
    p.add_argument('--eval-protocol', choices=('whole', 'released'),
                   help="every target once in one stream, or the released code's 500 "
                   'batches of 16 columns')
    p.add_argument('--log-interval', type=positive_int,
                   help='a train record every N steps')


def show(value):
    """A default as --help writes it: off for a switch or none, 2,8,2 for layers."""
    if value is False or value is None:
        return 'off'
    if isinstance(value, tuple):
        return ','.join(map(str, value))
    return str(value)


def resolve_args(argv, procs=rt.Processes()):
    """Flags → (args filled in: given, --resume's checkpoint's, defaults; checkpoint or
    None). The --import files are imported first (import_sources; args.imports)."""
    imports = import_sources(argv)
    args = parser().parse_args(argv)
    device = rt.pick_device(args.device, procs.local_rank if procs.world > 1 else None)
    data = args.data or COMMON['data']
    out = Path(args.out or f'out/{Path(data).name}-{args.boundary or COMMON["boundary"]}')
    saved_at = out / 'ckpt.pt'
    model = model_defaults()
    ckpt = None
    if args.resume:
        # the run folder's ckpt.pt (read_checkpoint takes a folder called so for a run's)
        ckpt = read_checkpoint(out if out.is_dir() else saved_at, resume=True)
        saved = ckpt['args']
        # a flag given (not None) that the run keeps must be the run's
        for k in sorted({*KEPT_ON_RESUME, *model}):
            if getattr(args, k) not in (None, saved.get(k)):
                raise UserError(f'--{k.replace("_", "-")} differs from the checkpoint\'s '
                                f'{show(saved.get(k))}: a resumed run keeps it', code=2)
        fill(args, {k: v for k, v in saved.items() if k not in NOT_RESUMED})
    elif saved_at.exists():
        # (a folder or another file in its place is no checkpoint to resume)
        what = 'exists: --resume it'
        if not saved_at.is_file():
            what = 'is not a checkpoint file: remove it'
        raise UserError(f'{saved_at} {what} or choose another --out')
    vars(args).update(out=str(out), device=device, imports=imports)
    preset = CPU_PRESET
    if device.startswith('cuda'):
        preset = GPU_PRESET
    # Every flag not given nor resumed: the preset's, the model's, the dataset's. With a
    # FLOP budget, the budget ends the run (run() turns it into FLOPs); --max-steps is
    # only a cap.
    defaults = {**COMMON, **model, **preset, **dataset_defaults(data, model),
                'run_id': uuid.uuid4().hex}
    if args.flop_budget is not None:
        defaults['max_steps'] = 10**9
    fill(args, defaults)
    return args, ckpt


def fill(args, values):
    """Set each of `values` on args where args holds None (a flag not given) or lacks it."""
    for k, v in values.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)


def model_config(args, meta, world=1):
    """The rules between flags, and the model's Config they build."""
    if args.eval_step > args.eval_window:
        raise UserError(f'--eval-step {args.eval_step} > --eval-window {args.eval_window}: '
                        'characters between windows would never be scored', code=2)
    if args.batch_size % (world * args.grad_accum):
        raise UserError(f'--batch-size {args.batch_size} does not split over {world} process(es) '
                        f'x --grad-accum {args.grad_accum}', code=2)
    # (the flags that are not Config's fields are left out)
    return config_from_dict(vars(args), vocab_size=meta['vocab_size'],
                            whitespace_id=meta.get('space_id'))


def budget_flops(budget, cfg, batch_size, seq_len):
    """--flop-budget as FLOPs: a number as it is, vanilla:N as N steps of cfg's shape
    unpooled."""
    if not isinstance(budget, str):
        return budget
    vanilla = dataclasses.replace(cfg, boundary='none', options={})   # (no source options)
    return int(budget[8:]) * step_flops(vanilla, batch_size, seq_len)
