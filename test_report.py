"""report.py on synthetic run directories: numbers, seeds, units, the t-test and its pairing,
errors, paths and flags, damaged logs, plots, and a fuzz test of the command line's contract.

Run:   python -m pytest -q test_report.py
"""
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

import report
from conftest import HYPOTHESIS_FIXTURES, assert_cli_contract, no_hang, odd_paths, run_main

HERE = Path(__file__).resolve().parent
CHARS_PER_STEP = 4 * 512


def config(boundary='whitespace', seed=1337, **kw):
    """A config record as train.py writes it (fields report.py reads, and some it ignores)."""
    return {**dict(kind='config', seed=seed, boundary=boundary, data='data/text8-head',
                   layers='1,4,1', d_model=128, n_head=2, d_head=64, d_inner=512, seq_len=512,
                   batch_size=4, max_steps=300, lr=1e-3, fixed_factor=None, prior=None,
                   params=1_300_000, device='cpu', device_name='cpu', world=1, amp='off',
                   torch='2.13.0', resumed_from=None, out=f'runs/{boundary}-s{seed}'), **kw}


def evals_and_steps(valid, test=None, sf=5.0, flops_per_step=1e9, secs_per_step=0.5, start=0):
    """Train records every 50 steps and a valid eval every 100 (bpc from `valid`), new schema."""
    recs = []
    for i, bpc in enumerate(valid):
        step = start + 100 * i
        if step > start:
            for s in (step - 50, step):
                recs.append(dict(kind='train', step=s, train_chars=s * CHARS_PER_STEP,
                                 train_flops=s * flops_per_step, train_time=s * secs_per_step,
                                 loss=2.0, bpc=bpc, sf=sf,
                                 chars_per_s=CHARS_PER_STEP / secs_per_step))
        recs.append(dict(kind='eval', step=step, split='valid', bpc=bpc, sf=sf, eval_chars=20000,
                         subset=True, train_chars=step * CHARS_PER_STEP,
                         train_flops=step * flops_per_step, train_time=step * secs_per_step))
    if test is not None:
        last = dict(recs[-1], split='test', bpc=test, sf=sf)
        recs.append(last)
    return recs


def write_run(root, name, records):
    d = root / name
    d.mkdir(parents=True)
    (d / 'log.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in records))
    return d


@pytest.fixture
def study(tmp_path):
    """Two seeds of whitespace, one of vanilla, one whitespace run with other layers."""
    write_run(tmp_path, 'ws-s1', [config(seed=1)] + evals_and_steps([4.0, 3.0, 2.5, 2.2], 2.1))
    write_run(tmp_path, 'ws-s2', [config(seed=2)] + evals_and_steps([4.0, 3.2, 2.7, 2.4], 2.4,
                                                                     secs_per_step=0.25))
    write_run(tmp_path, 'none-s1', [config('none', seed=1)]
              + evals_and_steps([4.0, 2.9, 2.4, 2.0], 1.9, sf=1.0, flops_per_step=3e9))
    write_run(tmp_path, 'ws-deep', [config(seed=1, layers='2,4,2')]
              + evals_and_steps([4.0, 3.1, 2.6, 2.3], 2.2))
    return tmp_path


def rows_of(root):
    """The runs table and the seed table as report.py computes them (runs of one unit)."""
    rows = report.one_per_run([report.summarize(r) for r in report.find_runs([str(root)])])
    return {r['run'].name: r for r in rows}, report.experiments(rows)


def test_run_rows_and_seed_means(study):
    rows, groups = rows_of(study)
    ws = rows['ws-s1']
    assert (ws['steps'], ws['train_chars'], ws['train_flops'], ws['train_time']) == \
        (300, 300 * CHARS_PER_STEP, 300e9, 150.0)
    assert (ws['valid_bpc'], ws['test_bpc'], ws['sf'], ws['done']) == (2.2, 2.1, 5.0, True)
    assert ws['chars_per_s'] == pytest.approx(CHARS_PER_STEP / 0.5)
    pooled = [g for g in groups if g['n'] == '2']
    assert len(groups) == 3 and len(pooled) == 1  # other layers, other mode: not pooled
    g = pooled[0]
    assert g['seeds'] == '1,2'
    assert g['test_bpc'][0] == pytest.approx(2.25)
    assert g['test_bpc'][1] == pytest.approx(statistics.stdev([2.1, 2.4]))
    assert g['train_time'][0] == pytest.approx((150 + 75) / 2)
    assert g['chars_per_s'][0] == pytest.approx((4096 + 8192) / 2)


def test_text_table_shows_means_and_varying_flags(study, capsys):
    report.main([str(study)])
    out = capsys.readouterr().out
    runs, seeds = out.split('Mean ± std over seeds')
    assert len(runs.strip().splitlines()) == 3 + 4  # title, blank, header, 4 runs
    assert 'layers=2,4,2' in runs and 'layers=1,4,1' in runs
    line = next(x for x in seeds.splitlines() if x.lstrip().startswith('whitespace')
                and '1,2' in x)
    sd = statistics.stdev([2.1, 2.4])
    assert f'2.2500 ± {sd:.4f}' in line          # test BPC
    assert f'2.3000 ± {statistics.stdev([2.2, 2.4]):.4f}' in line  # last valid BPC
    assert ' 3e11 ' in line and '3e11 ±' not in line  # FLOPs equal over the seeds: no '± 0'



def test_a_flag_only_some_logs_have_splits_experiments(tmp_path, capsys):
    """A flag only some logs have (a newer train.py) splits experiments and is shown as '-' where
    it is missing, or the rows of the two experiments would read the same."""
    for seed in (1, 2):
        write_run(tmp_path, f'ds-s{seed}', [config('unigram', seed=seed, double_sigmoid=True)]
                  + evals_and_steps([4.0, 3.1], 3.0))
        write_run(tmp_path, f'x-s{seed}', [config('unigram', seed=seed, double_sigmoid=True,
                                                  newer_flag=7)] + evals_and_steps([4.0, 3.1], 3.0))
    report.main([str(tmp_path)])
    seeds = capsys.readouterr().out.split('Mean ± std over seeds')[1]
    rows = [x for x in seeds.splitlines() if x.lstrip().startswith('unigram')]
    assert len(rows) == 2
    assert any('newer_flag=-' in x for x in rows) and any('newer_flag=7' in x for x in rows)


def test_final_full_split_validation_is_the_tables_valid_bpc(tmp_path):
    """train.py validates on a 20k-character subset during training and on the whole split at the
    end: the end point is the table's valid BPC."""
    recs = evals_and_steps([4.0, 3.0, 2.5])
    full = dict(recs[-1], step=300, bpc=2.9, subset=False, eval_chars=200_000,
                train_chars=300 * CHARS_PER_STEP, train_flops=3e11, train_time=150.0)
    write_run(tmp_path, 'ws', [config()] + recs + [full, dict(full, split='test', bpc=3.0)])
    rows, _ = rows_of(tmp_path)
    assert rows['ws']['valid_bpc'] == 2.9 and rows['ws']['test_bpc'] == 3.0


def test_resume_and_restart_drop_redone_records(tmp_path):
    """Killed at step 350 after its checkpoint at 200: steps 201-350 are redone after the resume
    (now at 300); a run that started over (no checkpoint yet): none of its first attempt counts."""
    recs = [config()] + evals_and_steps([4.0, 3.0, 2.5, 9.9])
    recs += [dict(recs[-2], step=350, bpc=9.9)]
    recs += [config(resumed_from=200)] + evals_and_steps([2.5, 2.2], 2.1, start=200)[1:]
    write_run(tmp_path, 'resumed', recs)
    write_run(tmp_path, 'restarted', [config()] + evals_and_steps([4.0, 1.0, 1.0, 1.0, 1.0])
              + [config()] + evals_and_steps([4.0, 3.0, 2.5, 2.2], 2.1))
    for name in ('resumed', 'restarted'):
        row = report.summarize(tmp_path / name)
        assert (row['valid_bpc'], row['test_bpc']) == (2.2, 2.1), name
        assert (row['steps'], row['train_chars']) == (300, 300 * CHARS_PER_STEP), name


def test_unfinished_runs_are_shown_as_such(tmp_path, capsys):
    d = write_run(tmp_path, 'partial', [config()] + evals_and_steps([4.0, 3.0]))
    with open(d / 'log.jsonl', 'a') as f:
        f.write('{"kind": "train", "step": 1')  # a record being written right now
    write_run(tmp_path, 'starting', [])  # its config record not yet written
    rows, _ = rows_of(tmp_path)
    assert (rows['partial']['done'], rows['partial']['test_bpc']) == (False, None)
    assert (rows['starting']['steps'], rows['starting']['done']) == (0, False)
    report.main([str(d)])
    line = capsys.readouterr().out.splitlines()[-1]
    assert ' 100 unfinished ' in line and line.split()[-3] == '-'  # no test BPC


def test_runs_ended_by_a_flop_budget_show_it_in_a_budget_column(tmp_path, capsys):
    # train.py --flop-budget sets max_steps out of reach; the budget, not those flags, is shown
    write_run(tmp_path, 'none-s1', [config('none', seed=1)] + evals_and_steps([4.0, 3.0], 2.9))
    write_run(tmp_path, 'ws-flops-s1', [config(seed=1, max_steps=10**9, flop_budget=3.91e13)]
              + evals_and_steps([4.0, 3.0, 2.5], 2.4))
    d = write_run(tmp_path, 'ws-flops-s2', [config(seed=2, max_steps=10**9, flop_budget=3.91e13)]
                  + evals_and_steps([4.0, 3.1]))
    report.main([str(tmp_path)])
    out = capsys.readouterr().out
    head, *lines = out.split('Mean')[0].strip().splitlines()[2:]
    assert 'budget' in head.split() and 'flags' not in head.split()
    assert '1000000000' not in out and 'flop_budget' not in out
    line = {n: next(x for x in lines if f'/{n} ' in x) for n in ('none-s1', 'ws-flops-s1',
                                                                  'ws-flops-s2')}
    assert ' 300 steps ' in line['none-s1'] and ' 3.91e13 FLOPs ' in line['ws-flops-s1']
    assert ' 100 unfinished ' in line['ws-flops-s2']
    rows, _ = rows_of(tmp_path)
    assert rows['ws-flops-s1']['flop_budget'] == 3.91e13 and rows['none-s1']['flop_budget'] is None
    d.joinpath('log.jsonl').unlink()
    d.rmdir()
    write_run(tmp_path, 'none-s2', [config('none', seed=2)] + evals_and_steps([4.0, 3.0], 2.8))
    report.main([str(tmp_path / 'none-s1'), str(tmp_path / 'none-s2')])
    assert 'budget' not in capsys.readouterr().out  # no run with a FLOP budget: no column


def test_by_data_puts_each_dataset_in_a_column(tmp_path, capsys):
    """--by-data: a row per source (with its knob: fixed k, Gumbel α) and budget, a column per
    dataset (a Unigram label set's dataset is one too); unfinished runs and datasets without a
    finished run are left out."""
    def run(name, data, boundary='whitespace', seed=1, test=2.0, **kw):
        write_run(tmp_path, name, [config(boundary, seed=seed, data=f'data/{data}', **kw)]
                  + evals_and_steps([4.0, 3.0, 2.5], test))
    run('en-ws-s1', 'en', test=2.0)
    run('en-ws-s2', 'en', seed=2, test=2.2)
    run('fi-ws-s1', 'fi', test=1.5)
    run('en-g-s1', 'en', 'gumbel', prior=0.2, test=2.4)
    run('fi-g-s1', 'fi', 'gumbel', prior=0.37, test=1.7)
    run('fi-f3-s1', 'fi', 'fixed', fixed_factor=3, test=1.9)
    run('en-ws-flops-s1', 'en', max_steps=10**9, flop_budget=2e12, test=1.8)
    run('fi-u200-s1', 'fi-u200', 'unigram', test=1.55)
    write_run(tmp_path, 'he-ws-s1', [config(data='data/he')] + evals_and_steps([4.0, 3.0]))
    report.main([str(tmp_path), '--by-data', '--markdown'])
    table = capsys.readouterr().out.split('by dataset')[1].strip().splitlines()
    assert table[0] == '| mode | budget | en | fi | fi-u200 |'  # he: no finished run
    cells = {tuple(x.split(' | ')[:2]): x.split(' | ')[2:] for x in table[2:]}
    sd = statistics.stdev([2.0, 2.2])
    assert cells[('| whitespace', '300 steps')] == [f'2.1000 ± {sd:.4f} (5.00, n=2)',
                                                   '1.5000 (5.00, n=1)', '- |']
    assert cells[('| gumbel α=0.2', '300 steps')] == ['2.4000 (5.00, n=1)', '-', '- |']
    assert cells[('| gumbel α=0.37', '300 steps')] == ['-', '1.7000 (5.00, n=1)', '- |']
    assert cells[('| fixed k=3', '300 steps')] == ['-', '1.9000 (5.00, n=1)', '- |']
    assert cells[('| unigram', '300 steps')] == ['-', '-', '1.5500 (5.00, n=1) |']
    assert cells[('| whitespace', '2e12 FLOPs')] == ['1.8000 (5.00, n=1)', '-', '- |']
    assert len(table) == 2 + 6


def test_markdown(study, capsys):
    report.main([str(study), '--markdown'])
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == ['### Runs', ''] and out[8:11] == ['', '### Mean ± std over seeds', '']
    head, sep, body = out[2], out[3], out[4:8]
    n = head.count('|')
    assert head.startswith('| run | mode | data | flags | seed | steps |')
    assert head.endswith('| test BPC | SF | chars/s |')
    assert sep == '|' + '---|' * (n - 1) and all(x.count('|') == n for x in body)
    ws1 = next(x for x in body if '/ws-s1 |' in x).split(' | ')
    assert ws1[-4:-1] == ['2.2000', '2.1000', '5.00']
    assert out[15].startswith('| whitespace | text8-head |') and out[16] == ''
    # one seed of vanilla: a p column of '-', the test named under the table
    assert out[11].split(' | ')[-2:] == ['chars/s', 'p vs none |']
    assert out[13].split(' | ')[-1] == '- |' and out[17:] == [report.SIGNIFICANCE]


# ---------------------------------------------------------------------------------------------
# The paper's significance test: paired by seed against vanilla and every fixed k
# ---------------------------------------------------------------------------------------------
def seeded_runs(root, test_bpc, **kw):
    """A finished run per source and seed: test_bpc = {'none' | 'fixed<k>' | mode: {seed: BPC}}."""
    for source, seeds in test_bpc.items():
        k = int(source[5:]) if source.startswith('fixed') else None
        for seed, bpc in seeds.items():
            write_run(root, f'{source}-s{seed}', [config('fixed' if k else source, seed=seed,
                                                         fixed_factor=k, **kw)]
                      + evals_and_steps([4.0, 3.0], bpc))


def md_table(out, title):
    """{mode (' @ budget' where a budget column is): {column head: cell}} of the Markdown table
    after `title` in report.py's output."""
    return {' @ '.join(r[k] for k in ('mode', 'budget') if k in r): r for r in md_rows(out, title)}


def md_rows(out, title):
    """[{column head: cell}] of the Markdown table after `title` in report.py's output."""
    lines = out.split(title)[1].strip().split('\n\n')[0].splitlines()
    cells = [[c.strip() for c in x.strip().strip('|').split('|')] for x in lines]
    return [dict(zip(cells[0], x)) for x in cells[2:]]


def hand_p(a, b):
    """Two-sided p of the paired t-test, by hand: t = mean(d) / (stdev(d) / sqrt(n)), n - 1 df."""
    from scipy.stats import t as student
    d = [x - y for x, y in zip(a, b)]
    t = statistics.mean(d) / (statistics.stdev(d) / math.sqrt(len(d)))
    return 2 * student.sf(abs(t), len(d) - 1)


WS = {1: 1.90, 2: 1.95, 3: 1.88}


def significant(cell):
    return cell == '<0.001' or cell != '-' and float(cell) < 0.05


def test_star_only_where_every_baseline_is_beaten_at_p_below_005(tmp_path, capsys):
    """Better than vanilla and fixed k=2 at p < 0.05: a star, in the seeds table and --by-data. A
    source worse than vanilla at p < 0.05 (entropy), or not significantly better than a fixed k=3
    added later: none."""
    seeded_runs(tmp_path, {'none': {1: 2.05, 2: 2.08, 3: 2.04},
                           'fixed2': {1: 2.00, 2: 2.06, 3: 1.99},
                           'whitespace': WS, 'entropy': {1: 2.15, 2: 2.20, 3: 2.13}})
    assert report.main([str(tmp_path), '--markdown', '--by-data']) == 0
    out = capsys.readouterr().out
    seeds, data = md_table(out, 'over seeds'), md_table(out, 'by dataset')
    assert all(significant(seeds['whitespace'][f'p vs {b}']) for b in ('none', 'fixed k=2'))
    assert seeds['whitespace']['test BPC'].endswith(' *')
    assert ' * (' in data['whitespace @ 300 steps']['text8-head']
    assert significant(seeds['entropy']['p vs none']) and '*' not in seeds['entropy']['test BPC']
    close = {s: b + d for (s, b), d in zip(WS.items(), (0.10, -0.15, 0.08))}   # a bit worse
    seeded_runs(tmp_path, {'fixed3': close})
    assert report.main([str(tmp_path), '--markdown', '--by-data']) == 0
    out = capsys.readouterr().out
    seeds, data = md_table(out, 'over seeds'), md_table(out, 'by dataset')
    assert not significant(seeds['whitespace']['p vs fixed k=3'])
    assert '*' not in seeds['whitespace']['test BPC'] + data['whitespace @ 300 steps']['text8-head']


def test_no_star_for_a_baseline_nor_without_vanilla(tmp_path, capsys):
    """The paper stars a source better than vanilla and fixed pooling: never a baseline itself
    (fixed k=2 far below vanilla), never a source shown against fixed pooling alone."""
    seeded_runs(tmp_path / 'a', {'none': {1: 2.50, 2: 2.61, 3: 2.55}, 'fixed2': WS})
    seeded_runs(tmp_path / 'b', {'fixed2': {1: 2.50, 2: 2.61, 3: 2.55}, 'whitespace': WS})
    for folder, source, base in (('a', 'fixed k=2', 'none'), ('b', 'whitespace', 'fixed k=2')):
        assert report.main([str(tmp_path / folder), '--markdown']) == 0
        seeds = md_table(capsys.readouterr().out, 'over seeds')
        assert significant(seeds[source][f'p vs {base}'])
        assert not any('*' in row['test BPC'] for row in seeds.values()), folder


def test_a_sub_sampled_source_is_starred_against_the_baselines_not_its_mean_twin(tmp_path, capsys):
    """whitespace (last) beats vanilla and fixed k=2 but not its mean-pooled twin: the star is
    the paper's Table 1 question; the twin's p (Table 2) is shown and does not take it away."""
    seeded_runs(tmp_path / 'mean', {'none': {1: 2.05, 2: 2.08, 3: 2.04},
                                    'fixed2': {1: 2.00, 2: 2.06, 3: 1.99}, 'whitespace': WS})
    seeded_runs(tmp_path / 'last', {'whitespace': {1: 1.91, 2: 1.93, 3: 1.89}}, pooling='last')
    assert report.main([str(tmp_path), '--markdown']) == 0
    seeds = md_table(capsys.readouterr().out, 'over seeds')
    last = seeds['whitespace (last)']
    assert not significant(last['p vs whitespace']) and last['test BPC'].endswith(' *')


def test_paired_t_test_against_each_baseline_is_the_hand_computed_one(tmp_path, capsys):
    none, fixed2 = {1: 2.05, 2: 2.08, 3: 2.04}, {1: 1.93, 2: 2.10, 3: 1.95}
    seeded_runs(tmp_path, {'none': none, 'fixed2': fixed2, 'whitespace': WS})
    assert report.main([str(tmp_path), '--markdown']) == 0
    seeds = md_table(capsys.readouterr().out, 'Mean ± std over seeds')
    for label, base in (('none', none), ('fixed k=2', fixed2)):
        p = hand_p(WS.values(), base.values())
        assert seeds['whitespace'][f'p vs {label}'] == f'{p:.3f}', label
    # vanilla against fixed k=2 (and not against itself)
    assert seeds['none']['p vs fixed k=2'] == f'{hand_p(none.values(), fixed2.values()):.3f}'
    assert seeds['none']['p vs none'] == '-'


def test_seeds_that_do_not_pair_are_left_out(tmp_path, capsys):
    """Seed 3 without a vanilla run: left out, the p of seeds 1 and 2 (by hand); fixed k=2 shares
    one seed only, and a FLOP-budget run pairs with no equal-step baseline: '-'."""
    none = {1: 2.05, 2: 2.08}
    seeded_runs(tmp_path, {'none': none, 'fixed2': {3: 2.0, 4: 2.1}, 'whitespace': WS})
    write_run(tmp_path, 'ws-flops-s1', [config(seed=1, max_steps=10**9, flop_budget=1e12)]
              + evals_and_steps([4.0, 3.0], 1.8))
    write_run(tmp_path, 'ws-flops-s2', [config(seed=2, max_steps=10**9, flop_budget=1e12)]
              + evals_and_steps([4.0, 3.0], 1.7))
    assert report.main([str(tmp_path), '--markdown']) == 0
    out = capsys.readouterr().out
    seeds = md_table(out, 'over seeds')
    ws = seeds['whitespace @ 300 steps']
    assert ws['p vs none'] == f'{hand_p([WS[1], WS[2]], none.values()):.3f}'
    assert ws['p vs fixed k=2'] == '-'
    flops = seeds['whitespace @ 1e12 FLOPs']
    assert flops['p vs none'] == flops['p vs fixed k=2'] == '-'

def test_a_flop_budget_run_is_paired_with_the_vanilla_runs_that_spent_its_budget(tmp_path, capsys):
    """Equal compute: whitespace trained to vanilla's FLOPs (1e11: 100 steps of 1e9) is paired by
    seed with those vanilla runs (p by hand) and starred; not with vanilla of another shape, nor
    at another budget (2e11: '-')."""
    none = {1: 2.05, 2: 2.08, 3: 2.04}
    seeded_runs(tmp_path / 'none', {'none': none})
    seeded_runs(tmp_path / 'other', {'none': {1: 1.5, 2: 1.6, 3: 1.55}}, layers='2,8,2')
    for budget, root in ((1e11, 'spent'), (2e11, 'more')):
        seeded_runs(tmp_path / root, {'whitespace': WS}, max_steps=10**9, flop_budget=budget)
    assert report.main([str(tmp_path), '--markdown']) == 0
    seeds = md_table(capsys.readouterr().out, 'over seeds')
    spent, more = seeds['whitespace @ 1e11 FLOPs'], seeds['whitespace @ 2e11 FLOPs']
    assert spent['p vs none'] == f'{hand_p(WS.values(), none.values()):.3f}'
    assert spent['test BPC'].endswith(' *') and more['p vs none'] == '-'


def test_each_source_is_paired_with_the_baselines_of_its_own_model_shape(tmp_path, capsys):
    """Two layer counts: whitespace at 2,8,2 is tested against vanilla at 2,8,2 and whitespace at
    1,4,1 against vanilla at 1,4,1, never across shapes (issue #26); pooling by the last token is
    another source with its own row and label, paired with the same vanilla."""
    small, big = {1: 2.05, 2: 2.08, 3: 2.04}, {1: 1.80, 2: 1.86, 3: 1.83}
    seeded_runs(tmp_path / 'small', {'none': small, 'whitespace': WS}, layers='1,4,1')
    seeded_runs(tmp_path / 'big', {'none': big, 'whitespace': WS}, layers='2,8,2')
    last = {s: b + 0.01 + 0.004 * s for s, b in WS.items()}
    seeded_runs(tmp_path / 'last', {'whitespace': last}, layers='2,8,2', pooling='last')
    assert report.main([str(tmp_path), '--markdown']) == 0
    out = capsys.readouterr().out
    lines = out.split('over seeds')[1].strip().splitlines()[2:]
    cells = [[c.strip() for c in x.strip('|').split('|')] for x in lines if x.startswith('|')]
    heads = [c.strip() for c in out.split('over seeds')[1].strip().splitlines()[0].strip('|')
             .split('|')]
    rows = {(r[0], r[heads.index('flags')]): dict(zip(heads, r)) for r in cells}
    for layers, none in (('1,4,1', small), ('2,8,2', big)):
        ws = rows['whitespace', f'layers={layers}']
        assert ws['p vs none'] == f'{hand_p(WS.values(), none.values()):.3f}', layers
    ws_last = rows['whitespace (last)', 'layers=2,8,2']
    assert ws_last['p vs none'] == f'{hand_p(last.values(), big.values()):.3f}'
    # the paper's Table 2: sub-sampling against the same source pooled by the mean, same shape
    assert ws_last['p vs whitespace'] == f'{hand_p(last.values(), WS.values()):.3f}'
    assert rows['whitespace', 'layers=2,8,2']['p vs whitespace'] == '-'   # not against itself


# ---------------------------------------------------------------------------------------------
# Units: a byte run's records carry bpb, never in one column with a character run's bpc
# ---------------------------------------------------------------------------------------------
def byte_runs(root, test_bpb, **kw):
    """seeded_runs of byte runs: a config record with unit 'byte', bpb where bpc was."""
    seeded_runs(root, test_bpb, unit='byte', encoding='bytes', **kw)
    for log in root.glob('*/log.jsonl'):
        recs = [json.loads(x) for x in log.read_text().splitlines()]
        for r in recs:
            if 'bpc' in r:
                r['bpb'] = r.pop('bpc')
        log.write_text(''.join(json.dumps(r) + '\n' for r in recs))


def test_byte_runs_are_tables_of_their_own_in_bpb(tmp_path, capsys):
    """Runs of both units (datasets of one name in two folders): a byte run's BPB never shares a
    column with BPC, its seeds are paired only with byte runs (p by hand), --by-data too."""
    none_chars = {1: 2.05, 2: 2.08, 3: 2.04}
    none_bytes = {1: 1.60, 2: 1.70, 3: 1.62}
    ws_bytes = {1: 1.50, 2: 1.58, 3: 1.57}
    seeded_runs(tmp_path / 'chars', {'none': none_chars, 'whitespace': WS}, data='chars/en')
    byte_runs(tmp_path / 'bytes', {'none': none_bytes, 'whitespace': ws_bytes}, data='bytes/en')
    assert report.main([str(tmp_path), '--markdown', '--by-data']) == 0
    out = capsys.readouterr().out.replace(report.SIGNIFICANCE, '')
    chars, on_bytes = out.split('### Runs on bytes')
    for title in ('Runs', 'Mean ± std over seeds', 'Test BPC (SF, seeds) by dataset'):
        assert f'### {title}\n' in chars
    for title in ('Mean ± std over seeds on bytes', 'Test BPB (SF, seeds) by dataset'):
        assert f'### {title}\n' in on_bytes
    assert 'BPB' not in chars and 'BPC' not in on_bytes
    seeds = md_table(chars, 'over seeds')
    assert seeds['whitespace']['p vs none'] == f'{hand_p(WS.values(), none_chars.values()):.3f}'
    assert seeds['whitespace']['test BPC'].startswith(f'{statistics.mean(WS.values()):.4f} ± ')
    seeds = md_table(on_bytes, 'over seeds on bytes')
    assert seeds['whitespace']['p vs none'] == \
        f'{hand_p(ws_bytes.values(), none_bytes.values()):.3f}'
    assert seeds['none']['test BPB'].startswith(f'{statistics.mean(none_bytes.values()):.4f} ± ')
    # two datasets named en: each named by its path
    assert md_table(on_bytes, 'by dataset')['none @ 300 steps']['bytes/en'].endswith(' (5.00, n=3)')
    runs = md_table(out, 'Runs on bytes')
    assert {r['valid BPB'] for r in runs.values()} == {'3.0000'}
    assert {r['train bytes'] for r in runs.values()} == {f'{100 * CHARS_PER_STEP:,}'}
    assert 'bytes/s' in next(iter(runs.values()))


def test_a_plot_of_both_units_is_refused_per_axis():
    """BPB and BPC never share an axis: a plot over runs of both units is one error line naming
    the flag; one unit's runs give its label."""
    rows = [dict(bits='BPC'), dict(bits='BPB')]
    with pytest.raises(report.UserError, match='--plot: runs in BPC and in BPB'):
        report.bits_of(rows, '--plot')
    assert report.bits_of(rows[1:], '--plot') == 'BPB' and report.bits_of([], '--plot') == 'BPC'


@pytest.mark.plots
def test_plot_sf_labels_each_panel_by_its_unit(tmp_path, monkeypatch):
    pytest.importorskip('matplotlib')
    seeded_runs(tmp_path / 'chars', {'whitespace': WS}, data='data/en')
    byte_runs(tmp_path / 'bytes', {'whitespace': WS}, data='data/en-bytes')
    seen = spy_on_figures(monkeypatch)
    assert report.main([str(tmp_path), '--plot-sf', str(tmp_path / 'sf.png')]) == 0
    assert [ax.get_ylabel() for ax in seen['--plot-sf'].axes] == ['test BPC', 'test BPB']
    assert report.main([str(tmp_path), '--plot', str(tmp_path / 'p.png')]) == 1
    assert not (tmp_path / 'p.png').exists()


def test_cli_errors_are_one_line(tmp_path, capsys):
    (tmp_path / 'empty').mkdir()
    (tmp_path / 'notalog').mkdir()
    (tmp_path / 'notalog' / 'log.jsonl').write_text('hello\n{"kind": "config"}\n')
    for args, code, says in (([tmp_path / 'empty'], 1, 'is not a run'),
                             ([tmp_path / 'missing'], 1, 'No such file or directory'),
                             ([tmp_path / 'notalog'], 1, 'line 1 is not a JSON object'),
                             ([tmp_path / 'empty', '--by-data=x'], 2, '--by-data')):
        assert report.main([str(a) for a in args]) == code, args
        out, err = capsys.readouterr()
        assert out == '' and err.count('\n') == 1 and err.startswith('error: '), err
        assert says in err


def test_a_full_stdout_is_one_error_line(study):
    """`python report.py` as README runs it: the tables are printed inside common.main, so a full
    disk (/dev/full) is one `error:` line and exit 1, not an OSError traceback at exit."""
    with open('/dev/full', 'w') as full:
        r = subprocess.run([sys.executable, str(HERE / 'report.py'), str(study)], stdout=full,
                           stderr=subprocess.PIPE, text=True, timeout=60)
    assert r.returncode == 1 and r.stderr.count('\n') == 1, r.stderr
    assert r.stderr.startswith('error: ') and 'No space left' in r.stderr

@pytest.mark.plots
def test_plot_writes_a_png(study, tmp_path, capsys, monkeypatch):
    """--plot: the Pareto figure of every finished experiment in one panel, a line per source."""
    pytest.importorskip('matplotlib')
    seen = spy_on_figures(monkeypatch)
    png = tmp_path / 'study.png'
    assert report.main([str(study), '--plot', str(png)]) == 0
    ax, *curves = seen['--plot'].axes
    assert ax.get_title() == 'test BPC against SF'
    assert sorted(xy for _, xy, _ in drawn(ax)) == [(1.0, 1.9), (5.0, 2.2), (5.0, 2.25)]
    assert png.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n' and png.stat().st_size > 10_000
    assert [p.name for p in tmp_path.iterdir() if p.suffix == '.tmp' or 'tmp' in p.name] == []
    assert f'plot: {png}' in capsys.readouterr().out
    assert [c.get_title() for c in curves] == [f'valid BPC against training {x}' for x in
                                               ('characters', 'seconds', 'FLOPs')]


@pytest.mark.plots
def test_plot_draws_each_runs_curves_from_its_log(study, tmp_path, monkeypatch):
    """--plot's curve panels: valid BPC against training characters, seconds and FLOPs, one line
    per run (unfinished ones too) with the points of its log.jsonl's validations, a legend entry
    per source; on bytes, BPB against bytes."""
    pytest.importorskip('matplotlib')
    write_run(study, 'none-s9', [config('none', seed=9)] + evals_and_steps([4.0, 3.5]))
    seen = spy_on_figures(monkeypatch)
    assert report.main([str(study), '--plot', str(tmp_path / 'p.png')]) == 0
    _, *curves = seen['--plot'].axes
    logs = sorted(study.glob('*/log.jsonl'))
    for ax, field in zip(curves, ('train_chars', 'train_time', 'train_flops')):
        want = []
        for log in logs:
            recs = [json.loads(x) for x in log.read_text().splitlines()]
            want.append([(rec[field], rec['bpc']) for rec in recs
                         if rec['kind'] == 'eval' and rec['split'] == 'valid'])
        lines = [[tuple(xy) for xy in line.get_xydata().tolist()] for line in ax.get_lines()]
        assert sorted(lines) == sorted(want), field
        assert [t.get_text() for t in ax.get_legend().get_texts()] == ['none', 'whitespace']
    byte_runs(tmp_path / 'bytes', {'none': {1: 1.6}})
    assert report.main([str(tmp_path / 'bytes'), '--plot', str(tmp_path / 'b.png')]) == 0
    assert seen['--plot'].axes[1].get_title() == 'valid BPB against training bytes'


def spy_on_figures(monkeypatch):
    """{flag: figure} of the figures report.py draws (their axes read back after saving)."""
    seen, draw = {}, report.draw

    def spy(plt, flag, done, runs):
        seen[flag] = draw(plt, flag, done, runs)
        return seen[flag]
    monkeypatch.setattr(report, 'draw', spy)
    return seen


def drawn(ax):
    """[(label, (x, y), y error)] of each point of each errorbar line in a panel."""
    out = []
    for c in ax.containers:
        bars = c.lines[2][-1].get_segments() if c.lines[2] else None
        out += [(c.get_label(), tuple(xy), bars[i][1][1] - xy[1] if bars else None)
                for i, xy in enumerate(c.lines[0].get_xydata().tolist())]
    return out


@pytest.mark.plots
def test_plot_sf_draws_a_panel_per_dataset(tmp_path, capsys, monkeypatch):
    pytest.importorskip('matplotlib')
    for data, test in (('en', 2.0), ('fi', 1.5)):
        write_run(tmp_path, f'{data}-ws', [config(data=f'data/{data}')]
                  + evals_and_steps([4.0, 3.0], test))
        write_run(tmp_path, f'{data}-ws-flops', [config(data=f'data/{data}', max_steps=10**9,
                                                        flop_budget=1e12)]
                  + evals_and_steps([4.0, 3.0, 2.5], test - 0.1))
    write_run(tmp_path, 'he-ws', [config(data='data/he')] + evals_and_steps([4.0]))  # unfinished
    write_run(tmp_path, 'fi-u200', [config('unigram', data='data/fi-u200')]   # fi's panel
              + evals_and_steps([4.0, 3.0], 1.45, sf=3.0))
    seen = spy_on_figures(monkeypatch)
    png = tmp_path / 'sf.png'
    assert report.main([str(tmp_path / 'en-ws'), str(tmp_path / 'en-ws-flops'), str(tmp_path),
                        '--plot-sf', str(png)]) == 0
    assert png.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    axes = seen['--plot-sf'].axes
    assert [ax.get_title() for ax in axes] == ['en: test BPC against SF',
                                              'fi: test BPC against SF']  # he: unfinished
    assert sorted(xy for _, xy, _ in drawn(axes[1])) == [(3.0, 1.45), (5.0, 1.4), (5.0, 1.5)]
    assert [[t.get_text() for t in ax.get_legend().get_texts()] for ax in axes] == \
        [['whitespace', 'whitespace, FLOP budget'],
         ['whitespace', 'whitespace, FLOP budget', 'unigram']]
    assert f'plot: {png}' in capsys.readouterr().out
    assert report.main([str(tmp_path), '--plot-sf', str(tmp_path / 'sf.xyz')]) == 1
    assert '--plot-sf' in capsys.readouterr().err

def test_plot_without_matplotlib_is_one_line(study, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, 'matplotlib', None)  # as if it were not installed
    rc = report.main([str(study), '--plot', str(tmp_path / 'study.png')])
    one_error_line(capsys, rc, 1, 'error: --plot needs matplotlib')
    assert not list(tmp_path.glob('study*'))


@pytest.mark.plots
def test_plot_in_an_unknown_format_is_one_line(study, tmp_path, capsys):
    pytest.importorskip('matplotlib')
    one_error_line(capsys, report.main([str(study), '--plot', str(tmp_path / 'study.xyz')]), 1,
                   "no 'xyz' files")
    assert not list(tmp_path.glob('*study*'))  # nor a temporary file


def one_error_line(capsys, rc, code, *words):
    """Exit `code`, nothing on stdout, one `error:` line on stderr naming each of `words`."""
    out, err = capsys.readouterr()
    assert rc == code and out == '' and err.count('\n') == 1 and err.startswith('error: '), err
    assert all(w in err for w in words), err


def odd_run_paths(root):
    """conftest's odd_paths and runs whose log.jsonl is a directory or a FIFO."""
    (root / 'run-log-dir' / 'log.jsonl').mkdir(parents=True)
    (root / 'run-log-fifo').mkdir()
    os.mkfifo(root / 'run-log-fifo' / 'log.jsonl')
    return dict(odd_paths(root), **{'log-is-a-dir': root / 'run-log-dir',
                                    'log-is-a-fifo': root / 'run-log-fifo',
                                    'log-fifo-itself': root / 'run-log-fifo' / 'log.jsonl'})


def test_odd_run_paths_are_one_line(tmp_path, capsys):
    """A run path that cannot be read: one line naming it, exit 1; never a traceback, never a hang
    on a FIFO. The same for a log.jsonl found below a folder."""
    odd = odd_run_paths(tmp_path)
    for case, words in (('too-long', 'File name too long'), ('too-deep', 'No such file'),
                        ('through-a-file', 'Not a directory'), ('fifo', 'Not a directory'),
                        ('dir', 'is not a run'), ('log-is-a-dir', 'is not a regular file'),
                        ('log-is-a-fifo', 'is not a regular file'),
                        ('log-fifo-itself', 'Not a directory')):
        with no_hang():
            one_error_line(capsys, report.main([str(odd[case])]), 1, words)
    with no_hang():   # found by the search below a folder
        one_error_line(capsys, report.main([str(tmp_path)]), 1, 'log.jsonl is not a regular file')


def test_unreadable_log_is_one_line(study, capsys, monkeypatch):
    """A log this user may not read (simulated: tests may run as root, who reads everything)."""
    def denied(path):
        raise PermissionError(13, 'Permission denied', str(path))

    monkeypatch.setattr(Path, 'read_bytes', denied)
    assert report.main([str(study / 'ws-s1')]) == 1
    out, err = capsys.readouterr()
    assert out == '' and err == f"error: {study / 'ws-s1' / 'log.jsonl'}: Permission denied\n"


class StandInFigure:
    """A figure of no axes that saves a stand-in PNG: --plot's path handling without matplotlib."""
    axes, canvas = [], types.SimpleNamespace(get_supported_filetypes=lambda: {'png': 'PNG'})

    def tight_layout(self):
        pass

    def savefig(self, path, **kwargs):
        Path(path).write_bytes(b'\x89PNG whole')


def stand_in_for_matplotlib(monkeypatch):
    monkeypatch.setattr(report.common, 'import_pyplot', lambda flag: types.SimpleNamespace(
        close=lambda fig: None))
    monkeypatch.setattr(report, 'draw', lambda plt, flag, done, runs: StandInFigure())


def test_odd_plot_paths_are_one_line_before_any_table(study, tmp_path, capsys, monkeypatch):
    """The OS names what is wrong with a --plot path; the plot is drawn before the tables print."""
    stand_in_for_matplotlib(monkeypatch)
    (tmp_path / 'odd').mkdir()
    odd = odd_run_paths(tmp_path / 'odd')
    for case, words in (('too-long', 'File name too long'), ('too-deep', 'No such file'),
                        ('through-a-file', 'Not a directory'), ('fifo', 'not a regular file'),
                        ('dir', 'not a regular file')):
        path = odd[case].with_suffix('.png')
        if case in ('dir', 'fifo'):  # a folder or a FIFO where the plot belongs
            path.mkdir() if case == 'dir' else os.mkfifo(path)
        with no_hang():
            rc = report.main([str(study / 'ws-s1'), '--plot', str(path)])
        one_error_line(capsys, rc, 1, words)


def test_bad_flags_are_one_line_exit_2(study, capsys):
    for flags in (['--plot', ''], ['--plot-sf', ' '], ['--plot', 'a\0b'], ['--markdown=yes']):
        one_error_line(capsys, report.main([str(study)] + flags), 2, flags[0].split('=')[0])


def test_a_cut_last_line_is_skipped_saying_so(study, capsys):
    """A run killed while writing a record: the whole lines are read, the cut one is left out with
    a note; a line that is not JSON anywhere else (the last one too, when whole) is refused."""
    log = study / 'ws-s1' / 'log.jsonl'
    whole = log.read_text()
    log.write_text(whole + '{"kind": "train", "step": 350, "tra')
    assert report.main([str(study / 'ws-s1')]) == 0
    out, err = capsys.readouterr()
    cut = whole.count(chr(10)) + 1
    assert err == f'note: {log}: skipped its last line {cut}, cut short\n'
    assert ' 2.1000 ' in out.splitlines()[-1]  # the whole lines: test BPC and all
    lines = whole.splitlines()
    for damaged, bad in ((lines[:3] + ['{"kind": "tr'] + lines[3:], 4),
                         (lines + ['{"kind": "tr'], len(lines) + 1)):
        log.write_text('\n'.join(damaged) + '\n')
        one_error_line(capsys, report.main([str(study / 'ws-s1')]), 1,
                       f'{log} line {bad} is not a JSON object')


def test_wrong_field_types_are_one_line_naming_line_and_field(tmp_path, capsys):
    """A record with no number where report.py reads one (a train or eval record: no step) is one
    line naming the log, the line and the field, exit 1. (A null BPC is a record without a number:
    shown as '-'.)"""
    for i, (field, value) in enumerate((('bpc', 'abc'), ('step', '100'), ('step', True),
                                        ('step', -1), ('train_flops', 10**400), ('sf', [5]),
                                        ('resumed_from', 'x'), ('step', None), ('bpc', None))):
        recs = [config()] + evals_and_steps([4.0, 3.0, 2.5], 2.4)
        line = 1 if field == 'resumed_from' else len(recs)  # the config, or the test evaluation
        recs[line - 1] = dict(recs[line - 1], **{field: value})
        d = write_run(tmp_path, f'run{i}', recs)
        rc = report.main([str(d)])
        if (field, value) == ('bpc', None):
            out, err = capsys.readouterr()
            assert rc == 0 and err == '' and out.splitlines()[-1].split()[-3] == '-', out
        else:
            one_error_line(capsys, rc, 1, f"{d / 'log.jsonl'} line {line}: ",
                           f'{field} must be a number')


def test_non_finite_bpc_of_seeds_is_shown_as_missing(tmp_path, capsys):
    """Two seeds, one diverged (NaN BPC): their mean and spread are '-', not a crash
    (statistics.stdev cannot take NaN)."""
    write_run(tmp_path, 's1', [config(seed=1)] + evals_and_steps([4.0, 3.0], float('nan')))
    write_run(tmp_path, 's2', [config(seed=2)] + evals_and_steps([4.0, float('inf')], 2.0))
    assert report.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    seeds = out.split('Mean ± std over seeds')[1].splitlines()[-1]
    assert seeds.split()[-3:-1] == ['-', '5.00'] and ' - ' in seeds
    _, groups = rows_of(tmp_path)
    assert math.isnan(groups[0]['test_bpc'][1])  # the spread is unknown: NaN, not a crash


def test_a_table_imports_no_torch(study):
    """`python report.py` prints its tables without importing torch (nor dynpool): the mode names
    come from the runs' records (python -X importtime lists every module imported)."""
    r = subprocess.run([sys.executable, '-X', 'importtime', str(HERE / 'report.py'), str(study),
                        '--by-data'], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and 'Mean ± std over seeds' in r.stdout, r.stderr[-2000:]
    imported = {line.split('|')[-1].strip() for line in r.stderr.splitlines()
                if line.startswith('import time:')}
    assert 'scipy' in imported   # (what -X importtime lists)
    assert not {'torch', 'dynpool', 'hnet'} & imported


# ---------------------------------------------------------------------------------------------
# Fuzz: random damage to the logs and random flags keep the command line's contract
# ---------------------------------------------------------------------------------------------
_ODD_VALUES = ['abc', [], {}, None, True, 10**400, -1, float('nan'), 1e308, '', {'a': [1]}]


def _damage(data, log):
    """Cut the log at a random byte, put a non-JSON line in, or give a field a wrong value."""
    raw = log.read_bytes()
    how = data.draw(st.sampled_from(['none', 'cut', 'junk line', 'field', 'field']), label='damage')
    if how == 'cut':
        log.write_bytes(raw[: data.draw(st.integers(0, len(raw)), label='cut at')])
    elif how == 'junk line':
        lines = raw.split(b'\n')
        at = data.draw(st.integers(0, len(lines)), label='junk at')
        junk = data.draw(st.sampled_from([b'{"kind": "tr', b'hello', b'[1, 2]', b'\x00\xff\xfe',
                                          b'"x"', b'{}', b'[' * 5000]), label='junk')
        log.write_bytes(b'\n'.join(lines[:at] + [junk] + lines[at:]))
    elif how == 'field':
        recs = [json.loads(ln) for ln in raw.decode().splitlines()]
        i = data.draw(st.integers(0, len(recs) - 1), label='record')
        key = data.draw(st.sampled_from(sorted(recs[i]) + ['step', 'bpc', 'bpb', 'unit', 'kind',
                                                           'split', 'resumed_from']), label='key')
        recs[i][key] = data.draw(st.sampled_from(_ODD_VALUES), label='value')
        log.write_text(''.join(json.dumps(r) + '\n' for r in recs))


@settings(max_examples=40, **HYPOTHESIS_FIXTURES)
@given(data=st.data())
def test_fuzz_keeps_the_contract(data, capsys, monkeypatch):
    """Random damage to the logs (cut at any byte, non-JSON lines, wrong field types) and random
    flags (odd run and plot paths): report.main ends with exit
    0, 1, 2 or 130, never an uncaught exception; a failure is one `error:` line, and no temporary
    file is left. (The plot is stood in for: matplotlib is optional.)"""
    with tempfile.TemporaryDirectory() as tmp, no_hang(60), monkeypatch.context() as m:
        root = Path(tmp)
        odd = odd_run_paths(root)
        stand_in_for_matplotlib(m)
        study = root / 'study'
        write_run(study, 'ws-s1', [config(seed=1)] + evals_and_steps([4.0, 3.0, 2.5], 2.1))
        write_run(study, 'ws-s2', [config(seed=2)] + evals_and_steps([4.0, 3.2], 2.4))
        write_run(study, 'none', [config('none', seed=1)] + evals_and_steps([4.0, 3.1], 2.0))
        runs = st.lists(st.sampled_from(['ws-s1', 'ws-s2', 'none']), unique=True, max_size=2)
        for run in data.draw(runs):
            _damage(data, study / run / 'log.jsonl')
        named = {'study': study, 'run': study / 'ws-s1', 'log': study / 'none' / 'log.jsonl', **odd}
        argv = [str(named[data.draw(st.sampled_from(['study', 'study', 'run', 'log'] + sorted(odd)),
                                    label='runs')])]
        argv += data.draw(st.lists(st.sampled_from(['--markdown', '--by-data']), unique=True))
        if data.draw(st.booleans(), label='--plot'):
            pick = data.draw(st.sampled_from(['p.png', 'p.png', 'p.xyz'] + sorted(odd)),
                             label='plot path')
            argv += ['--plot', str(odd.get(pick, root / pick))]
        rc, out, err = run_main(report.main, argv, capsys)
        event(f'exit {rc}')  # --hypothesis-show-statistics: how many examples got how far
        assert_cli_contract(rc, err, argv)
        assert not [f for d, _, fs in os.walk(root) for f in fs if 'tmp' in f], argv
        if (root / 'p.png').exists():
            assert rc == 0 and (root / 'p.png').read_bytes() == b'\x89PNG whole'


# ---------------------------------------------------------------------------------------------
# A run's identity and state
# ---------------------------------------------------------------------------------------------
def test_a_backup_copy_of_a_run_is_counted_once(tmp_path, capsys):
    """Copies of one run (same run_id) are one row, the copy that got furthest, with a note:
    never two seeds of one experiment."""
    run = [config(run_id='a1')] + evals_and_steps([4.0, 3.0, 2.5], 2.4)
    write_run(tmp_path, 'ws', run)
    write_run(tmp_path, 'ws.bak', run[:4])   # copied while it trained
    write_run(tmp_path, 'other-seed', [config(seed=3, run_id='b2')] + evals_and_steps([4.0], 3.1))
    assert report.main([str(tmp_path), '--by-data']) == 0
    out, err = capsys.readouterr()
    runs = out.split('Mean')[0]
    assert '/ws ' in runs and 'ws.bak' not in runs
    assert f'{tmp_path}/ws and {tmp_path}/ws.bak are one run (same run_id): counted once' in err
    assert '1337,1337' not in out and '3,1337' in out   # the copy is no second seed


def test_runs_that_did_not_finish_say_why(tmp_path, capsys):
    """running: another process holds the run folder's lock; diverged: a diverged record;
    unfinished: the log ends at a validation (stopped to be resumed); crashed: records after its
    last validation."""
    import common

    def log(name, *more):   # runs of their own (run_id), alike but for how they ended
        return write_run(tmp_path, name, [config(run_id=name)] + base + list(more))
    base = evals_and_steps([4.0, 3.0])
    log('unfinished')
    log('crashed', dict(base[-2], step=150))
    log('diverged', dict(step=150, diverged=True, kind='train'))
    running = log('running')
    write_run(tmp_path, 'done', [config(seed=2)] + evals_and_steps([4.0, 3.0], 2.9))
    with common.locked(running, 'the test'):
        rows, _ = rows_of(tmp_path)
        report.main([str(tmp_path)])
    out = capsys.readouterr().out
    assert {name: row['state'] for name, row in rows.items()} == dict(
        unfinished='unfinished', crashed='crashed', diverged='diverged', running='running',
        done='')
    for name, steps in (('unfinished', 100), ('crashed', 150), ('running', 100), ('done', 100)):
        line = next(x for x in out.splitlines() if f'/{name} ' in x)
        assert f' {steps} {rows[name]["state"]}'.rstrip() + ' ' in line, line
    assert report.summarize(running)['state'] == 'unfinished'   # the lock released


# ---------------------------------------------------------------------------------------------
# Samples: a seed's replicas are one; the data compared is one; sources of one's own count
# ---------------------------------------------------------------------------------------------
def test_replicas_of_one_seed_are_one_sample(tmp_path, capsys):
    """Two runs of the same flags, data and seed (separate runs: their own run_id) are one sample:
    n 1 (2 runs), their mean, no standard deviation; in the t-test a seed's replicas enter as
    their mean, once (p by hand)."""
    none = {1: 2.05, 2: 2.08, 3: 2.04}
    seeded_runs(tmp_path / 'a', {'none': none, 'whitespace': WS})
    seeded_runs(tmp_path / 'b', {'whitespace': {1: 1.96}})   # a replica of seed 1
    write_run(tmp_path, 'solo-a', [config(seed=7, layers='2,2,2')] + evals_and_steps([4.0], 2.0))
    write_run(tmp_path, 'solo-b', [config(seed=7, layers='2,2,2')] + evals_and_steps([4.0], 2.2))
    assert report.main([str(tmp_path), '--markdown', '--by-data']) == 0
    out = capsys.readouterr().out
    rows = {(r['mode'], r['flags']): r for r in md_rows(out, 'over seeds')}
    solo = rows['whitespace', 'layers=2,2,2']
    assert (solo['seeds'], solo['n'], solo['test BPC']) == ('7', '1 (2 runs)', '2.1000')
    ws = rows['whitespace', 'layers=1,4,1']
    assert (ws['seeds'], ws['n']) == ('1,2,3', '3 (4 runs)')
    mine = {**WS, 1: (WS[1] + 1.96) / 2}
    assert ws['test BPC'].startswith(f'{statistics.mean(mine.values()):.4f} ± '
                                     f'{statistics.stdev(mine.values()):.4f}')
    assert ws['p vs none'] == f'{hand_p(mine.values(), none.values()):.3f}'
    by = md_table(out, 'by dataset')['whitespace @ 300 steps']['text8-head']
    assert 'layers=2,2,2: 2.1000 (5.00, n=1 (2 runs))' in by


def test_runs_on_other_data_are_never_pooled_nor_paired(tmp_path, capsys):
    """Runs whose recorded data differ are other experiments: another path of the same name (each
    named by its path), or one path holding other data (its fingerprint, which a config record's
    dataset holds, names it); the same fingerprint at two paths is one dataset."""
    def runs(root, data, fingerprint=None, **bpc):
        dataset = None
        if fingerprint:
            dataset = dict(path=data, fingerprint=fingerprint)
        for boundary, by_seed in bpc.items():
            for seed, test in by_seed.items():
                write_run(root, f'{boundary}-s{seed}', [config(boundary, seed=seed, data=data,
                                                               dataset=dataset)]
                          + evals_and_steps([4.0, 3.0], test))
    runs(tmp_path / 'a', 'a/en', none={1: 2.0, 2: 2.1}, whitespace={1: 1.9, 2: 1.95})
    runs(tmp_path / 'b', 'b/en', none={1: 3.0, 2: 3.1})
    runs(tmp_path / 'b2', './b/en/', none={3: 3.3})   # the same path, written otherwise
    assert report.main([str(tmp_path), '--markdown']) == 0
    rows = {(r['mode'], r['data']): r for r in md_rows(capsys.readouterr().out, 'over seeds')}
    assert set(rows) == {('none', 'a/en'), ('none', 'b/en'), ('whitespace', 'a/en')}
    assert rows['none', 'b/en']['n'] == '3' and rows['none', 'a/en']['n'] == '2'
    # paired with the vanilla of its own data only
    assert rows['whitespace', 'a/en']['p vs none'] == f'{hand_p([1.9, 1.95], [2.0, 2.1]):.3f}'
    # one path, data remade from other text (its fingerprint), and a copy of it elsewhere
    runs(tmp_path / 'c', 'data/he', 'f00d', none={1: 2.0, 2: 2.1})
    runs(tmp_path / 'd', 'data/he', 'beef', none={1: 3.0, 2: 3.1})
    runs(tmp_path / 'e', '/scratch/he', 'beef', none={3: 3.2})
    assert report.main([str(tmp_path / d) for d in 'cde'] + ['--markdown']) == 0
    seeds = md_rows(capsys.readouterr().out, 'over seeds')
    assert {(r['data'], r['seeds']) for r in seeds} == {('data/he@f00d', '1,2'),
                                                        ('data/he@beef', '1,2,3')}


def test_an_imported_source_is_in_tables_and_plots(tmp_path, capsys, monkeypatch):
    """A source of one's own (train.py --import) is a mode like any other: rows in the tables
    after the paper's sources, paired with vanilla, a line in each panel of --plot in a colour of
    its own."""
    seeded_runs(tmp_path, {'none': {1: 2.05, 2: 2.08}, 'zeta': {1: 1.9, 2: 1.95},
                           'whitespace': {1: 2.0, 2: 2.02}})
    assert report.main([str(tmp_path), '--markdown', '--by-data']) == 0
    out = capsys.readouterr().out
    assert list(md_table(out, 'over seeds')) == ['none', 'whitespace', 'zeta']
    assert list(md_table(out, 'by dataset')) == ['none @ 300 steps', 'whitespace @ 300 steps',
                                                 'zeta @ 300 steps']
    zeta = md_table(out, 'over seeds')['zeta']
    assert zeta['p vs none'] == f'{hand_p([1.9, 1.95], [2.05, 2.08]):.3f}'
    pytest.importorskip('matplotlib')
    seen = spy_on_figures(monkeypatch)
    assert report.main([str(tmp_path), '--plot', str(tmp_path / 'p.png')]) == 0
    for ax in seen['--plot'].axes:
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        assert labels == ['none', 'whitespace', 'zeta'], ax.get_title()
    pareto = seen['--plot'].axes[0]
    colours = [c.lines[0].get_color() for c in pareto.containers]
    assert len(set(colours)) == 3


def by_data_runs(root):
    """Runs for --by-data whose rows hold several budgets (a FLOP budget differs between datasets)
    and whose cells hold several experiments (two layer counts); test BPC says which run it is."""
    def run(name, data, test, boundary='whitespace', seed=1, **kw):
        write_run(root, name, [config(boundary, seed=seed, data=f'data/{data}', **kw)]
                  + evals_and_steps([4.0, 3.0], test))
    run('en-ws-s1', 'en', 2.01)
    run('en-ws-s2', 'en', 2.03, seed=2)
    run('en-ws-deep', 'en', 2.05, layers='2,8,2')
    run('vi-ws', 'vi', 2.07)
    run('en-ws-flops', 'en', 2.11, max_steps=10**9, flop_budget=9e12)
    run('vi-ws-flops', 'vi', 2.13, max_steps=10**9, flop_budget=1e13)
    run('en-ws-flops2', 'en', 2.15, max_steps=10**9, flop_budget=2e13)
    run('en-fixed10', 'en', 2.17, 'fixed', fixed_factor=10)
    run('en-fixed2', 'en', 2.19, 'fixed', fixed_factor=2)
    return sorted(root.iterdir())


def by_data_cells(argv, capsys):
    """{(mode, budget): {dataset: cell}} and the rows' order of --by-data over argv."""
    assert report.main(argv + ['--by-data', '--markdown']) == 0
    rows = md_rows(capsys.readouterr().out, 'by dataset')
    keys = [(row.pop('mode'), row.pop('budget')) for row in rows]
    return dict(zip(keys, rows)), keys


def test_by_data_names_each_entry_by_its_own_record(tmp_path, capsys):
    """A row of two FLOP budgets names each cell's budget (in order of value, not of text); a
    cell of two experiments names each by its flags; fixed k in order of k."""
    cells, keys = by_data_cells([str(p) for p in by_data_runs(tmp_path)], capsys)
    budgets = '9e12 FLOPs / 1e13 FLOPs / 2e13 FLOPs'
    assert keys == [('fixed k=2', '300 steps'), ('fixed k=10', '300 steps'),
                    ('whitespace', '300 steps'), ('whitespace', budgets)]
    assert cells['whitespace', budgets] == {
        'en': '9e12 FLOPs: 2.1100 (5.00, n=1) / 2e13 FLOPs: 2.1500 (5.00, n=1)',
        'vi': '1e13 FLOPs: 2.1300 (5.00, n=1)'}
    sd = statistics.stdev([2.01, 2.03])
    assert cells['whitespace', '300 steps'] == {
        'en': f'layers=1,4,1: 2.0200 ± {sd:.4f} (5.00, n=2) / layers=2,8,2: 2.0500 (5.00, n=1)',
        'vi': '2.0700 (5.00, n=1)'}


@settings(max_examples=15, **HYPOTHESIS_FIXTURES)
@given(data=st.data())
def test_by_data_is_the_same_in_any_run_order(data, tmp_path_factory, capsys):
    """Property: the run folders in any order on the command line give the same --by-data cells
    and rows (the columns follow the order the datasets were given)."""
    root = tmp_path_factory.getbasetemp() / 'by-data-order'
    if not root.exists():
        by_data_runs(root)
    runs = [str(p) for p in sorted(root.iterdir())]
    shuffled = data.draw(st.permutations(runs))
    assert by_data_cells(shuffled, capsys) == by_data_cells(runs, capsys)


@pytest.mark.plots
def test_labels_in_any_script_draw_without_a_missing_glyph(tmp_path, monkeypatch):
    """Dataset names in Hebrew, in Chinese and in a symbol the default font lacks (Ⓐ, which
    matplotlib's own STIX font has): saving the figure warns of no missing glyph; a character is
    drawn as it is where an installed font has it, else as its escape."""
    pytest.importorskip('matplotlib')
    import warnings

    for name in ('עברית', '中文', 'Ⓐ'):
        write_run(tmp_path, name, [config(data=f'data/{name}')] + evals_and_steps([4.0, 3.0], 2.0))
    seen = spy_on_figures(monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        assert report.main([str(tmp_path), '--plot-sf', str(tmp_path / 'sf.png')]) == 0
    assert [str(w.message) for w in caught] == []
    titles = {ax.get_title().split(':')[0] for ax in seen['--plot-sf'].axes}
    assert {'Ⓐ', 'עברית'} < titles and titles & {'中文', r'\u4e2d\u6587'}
