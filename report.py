"""
Results of dynpool runs (train.py's log.jsonl in each run folder): tables of BPC, SF, speed and
cost, mean ± std over seeds with the paper's paired t-test, and plots; docs/results.md shows them.

    python report.py runs/study runs/other --at-chars 2M --at-flops min --plot study.png
"""
import argparse
import collections
import fcntl
import json
import math
import os
import stat
import statistics
import sys
import warnings
from pathlib import Path

import scipy.stats

import common
from common import UserError

# dynpool.BOUNDARY_MODES in its order (reading logs needs no torch); a mode's colour is C<rank>
MODES = ('none', 'fixed', 'whitespace', 'unigram', 'entropy', 'gumbel', 'hnet')
RANK = {m: i for i, m in enumerate(MODES)}
# Config fields that say nothing about the experiment: runs differing only in these are its seeds.
NOT_THE_EXPERIMENT = {'kind', 'seed', 'out', 'resume', 'resumed_from', 'stop_step', 'params',
                      'torch', 'device_name', 'world', 'preset', 'tensorboard', 'wandb'}
# The fields that choose the boundary source and its pooling (and hnet's ratio_*): all others
# (model shape, budget, training) and the dataset's name must match to pair a baseline's seeds.
SOURCE_FIELDS = {'boundary', 'pooling', 'fixed_factor', 'prior', 'temperature', 'entropy_window',
                 'unigram', 'double_sigmoid', 'threshold', 'whitespace_id', 'data'}
OWN_COLUMNS = {'boundary', 'fixed_factor', 'prior', 'pooling', 'data'}   # never in 'flags'
BUDGETS = (('chars', 'train_chars', 'characters'), ('flops', 'train_flops', 'FLOPs'),
           ('time', 'train_time', 'wall-clock seconds'))
# Fields read as numbers: train.py writes them >= 0 or null (NaN and inf: a diverged run's).
NUMBERS = ('step', 'bpc', 'sf', 'train_chars', 'train_flops', 'train_time', 'resumed_from',
           'seed', 'max_steps', 'flop_budget')
# The paper's Table 1 stars a source whose test BPC beats vanilla and fixed pooling, each by a
# paired Student's t-test over seeds at p < 0.05; two-sided, as the paper names no direction.
BASELINES, P_STAR = ('none', 'fixed'), 0.05
SIGNIFICANCE = ("p: two-sided paired Student's t-test of test BPC, paired by seed with the "
                "baseline's runs of the same dataset, budget and model shape (a source pooled by "
                "its last token: also with its mean-pooled runs); *: lower than "
                f"vanilla and every fixed k shown, p < {P_STAR} against each (the paper's Table 1)")


def find_runs(paths):
    """Each path holding log.jsonl (or being one), else every folder below it that holds one."""
    runs = []
    for p in map(Path, paths):
        p = p.parent if p.name == 'log.jsonl' and not p.is_dir() else p
        os.scandir(p).close()   # the OS names a path that is missing or no folder
        found = [p] if os.path.lexists(p / 'log.jsonl') else sorted(
            f.parent for f in p.rglob('log.jsonl'))
        if not found:
            raise UserError(f'{p} is not a run: no log.jsonl in it or below it (pass a folder '
                            f'written by train.py --out, or a folder of them)')
        runs += [r for r in found if r not in runs]
    return runs


def read_run(run):
    """(config, train records, eval records) of <run>/log.jsonl, less the records a resume redid.
    A last line cut short (a run writing it now) is left out with a note; any other damage is one
    error naming the line: no JSON object, or no number where NUMBERS expects one."""
    log = run / 'log.jsonl'
    fd = os.open(log, os.O_RDONLY | os.O_NONBLOCK)   # a FIFO would wait for a writer forever
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UserError(f'{log} is not a regular file, so no log written by train.py')
    with open(fd, 'rb') as f:
        lines = f.read().decode('utf-8', errors='replace').split('\n')
    config, logged = {}, {'train': [], 'eval': []}
    for i, line in enumerate(lines, 1):
        try:
            rec = json.loads(line) if line.strip() else {}
        except (ValueError, RecursionError):   # RecursionError: '[[[[...' nested too deep
            if i == len(lines):   # after the last line end: cut short
                print(f'note: {log}: skipped its last line {i}, cut short (a run killed while '
                      f'writing it, or writing it now)', file=sys.stderr)
                break
            rec = None
        if not isinstance(rec, dict):
            raise UserError(f'{log} line {i} is not a JSON object; not a log written by train.py')
        kind = rec.get('kind') if rec.get('kind') in ('config', 'train', 'eval') else None
        for k, v in ((k, rec.get(k)) for k in NUMBERS):
            number = type(v) is float and not v < 0 or \
                type(v) is int and 0 <= v <= sys.float_info.max   # float(v) would overflow
            if not number and (v is not None or k == 'step' and kind in ('train', 'eval')):
                raise UserError(f'{log} line {i}: {k} must be a number >= 0, not '
                                f'{json.dumps(v)[:40]}; not a log written by train.py')
        if kind == 'config':   # a restart: --resume redoes the steps after resumed_from; a run
            start = rec.get('resumed_from')   # without it starts over (no evaluation counts)
            logged = {k: [r for r in rs if r['step'] <= (start or 0) and (k == 'train' or start)]
                      for k, rs in logged.items()}
            config = rec
        elif kind:
            logged[kind].append(rec)
    return config, logged['train'], logged['eval']


def mode_label(cfg):
    """The source with its Pareto knob (k, α) and ' (last)' for last-token pooling (Table 2)."""
    b, last = str(cfg.get('boundary', '?')), ' (last)' * (cfg.get('pooling') == 'last')
    knob = {'fixed': ('k', 'fixed_factor'), 'gumbel': ('α', 'prior')}.get(b, ('', 'no knob'))
    return f'{b} {knob[0]}={cfg[knob[1]]}{last}' if cfg.get(knob[1]) is not None else b + last


def summarize(run):
    """One row of the runs table, with the validation curve of each budget."""
    cfg, train, evals = read_run(run)
    valid = [e for e in evals if e.get('split') == 'valid']
    test = [e for e in evals if e.get('split') == 'test']
    # The curve: the validations during training. Where they read a subset (--eval-subset-chars),
    # the final full-split validation measures other text, so it is only the table's valid BPC.
    curve = [e for e in valid if e.get('subset')] or valid
    last = max(train + evals, key=lambda r: r['step'], default={})
    t, status = train[-1] if train else {}, 'done' if test else 'stopped'
    try:   # running: train.py holds an exclusive flock on <run>/.lock, so a shared one is refused
        with open(run / '.lock') as f:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)   # dropped on close
    except BlockingIOError:
        status = 'done' if test else 'running'
    except OSError:   # no lock file: never started
        pass
    budget = cfg.get('flop_budget')   # train.py --flop-budget: max_steps is then out of reach
    return dict(run=run, config=cfg, mode=mode_label(cfg), boundary=str(cfg.get('boundary')),
                data=Path(str(cfg.get('data', '?'))).name, seed=cfg.get('seed'), status=status,
                steps=last.get('step', cfg.get('resumed_from') or 0), done=bool(test),
                max_steps=cfg.get('max_steps'), flop_budget=budget,
                budget=f'{fmt(budget, "flops")} FLOPs' if budget else
                f'{cfg.get("max_steps")} steps' if cfg.get('max_steps') else '-',
                curves={key: sorted((e[key], e['bpc']) for e in curve if e.get(key) is not None
                                    and e.get('bpc') is not None) for _, key, _ in BUDGETS},
                valid_bpc=valid[-1].get('bpc') if valid else None,
                valid_step=valid[-1]['step'] if valid else None,
                test_bpc=test[-1].get('bpc') if test else None,
                sf=(test or valid or [{}])[-1].get('sf'),
                chars_per_s=t['train_chars'] / t['train_time']
                if t.get('train_chars') and t.get('train_time') else None,
                **{key: last.get(key) for _, key, _ in BUDGETS})   # cumulative totals


def value_at(pts, budget, interp):
    """Valid BPC at a budget from sorted (budget, BPC) points: interpolated between the two around
    it (or the last at or before it); None where the run never got there."""
    before, after = [p for p in pts if p[0] <= budget][-1:], [p for p in pts if p[0] >= budget][:1]
    if not before or not after:
        return None
    (x0, y0), (x1, y1) = before[0], after[0]
    return y0 if not interp or x1 == x0 else y0 + (budget - x0) / (x1 - x0) * (y1 - y0)


def group_rows(rows, budgets):
    """One row per experiment (all that defines it but the seed), with (mean, std) over seeds:
    None where a seed lacks the value, std None for one seed, NaN where a value is not finite (a
    diverged seed: statistics.stdev cannot take it)."""
    groups = {}
    for r in rows:
        key = tuple(sorted((k, json.dumps(v, sort_keys=True)) for k, v in r['config'].items()
                           if k not in NOT_THE_EXPERIMENT))
        groups.setdefault((r['done'], key), []).append(dict(r, key=key))
    out = []
    for members in groups.values():
        steps = sorted({m['steps'] for m in members})
        out.append(dict(members[0], n=len(members), members=members,
                        seeds=','.join(str(m['seed']).replace('None', '-') for m in members),
                        steps=steps[0] if len(steps) == 1 else f'{steps[0]}-{steps[-1]}',
                        status='running' if any(m['status'] == 'running' for m in members)
                        else members[0]['status']))
        for k in ('train_chars', 'train_flops', 'train_time', 'valid_bpc', 'test_bpc', 'sf',
                  'chars_per_s') + tuple(f'at_{name}' for name, _ in budgets):
            v = [m.get(k) for m in members]
            finite = None not in v and all(math.isfinite(x) for x in v)
            std = None if len(v) == 1 else statistics.stdev(v) if finite else math.nan
            out[-1][k] = None if None in v else (statistics.fmean(v), std)
    return out


def significance(groups):
    """g['p'] {baseline: p or None} and g['star'] of each finished g, paired by seed with vanilla
    and each fixed k of its shape, and a pooling='last' g with its mean-pooled twin (the paper's
    Table 2) → notes on tests that left seeds out or had < 2 pairs (no p)."""
    def shape(g):
        return tuple(kv for kv in g['key'] if kv[0] not in SOURCE_FIELDS
                     and not kv[0].startswith('ratio_')) + (g['data'],)
    def mean_twin(g):   # Table 2: a sub-sampled source's own mean-pooled runs (no star)
        key = tuple(kv for kv in g['key'] if kv[0] != 'pooling')   # logs before it: no pooling
        return [t for t in groups if ('pooling', '"last"') in g['key']
                and tuple(kv for kv in t['key'] if kv != ('pooling', '"mean"')) == key]
    bases, notes = collections.defaultdict(list), []
    for g in (g for g in groups if g['boundary'] in BASELINES):
        bases[shape(g)].append(g)
    for g in groups:
        g['p'], better = {}, []
        for base in [b for b in bases[shape(g)] if b is not g] + mean_twin(g):
            a, b = ({m['seed']: m['test_bpc'] for m in x['members'] if m['seed'] is not None}
                    for x in (g, base))
            seeds, alone = sorted(a.keys() & b.keys()), sorted(a.keys() ^ b.keys())
            note = [f'seed {", ".join(map(str, alone))} run on one side only'] * bool(alone)
            if len(seeds) < 2:
                note.append(f'{len(seeds)} seed(s) on both sides, a paired t-test needs 2: no p')
            else:
                note = [n + ', left out' for n in note]
                with warnings.catch_warnings():   # equal differences: no spread, p NaN ('-')
                    warnings.simplefilter('ignore')
                    test = scipy.stats.ttest_rel([a[s] for s in seeds], [b[s] for s in seeds])
            p = g['p'][base['mode']] = float(test.pvalue) if len(seeds) > 1 else None
            if base['boundary'] in BASELINES:
                better.append(p is not None and p < P_STAR and test.statistic < 0)
            notes += [f'{g["mode"]} {g["flags"]}'.strip() + f' vs {base["mode"]} ({g["data"]}, '
                      f'{g["budget"]}): ' + '; '.join(note)] if note else []
        # the paper stars a source (not a baseline) that beats vanilla and fixed pooling alike
        g['star'] = (g['boundary'] not in BASELINES and all(better)
                     and any(b['boundary'] == 'none' for b in bases[shape(g)]))
    return notes


def fmt(v, kind):
    """A number as the tables show it: '-' where it is missing; (mean, std) as 'mean ± std'."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return '-'
    if isinstance(v, tuple):  # a std of exactly 0 (the same characters) says nothing
        quiet = v[1] is None or (v[1] == 0 and kind != 'bpc')
        return fmt(v[0], kind) + ('' if quiet else ' ± ' + fmt(v[1], kind))
    if kind in ('bpc', 'sf', 'flops', 'p'):
        return {'bpc': f'{v:.4f}', 'sf': f'{v:.2f}', 'flops': f'{v:.3g}'.replace('e+', 'e'),
                'p': '<0.001' if v < 0.001 else f'{v:.3f}'}[kind]
    return f'{v:.3g}' if kind == 'time' and v < 100 else f'{v:,.0f}'


def varying_flags(rows):
    """Per row, the other flags that differ between the rows ('-' where a log lacks one)."""
    cfgs, at_flops = [r['config'] for r in rows], any(r['flop_budget'] for r in rows)
    own = OWN_COLUMNS | NOT_THE_EXPERIMENT | ({'flop_budget', 'max_steps'} if at_flops else set())
    keys = [k for k in sorted(set().union(*cfgs) - own)
            if len({json.dumps(c.get(k, '-'), sort_keys=True) for c in cfgs}) > 1]
    return [' '.join(f'{k}={c.get(k, "-")}' for k in keys) for c in cfgs]


def columns(budgets, grouped, baselines=()):
    """(header, cell function) of the runs table, or of the seeds table (p column per baseline)."""
    cols = [] if grouped else [('run', lambda r: r['run'].as_posix())]
    cols += [('mode', lambda r: r['mode']), ('data', lambda r: r['data']),
             ('flags', lambda r: r['flags']), ('budget', lambda r: r['budget'])]
    cols += [('seeds', lambda r: r['seeds']), ('n', lambda r: str(r['n']))] if grouped else \
        [('seed', lambda r: str(r['seed']).replace('None', '-'))]
    cols += [('steps', lambda r: str(r['steps']) if r['done'] else f'{r["steps"]}'   # target
              f'{"" if r["flop_budget"] else "/" + str(r["max_steps"] or "?")} {r["status"]}'),
             ('train chars', lambda r: fmt(r['train_chars'], 'chars')),
             ('train FLOPs', lambda r: fmt(r['train_flops'], 'flops')),
             ('wall s', lambda r: fmt(r['train_time'], 'time')),
             ('valid BPC', lambda r: fmt(r['valid_bpc'], 'bpc') + (   # its step, if not the last
                 f' @{r["valid_step"]}' if not grouped and r['valid_step'] not in (None, r['steps'])
                 else '')),
             ('test BPC', lambda r: fmt(r['test_bpc'], 'bpc') + (' *' if r.get('star') else '')),
             ('SF', lambda r: fmt(r['sf'], 'sf')),
             ('chars/s', lambda r: fmt(r['chars_per_s'], 'cps'))]
    cols += [(f'p vs {b}', lambda r, b=b: fmt(r.get('p', {}).get(b), 'p')) for b in baselines]
    unit = dict(chars='chars', flops='FLOPs', time='s')   # short: a column head
    return cols + [(f'valid BPC @ {fmt(budget, name)} {unit[name]}',
                    lambda r, k=f'at_{name}': fmt(r[k], 'bpc')) for name, budget in budgets]


def table(rows, cols, markdown):
    """Aligned text or Markdown; 'flags' where they differ, 'budget' where a FLOP budget is."""
    cols = [c for c in cols if (c[0] != 'flags' or any(r['flags'] for r in rows))
            and (c[0] != 'budget' or any(r['flop_budget'] for r in rows))]
    heads, cells = [h for h, _ in cols], [[f(r) for _, f in cols] for r in rows]
    if markdown:
        lines = ['| ' + ' | '.join(heads) + ' |', '|' + '---|' * len(heads)]
        return '\n'.join(lines + ['| ' + ' | '.join(c) + ' |' for c in cells])
    widths = [max(len(x) for x in col) for col in zip(heads, *cells)]
    left = {'run', 'mode', 'data', 'flags', 'budget', 'seeds', 'steps'}
    return '\n'.join('  '.join(x.ljust(w) if h in left else x.rjust(w)
                               for x, w, h in zip(line, widths, heads)).rstrip()
                     for line in [heads] + cells)


def by_data(groups, markdown):
    """Test BPC, SF and seeds: a column per dataset, a row per source (whatever prior a language
    had for Gumbel) and budget; a source in two variants on one dataset: a row each."""
    datasets, rows = list(dict.fromkeys(g['data'] for g in groups)), {}
    source = {id(g): (mode_label(dict(g['config'], prior=None)), bool(g['flop_budget']))
              for g in groups}
    shared = collections.Counter(source[id(g)] + (g['data'],) for g in groups)
    for g in groups:
        key = source[id(g)]
        if any(shared[key + (d,)] > 1 for d in datasets):
            key = (' '.join(x for x in (g['mode'], g['flags']) if x), key[1])
        row = rows.setdefault(key, dict(mode=key[0], flags='', budgets=set(),
                                        flop_budget=g['flop_budget']))
        row['budgets'].add(g['budget'])
        row[g['data']] = (f'{fmt(g["test_bpc"], "bpc")}{" *" if g.get("star") else ""} '
                          f'({fmt(g["sf"], "sf")}, n={g["n"]})')
    order = sorted(rows, key=lambda k: (k[1], RANK.get(k[0].split()[0], 9), k[0]))
    # a FLOP budget of vanilla's shape differs a little between datasets (the output layer)
    cols = [('mode', lambda r: r['mode']), ('budget', lambda r: ' / '.join(sorted(r['budgets'])))]
    return table([rows[k] for k in order], cols + [(d, lambda r, d=d: r.get(d, '-'))
                                                   for d in datasets], markdown)


def plot(plt, rows, done):
    """Valid BPC against training characters, FLOPs and seconds, a line per run; Pareto panel."""
    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    for ax, (name, key, unit) in zip(axes.flat, BUDGETS):
        for r in sorted(rows, key=lambda r: RANK.get(r['boundary'], 9)):  # legend in MODES' order
            seen = r['boundary'] in ax.get_legend_handles_labels()[1] or not r['curves'][key]
            ax.plot(*zip(*r['curves'][key] or [([], [])]), '-' if r['done'] else '--', marker='.',
                    label=None if seen else r['boundary'], color=f'C{RANK.get(r["boundary"], 9)}')
        ax.set(xlabel=f'training {unit}', ylabel='valid BPC', title=f'valid BPC against {unit}')
    pareto(axes[1, 1], done)
    return fig


def plot_sf(plt, rows, done):
    """Test BPC against SF alone, a panel per dataset."""
    datasets = list(dict.fromkeys(g['data'] for g in done)) or ['no runs']
    fig, axes = plt.subplots(1, len(datasets), figsize=(5 * len(datasets), 4.5), squeeze=False)
    for ax, d in zip(axes.flat, datasets):
        pareto(ax, [g for g in done if g['data'] == d], f'{d}: ')
    return fig


def pareto(ax, done, title=''):
    """Test BPC against SF (the paper's Pareto figure): a point per experiment, std as error bars, a
    line through a source's variants; runs ended by a FLOP budget are hollow squares."""
    for b, at_flops in [(b, f) for b in MODES for f in (False, True)]:
        pts = sorted((g for g in done if g['boundary'] == b and bool(g['flop_budget']) == at_flops
                      and g['sf'] is not None), key=lambda g: g['sf'][0])
        # a variant: k or α from its mode, a Unigram size V from its dataset's name (-u<V>)
        names = [g['data'].rsplit('-u', 1)[-1] if b == 'unigram' else g['mode'].split(' ', 1)[-1]
                 for g in pts]
        for g, name in zip(pts, names) if len(set(names)) > 1 else ():
            ax.annotate('V=' * name.isdigit() + name, (g['sf'][0], g['test_bpc'][0]),
                        fontsize=7, xytext=(3, 3), textcoords='offset points')
        if pts:
            ax.errorbar([g['sf'][0] for g in pts], [g['test_bpc'][0] for g in pts],
                        xerr=[g['sf'][1] or 0 for g in pts],
                        yerr=[g['test_bpc'][1] or 0 for g in pts], capsize=3,
                        fmt=('s' if at_flops else 'o') + '-' * (len(set(names)) > 1),
                        mfc='none' if at_flops else f'C{RANK[b]}', color=f'C{RANK[b]}',
                        label=f'{b}, FLOP budget' if at_flops else b)
    ax.set(xlabel='shortening factor (test)', ylabel='test BPC',
           title=f'{title}test BPC against SF')


def plot_layers(plt, rows, done):
    """Test BPC against the total number of layers, a line per source (the paper's scaling)."""
    fig, ax = plt.subplots(figsize=(7, 5))
    lines = collections.defaultdict(list)
    for g in done:
        depth = sum(int(n) for n in str(g['config'].get('layers')).split(',') if n.isdigit())
        lines[g['mode']].append((depth, g['test_bpc'][0], g['test_bpc'][1] or 0))
    for mode in sorted(lines, key=lambda m: (RANK.get(m.split()[0], 9), m)):
        depth, bpc, std = zip(*sorted(lines[mode]))
        ax.errorbar(depth, bpc, yerr=std, fmt='o-', capsize=3, label=mode)
    ax.set(xlabel='layers (pre + shortened + post)', ylabel='test BPC',
           title='test BPC against the number of layers')
    return fig


def save_figure(plt, fig, path, flag):
    """The figure through common.write_atomic (never half-written), gridded and legended."""
    for ax in fig.axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    try:
        common.write_atomic(path, lambda tmp: fig.savefig(tmp, format=path.suffix[1:].lower(),
                                                          dpi=120))
    except (ValueError, RuntimeError) as e:   # (OSError: common.main's)
        raise UserError(f'cannot write {flag} {path}: {str(e).strip() or type(e).__name__}')
    finally:
        plt.close(fig)


def parse_budget(s):
    """Argument type: 'min' or a number with an optional k/M/G/T suffix (2M = 2e6)."""
    scale = {'k': 1e3, 'M': 1e6, 'G': 1e9, 'T': 1e12}.get(s[-1:], 1)
    try:
        v = s if s == 'min' else float(s[:-1] if scale != 1 else s) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f'{s!r} is not a number (e.g. 2e6, 2M) or min') from None
    if v != 'min' and not 0 <= v < math.inf:
        raise argparse.ArgumentTypeError(f'{s!r} must be a finite number >= 0')
    return v


PLOTS = {'--plot': ('BPC against characters, FLOPs, seconds and SF', plot),
         '--plot-sf': ('test BPC against SF alone, a panel per dataset', plot_sf),
         '--plot-layers': ('test BPC against the number of layers, a line per source',
                           plot_layers)}


def parse_args(argv):
    p = common.Parser(prog='report.py', description='Tables and plots of dynpool training runs.')
    p.add_argument('runs', nargs='+', help='run folders (with log.jsonl) or folders holding them')
    p.add_argument('--markdown', action='store_true', help='print the tables as Markdown')
    for flag, (what, _) in PLOTS.items():
        p.add_argument(flag, type=lambda s: Path(common.nonblank(s)), metavar='OUT.png',
                       help=f'also draw {what} (needs matplotlib)')
    for name, _, unit in BUDGETS:
        p.add_argument(f'--at-{name}', type=parse_budget, metavar='N',
                       help=f'valid BPC of each run at this many training {unit} '
                            f'(k/M/G/T suffixes; min = the most every run reached)')
    p.add_argument('--no-interp', action='store_true',
                   help='at a budget, take the last validation at or before it (no interpolation)')
    p.add_argument('--by-data', action='store_true', help='also a table of test BPC ± std (SF, '
                   'seeds) with a column per dataset, starred as in the seeds table')
    return p.parse_args(argv)


def results(args):
    """(runs, experiments, [(budget name, value)]) with flags, budgets and the t-tests' notes."""
    rows, budgets = [summarize(r) for r in find_runs(args.runs)], []
    for name, key, unit in BUDGETS:
        b = getattr(args, f'at_{name}')
        if b == 'min':   # the largest budget every run reached
            reach = [r['curves'][key][-1][0] for r in rows if r['curves'][key]]
            if not reach:
                raise UserError(f'--at-{name} min: no run logged training {unit} with a validation')
            b = min(reach)
        for r in rows if b is not None else ():
            r[f'at_{name}'] = value_at(r['curves'][key], b, not args.no_interp)
        budgets += [(name, b)] if b is not None else []
    groups = group_rows(rows, budgets)
    for some in (rows, groups):
        for r, flags in zip(some, varying_flags(some)):
            r['flags'] = flags
    return rows, groups, budgets, significance([g for g in groups if g['test_bpc'] is not None])


def run(argv):
    """Draw the plots, then print the tables: a plot that fails leaves nothing on stdout."""
    args = parse_args(argv)
    if hasattr(sys.stdout, 'reconfigure'):
        sys.stdout.reconfigure(errors='replace')  # '±' and 'α' on a terminal that lacks them
    rows, groups, budgets, notes = results(args)
    done = [g for g in groups if g['test_bpc'] is not None]
    plots = [(flag, path) for flag in PLOTS if (path := getattr(args, flag[2:].replace('-', '_')))]
    for flag, path in plots:
        plt = common.import_pyplot(flag)
        save_figure(plt, PLOTS[flag][1](plt, rows, done), path, flag)
    md, baselines = args.markdown, sorted({b for g in groups for b in g.get('p', {})},
                                          key=lambda b: (RANK.get(b.split()[0], 9), len(b), b))
    title = '### ' if md else ''
    caption = '\n\n' + '\n'.join([SIGNIFICANCE] + [('- ' if md else 'note: ') + n for n in notes])
    print(f'{title}Runs\n\n' + table(rows, columns(budgets, False), md))
    if any(g['n'] > 1 for g in groups):
        print(f'\n{title}Mean ± std over seeds\n\n' + table(
            groups, columns(budgets, True, baselines), md) + (caption if baselines else ''))
    if args.by_data:
        print(f'\n{title}Test BPC (SF, seeds) by dataset\n\n' + by_data(done, md)
              + ('\n\n' + SIGNIFICANCE if any(g.get('star') for g in groups) else ''))
    for _, path in plots if not md else ():
        print(f'\nplot: {path}')


def main(argv=None):
    """The command line → its exit code (common.main: one `error:` line for what goes wrong)."""
    return common.main(lambda: run(argv))


if __name__ == '__main__':
    sys.exit(main())
