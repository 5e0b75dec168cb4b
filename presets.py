"""train.py's flags and the presets that fill their defaults: the paper's GPU recipe and a small
CPU one, the flag table, argument parsing with --resume's rules, and the model Config the flags
build. Its own module so that bench.py and study.sh read the same rules without importing
train.py."""
import argparse
import dataclasses
from pathlib import Path

import common
import hnet  # noqa: F401  (registers boundary='hnet' before BOUNDARY_MODES is read)
import runtime as rt
from checkpoint import config_from_dict, read_checkpoint
from common import (UserError, float_range, fraction, int_range, nonblank, non_negative_float,
                    non_negative_int, positive_float, positive_int, probability, seed_int)
from dataset import dataset_defaults
from dynpool import BOUNDARY_MODES, Config, step_flops

DESCRIPTION = ('Train a dynamic-pooling Transformer (Nawrot et al., ACL 2023), '
               'a character-level LM.')

# The paper's recipe (appendix) for a GPU: batch 8 x 2048 chars, Adam 2.5e-4, 4k warm-up steps,
# one cosine cycle over 200k, grad clip 0.25, dropout 0.1; bf16 (fp16 and loss scaling without it).
GPU_PRESET = dict(d_model=512, n_head=8, d_head=64, d_inner=2048, layers='2,8,2', dropout=0.1,
                  dropatt=0.1, batch_size=8, seq_len=2048, lr=2.5e-4, warmup=4000,
                  max_steps=200_000, eval_interval=5000, eval_window=2048, eval_step=512,
                  eval_subset_chars=300_000, eval_max_chars=0, eval_batch_size=64, log_interval=100)
# A small model for 2 CPU cores that learns in a few hundred steps, which never see a character
# twice (so no dropout); the eval window keeps the 4:1 window:step ratio.
CPU_PRESET = dict(d_model=128, n_head=2, d_head=64, d_inner=512, layers='1,4,1', dropout=0.0,
                  dropatt=0.0, batch_size=4, seq_len=512, lr=1e-3, warmup=50, max_steps=300,
                  eval_interval=100, eval_window=512, eval_step=128, eval_subset_chars=20_000,
                  eval_max_chars=0, eval_batch_size=8, log_interval=10)
COMMON = dict(data='data/text8', boundary='entropy', grad_accum=1, grad_clip=0.25, seed=1337,
              amp='auto', compile=False, attention='auto', tensorboard=False)
# Flags whose default is the model's (the Gumbel prior: the dataset's, where meta.json has one).
MODEL_FLAGS = ('fixed_factor', 'temperature', 'prior', 'entropy_window', 'ratio_target',
               'ratio_weight', 'double_sigmoid', 'pooling')
MODEL_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Config)}
# Flags that define the model or the data order: a resumed run must keep them.
KEPT_ON_RESUME = ('boundary', 'unigram', 'd_model', 'n_head', 'd_head', 'd_inner', 'layers',
                  'dropout', 'dropatt', 'seq_len', 'batch_size', 'seed') + MODEL_FLAGS
# Flags of this invocation only: a resumed run does not take them from the checkpoint.
NOT_RESUMED = ('resume', 'device', 'stop_step', 'max_time')


def layer_counts(s):
    """Argument type: pre,shortened,post layer counts like 2,8,2 (each 0 to 1000)."""
    counts = str(s).split(',')
    if len(counts) != 3 or not all(n.strip().isdigit() and int(n) <= 1000 for n in counts):
        raise argparse.ArgumentTypeError(f'must be three counts like 2,8,2 (each 0 to 1000), '
                                         f'got {s!r}')
    return ','.join(str(int(n)) for n in counts)


def flop_budget(s):
    """Argument type: FLOPs, or vanilla:N (N vanilla steps of the run's shape: model_config)."""
    s = str(s).strip()
    return f'vanilla:{positive_int(s[8:])}' if s.startswith('vanilla:') else positive_float(s)


FLAGS = [  # (flag, type or choices, help); --help adds the default where it does not say it
    ('--data', nonblank, 'dataset directory written by prepare_data.py'),
    ('--boundary', BOUNDARY_MODES, 'where segments end (none: a vanilla Transformer)'),
    ('--out', nonblank, 'run directory: ckpt.pt, log.jsonl (default out/<dataset>-<boundary>)'),
    ('--resume', None, 'continue the run in --out from its checkpoint'),
    ('--device', nonblank, 'cpu, cuda, cuda:1 or mps; sets the preset (default cuda if any)'),
    ('--seed', seed_int, 'seed of initialisation, data order and dropout'),
    ('--d-model', positive_int, 'model width'),
    ('--n-head', positive_int, 'attention heads'),
    ('--d-head', positive_int, 'width of one head'),
    ('--d-inner', positive_int, 'feed-forward width'),
    ('--layers', layer_counts, 'pre,shortened,post layer counts (vanilla: all at full length)'),
    ('--dropout', fraction, 'dropout'),
    ('--dropatt', fraction, 'attention dropout'),
    ('--pooling', ('mean', 'last'), "a segment's mean, or its last token (Table 2's sub-sampling)"),
    ('--fixed-factor', int_range(1, 2**20), 'fixed: segment length k'),
    ('--temperature', positive_float, 'gumbel: Gumbel-sigmoid temperature'),
    ('--prior', probability, "gumbel: prior boundary rate (default the dataset's, else 0.2)"),
    ('--entropy-window', int_range(1, 2**20), 'entropy: k of the spike rule'),
    ('--unigram', positive_int, "unigram: the label set of V pieces (default the dataset's)"),
    ('--double-sigmoid', None, "unigram/entropy: the released code's loss, BCE of sigmoid(logit)"),
    ('--ratio-target', float_range(1, lo_open=True), 'hnet: target compression of the ratio loss'),
    ('--ratio-weight', non_negative_float, 'hnet: weight of the ratio loss'),
    ('--attention', ('auto', 'sdpa', 'blocked'), 'attention kernels, speed only'),
    ('--batch-size', positive_int, 'global batch: sequences a step over processes, --grad-accum'),
    ('--seq-len', positive_int, 'training sequence length in characters'),
    ('--grad-accum', positive_int, 'micro-steps per optimizer step'),
    ('--max-steps', positive_int, 'optimizer steps; the cosine ends here'),
    ('--flop-budget', flop_budget, 'FLOPs to train, or vanilla:N: those of N vanilla steps'),
    ('--stop-step', positive_int, 'save and exit here, unfinished, for --resume (default none)'),
    ('--max-time', positive_float, 'seconds to train, then save and exit (default none)'),
    ('--lr', positive_float, 'peak learning rate'),
    ('--warmup', non_negative_int, 'linear warm-up steps before the cosine'),
    ('--grad-clip', non_negative_float, 'gradient norm clip, 0 = off'),
    ('--amp', ('auto', 'bf16', 'fp16', 'off'), 'auto: bf16 where the GPU has it, else fp16'),
    ('--compile', None, 'torch.compile the model for training'),
    ('--eval-interval', positive_int, 'validate and save every N steps'),
    ('--eval-window', positive_int, 'evaluation window in characters'),
    ('--eval-step', positive_int, 'each window scores its last N characters'),
    ('--eval-subset-chars', non_negative_int, 'validate on the first N chars in training, 0 = all'),
    ('--eval-max-chars', non_negative_int, 'cap the final validation and test at N chars, 0 = all'),
    ('--eval-batch-size', positive_int, 'windows per evaluation batch'),
    ('--log-interval', positive_int, 'a train record every N steps'),
    ('--tensorboard', None, 'also log to TensorBoard in <out>/tensorboard (needs tensorboard)'),
    ('--wandb', nonblank, 'also log to this Weights & Biases project (needs wandb; default off)'),
]


def parser():
    """FLAGS as argparse (a switch is None when not given: a resumed run can tell)."""
    p = common.Parser(prog='train.py', description=DESCRIPTION)
    for flag, kind, words in FLAGS:
        k = flag[2:].replace('-', '_')
        v = {**MODEL_DEFAULTS, **GPU_PRESET, **COMMON}.get(k, False)
        default = (f'default GPU {v}, CPU {CPU_PRESET[k]}' if v != CPU_PRESET.get(k, v)
                   else f'default {"off" if v is False else v}')
        how = (dict(action='store_true', default=None) if kind is None else
               {'choices' if isinstance(kind, tuple) else 'type': kind})
        p.add_argument(flag, help=words if 'default' in words else f'{words} ({default})', **how)
    return p


def resolve_args(argv, procs=rt.Processes()):
    """Flags → (args filled in: given, --resume's checkpoint's, defaults; checkpoint or None)."""
    args = parser().parse_args(argv)
    given = {k for k, v in vars(args).items() if v is not None}
    device = rt.pick_device(args.device, procs.local_rank if procs.world > 1 else None)
    data = args.data or COMMON['data']
    out = Path(args.out or f'out/{Path(data).name}-{args.boundary or COMMON["boundary"]}')
    ckpt, taken = None, {}
    if args.resume:
        ckpt = read_checkpoint(out / 'ckpt.pt')
        if {'args', 'optimizer', 'scaler', 'rng', 'epoch', 'pos'} - ckpt.keys():
            raise UserError(f'{out / "ckpt.pt"} lacks the training state to resume from')
        for k in sorted(given & set(KEPT_ON_RESUME)):
            if getattr(args, k) != ckpt['args'].get(k):
                raise UserError(f'--{k.replace("_", "-")} differs from the checkpoint\'s '
                                f'{ckpt["args"].get(k)}: a resumed run keeps it', code=2)
        taken = {k: v for k, v in ckpt['args'].items() if k not in given | set(NOT_RESUMED)}
    elif (out / 'ckpt.pt').exists():
        raise UserError(f'{out / "ckpt.pt"} exists: --resume it or choose another --out')
    vars(args).update({**taken, 'out': str(out), 'device': device})
    defaults = {**COMMON, **(GPU_PRESET if device.startswith('cuda') else CPU_PRESET),
                **({'max_steps': 10**9} if args.flop_budget is not None else {}),  # budget ends it
                **{k: MODEL_DEFAULTS[k] for k in MODEL_FLAGS},
                **dataset_defaults(args.data or COMMON['data'], MODEL_FLAGS)}
    vars(args).update({k: v for k, v in defaults.items() if getattr(args, k, None) is None})
    return args, ckpt


def model_config(args, meta, world=1):
    """The rules between flags, the model's Config; --flop-budget vanilla:N becomes FLOPs."""
    if args.eval_step > args.eval_window:
        raise UserError(f'--eval-step {args.eval_step} > --eval-window {args.eval_window}: '
                        'characters between windows would never be scored', code=2)
    if args.batch_size % (world * args.grad_accum):
        raise UserError(f'--batch-size {args.batch_size} does not split over {world} process(es) '
                        f'x --grad-accum {args.grad_accum}', code=2)
    cfg = config_from_dict({k: getattr(args, k) for k in MODEL_FLAGS + (
        'd_model', 'n_head', 'd_head', 'd_inner', 'dropout', 'dropatt', 'boundary', 'attention')},
        vocab_size=meta['vocab_size'], whitespace_id=meta.get('space_id'),
        layers=tuple(int(n) for n in args.layers.split(',')))
    if args.flop_budget is not None:
        args.flop_budget = budget_flops(args.flop_budget, cfg, args.batch_size, args.seq_len)
    return cfg


def budget_flops(budget, cfg, batch_size, seq_len):
    """--flop-budget as FLOPs: a number as it is, vanilla:N as N steps of cfg's shape unpooled."""
    if not isinstance(budget, str):
        return budget
    return int(budget[8:]) * step_flops(dataclasses.replace(cfg, boundary='none'), batch_size,
                                        seq_len)
