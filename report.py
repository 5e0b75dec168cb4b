"""Tables of dynpool runs (train.py's log.jsonl in each run folder): BPC, SF, speed and cost, mean
± std over seeds with the paper's paired t-test; and plots. docs/results.md shows them.

    python report.py runs/study runs/other --at-chars 2M --at-flops min --plot study.png
"""
import collections
import json
import math
import os
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
# The fields that choose the boundary source and its pooling (and hnet's): all others
# (model shape, budget, training) and the dataset must match to pair a baseline's seeds.
SOURCE_FIELDS = {'boundary', 'pooling', 'fixed_factor', 'prior', 'temperature', 'entropy_window',
                 'unigram', 'double_sigmoid', 'threshold', 'whitespace_id', 'data', 'ratio_target',
                 'ratio_weight'}
OWN_COLUMNS = {'boundary', 'fixed_factor', 'prior', 'pooling', 'data'}   # never in 'flags'
BUDGETS = (('chars', 'train_chars', 'characters'), ('flops', 'train_flops', 'FLOPs'),
           ('time', 'train_time', 'wall-clock seconds'))
# (head, field, fmt kind) of the numbers both tables show, the seeds table as mean ± std
NUMBER_COLUMNS = (('train chars', 'train_chars', ''), ('train FLOPs', 'train_flops', 'flops'),
                  ('wall s', 'train_time', 'time'), ('valid BPC', 'valid_bpc', 'bpc'),
                  ('test BPC', 'test_bpc', 'bpc'), ('SF', 'sf', 'sf'),
                  ('chars/s', 'chars_per_s', ''))
# Fields read as numbers: train.py writes them >= 0 or null (NaN and inf: a diverged run's).
NUMBERS = ('step', 'bpc', 'sf', 'train_chars', 'train_flops', 'train_time', 'resumed_from',
           'seed', 'max_steps', 'flop_budget')
# The paper's baselines; its paired t-test two-sided, as the paper names no direction.
BASELINES = ('none', 'fixed')
SIGNIFICANCE = ("p: two-sided paired t-test of test BPC, paired by seed with the baseline's runs "
                "of the same dataset, budget and model shape (a run trained to a FLOP budget: also "
                "with vanilla's runs of those FLOPs; a source pooled by its last token: also with "
                "its mean-pooled runs); seeds on one side only left out; '-': < 2 pairs; "
                "*: lower than vanilla and every fixed k at p < 0.05 (the paper's Table 1)")


def mode_label(cfg):
    """The source with its Pareto knob (k, α) and ' (last)' for last-token pooling (Table 2)."""
    b = str(cfg.get('boundary', '?'))
    knob = {'fixed': f' k={cfg.get("fixed_factor")}', 'gumbel': f' α={cfg.get("prior")}'}.get(b, '')
    return b + knob * ('=None' not in knob) + ' (last)' * (cfg.get('pooling') == 'last')


def summarize(run):
    """One row of the runs table from <run>/log.jsonl, less the records a resume redid, with the
    validation curve of each budget. A last line cut short (a run writing it now) is left out with
    a note; other damage is one error naming the line: no JSON object, or no number in NUMBERS."""
    log = run / 'log.jsonl'
    if not log.is_file():   # a FIFO (or a folder): reading it would wait for a writer forever
        raise UserError(f'{log} is not a regular file, so no log written by train.py')
    lines = log.read_bytes().decode('utf-8', errors='replace').split('\n')
    cfg, recs = {}, []
    for i, line in enumerate(lines, 1):
        try:
            rec = json.loads(line) if line.strip() else {}
        except (ValueError, RecursionError):   # RecursionError: '[[[[...' nested too deep
            if i == len(lines):   # after the last line end: cut short
                print(f'note: {log}: skipped its last line {i}, cut short', file=sys.stderr)
                break
            rec = None
        if not isinstance(rec, dict):
            raise UserError(f'{log} line {i} is not a JSON object; not a log written by train.py')
        kind = rec.get('kind') if rec.get('kind') in ('config', 'train', 'eval') else None
        for k, v in ((k, rec.get(k)) for k in NUMBERS):
            number = type(v) in (int, float) and not v < 0 and not (   # float(v) would overflow
                type(v) is int and v > sys.float_info.max)
            if not number and (v is not None or k == 'step' and kind in ('train', 'eval')):
                raise UserError(f'{log} line {i}: {k} must be a number >= 0, not {v!r:.40}')
        if kind == 'config':   # a restart: --resume redoes the steps after resumed_from; a run
            start = rec.get('resumed_from') or 0   # without it starts over (no evaluation counts)
            recs = [r for r in recs if r['step'] <= start and (start or r['kind'] == 'train')]
            cfg = rec
        elif kind:
            recs.append(rec)
    valid, test = ([r for r in recs if r['kind'] == 'eval' and r.get('split') == split]
                   for split in ('valid', 'test'))
    # The curve: the validations during training; the final full-split one after subsets
    # (--eval-subset-chars) measures other text, so it is only the table's valid BPC.
    curve = [e for e in valid if e.get('subset')] or valid
    last = max(recs, key=lambda r: r['step'], default={})
    budget = cfg.get('flop_budget')   # train.py --flop-budget: max_steps is then out of reach
    return dict(run=run, config=cfg, mode=mode_label(cfg), boundary=str(cfg.get('boundary')),
                data=Path(str(cfg.get('data', '?'))).name, seed=cfg.get('seed'),
                steps=last.get('step', cfg.get('resumed_from') or 0), done=bool(test),
                flop_budget=budget,
                budget=f'{fmt(budget, "flops")} FLOPs' if budget else
                f'{cfg.get("max_steps")} steps',
                curves={key: sorted((e[key], e['bpc']) for e in curve if e.get(key) is not None
                                    and e.get('bpc') is not None) for _, key, _ in BUDGETS},
                valid_bpc=(valid or [{}])[-1].get('bpc'), test_bpc=(test or [{}])[-1].get('bpc'),
                sf=(test or valid or [{}])[-1].get('sf'),
                chars_per_s=last['train_chars'] / last['train_time']
                if last.get('train_chars') and last.get('train_time') else None,
                **{key: last.get(key) for _, key, _ in BUDGETS})   # cumulative totals


def value_at(pts, budget, interp):
    """Valid BPC at a budget from sorted (budget, BPC) points: interpolated between the two around
    it (or the last at or before it); None where the run never got there."""
    before, after = [p for p in pts if p[0] <= budget][-1:], [p for p in pts if p[0] >= budget][:1]
    if not before or not after:
        return None
    (x0, y0), (x1, y1) = before[0], after[0]
    return y0 if not interp or x1 == x0 else y0 + (budget - x0) / (x1 - x0) * (y1 - y0)


def experiments(rows, budgets):
    """One row per experiment (all that defines it but the seed) with (mean, std) over seeds (None
    where a seed lacks the value, std None for one seed, NaN for a diverged one) and p {baseline:
    p} of its test BPC paired by seed with vanilla's and each fixed k's of its shape (Table 1),
    trained to a FLOP budget also with the vanilla runs that spent it, and, pooled by the last
    token, with its mean-pooled twin's (Table 2)."""
    groups = collections.defaultdict(list)
    for r in rows:
        key = tuple(sorted((k, json.dumps(v, sort_keys=True)) for k, v in r['config'].items()
                           if k not in NOT_THE_EXPERIMENT))
        groups[r['done'], key].append(dict(r, key=key))
    out = [dict(ms[0], n=len(ms), members=ms, steps=max(m['steps'] for m in ms), p={},
                seeds=','.join(str(m['seed']) for m in ms), shape=tuple(  # model, budget, data
                    kv for kv in ms[0]['key'] if kv[0] not in SOURCE_FIELDS) + (ms[0]['data'],))
           for ms in groups.values()]
    for g in out:
        for k in [k for _, k, _ in NUMBER_COLUMNS] + [f'at_{name}' for name, _ in budgets]:
            v = [m.get(k) for m in g['members']]
            finite = None not in v and all(math.isfinite(x) for x in v)
            std = None if len(v) == 1 else statistics.stdev(v) if finite else math.nan
            g[k] = None if None in v else (statistics.fmean(v), std)
    done = [g for g in out if g['test_bpc'] is not None]
    bases = collections.defaultdict(list)
    for g in done:
        bases[g['shape']] += [g] * (g['boundary'] in BASELINES)
    def unscheduled(g):   # the shape less how long it trains
        return [kv for kv in g['shape'] if kv[0] not in ('max_steps', 'flop_budget')]
    for g in done:   # equal compute: a run trained to a FLOP budget, against the vanilla runs of
        spent = [v for v in done if g['flop_budget'] and v['boundary'] == 'none'   # its shape that
                 and not v['flop_budget'] and unscheduled(v) == unscheduled(g)     # spent as much
                 and v['train_flops'] and math.isclose(v['train_flops'][0], g['flop_budget'],
                                                      rel_tol=1e-3)]
        twin = tuple(kv for kv in g['key'] if kv[0] != 'pooling')   # older logs: no pooling
        twins = [t for t in done if ('pooling', '"last"') in g['key']
                 and tuple(kv for kv in t['key'] if kv != ('pooling', '"mean"')) == twin]
        beaten = []   # the paper's star: lower than vanilla and each fixed k, p < 0.05 against each
        for base in [b for b in bases[g['shape']] + spent if b is not g] + twins:
            a, b = ({m['seed']: m['test_bpc'] for m in x['members']} for x in (g, base))
            seeds = sorted(a.keys() & b.keys() - {None})
            with warnings.catch_warnings():   # fewer than 2 pairs: p NaN, shown as '-'
                warnings.simplefilter('ignore')
                t = scipy.stats.ttest_rel([a[s] for s in seeds], [b[s] for s in seeds])
            g['p'][base['mode']] = float(t.pvalue)
            if base not in twins:   # (the twin's p answers Table 2, not the star's question)
                beaten.append(t.pvalue < 0.05 and t.statistic < 0)
        g['star'] = g['boundary'] not in BASELINES and 'none' in g['p'] and all(beaten)
    return out


def fmt(v, kind):
    """A number as the tables show it: '-' where it is missing; (mean, std) as 'mean ± std'."""
    if isinstance(v, tuple):  # a std of exactly 0 (the same characters) says nothing
        return fmt(v[0], kind) + ('' if not v[1] else ' ± ' + fmt(v[1], kind))
    if v is None or not math.isfinite(v):
        return '-'
    return '<0.001' if kind == 'p' and v < 0.001 else {
        'bpc': f'{v:.4f}', 'sf': f'{v:.2f}', 'p': f'{v:.3f}', 'time': f'{v:.3g}' if v < 100 else
        f'{v:,.0f}', 'flops': f'{v:.3g}'.replace('e+', 'e')}.get(kind, f'{v:,.0f}')


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


def columns(budgets, grouped, baselines=()):
    """The columns of the runs table, or of the seeds table (a p column per baseline)."""
    heads = ['mode', 'data', 'flags', 'budget'] + (['seeds', 'n'] if grouped else ['seed'])
    cols = [(h, lambda r, h=h: str(r[h])) for h in ([] if grouped else ['run']) + heads]
    cols.append(('steps', lambda r: f'{r["steps"]}' + ' unfinished' * (not r['done'])))
    cols += [(h, lambda r, k=k, kind=kind: fmt(r[k], kind) + ' *' * (k == 'test_bpc' and bool(
        r.get('star')))) for h, k, kind in NUMBER_COLUMNS]
    cols += [(f'p vs {b}', lambda r, b=b: fmt(r['p'].get(b), 'p')) for b in baselines]
    unit = dict(chars='chars', flops='FLOPs', time='s')   # short: a column head
    return cols + [(f'valid BPC @ {fmt(budget, name)} {unit[name]}',
                    lambda r, k=f'at_{name}': fmt(r[k], 'bpc')) for name, budget in budgets]


def text_of(g):
    """The text a run trained on: its dataset's name less a Unigram label set's -u<V> (study.sh
    names the datasets that differ only in their labels fi-u200, fi-u500, ...)."""
    name, _, v = g['data'].rpartition('-u')
    return name if name and v.isdigit() else g['data']


def variant(g):
    """The Pareto knob that sets runs of one source and text apart: 'α=0.2', 'V=200' or ''."""
    if g['boundary'] == 'gumbel':
        return f'α={g["config"].get("prior")}'
    v = g['config'].get('unigram') or g['data'][len(text_of(g)) + 2:]   # fi-u200: 200
    return f'V={v}' if g['boundary'] == 'unigram' and v else ''


def by_data(groups, markdown):
    """Test BPC (SF, seeds): a column per dataset (text_of), a row per source and budget; a
    language's own Gumbel prior in its source's row, the variants of a source on one dataset
    (α, Unigram V: a Pareto front) in one cell, each named, in the knob's order."""
    rows = {}
    for g in sorted(groups, key=lambda g: (bool(g['flop_budget']), RANK.get(g['boundary'], 9),
                                           float(variant(g)[2:] or 0))):
        key = (mode_label(dict(g['config'], prior=None)), bool(g['flop_budget']))
        row = rows.setdefault(key, dict(mode=key[0], budgets=set(), flop_budget=key[1]))
        row['budgets'].add(g['budget'])   # a FLOP budget of one shape differs between datasets
        row.setdefault(text_of(g), []).append((variant(g), f'{fmt(g["test_bpc"], "bpc")}'
                                               f'{" *" * g["star"]} ({fmt(g["sf"], "sf")}, '
                                               f'n={g["n"]})'))

    def cell(r, d):
        named = len(r.get(d, ())) > 1
        return ' / '.join(f'{k} {v}' if named else v for k, v in r.get(d, ())) or '-'
    cols = [('mode', lambda r: r['mode']), ('budget', lambda r: ' / '.join(sorted(r['budgets'])))]
    cols += [(d, lambda r, d=d: cell(r, d)) for d in dict.fromkeys(text_of(g) for g in groups)]
    return table(list(rows.values()), cols, markdown)


def draw(plt, flag, rows, done):
    """The figure of a plot flag: --plot valid BPC against characters, FLOPs and seconds and the
    Pareto panel; --plot-sf the Pareto panel per dataset; --plot-layers the paper's scaling."""
    def pareto(ax, done, title=''):   # the paper's Pareto figure; a FLOP budget: hollow squares
        for b, at_flops in [(b, f) for b in MODES for f in (False, True)]:
            pts = sorted((g['sf'][0], g['test_bpc'][0], g['sf'][1] or 0, g['test_bpc'][1] or 0)
                         for g in done if g['boundary'] == b and g['sf'] is not None
                         and bool(g['flop_budget']) == at_flops)
            if pts:
                x, bpc, x_std, bpc_std = zip(*pts)
                ax.errorbar(x, bpc, bpc_std, x_std, 's-' if at_flops else 'o-', capsize=3,
                            color=f'C{RANK[b]}', mfc='none' if at_flops else f'C{RANK[b]}',
                            label=f'{b}, FLOP budget' if at_flops else b)
        ax.set(xlabel='shortening factor (test)', ylabel='test BPC',
               title=f'{title}test BPC against SF')
    if flag == '--plot-layers':   # the paper's scaling figure
        fig, ax = plt.subplots(figsize=(7, 5))
        lines = collections.defaultdict(list)
        for g in done:
            depth = sum(int(n) for n in str(g['config'].get('layers')).split(',') if n.isdigit())
            lines[g['mode'] + ', FLOP budget' * bool(g['flop_budget'])].append(
                (depth, g['test_bpc'][0], g['test_bpc'][1] or 0))
        for mode in sorted(lines, key=lambda m: (RANK.get(m.split()[0], 9), m)):
            depth, bpc, std = zip(*sorted(lines[mode]))
            ax.errorbar(depth, bpc, yerr=std, fmt='o-', capsize=3, label=mode)
        ax.set(xlabel='layers (pre + shortened + post)', ylabel='test BPC',
               title='test BPC against the number of layers')
    elif flag == '--plot-sf':
        datasets = list(dict.fromkeys(text_of(g) for g in done)) or ['no runs']
        fig, axes = plt.subplots(1, len(datasets), figsize=(5 * len(datasets), 4.5), squeeze=False)
        for ax, d in zip(axes.flat, datasets):
            pareto(ax, [g for g in done if text_of(g) == d], f'{d}: ')
    else:   # a line per run, dashed while unfinished; the Pareto figure in the fourth panel
        fig, axes = plt.subplots(2, 2, figsize=(12, 9))
        for ax, (name, key, unit) in zip(axes.flat, BUDGETS):
            for r in sorted(rows, key=lambda r: RANK.get(r['boundary'], 9)):  # MODES' order
                seen = r['boundary'] in ax.get_legend_handles_labels()[1] or not r['curves'][key]
                ax.plot(*zip(*r['curves'][key] or [([], [])]), '-' if r['done'] else '--',
                        marker='.', label=None if seen else r['boundary'],
                        color=f'C{RANK.get(r["boundary"], 9)}')
            ax.set(xlabel=f'training {unit}', ylabel='valid BPC', title=f'valid BPC against {unit}')
        pareto(axes[1, 1], done)
    return fig


def parse_budget(s):
    """Argument type: 'min' or a number >= 0 with an optional k/M/G/T suffix (2M = 2e6)."""
    if s == 'min':
        return s
    scale = {'k': 1e3, 'M': 1e6, 'G': 1e9, 'T': 1e12}.get(s[-1:], 1)
    return common.non_negative_float(s[:-1] if scale != 1 else s) * scale


def parse_args(argv):
    p = common.Parser(prog='report.py', description='Tables and plots of dynpool training runs.')
    p.add_argument('runs', nargs='+', help='run folders (with log.jsonl) or folders holding them')
    p.add_argument('--markdown', action='store_true', help='print the tables as Markdown')
    for flag, what in (('--plot', 'BPC against characters, FLOPs, seconds and SF'),
                       ('--plot-sf', 'test BPC against SF alone, a panel per dataset'),
                       ('--plot-layers', 'test BPC against the layers, a line per source')):
        p.add_argument(flag, type=lambda s: Path(common.nonblank(s)), metavar='OUT.png',
                       help=f'also draw {what} (needs matplotlib)')
    for name, _, unit in BUDGETS:
        p.add_argument(f'--at-{name}', type=parse_budget, metavar='N', help=f'valid BPC at this '
                       f'many training {unit} (2M = 2e6; min: the most every run reached)')
    p.add_argument('--no-interp', action='store_true',
                   help='at a budget, take the last validation at or before it (no interpolation)')
    p.add_argument('--by-data', action='store_true',
                   help='also a table of test BPC (SF, seeds), a column per dataset')
    return p.parse_args(argv)


def results(args):
    """(runs, experiments, [(budget name, value)]): the rows of the tables. A path is a run (with
    log.jsonl, or log.jsonl itself) or a folder of them."""
    runs, budgets = [], []
    for p in map(Path, args.runs):
        p = p.parent if p.name == 'log.jsonl' and not p.is_dir() else p
        os.scandir(p).close()   # the OS names a path that is missing or no folder
        found = sorted(f.parent for f in p.rglob('log.jsonl'))
        if not found:
            raise UserError(f'{p} is not a run: no log.jsonl (of train.py --out) in it or below')
        runs += [r for r in found if r not in runs]
    rows = [summarize(r) for r in runs]
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
    # 'flags': the others that differ between the runs (so between the experiments too)
    cfgs, at_flops = [r['config'] for r in rows], any(r['flop_budget'] for r in rows)
    own = OWN_COLUMNS | NOT_THE_EXPERIMENT | ({'flop_budget', 'max_steps'} if at_flops else set())
    keys = [k for k in sorted(set().union(*cfgs) - own)
            if len({json.dumps(c.get(k, '-'), sort_keys=True) for c in cfgs}) > 1]
    for r in rows:   # '-' where a log lacks one
        r['flags'] = ' '.join(f'{k}={r["config"].get(k, "-")}' for k in keys)
    return rows, experiments(rows, budgets), budgets


def run(argv):
    """Draw the plots (written whole or not at all), then print the tables: nothing on stdout
    from a plot that fails."""
    args = parse_args(argv)
    if hasattr(sys.stdout, 'reconfigure'):
        sys.stdout.reconfigure(errors='replace')  # '±' and 'α' on a terminal that lacks them
    rows, groups, budgets = results(args)
    done = [g for g in groups if g['test_bpc'] is not None]
    plots = [(flag, path) for flag in ('--plot', '--plot-sf', '--plot-layers')
             if (path := getattr(args, flag[2:].replace('-', '_')))]
    for flag, path in plots:
        plt = common.import_pyplot(flag)
        fig, kind = draw(plt, flag, rows, done), path.suffix[1:].lower()
        if kind not in fig.canvas.get_supported_filetypes():
            raise UserError(f'{flag} {path}: matplotlib writes no {kind!r} files (.png, .pdf, ...)')
        for ax in fig.axes:
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
        fig.tight_layout()
        common.write_atomic(path, lambda tmp: fig.savefig(tmp, format=kind, dpi=120))
        plt.close(fig)
    md, baselines = args.markdown, sorted({b for g in groups for b in g['p']},
                                          key=lambda b: (RANK.get(b.split()[0], 9), len(b), b))
    title = '### ' * md
    print(f'{title}Runs\n\n' + table(rows, columns(budgets, False), md))
    if any(g['n'] > 1 for g in groups):
        print(f'\n{title}Mean ± std over seeds\n\n' + table(groups, columns(
            budgets, True, baselines), md) + ('\n\n' + SIGNIFICANCE) * bool(baselines))
    if args.by_data:
        print(f'\n{title}Test BPC (SF, seeds) by dataset\n\n' + by_data(done, md))
    for _, path in plots if not md else ():
        print(f'\nplot: {path}')


def main(argv=None):
    return common.main(lambda: run(argv))


if __name__ == '__main__':
    sys.exit(main())
