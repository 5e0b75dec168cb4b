"""Tables of dynpool runs (train.py's log.jsonl in each run folder): bits per character (BPC)
or per byte (BPB), SF, speed and cost, mean ± std over seeds with the paper's paired t-test;
and plots. docs/results.md shows them.

    python report.py runs/study runs/other --by-data --markdown --plot study.png
"""
import collections
import json
import math
import os
import statistics
import sys
import warnings
from pathlib import Path

import filelock

import common
from common import UserError
from dataset import BITS

# The paper's sources in its order (and H-Net's): the order of the tables' rows and the
# plots' colours. The mode names come from the runs' own records, so a table needs no
# dynpool (nor torch); a source of its own (train.py --import) comes after these, by name.
PAPER_MODES = ('none', 'fixed', 'whitespace', 'unigram', 'entropy', 'gumbel', 'hnet')
# Config fields that say nothing about the experiment: runs differing only in these are
# its seeds. (The dataset decides the encoding and the unit; its identity, data_id, is
# compared instead of the path it was given by.)
NOT_THE_EXPERIMENT = {'kind', 'seed', 'out', 'resume', 'resumed_from', 'stop_step',
                      'params', 'torch', 'device_name', 'world', 'preset', 'run_id',
                      'encoding', 'unit', 'data', 'dataset'}
# The fields that choose the boundary source and its pooling (and hnet's), and the
# budget's: all others (model shape, training) and the dataset must match to pair a
# baseline's seeds, the budget too (its words) but where a FLOP budget meets the vanilla
# runs that spent it.
NOT_THE_SHAPE = {'boundary', 'pooling', 'fixed_factor', 'prior', 'temperature',
                 'entropy_window', 'unigram', 'double_sigmoid', 'threshold', 'whitespace_id',
                 'ratio_target', 'ratio_weight', 'max_steps', 'flop_budget'}
# never in 'flags': the mode column's, and what is not the experiment
NOT_FLAGS = NOT_THE_EXPERIMENT | {'boundary', 'fixed_factor', 'prior', 'pooling'}
# (head, field, format) of the numbers both tables show, the seeds table as mean ± std,
# their heads written for characters (in_unit says them for bytes)
NUMBER_COLUMNS = (('train chars', 'train_chars', ',.0f'), ('train FLOPs', 'train_flops', '.3g'),
                  ('wall s', 'train_time', ',.0f'), ('valid BPC', 'valid_bpc', '.4f'),
                  ('test BPC', 'test_bpc', '.4f'), ('SF', 'sf', '.2f'),
                  ('chars/s', 'chars_per_s', ',.0f'))
# Fields read as numbers: train.py writes them >= 0 or null (NaN and inf: a diverged
# run's).
NUMBERS = ('step', 'bpc', 'bpb', 'sf', 'train_chars', 'train_flops', 'train_time',
           'resumed_from', 'seed', 'flop_budget', 'max_steps', 'fixed_factor', 'prior')
# the records of steps (the others: config, a test's own)
STEP_KINDS = ('train', 'eval', 'diverged', 'stopped')
# the curve panels of --plot: (x label, field of a validation record)
CURVES = (('training characters', 'train_chars'), ('training seconds', 'train_time'),
          ('training FLOPs', 'train_flops'))
# The paper's baselines; its paired t-test two-sided, as the paper names no direction.
BASELINES = ('none', 'fixed')
SIGNIFICANCE = ("p: two-sided paired t-test of test BPC (BPB), paired by seed with the "
                "baseline's runs of the same dataset, budget and model shape (a run trained "
                "to a FLOP budget: also with vanilla's runs of those FLOPs; a source pooled by "
                "its last token: also with its mean-pooled runs); seeds on one side only left "
                "out; '-': < 2 pairs; *: lower than vanilla and every fixed k at p < 0.05 (the "
                "paper's Table 1)")


def rank(mode):
    """Where a source (a mode label's first word) sorts: the paper's order, then any
    other by name."""
    boundary = mode.partition(' ')[0]
    if boundary in PAPER_MODES:
        return PAPER_MODES.index(boundary), ''
    return len(PAPER_MODES), boundary


def mode_label(cfg):
    """The source with its Pareto knob (k, α) and ' (last)' for
    last-token pooling (Table 2)."""
    label = str(cfg.get('boundary', '?'))
    # (a log without the knob: the source alone)
    if label == 'fixed' and cfg.get('fixed_factor') is not None:
        label += f' k={cfg["fixed_factor"]}'
    if label == 'gumbel' and cfg.get('prior') is not None:
        label += f' α={cfg["prior"]}'
    if cfg.get('pooling') == 'last':
        label += ' (last)'
    return label


def in_unit(words, bits):
    """Words written for characters (BPC, chars, characters) as runs in `bits` say them:
    a byte run's bits are BPB and its tokens bytes. (Its unit is its config record's,
    which train.py takes from dataset.unit.)"""
    if bits == 'BPB':
        words = words.replace('BPC', 'BPB').replace('characters', 'bytes')
        words = words.replace('chars', 'bytes')
    return words


def read_log(log):
    """<run>/log.jsonl → [record], its kind 'diverged' for a diverged record. A
    damaged line is one error naming it (no JSON object, no number in NUMBERS); a last
    line cut short (a run writing it now) is left out with a note."""
    if not log.is_file():   # a FIFO (or a folder): reading would wait for a writer forever
        raise UserError(f'{log} is not a regular file, so no log written by train.py')
    lines = log.read_bytes().decode(errors='replace').split('\n')
    records = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):   # RecursionError: '[[[[...' too deep
            if i == len(lines):   # after the last line end: cut short
                print(f'note: {log}: skipped its last line {i}, cut short', file=sys.stderr)
                break
            rec = None
        if not isinstance(rec, dict):
            raise UserError(f'{log} line {i} is not a JSON object; not a log written by '
                            'train.py')
        kind = rec.get('kind')
        if rec.get('diverged') is True:
            kind = 'diverged'
        for key in NUMBERS:
            v = rec.get(key)
            if v is None and not (key == 'step' and kind in STEP_KINDS):
                continue
            # (an int that float(v) would overflow is none train.py writes)
            if type(v) not in (int, float) or v < 0 or type(v) is int and v > sys.float_info.max:
                raise UserError(f'{log} line {i}: {key} must be a number >= 0, not {v!r:.40}')
        records.append(dict(rec, kind=kind))
    return records


def run_state(run, recs, done):
    """'' for a finished run; else what stopped it: 'running' (another process holds
    its folder's lock, as train.py does while it trains), 'diverged' (a diverged
    record), 'unfinished' (its log ends with the stopped record train.py writes when it
    stops to be resumed, or, in older logs, at a validation), else 'crashed' (it ended
    without a word)."""
    if done:
        return ''
    lock = run / '.lock'
    if lock.is_file():
        try:
            with filelock.FileLock(lock, blocking=False):
                pass
        except filelock.Timeout:
            return 'running'
        except OSError:   # a folder this process may not write: it cannot ask
            pass
    if any(rec['kind'] == 'diverged' for rec in recs):
        return 'diverged'
    if not recs or recs[-1]['kind'] in ('eval', 'stopped'):
        return 'unfinished'
    return 'crashed'


def summarize(run):
    """One row of the runs table from <run>/log.jsonl, less the records a resume redid,
    with its state (run_state), its unit (bits: BPC, or BPB where the run's config record
    says 'byte'), its identity (the run_id of its config record, else its folder), its
    data's (data_id: the fingerprint train.py records, else the path it was given) and
    its curve (its validation records)."""
    cfg = {}
    recs = []
    for rec in read_log(run / 'log.jsonl'):
        # a restart: --resume redoes the steps after resumed_from; a run without it starts
        # over (no evaluation counts)
        if rec['kind'] == 'config':
            start = rec.get('resumed_from') or 0
            recs = [prev for prev in recs
                    if prev['step'] <= start and (start or prev['kind'] == 'train')]
            cfg = rec
        elif rec['kind'] in STEP_KINDS:
            recs.append(rec)
    # the unit its config record names (train.py's dataset.unit): BPC, or BPB for bytes
    bits = BITS.get(cfg.get('unit'), 'bpc').upper()
    # the evaluations, their bits as bpc (a byte run's records say bpb), and the last of
    # each split (by its name as text: a damaged record's split may be any JSON value)
    evals = [dict(rec, bpc=rec.get(bits.lower())) for rec in recs if rec['kind'] == 'eval']
    last_of = {str(rec.get('split')): rec for rec in evals}
    valid = last_of.get('valid', {})
    test = last_of.get('test', {})
    done = 'test' in last_of
    last = max(recs, key=lambda rec: rec['step'], default={})
    chars_per_s = None
    if last.get('train_chars') and last.get('train_time'):
        chars_per_s = last['train_chars'] / last['train_time']
    budget = cfg.get('flop_budget')   # train.py --flop-budget: max_steps out of reach
    budget_words = f'{cfg.get("max_steps")} steps'
    if budget:
        budget_words = f'{fmt(budget, ".3g")} FLOPs'
    # (data/en/ and ./data/en are data/en)
    data = os.path.normpath(str(cfg.get('data', '?')))
    fingerprint = None
    if isinstance(cfg.get('dataset'), dict):
        fingerprint = cfg['dataset'].get('fingerprint')
    return dict(run=run, id=str(cfg.get('run_id') or run), config=cfg, mode=mode_label(cfg),
                boundary=str(cfg.get('boundary')), data=Path(data).name, data_path=data,
                fingerprint=fingerprint, data_id=json.dumps(fingerprint or data),
                seed=cfg.get('seed'), steps=last.get('step', cfg.get('resumed_from') or 0),
                done=done, state=run_state(run, recs, done), bits=bits,
                curve=[rec for rec in evals if rec.get('split') == 'valid'],
                flop_budget=budget, budget=budget_words, valid_bpc=valid.get('bpc'),
                test_bpc=test.get('bpc'), sf=(test or valid).get('sf'), chars_per_s=chars_per_s,
                train_chars=last.get('train_chars'), train_flops=last.get('train_flops'),
                train_time=last.get('train_time'))


def one_per_run(rows):
    """Copies of one run (a backup of its folder: the same run_id) → the copy that got
    furthest, once, with a note naming them."""
    copies = collections.defaultdict(list)
    for row in rows:
        copies[row['id']].append(row)
    kept = []
    for same in copies.values():
        best = max(same, key=lambda row: (row['done'], row['steps']))
        kept.append(best)
        if len(same) > 1:
            names = ' and '.join(str(row['run']) for row in same)
            print(f'note: {names} are one run (same run_id): counted once, as {best["run"]}',
                  file=sys.stderr)
    return kept


def name_datasets(rows):
    """Each row's 'data' names its dataset alone among the rows: the folder's name, or
    where two datasets share it, the path, and where one path held both (data remade
    from other text), the path with the fingerprint. A dataset's first row names it."""
    datasets = {}
    for row in rows:
        datasets.setdefault(row['data_id'], row)
    for form in ('{data_path}', '{data_path}@{fingerprint}'):
        shared = collections.Counter(row['data'] for row in datasets.values())
        for row in datasets.values():
            if shared[row['data']] > 1:
                row['data'] = form.format(**row)
    for row in rows:
        row['data'] = datasets[row['data_id']]['data']


def mean_std(values):
    """(mean, std) over seeds: None where a seed lacks the value, std None for one seed,
    NaN where a value is not finite (a diverged run's)."""
    if None in values:
        return None
    if len(values) == 1:
        return values[0], None
    std = math.nan
    if all(math.isfinite(v) for v in values):
        std = statistics.stdev(values)
    return statistics.fmean(values), std


def sample(replicas, key):
    """One seed's value of `key`: the mean over its replicas (runs of one configuration,
    data and seed, one sample), None where one lacks it."""
    values = [row[key] for row in replicas]
    if None in values:
        return None
    return statistics.fmean(values)


def group_seeds(rows):
    """One group per experiment (all that defines it but the seed: its configuration and
    its data): the first seed's row with its key, n (its seeds: a seed's replicas are one
    sample), members, samples {seed: its replicas}, the furthest steps, the seeds, the
    states, its shape (model and data: what a baseline must share) and (mean, std) over
    its samples of every number."""
    groups = collections.defaultdict(list)
    for row in rows:
        config = dict(row['config'], data_id=row['data_id'])
        key = tuple(sorted((k, json.dumps(v, sort_keys=True))
                           for k, v in config.items() if k not in NOT_THE_EXPERIMENT))
        groups[row['done'], key].append(row)
    out = []
    for (_, key), members in groups.items():
        # seeds in order, so the runs' order changes nothing
        members.sort(key=lambda m: (m['seed'] is None, m['seed'] or 0))
        samples = {}
        for member in members:
            samples.setdefault(member['seed'], []).append(member)
        # n counts samples; the runs where a seed has replicas
        n = str(len(samples))
        if len(members) > len(samples):
            n += f' ({len(members)} runs)'
        group = dict(members[0], key=key, n=n, members=members, samples=samples, p={},
                     shape=tuple(kv for kv in key if kv[0] not in NOT_THE_SHAPE),
                     steps=max(m['steps'] for m in members),
                     seeds=','.join(str(seed) for seed in samples),
                     state='/'.join(sorted({m['state'] for m in members})))
        for _, field, _ in NUMBER_COLUMNS:
            group[field] = mean_std([sample(runs, field) for runs in samples.values()])
        out.append(group)
    return out


def t_test(g, base):
    """The paired t-test of g's test BPC against base's, paired by seed (a seed's replicas
    as their mean; seeds on one side only left out): p NaN for fewer than 2 pairs."""
    import scipy.stats   # (seconds to import: only where a t-test runs)

    seeds = sorted(g['samples'].keys() & base['samples'].keys() - {None})
    mine = [sample(g['samples'][seed], 'test_bpc') for seed in seeds]
    theirs = [sample(base['samples'][seed], 'test_bpc') for seed in seeds]
    with warnings.catch_warnings(action='ignore'):
        return scipy.stats.ttest_rel(mine, theirs)


def experiments(rows):
    """One row per experiment (group_seeds) with p {baseline: p} of its test BPC paired
    by seed with vanilla's and each fixed k's of its shape (Table 1), trained to a FLOP
    budget also with the vanilla runs that spent it, and, pooled by the last token, with
    its mean-pooled twin's (Table 2); and the paper's star."""
    out = group_seeds(rows)
    done = [g for g in out if g['test_bpc'] is not None]
    for g in done:
        beaten = []
        for b in done:
            # equal compute: a run trained to a FLOP budget, against the vanilla runs of
            # its shape trained to the steps that spent as much
            spent = (g['flop_budget'] and b['boundary'] == 'none' and not b['flop_budget']
                     and b['train_flops']
                     and math.isclose(b['train_flops'][0], g['flop_budget'], rel_tol=1e-3))
            baseline = (b['boundary'] in BASELINES and b['shape'] == g['shape']
                        and (b['budget'] == g['budget'] or spent))
            # its mean-pooled twin, where it pools by the last token (older logs: no pooling)
            twin = (('pooling', '"last"') in g['key']
                    and dict(b['key'], pooling='"mean"') == dict(g['key'], pooling='"mean"'))
            if b is g or not (baseline or twin):
                continue
            test = t_test(g, b)
            g['p'][b['mode']] = float(test.pvalue)
            # the paper's star: lower than vanilla and each fixed k, p < 0.05 against each
            # (a twin's p answers Table 2, not the star's; a source whose twin is a baseline
            # is a baseline, never starred)
            if baseline:
                beaten.append(test.pvalue < 0.05 and test.statistic < 0)
        g['star'] = g['boundary'] not in BASELINES and 'none' in g['p'] and all(beaten)
    return out


def fmt(v, spec):
    """A number in format `spec` ('p': a p value) as the tables show it: '-' where it
    is missing; (mean, std) as 'mean ± std'."""
    if isinstance(v, tuple):
        text = fmt(v[0], spec)
        if v[1]:   # a std of exactly 0 (the same characters) says nothing
            text += ' ± ' + fmt(v[1], spec)
        return text
    if v is None or not math.isfinite(v):
        return '-'
    if spec == 'p':
        if v < 0.001:
            return '<0.001'
        spec = '.3f'
    return format(v, spec).replace('e+', 'e')


def cell(row, key, kind):
    """The text of a table's cell: row[key] as it is (kind None), the steps and the
    run's state ('steps'), the p against baseline `key` ('p'), else in format `kind`,
    test BPC starred."""
    if kind is None:
        return str(row[key])
    if kind == 'steps':
        return f'{row["steps"]} {row["state"]}'.rstrip()
    if kind == 'p':
        return fmt(row['p'].get(key), 'p')
    text = fmt(row[key], kind)
    if key == 'test_bpc' and row.get('star'):
        text += ' *'
    return text


def table(rows, cols, markdown):
    """Aligned text or Markdown of cols, each (head, key, kind) for cell()."""
    lines = [[head for head, _, _ in cols]]
    lines += [[cell(row, key, kind) for _, key, kind in cols] for row in rows]
    if markdown:
        lines = ['| ' + ' | '.join(line) + ' |' for line in lines]
        lines.insert(1, '|' + '---|' * len(cols))
        return '\n'.join(lines)
    widths = [max(map(len, column)) for column in zip(*lines)]
    # numbers to the right, text to the left
    text = []
    for line in lines:
        padded = [x.ljust(w) if kind in (None, 'steps') else x.rjust(w)
                  for x, w, (_, _, kind) in zip(line, widths, cols)]
        text.append('  '.join(padded).rstrip())
    return '\n'.join(text)


def columns(rows, bits, first, last, baselines=()):
    """The columns of the runs table or of the seeds table: first, the mode, the data,
    'flags' where they differ, 'budget' where a FLOP budget is, last, the steps, the
    numbers and a p column per baseline."""
    heads = first + ['mode', 'data']
    if any(row['flags'] for row in rows):
        heads.append('flags')
    if any(row['flop_budget'] for row in rows):
        heads.append('budget')
    cols = [(head, head, None) for head in heads + last] + [('steps', 'steps', 'steps')]
    cols += [(in_unit(head, bits), key, kind) for head, key, kind in NUMBER_COLUMNS]
    return cols + [(f'p vs {b}', b, 'p') for b in baselines]


def order(group):
    """Where an experiment sorts in a table: budget (steps, then FLOPs), the source as
    rank() has it, its knob, its budget, its flags: by its own record, never by the
    order of the runs."""
    cfg = group['config']
    return (bool(group['flop_budget']), rank(group['boundary']), cfg.get('fixed_factor') or 0,
            cfg.get('prior') or 0, group['mode'], group['flop_budget'] or cfg.get('max_steps')
            or 0, group['flags'])


def by_data(groups, markdown):
    """Test BPC (SF, seeds): a column per dataset, a row per source (with its knob, as
    mode_label names it) and kind of budget, each cell's entries made from one
    experiment's record each, named by their budget where the row has several and by
    their flags where the cell's differ."""
    by_row = {}
    for g in sorted(groups, key=order):
        by_row.setdefault((g['mode'], bool(g['flop_budget'])), []).append(g)
    datasets = list(dict.fromkeys(g['data'] for g in groups))
    rows = []
    for (mode, _), experiments in by_row.items():
        # a FLOP budget of one shape differs between datasets
        budgets = list(dict.fromkeys(g['budget'] for g in experiments))
        row = dict(mode=mode, budget=' / '.join(budgets))
        for data in datasets:
            here = [g for g in experiments if g['data'] == data]
            flags_differ = len({g['flags'] for g in here}) > 1
            entries = []
            for g in here:
                entry = f'{cell(g, "test_bpc", ".4f")} ({fmt(g["sf"], ".2f")}, n={g["n"]})'
                if flags_differ:
                    entry = f'{g["flags"]}: {entry}'
                if len(budgets) > 1:
                    entry = f'{g["budget"]}: {entry}'
                entries.append(entry)
            row[data] = ' / '.join(entries) or '-'
        rows.append(row)
    cols = [(head, head, None) for head in ['mode', 'budget'] + datasets]
    return table(rows, cols, markdown)


def bits_of(rows, flag):
    """The one unit of a plot's runs: BPC and BPB never share an axis."""
    units = {row['bits'] for row in rows} or {'BPC'}
    if len(units) > 1:
        raise UserError(f'{flag}: runs in BPC and in BPB; plot the runs of each unit apart')
    return units.pop()


def pareto(ax, groups, colours):
    """The paper's Pareto panel: test BPC against SF of finished experiments, a line per
    source, a FLOP budget's as hollow squares, the seeds' std as error bars."""
    for mode in colours:
        for at_flops in (False, True):
            pts = sorted((g['sf'][0], g['test_bpc'][0], g['sf'][1] or 0, g['test_bpc'][1] or 0)
                         for g in groups if g['boundary'] == mode and g['sf'] is not None
                         and bool(g['flop_budget']) == at_flops)
            if not pts:
                continue
            x, y, x_std, y_std = zip(*pts)
            style = dict(fmt='o-', label=mode)
            if at_flops:
                style = dict(fmt='s-', mfc='none', label=f'{mode}, FLOP budget')
            ax.errorbar(x, y, y_std, x_std, capsize=3, color=colours[mode], **style)


def curves(ax, runs, colours, field):
    """Validation BPC against `field` (characters, seconds, FLOPs), a line per run in its
    source's colour, labelled by its mode (the legend names each once)."""
    for row in runs:
        pts = [(rec[field], rec['bpc']) for rec in row['curve']
               if rec.get(field) is not None and rec['bpc'] is not None]
        if pts:
            ax.plot(*zip(*pts), '.-', color=colours[row['boundary']], label=row['mode'], alpha=0.8)


def draw(plt, flag, done, runs):
    """--plot: the Pareto panel of all finished experiments, and the curves of all runs
    against characters, seconds and FLOPs; --plot-sf: a Pareto panel per text."""
    # a source's colour: its place among the paper's and the others drawn
    modes = sorted(set(PAPER_MODES) | {row['boundary'] for row in runs}, key=rank)
    colours = {mode: f'C{i % 10}' for i, mode in enumerate(modes)}
    panels = {'': done}
    if flag == '--plot-sf' and done:
        panels = {}
        for g in done:
            # the text: the dataset's name less a Unigram label set's -u<V> (study.sh
            # names the datasets that differ only in their labels fi-u200, fi-u500, ...)
            text, _, v = g['data'].rpartition('-u')
            if not (text and v.isdigit()):
                text = g['data']
            panels.setdefault(f'{text}: ', []).append(g)
    # (title, rows, field of the curves' x axis: None for a Pareto panel)
    shown = [(title, rows, None) for title, rows in panels.items()]
    if flag == '--plot':
        shown += [(x_label, runs, field) for x_label, field in CURVES]
    fig, axes = plt.subplots(1, len(shown), figsize=(5 * len(shown), 4.5), squeeze=False)
    for ax, (title, rows, field) in zip(axes.flat, shown):
        bits = bits_of(rows, flag)
        if field:
            curves(ax, runs, colours, field)
            x_label = in_unit(title, bits)
            ax.set(xlabel=x_label, ylabel=f'valid {bits}', title=f'valid {bits} against {x_label}')
        else:
            pareto(ax, rows, colours)
            ax.set(xlabel='shortening factor (test)', ylabel=f'test {bits}',
                   title=f'{title}test {bits} against SF')
        ax.grid(alpha=0.3)
        # a legend entry per label, in the order drawn (a source's runs are a line each)
        handles, labels = ax.get_legend_handles_labels()
        legend = dict(zip(labels, handles))
        if legend:
            ax.legend(legend.values(), legend.keys(), fontsize=8)
    legible(fig)
    return fig


def legible(fig):
    """Every text of the figure drawn without a missing glyph (no warning): the default
    font, then the installed fonts with the glyphs it lacks (matplotlib falls back glyph
    by glyph); a character no installed font has is shown as its escape, \\u4e2d."""
    from matplotlib import font_manager, text

    texts = fig.findobj(text.Text)
    wanted = {c for t in texts for c in t.get_text() if not c.isascii()}
    default = font_manager.findfont(font_manager.FontProperties())
    families = [font_manager.get_font(default).family_name]
    for path in [default] + [font.fname for font in font_manager.fontManager.ttflist]:
        if not wanted:
            break
        font = font_manager.get_font(path)
        # (its glyphs are boxes: a missing glyph drawn, no better than the warning)
        if font.family_name.startswith('Last Resort'):
            continue
        has = {c for c in wanted if ord(c) in font.get_charmap()}
        if has:
            families.append(font.family_name)
        wanted -= has
    escapes = {ord(c): ascii(c)[1:-1] for c in wanted}
    for t in texts:
        t.set_text(t.get_text().translate(escapes))
        if len(families) > 1:
            t.set_fontfamily(families)


def parse_args(argv):
    p = common.Parser(prog='report.py',
                      description='Tables and plots of dynpool training runs.')
    p.add_argument('runs', nargs='+',
                   help='run folders (with log.jsonl) or folders holding them')
    p.add_argument('--markdown', action='store_true', help='print the tables as Markdown')
    p.add_argument('--plot', type=common.nonblank, metavar='OUT.png',
                   help="also draw test BPC against SF (the Pareto figure) and each run's "
                   'validation BPC against training characters, seconds and FLOPs')
    p.add_argument('--plot-sf', type=common.nonblank, metavar='OUT.png',
                   help='also draw test BPC against SF, a panel per dataset')
    p.add_argument('--by-data', action='store_true',
                   help='also a table of test BPC (SF, seeds), a column per dataset')
    return p.parse_args(argv)


def find_runs(paths):
    """The run folders: a path is a run (with log.jsonl) or a folder of them."""
    runs = []
    for p in map(Path, paths):
        os.scandir(p).close()   # the OS names a path that is missing or no folder
        found = sorted(f.parent for f in p.rglob('log.jsonl'))
        if not found:
            raise UserError(f'{p} is not a run: no log.jsonl (of train.py --out) in it or below')
        runs += found
    return list(dict.fromkeys(runs))


def add_flags(rows):
    """Each row's 'flags': the config fields that differ between the rows (so between
    their experiments too), '-' where a log lacks one."""
    configs = [row['config'] for row in rows]
    own = NOT_FLAGS
    if any(row['flop_budget'] for row in rows):
        own = own | {'flop_budget', 'max_steps'}
    keys = [k for k in sorted(set().union(*configs) - own)
            if len({json.dumps(c.get(k, '-'), sort_keys=True) for c in configs}) > 1]
    for row in rows:
        row['flags'] = ' '.join(f'{k}={row["config"].get(k, "-")}' for k in keys)


def run(argv):
    """Print the tables, each unit's apart (no column holds both BPC and BPB), after
    drawing the plots: nothing on stdout from a plot that fails."""
    args = parse_args(argv)
    rows = one_per_run([summarize(run) for run in find_runs(args.runs)])
    name_datasets(rows)
    head = ''
    if args.markdown:
        head = '### '
    sections = []
    done = []
    for bits, where in (('BPC', ''), ('BPB', ' on bytes')):
        runs = [row for row in rows if row['bits'] == bits]
        if not runs:
            continue
        # each unit's flags and pairs its own
        add_flags(runs)
        groups = experiments(runs)
        finished = [g for g in groups if g['test_bpc'] is not None]
        done += finished
        runs_table = table(runs, columns(runs, bits, ['run'], ['seed']), args.markdown)
        sections.append(f'{head}Runs{where}\n\n{runs_table}')
        baselines = sorted({b for g in groups for b in g['p']},
                           key=lambda b: (rank(b), len(b), b))
        if any(len(g['members']) > 1 for g in groups):
            seed_cols = columns(groups, bits, [], ['seeds', 'n'], baselines)
            seeds = table(groups, seed_cols, args.markdown)
            sections.append(f'{head}Mean ± std over seeds{where}\n\n{seeds}')
            if baselines:
                sections.append(SIGNIFICANCE)
        if args.by_data:
            by = by_data(finished, args.markdown)
            sections.append(f'{head}Test {bits} (SF, seeds) by dataset\n\n{by}')
    # each figure written whole or not at all, in the format its path's suffix names
    for flag, path in (('--plot', args.plot), ('--plot-sf', args.plot_sf)):
        if not path:
            continue
        fig = draw(common.import_pyplot(flag), flag, done, rows)
        kind = Path(path).suffix[1:].lower()
        if kind not in fig.canvas.get_supported_filetypes():
            raise UserError(f'{flag} {path}: matplotlib writes no {kind!r} files (.png, ...)')
        fig.tight_layout()
        common.write_atomic(path, lambda tmp: fig.savefig(tmp, format=kind, dpi=120))
        if not args.markdown:
            sections.append(f'plot: {path}')
    print('\n\n'.join(sections))


def main(argv=None):
    return common.main(lambda: run(argv))


if __name__ == '__main__':
    sys.exit(main())
