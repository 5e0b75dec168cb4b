"""
Results of dynpool runs: the tables (BPC, SF, speed, cost; mean ± std over seeds; the paper's
paired t-test against vanilla and fixed pooling) and the plots. docs/results.md shows the views.

    python report.py runs/study                       # every run below the folder
    python report.py runs/a runs/b --markdown         # the same tables as Markdown (for README)
    python report.py runs/study --at-chars 2M --at-flops min   # valid BPC at equal budgets
    python report.py runs/langs --by-data             # test BPC with a column per dataset
    python report.py runs/study --plot study.png      # BPC against characters, FLOPs, seconds, SF

A run is a directory holding train.py's log.jsonl (either schema: with "kind", or the older one
without). Runs whose flags differ only in --seed are pooled. A run without a test evaluation is
'running' (its <dir>/.lock is held) or 'stopped'. A log's last line cut short (a run writing it
now) is left out with a note; any other damage is one `error:` line naming the log, the line and
the field (common.main: exit 1, 2 for a flag, 130 on Ctrl-C). A NaN or inf is shown as '-'.
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

# dynpool.BOUNDARY_MODES in its order, spelled out so that reading logs needs no torch import
MODES = ('none', 'fixed', 'whitespace', 'unigram', 'entropy', 'gumbel', 'hnet')
# Config fields that say nothing about the experiment: runs differing only in these (and the seed)
# are the same experiment. Logging switches (TensorBoard, W&B) count among them too.
NOT_THE_EXPERIMENT = {'kind', 'seed', 'out', 'resume', 'resumed_from', 'stop_step', 'params',
                      'torch', 'device_name', 'world', 'preset'}
# Flags train.py gained after its logs began, with the value runs logged before ran with: such a
# run is the same experiment as a newer one that logs the value.
ADDED_LATER = {'double_sigmoid': False}
# Shown in their own columns, so never repeated in the flags column.
OWN_COLUMNS = {'boundary', 'fixed_factor', 'prior', 'data'}
# What ends a run; where some runs end at a FLOP budget (train.py --flop-budget, which sets
# max_steps out of reach) a budget column says which, in place of these two flags.
BUDGET_FLAGS = {'flop_budget', 'max_steps'}
BUDGETS = (('chars', 'train_chars', 'characters'), ('flops', 'train_flops', 'FLOPs'),
           ('time', 'train_time', 'wall-clock seconds'))
# The paper's Table 1 stars a source whose test BPC beats both vanilla and fixed pooling, each by
# a paired Student's t-test over 3 seeds at p < 0.05.
BASELINES = ('none', 'fixed')
P_STAR = 0.05
SIGNIFICANCE = ("p: two-sided paired Student's t-test of test BPC, paired by seed with the "
                "baseline's runs of the same dataset and budget; *: lower than vanilla and every "
                f"fixed k shown, p < {P_STAR} against each (the paper's Table 1)")


def defines_experiment(key):
    """Whether a config field is part of what an experiment is (beyond its seed)."""
    return key not in NOT_THE_EXPERIMENT and 'wandb' not in key and 'tensorboard' not in key


# ----------------------------------------------------------------------------- reading runs
def find_runs(paths):
    """Run directories: each path that holds log.jsonl (or is one), else every folder below it
    that does. The OS reports a path that is missing or no folder (os.scandir)."""
    runs = []
    for p in map(Path, paths):
        if p.name == 'log.jsonl' and not p.is_dir():
            p = p.parent
        os.scandir(p).close()
        found = [p] if os.path.lexists(p / 'log.jsonl') else sorted(
            f.parent for f in p.rglob('log.jsonl'))
        if not found:
            raise UserError(f'{p} is not a run: no log.jsonl in it or below it (pass a directory '
                            f'written by train.py --out, or a folder of them)')
        runs += [r for r in found if r not in runs]
    return runs


def read_records(log):
    """[(line number, JSON object)] of a log.jsonl, opened without blocking and refused unless a
    regular file (a FIFO named log.jsonl would wait for a writer forever). A last line cut short (a
    run killed mid-write, or writing now) is left out with a note on stderr; any other line that is
    not a JSON object is refused, naming it."""
    fd = os.open(log, os.O_RDONLY | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UserError(f'{log} is not a regular file, so no log written by train.py')
    with open(fd, 'rb') as f:
        lines = f.read().decode('utf-8', errors='replace').split('\n')
    recs = []
    for i, line in enumerate(lines):
        try:
            rec = json.loads(line) if line.strip() else {}
        except (ValueError, RecursionError):   # RecursionError: '[[[[...' nested too deep
            if i == len(lines) - 1:   # after the last line end: cut short
                print(f'note: {log}: skipped its last line {i + 1}, cut short (a run killed '
                      f'while writing it, or writing it now)', file=sys.stderr)
                break
            rec = None
        if not isinstance(rec, dict):
            raise UserError(f'{log} line {i + 1} is not a JSON object; not a log written by '
                            f'train.py')
        recs += [(i + 1, rec)] if rec else []
    return recs


# What train.py writes in the fields report.py reads, where a record has them: counts (a train or
# eval record has its step), and numbers (NaN and inf too: a diverged run's).
COUNTS = ('step', 'resumed_from', 'batch_size', 'seq_len', 'seed', 'max_steps')
NUMBERS = ('bpc', 'sf', 'train_chars', 'train_flops', 'train_time', 'chars_per_s', 'eval_chars',
           'chars', 'flop_budget')


def check_record(rec, kind, log, line):
    """UserError naming the line and the field where a field report.py reads holds what train.py
    never writes, or a train or eval record lacks its step (an eval its BPC)."""
    for k in ('step', 'bpc')[:{'train': 1, 'eval': 2}.get(kind, 0)]:
        if k not in rec:
            raise UserError(f'{log} line {line}: a {kind} record without {k}; not a train.py log')
    for k in (k for k in COUNTS + NUMBERS if k in rec):
        v, count = rec[k], k in COUNTS
        if v is None and k != 'step' or (type(v) is int and v >= 0 if count else type(v) is float
                                         or type(v) is int and abs(v) <= sys.float_info.max):
            continue
        rule = ('a count >= 0' + ' or null' * (k != 'step')) if count else 'a number or null'
        raise UserError(f'{log} line {line}: {k} must be {rule}, not {json.dumps(v)[:40]}')


def read_run(run):
    """config, train and eval records of one run, in the new schema's field names; older logs have
    no 'kind' and are told apart by their keys."""
    config, train, evals = None, [], []
    log = run / 'log.jsonl'
    records = read_records(log)
    for line, rec in records:
        kind = rec['kind'] if 'kind' in rec else \
            'eval' if 'split' in rec else 'train' if 'loss' in rec else 'config'
        if kind in ('config', 'train', 'eval'):
            check_record(rec, kind, log, line)
        if kind == 'config':
            # A restart: --resume continues from resumed_from (records logged after that checkpoint
            # are redone); without it the run started over.
            start = rec.get('resumed_from') or 0
            train = [r for r in train if r['step'] <= start]
            evals = [r for r in evals if r['step'] <= start and rec.get('resumed_from') is not None]
            config = {**ADDED_LATER, **rec}
        elif kind in ('train', 'eval'):
            (train if kind == 'train' else evals).append(normalise(rec, kind, config or {}))
    if config is None and records:
        raise UserError(f'{log} has no config record; not a log written by train.py')
    return config or {}, train, evals   # no records: just started, nothing (whole) logged yet


def normalise(rec, kind, config):
    """A record with train_chars/train_flops/train_time (None where an old log lacks them)."""
    rec = dict(rec)
    if 'kind' not in rec:  # old schema: eval 'chars' counted evaluated characters
        if kind == 'eval':
            rec['eval_chars'] = rec.pop('chars', None)
        bs, seq = config.get('batch_size'), config.get('seq_len')
        rec['train_chars'] = rec['step'] * bs * seq if bs and seq else None
    for k in ('train_chars', 'train_flops', 'train_time'):
        rec.setdefault(k, None)
    return rec


def running(run):
    """Whether train.py holds <run>/.lock (an exclusive flock): a shared one is then refused. Taken
    and dropped at once, and no file made; Linux's /proc/locks would be a second way to ask."""
    try:
        fd = os.open(run / '.lock', os.O_RDONLY)
    except OSError:   # no lock file: never started by this train.py
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- one run's numbers
def mode_label(cfg):
    """The boundary source with the knob that makes it a point of the Pareto front."""
    b = cfg.get('boundary', '?')
    if b == 'fixed' and cfg.get('fixed_factor') is not None:
        return f'fixed k={cfg["fixed_factor"]}'
    if b == 'gumbel' and cfg.get('prior') is not None:
        return f'gumbel α={cfg["prior"]}'
    return str(b)


def chars_per_s(train, cfg):
    """Training characters per second over the run (old logs: from each logged interval's rate)."""
    last = train[-1] if train else None
    if last and last['train_chars'] and last['train_time']:
        return last['train_chars'] / last['train_time']
    per_step = (cfg.get('batch_size') or 0) * (cfg.get('seq_len') or 0)
    chars, secs, prev = 0, 0.0, 0
    for r in train:
        if r.get('chars_per_s') and r['step'] > prev:
            chars += (r['step'] - prev) * per_step
            secs += (r['step'] - prev) * per_step / r['chars_per_s']
        prev = r['step']
    return chars / secs if secs else None


def summarize(run):
    """One row of the results table, with the validation curve for budgets and plots."""
    cfg, train, evals = read_run(run)
    valid = [e for e in evals if e.get('split') == 'valid']
    # The curve (plots, budgets): the validations made during training. Where they read a subset
    # (--eval-subset-chars), the final full-split validation measures other text and would put a
    # step in every curve's last point, so it is only the table's valid BPC.
    curve = [e for e in valid if e.get('subset')] or valid
    test = [e for e in evals if e.get('split') == 'test']
    last = max(train + evals, key=lambda r: r['step'], default=None)
    done = bool(test)
    row = dict(run=run, config=cfg, mode=mode_label(cfg), boundary=cfg.get('boundary'),
               data=Path(str(cfg.get('data', '?'))).name, seed=cfg.get('seed'),
               steps=last['step'] if last else cfg.get('resumed_from') or 0,
               max_steps=cfg.get('max_steps'), flop_budget=cfg.get('flop_budget'), done=done,
               status='done' if done else 'running' if running(run) else 'stopped',
               curve=curve, valid_bpc=valid[-1]['bpc'] if valid else None,
               valid_step=valid[-1]['step'] if valid else None,
               test_bpc=test[-1]['bpc'] if done else None,
               sf=(test or valid or [{}])[-1].get('sf'), chars_per_s=chars_per_s(train, cfg))
    for _, key, _ in BUDGETS:  # cumulative totals: the latest record that has them
        row[key] = next((r[key] for r in sorted(train + evals, key=lambda r: -r['step'])
                         if r[key] is not None), None)
    return row


def value_at(curve, key, budget, interp=True):
    """Valid BPC at a training budget: interpolated between the validations around it, or the
    last one at or before it; None where the run never reached the budget."""
    pts = sorted((e[key], e['bpc']) for e in curve if e[key] is not None and e['bpc'] is not None)
    if not pts or budget > pts[-1][0] or budget < pts[0][0]:
        return None
    before = [p for p in pts if p[0] <= budget][-1]
    after = next(p for p in pts if p[0] >= budget)
    if not interp or after[0] == before[0]:
        return before[1]
    w = (budget - before[0]) / (after[0] - before[0])
    return before[1] + w * (after[1] - before[1])


# ----------------------------------------------------------------------------- seeds
def experiment_key(row):
    """All that defines the experiment but the seed; old logs (no seed logged) stand alone."""
    cfg = row['config']
    if 'seed' not in cfg:
        return ('run', str(row['run']))
    items = sorted((k, json.dumps(v, sort_keys=True)) for k, v in cfg.items()
                   if defines_experiment(k))
    return (row['done'], tuple(items))


def mean_std(values):
    """(mean, sample std or None) of the values that exist; None if any is missing."""
    if not values or any(v is None for v in values):
        return None
    if len(values) == 1:
        return statistics.fmean(values), None
    # statistics.stdev cannot take NaN or inf (a diverged seed): its spread is then unknown
    finite = all(math.isfinite(v) for v in values)
    return statistics.fmean(values), statistics.stdev(values) if finite else math.nan


def group_rows(rows, budgets):
    """One row per experiment: mean ± std over its seeds, in the order the runs came."""
    groups = {}
    for r in rows:
        groups.setdefault(experiment_key(r), []).append(r)
    out = []
    for members in groups.values():
        g = dict(members[0], n=len(members), members=members,
                 seeds=','.join('-' if m['seed'] is None else str(m['seed']) for m in members),
                 status='running' if any(m['status'] == 'running' for m in members)
                 else members[0]['status'])
        steps = sorted({m['steps'] for m in members})
        g['steps'] = steps[0] if len(steps) == 1 else f'{steps[0]}-{steps[-1]}'
        for k in ('train_chars', 'train_flops', 'train_time', 'valid_bpc', 'test_bpc', 'sf',
                  'chars_per_s') + tuple(f'at_{name}' for name, _ in budgets):
            g[k] = mean_std([m.get(k) for m in members])
        out.append(g)
    return out


# ----------------------------------------------------------------------------- significance
def paired_t(g, base):
    """(p, mean difference of test BPC, note or None): the two-sided paired t-test of experiment g
    against experiment base over the seeds both ran; p None where fewer than 2 seeds pair."""
    a, b = ({m['seed']: m['test_bpc'] for m in x['members'] if m['seed'] is not None}
            for x in (g, base))
    seeds, alone = sorted(a.keys() & b.keys()), sorted(a.keys() ^ b.keys())
    note = f'seed {", ".join(map(str, alone))} run on one side only' if alone else ''
    if len(seeds) < 2:
        return None, None, f'{note + "; " if note else ""}{len(seeds)} seed(s) on both sides, ' \
                           f'a paired t-test needs 2: no p'
    with warnings.catch_warnings():   # equal differences have no spread: p is NaN, shown '-'
        warnings.simplefilter('ignore')
        p = scipy.stats.ttest_rel([a[s] for s in seeds], [b[s] for s in seeds]).pvalue
    return float(p), statistics.fmean(a[s] - b[s] for s in seeds), note and note + ', left out'


def significance(groups):
    """Set g['p'] ({baseline label: p or None}) and g['star'] of each finished experiment: paired
    by seed with vanilla and each fixed k of the same dataset and budget (steps, or FLOPs) → the
    notes on comparisons that lost seeds or could not be made."""
    done = [g for g in groups if g['test_bpc'] is not None]
    bases = collections.defaultdict(list)
    for g in done:
        if g['boundary'] in BASELINES:
            bases[g['data'], budget_cell(g)].append(g)
    notes = []
    for g in done:
        g['p'], better = {}, []
        cell = bases[g['data'], budget_cell(g)]
        for b in (b for b in cell if b is not g):
            # two experiments of one baseline (other flags): each its own column
            twins = sum(x['mode'] == b['mode'] for x in cell) > 1
            label = f'{b["mode"]} {b["flags"]}'.strip() if twins else b['mode']
            p, diff, note = paired_t(g, b)
            g['p'][label] = p
            better.append(p is not None and p < P_STAR and diff < 0)
            if note:
                notes.append(f'{g["mode"]} {g["flags"]}'.strip() + f' vs {label} ({g["data"]}, '
                             f'{budget_cell(g)}): {note}')
        g['star'] = bool(better) and all(better)
    return notes


# ----------------------------------------------------------------------------- tables
def fmt(v, kind):
    """A number as the table shows it; '-' where it is missing."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return '-'
    if isinstance(v, tuple):  # (mean, std); a std of exactly 0 (same characters) says nothing
        quiet = v[1] is None or (v[1] == 0 and kind != 'bpc')
        return fmt(v[0], kind) + ('' if quiet else ' ± ' + fmt(v[1], kind))
    if kind == 'p':
        return '<0.001' if v < 0.001 else f'{v:.3f}'
    if kind in ('bpc', 'sf'):
        return f'{v:.4f}' if kind == 'bpc' else f'{v:.2f}'
    if kind == 'flops':
        return f'{v:.3g}'.replace('e+', 'e')
    return f'{v:.3g}' if kind == 'time' and v < 100 else f'{v:,.0f}'


def varying_flags(rows):
    """Per row, the flags (beyond mode and data) whose values differ between the rows shown."""
    cfgs = [r['config'] for r in rows]
    # A flag only some logs have (train.py gained it later) splits experiments too: shown as '-'
    # where it is missing, or two rows would look the same.
    own = OWN_COLUMNS | (BUDGET_FLAGS if any(c.get('flop_budget') for c in cfgs) else set())
    keys = sorted(set().union(*(set(c) for c in cfgs)) - own)
    keys = [k for k in keys if defines_experiment(k)
            and len({json.dumps(c.get(k, '-'), sort_keys=True) for c in cfgs}) > 1]
    return [' '.join(f'{k}={c.get(k, "-")}' for k in keys) for c in cfgs]


def steps_cell(r):
    """Steps trained; an unfinished run shows its target and whether it is running or stopped."""
    if not r['done']:
        of = '' if r['flop_budget'] else f'/{r["max_steps"] or "?"}'  # a budget: steps unknown
        return f'{r["steps"]}{of} {r["status"]}'
    return str(r['steps'])


def budget_cell(r):
    """What ends the run: its steps, or its FLOP budget."""
    if r['flop_budget']:
        return f'{fmt(r["flop_budget"], "flops")} FLOPs'
    return f'{r["max_steps"]} steps' if r['max_steps'] else '-'


def valid_cell(r):
    """Last valid BPC, with its step when that is not the run's last step."""
    s = fmt(r['valid_bpc'], 'bpc')
    if 'n' not in r and r['valid_step'] is not None and r['valid_step'] != r['steps']:
        s += f' @{r["valid_step"]}'
    return s


def columns(budgets, grouped, baselines=()):
    """(header, cell function) of the runs table, or of the mean ± std table (with a p column per
    baseline and the star on test BPC)."""
    cols = [('run', lambda r: r['run'].as_posix())] if not grouped else []
    cols += [('mode', lambda r: r['mode']), ('data', lambda r: r['data']),
             ('flags', lambda r: r['flags']), ('budget', budget_cell)]
    cols += [('seeds', lambda r: r['seeds']), ('n', lambda r: str(r['n']))] if grouped else \
        [('seed', lambda r: str(r['seed']) if r['seed'] is not None else '-')]
    cols += [('steps', steps_cell),
             ('train chars', lambda r: fmt(r['train_chars'], 'chars')),
             ('train FLOPs', lambda r: fmt(r['train_flops'], 'flops')),
             ('wall s', lambda r: fmt(r['train_time'], 'time')),
             ('valid BPC', valid_cell),
             ('test BPC', lambda r: fmt(r['test_bpc'], 'bpc') + (' *' if r.get('star') else '')),
             ('SF', lambda r: fmt(r['sf'], 'sf')),
             ('chars/s', lambda r: fmt(r['chars_per_s'], 'cps'))]
    cols += [(f'p vs {b}', lambda r, b=b: fmt(r.get('p', {}).get(b), 'p')) for b in baselines]
    for name, budget in budgets:
        unit = dict(chars='chars', flops='FLOPs', time='s')[name]  # short: a column head
        head = f'valid BPC @ {fmt(budget, name)} {unit}'
        cols.append((head, lambda r, k=f'at_{name}': fmt(r[k], 'bpc')))
    return cols


def table(rows, cols, markdown):
    """The rows as aligned text or a Markdown table; a flags column only where flags differ, a
    budget column only where some run ends at a FLOP budget."""
    cols = [c for c in cols if (c[0] != 'flags' or any(r['flags'] for r in rows))
            and (c[0] != 'budget' or any(r['flop_budget'] for r in rows))]
    cells = [[f(r) for _, f in cols] for r in rows]
    heads = [h for h, _ in cols]
    if markdown:
        lines = ['| ' + ' | '.join(heads) + ' |', '|' + '---|' * len(heads)]
        return '\n'.join(lines + ['| ' + ' | '.join(c) + ' |' for c in cells])
    widths = [max(len(x) for x in col) for col in zip(heads, *cells)]
    left = {'run', 'mode', 'data', 'flags', 'budget', 'seeds', 'steps'}
    return '\n'.join('  '.join(x.ljust(w) if h in left else x.rjust(w)
                               for x, w, h in zip(line, widths, heads)).rstrip()
                     for line in [heads] + cells)


def by_data(groups, markdown):
    """Test BPC (mean ± std over seeds, * where significant) and SF of each mode, a column per
    dataset: a row per boundary source (fixed with its k) and budget, whatever other flags a
    dataset's runs had (a language's own Gumbel prior)."""
    done = [g for g in groups if g['test_bpc'] is not None]  # unfinished: no test BPC yet
    datasets, rows = list(dict.fromkeys(g['data'] for g in done)), {}

    def source(g):  # the mode's label without Gumbel's α (a language's own prior)
        return 'gumbel' if g['boundary'] == 'gumbel' else g['mode']
    shared = collections.Counter((source(g), g['flop_budget'] is not None, g['data']) for g in done)
    for g in done:
        mode = source(g)
        if any(shared[mode, g['flop_budget'] is not None, d] > 1 for d in datasets):
            mode = ' '.join(x for x in (g['mode'], g.get('flags')) if x)  # variants: a row each
        row = rows.setdefault((mode, g['flop_budget'] is not None), dict(
            mode=mode, flags='', flop_budget=g['flop_budget'], budgets=set()))
        row['budgets'].add(budget_cell(g))
        row[g['data']] = (f'{fmt(g["test_bpc"], "bpc")}{" *" if g.get("star") else ""} '
                          f'({fmt(g["sf"], "sf")}, n={g["n"]})')
    order = sorted(rows, key=lambda k: (k[1], mode_rank(k[0].split()[0]), k[0]))
    # a FLOP budget of vanilla's shape differs a little between datasets (the output layer)
    cols = [('mode', lambda r: r['mode']), ('budget', lambda r: ' / '.join(sorted(r['budgets'])))]
    cols += [(d, lambda r, d=d: r.get(d, '-')) for d in datasets]
    return table([rows[k] for k in order], cols, markdown)


# ----------------------------------------------------------------------------- plots
def mode_rank(b):
    """Position of a boundary mode in MODES (unknown ones last)."""
    return MODES.index(b) if b in MODES else len(MODES)


def plot(plt, rows, groups, path):
    """Valid BPC against training characters, FLOPs and seconds (a line per run, a colour per
    mode), and test BPC against SF (the paper's Pareto figure: a point per experiment)."""
    colour = {m: plt.get_cmap('tab10')(i) for i, m in enumerate(MODES)}
    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    for ax, (name, key, unit) in zip(axes.flat, BUDGETS):
        labelled = set()
        for r in sorted(rows, key=lambda r: mode_rank(r['boundary'])):  # legend in MODES' order
            pts = sorted((e[key], e['bpc']) for e in r['curve']
                         if e[key] is not None and e['bpc'] is not None)
            if pts:
                ax.plot(*zip(*pts), '-' if r['done'] else '--', marker='.', alpha=0.8,
                        label=None if r['boundary'] in labelled else r['boundary'],
                        color=colour.get(r['boundary'], 'black'))
                labelled.add(r['boundary'])
        ax.set(xlabel=f'training {unit}', ylabel='valid BPC',
               title=f'valid BPC against training {unit}')
        if labelled:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, f'no training {unit} in these logs\n(older train.py)',
                    ha='center', transform=ax.transAxes)
        ax.grid(alpha=0.3)
    pareto(axes[1, 1], colour, groups)
    save_figure(plt, fig, path, '--plot')


def plot_sf(plt, groups, path):
    """Test BPC against SF alone, a panel per dataset (the languages study's figure)."""
    colour = {m: plt.get_cmap('tab10')(i) for i, m in enumerate(MODES)}
    done = [g for g in groups if g['test_bpc'] is not None]
    datasets = list(dict.fromkeys(g['data'] for g in done)) or ['no runs']
    ncols = 2 if len(datasets) == 4 else min(len(datasets), 3)
    nrows = -(-len(datasets) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.5 * ncols + 2, 4 * nrows), squeeze=False)
    for ax in axes.flat[len(datasets):]:
        ax.set_visible(False)
    legend = {}
    for ax, d in zip(axes.flat, datasets):  # one legend for all panels, beside them
        pareto(ax, colour, [g for g in done if g['data'] == d], legend=False)
        ax.set_title(f'{d}: test BPC against SF', fontsize=10)
        handles, labels = ax.get_legend_handles_labels()
        legend.update(zip(labels, handles))
    if legend:
        labels = sorted(legend, key=lambda k: (mode_rank(k.split(',')[0]), k))
        fig.legend([legend[k] for k in labels], labels, loc='center right', fontsize=8)
        w = fig.get_figwidth()
        fig.subplots_adjust(left=0.8 / w, right=1 - 2.3 / w, wspace=0.25, hspace=0.3)
    save_figure(plt, fig, path, '--plot-sf', tight=not legend)


def save_figure(plt, fig, path, flag, tight=True):
    """fig to path through common.write_atomic: never a half-written figure."""
    if tight:
        fig.tight_layout()
    try:
        common.write_atomic(path, lambda tmp: fig.savefig(tmp, format=path.suffix[1:].lower(),
                                                          dpi=120))
    except (ValueError, RuntimeError) as e:   # matplotlib's: a format it lacks (OSError: main's)
        raise UserError(f'cannot write {flag} {path}: {str(e).strip() or type(e).__name__}')
    finally:
        plt.close(fig)


def point_label(g):
    """What sets a Pareto point apart within its mode: k, α, or the Unigram size (dataset name)."""
    if g['boundary'] == 'unigram':
        size = g['data'].rsplit('-u', 1)[-1]
        return f'V={size}' if size.isdigit() else g['data']
    return g['mode'].split(' ', 1)[-1]


def pareto(ax, colour, groups, legend=True):
    """Test BPC against test SF, one point per experiment (error bars: std over seeds); the
    legend in the panel unless legend=False."""
    done = [g for g in groups if g['test_bpc'] is not None and g['sf'] is not None]
    # runs ended by a FLOP budget (equal compute) are hollow squares beside their mode's dots
    for b, at_flops in [(b, f) for b in MODES for f in (False, True)]:
        pts = sorted(((g['sf'], g['test_bpc'], g) for g in done
                      if g['boundary'] == b and bool(g['flop_budget']) == at_flops),
                     key=lambda p: p[0][0])
        if not pts:
            continue
        xs, ys = [p[0][0] for p in pts], [p[1][0] for p in pts]
        # a front only through variants (k, α, Unigram size); repeats of one variant are points
        variants = {point_label(p[2]) for p in pts}
        xerr, yerr = [p[0][1] or 0 for p in pts], [p[1][1] or 0 for p in pts]
        ax.errorbar(xs, ys, xerr=xerr if any(xerr) else None, yerr=yerr if any(yerr) else None,
                    fmt=('s' if at_flops else 'o') + ('-' if len(variants) > 1 else ''),
                    mfc='none' if at_flops else colour[b], color=colour[b], capsize=3,
                    label=f'{b}, FLOP budget' if at_flops else b)
        for x, y, p in zip(xs, ys, pts):
            if len(variants) > 1:
                ax.annotate(point_label(p[2]), (x, y), fontsize=7, xytext=(3, 3),
                            textcoords='offset points')
    ax.set(xlabel='shortening factor (test)', ylabel='test BPC',
           title='test BPC against shortening factor')
    if done and legend:
        ax.legend(fontsize=8)
    elif not done:
        ax.text(0.5, 0.5, 'no finished runs yet', ha='center', transform=ax.transAxes)
    ax.grid(alpha=0.3)


# ----------------------------------------------------------------------------- command line
def parse_budget(s):
    """'min' or a number with an optional k/M/G/T suffix (2M = 2e6)."""
    if s == 'min':
        return s
    scale = {'k': 1e3, 'M': 1e6, 'G': 1e9, 'T': 1e12}.get(s[-1:], 1)
    try:
        v = float(s[:-1] if scale != 1 else s) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f'{s!r} is not a number (e.g. 2e6, 2M) or min') from None
    if not v >= 0 or math.isinf(v):
        raise argparse.ArgumentTypeError(f'{s!r} must be a finite number >= 0')
    return v


def parse_args(argv):
    p = common.Parser(prog='report.py',
                      description='Results table and plots of dynpool training runs.')
    p.add_argument('runs', nargs='+',
                   help='run directories (with log.jsonl) or folders holding them')
    p.add_argument('--markdown', action='store_true', help='print the tables as Markdown')
    for flag, what in (('--plot', 'BPC against characters, FLOPs, seconds and SF'),
                       ('--plot-sf', 'test BPC against SF alone, a panel per dataset')):
        p.add_argument(flag, type=lambda s: Path(common.nonblank(s)), metavar='OUT.png',
                       help=f'also draw {what} (needs matplotlib)')
    for name, _, unit in BUDGETS:
        p.add_argument(f'--at-{name}', type=parse_budget, metavar='N',
                       help=f'valid BPC of each run at this many training {unit} '
                            f'(k/M/G/T suffixes; min = the most every run reached)')
    p.add_argument('--no-interp', action='store_true',
                   help='at a budget, take the last validation at or before it (no interpolation)')
    p.add_argument('--by-data', action='store_true',
                   help='also a table of test BPC ± std (SF, seeds) with a column per dataset, '
                        'starred as in the seed table')
    return p.parse_args(argv)


def resolve_budgets(args, rows):
    """[(name, budget)] asked for, with 'min' turned into the largest budget all runs reached."""
    budgets = []
    for name, key, unit in BUDGETS:
        b = getattr(args, f'at_{name}')
        if b == 'min':
            reach = [max(e[key] for e in r['curve'] if e[key] is not None)
                     for r in rows if any(e[key] is not None for e in r['curve'])]
            if not reach:
                raise UserError(f'--at-{name} min: no run logged training {unit} with its '
                                f'validations (older train.py logs lack FLOPs and time)')
            b = min(reach)
        if b is not None:
            budgets.append((name, b))
            for r in rows:
                r[f'at_{name}'] = value_at(r['curve'], key, b, not args.no_interp)
    return budgets


def draw(args, rows, groups):
    """The plots asked for, drawn before any table is printed: one that cannot be written fails
    with nothing on stdout."""
    if args.plot or args.plot_sf:
        plt = common.import_pyplot('--plot' if args.plot else '--plot-sf')
        if args.plot:
            plot(plt, rows, groups, args.plot)
        if args.plot_sf:
            plot_sf(plt, groups, args.plot_sf)


def run(argv):
    """Read the runs, draw the plots, print the tables."""
    args = parse_args(argv)
    if hasattr(sys.stdout, 'reconfigure'):
        sys.stdout.reconfigure(errors='replace')  # '±' and 'α' on a terminal that lacks them
    rows = [summarize(r) for r in find_runs(args.runs)]
    budgets = resolve_budgets(args, rows)
    for r, flags in zip(rows, varying_flags(rows)):
        r['flags'] = flags
    groups = group_rows(rows, budgets)
    for g, flags in zip(groups, varying_flags(groups)):
        g['flags'] = flags
    notes = significance(groups)
    baselines = sorted({b for g in groups for b in g.get('p', {})},
                       key=lambda b: (mode_rank(b.split()[0]), len(b), b))
    draw(args, rows, groups)
    md = args.markdown
    title = '### ' if md else ''
    caption = '\n\n' + '\n'.join([SIGNIFICANCE] + [('- ' if md else 'note: ') + n for n in notes])
    print(f'{title}Runs\n\n' + table(rows, columns(budgets, False), md))
    if any(g['n'] > 1 for g in groups):
        print(f'\n{title}Mean ± std over seeds\n\n' + table(
            groups, columns(budgets, True, baselines), md) + (caption if baselines else ''))
    if args.by_data:
        print(f'\n{title}Test BPC (SF, seeds) by dataset\n\n' + by_data(groups, md)
              + ('\n\n' + SIGNIFICANCE if any(g.get('star') for g in groups) else ''))
    for path in (args.plot, args.plot_sf):
        if path and not md:
            print(f'\nplot: {path}')


def main(argv=None):
    """The command line → its exit code (common.main: one `error:` line for what goes wrong)."""
    return common.main(lambda: run(argv))


if __name__ == '__main__':
    sys.exit(main())
