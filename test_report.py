"""report.py on synthetic run directories: numbers, seeds, budgets, old logs, errors, plots."""
import fcntl
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

import report

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


def run_cli(*args):
    return subprocess.run([sys.executable, str(HERE / 'report.py'), *map(str, args)],
                          capture_output=True, text=True, timeout=60)


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


def rows_of(root, argv=()):
    """The runs table and the seed table as report.py computes them."""
    args = report.parse_args([str(root), *argv])
    rows = [report.summarize(r) for r in report.find_runs(args.runs)]
    budgets = report.resolve_budgets(args, rows)
    return {r['run'].name: r for r in rows}, report.group_rows(rows, budgets)


def test_run_rows_and_seed_means(study):
    rows, groups = rows_of(study)
    ws = rows['ws-s1']
    assert (ws['steps'], ws['train_chars'], ws['train_flops'], ws['train_time']) == \
        (300, 300 * CHARS_PER_STEP, 300e9, 150.0)
    assert (ws['valid_bpc'], ws['test_bpc'], ws['sf'], ws['status']) == (2.2, 2.1, 5.0, 'done')
    assert ws['chars_per_s'] == pytest.approx(CHARS_PER_STEP / 0.5)
    pooled = [g for g in groups if g['n'] == 2]
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



def test_flags_that_older_logs_lack(tmp_path, capsys):
    """A flag train.py gained later: a log without it ran with the old behaviour (same experiment
    as a newer log that says so), and an unknown one splits experiments, shown as '-', or the
    rows of the two experiments would read the same."""
    for seed in (1, 2):
        write_run(tmp_path, f'old-s{seed}', [config('unigram', seed=seed)]
                  + evals_and_steps([4.0, 3.0], 2.9))
        write_run(tmp_path, f'new-s{seed}', [config('unigram', seed=seed + 2, double_sigmoid=False)]
                  + evals_and_steps([4.0, 3.1], 3.0))
        write_run(tmp_path, f'ds-s{seed}', [config('unigram', seed=seed, double_sigmoid=True)]
                  + evals_and_steps([4.0, 3.1], 3.0))
        write_run(tmp_path, f'x-s{seed}', [config('unigram', seed=seed, double_sigmoid=True,
                                                  newer_flag=7)] + evals_and_steps([4.0, 3.1], 3.0))
    report.main([str(tmp_path)])
    seeds = capsys.readouterr().out.split('Mean ± std over seeds')[1]
    rows = [x for x in seeds.splitlines() if x.lstrip().startswith('unigram')]
    assert len(rows) == 3
    assert any('double_sigmoid=False' in x and ' 4 ' in x for x in rows)  # old + new: 4 seeds
    assert any('double_sigmoid=True newer_flag=-' in x for x in rows)
    assert any('double_sigmoid=True newer_flag=7' in x for x in rows)

def test_budgets_interpolate_and_stop_at_the_end(study):
    budget = 130 * CHARS_PER_STEP  # between the evals at steps 100 (3.0) and 200 (2.5)
    rows, _ = rows_of(study, ['--at-chars', str(budget)])
    assert rows['ws-s1']['at_chars'] == pytest.approx(3.0 + 0.3 * (2.5 - 3.0))
    rows, _ = rows_of(study, ['--at-chars', str(budget), '--no-interp'])
    assert rows['ws-s1']['at_chars'] == 3.0
    rows, _ = rows_of(study, ['--at-chars', str(301 * CHARS_PER_STEP)])
    assert rows['ws-s1']['at_chars'] is None  # never got that far


def test_equal_flops_and_time(study):
    # vanilla spends 3e9 FLOPs a step, whitespace 1e9: the largest budget every run reached is
    # whitespace's final 3e11, where vanilla is at its step-100 validation
    rows, groups = rows_of(study, ['--at-flops', 'min'])
    assert rows['none-s1']['at_flops'] == pytest.approx(2.9)
    assert rows['ws-s1']['at_flops'] == pytest.approx(2.2)
    assert next(g for g in groups if g['n'] == 2)['at_flops'][0] == pytest.approx((2.2 + 2.4) / 2)
    rows, _ = rows_of(study, ['--at-flops', '1.5e11', '--at-time', '50'])
    assert rows['none-s1']['at_flops'] == pytest.approx((4.0 + 2.9) / 2)
    assert rows['ws-s1']['at_flops'] == pytest.approx((3.0 + 2.5) / 2)
    assert rows['ws-s2']['at_time'] == pytest.approx(2.7)   # 0.25 s a step: step 200
    assert rows['ws-s1']['at_time'] == pytest.approx(3.0)   # 0.5 s a step: step 100



def test_final_full_split_validation_stays_out_of_curves_and_budgets(tmp_path):
    """train.py validates on a 20k-character subset during training and on the whole split at the
    end: the end point is the table's valid BPC, but no point of the curve or of a budget."""
    recs = evals_and_steps([4.0, 3.0, 2.5])
    full = dict(recs[-1], step=300, bpc=2.9, subset=False, eval_chars=200_000,
                train_chars=300 * CHARS_PER_STEP, train_flops=3e11, train_time=150.0)
    write_run(tmp_path, 'ws', [config()] + recs + [full, dict(full, split='test', bpc=3.0)])
    write_run(tmp_path, 'none', [config('none')] + evals_and_steps([4.0, 2.9, 2.4, 2.0], 1.9))
    rows, _ = rows_of(tmp_path, ['--at-chars', 'min'])
    assert rows['ws']['valid_bpc'] == 2.9 and rows['ws']['test_bpc'] == 3.0
    assert [e['bpc'] for e in rows['ws']['curve']] == [4.0, 3.0, 2.5]
    assert rows['ws']['at_chars'] == 2.5 and rows['none']['at_chars'] == 2.4  # step 200, not 300
    rows, _ = rows_of(tmp_path, ['--at-chars', str(250 * CHARS_PER_STEP)])
    assert rows['ws']['at_chars'] is None

def test_budget_suffixes():
    assert report.parse_budget('2M') == 2e6 and report.parse_budget('1.5e12') == 1.5e12
    assert report.parse_budget('3k') == 3000 and report.parse_budget('min') == 'min'
    with pytest.raises(Exception):
        report.parse_budget('lots')


def old_log(boundary='fixed'):
    """A log of train.py before the 'kind' field: no seed, FLOPs or time."""
    cfg = dict(preset='cpu', device='cpu', world=1, amp='off', boundary=boundary, params=30523,
               layers='1,4,1', d_model=128, seq_len=512, batch_size=4, max_steps=20, lr=1e-3,
               resumed_from=None, data='data/text8-head', out='runs/old')
    recs = [cfg, dict(step=0, split='valid', bpc=4.7, sf=2.0, chars=20000)]
    for step, cps in ((10, 1000), (20, 2000)):
        recs.append(dict(step=step, loss=3.0, bpc=4.0, sf=2.0, precision=None, recall=None,
                         chars_per_s=cps, lr=1e-3, grad_norm=1.0, mem_mb=300, epoch=0))
    recs += [dict(step=20, split='valid', bpc=3.5, sf=2.0, chars=20000),
             dict(step=20, split='test', bpc=3.4, sf=2.0, chars=20000)]
    return recs


def test_old_schema(tmp_path, capsys):
    write_run(tmp_path, 'old-a', old_log())
    write_run(tmp_path, 'old-b', old_log())
    rows, groups = rows_of(tmp_path, ['--at-chars', str(10 * CHARS_PER_STEP)])
    r = rows['old-a']
    assert (r['steps'], r['train_chars'], r['train_flops'], r['train_time']) == \
        (20, 20 * CHARS_PER_STEP, None, None)
    assert (r['valid_bpc'], r['test_bpc'], r['sf'], r['seed']) == (3.5, 3.4, 2.0, None)
    assert r['curve'][0]['eval_chars'] == 20000  # the old 'chars' counted evaluated characters
    # 10 steps at 1000 chars/s, then 10 at 2000: the rate of the whole run
    assert r['chars_per_s'] == pytest.approx(20 * CHARS_PER_STEP / (10 * CHARS_PER_STEP * 1.5e-3))
    assert r['at_chars'] == pytest.approx((4.7 + 3.5) / 2)
    assert len(groups) == 2  # no seed logged: never pooled
    report.main([str(tmp_path / 'old-a')])
    line = capsys.readouterr().out.splitlines()[-1].split()
    # run mode data seed steps chars FLOPs wall valid test SF chars/s
    assert line[3:] == ['-', '20', '40,960', '-', '-', '3.5000', '3.4000', '2.00', '1,333']


def test_resume_and_restart_drop_redone_records(tmp_path):
    # killed at step 250 after its checkpoint at 200: steps 201-250 are redone after the resume
    recs = [config()] + evals_and_steps([4.0, 3.0, 2.5])
    recs += [dict(recs[-2], step=250, bpc=9.9)]
    recs += [config(resumed_from=200)] + evals_and_steps([2.5, 2.2], 2.1, start=200)[1:]
    write_run(tmp_path, 'resumed', recs)
    # a run that started over (no checkpoint yet): nothing of the first attempt counts
    write_run(tmp_path, 'restarted', [config()] + evals_and_steps([4.0, 1.0])
              + [config()] + evals_and_steps([4.0, 3.0, 2.5, 2.2], 2.1))
    for name in ('resumed', 'restarted'):
        cfg, train, evals = report.read_run(tmp_path / name)
        valid = [(e['step'], e['bpc']) for e in evals if e['split'] == 'valid']
        assert valid == [(0, 4.0), (100, 3.0), (200, 2.5), (300, 2.2)], name
        assert sorted(r['step'] for r in train) == [50, 100, 150, 200, 250, 300], name


def test_unfinished_runs_are_shown_as_such(tmp_path, capsys):
    d = write_run(tmp_path, 'partial', [config()] + evals_and_steps([4.0, 3.0]))
    with open(d / 'log.jsonl', 'a') as f:
        f.write('{"kind": "train", "step": 1')  # a record being written right now
    rows, _ = rows_of(tmp_path)
    assert (rows['partial']['status'], rows['partial']['test_bpc']) == ('stopped', None)
    write_run(tmp_path, 'starting', [])  # its config record not yet written
    rows, _ = rows_of(tmp_path)
    assert (rows['starting']['steps'], rows['starting']['status']) == (0, 'stopped')
    (tmp_path / 'starting' / 'log.jsonl').unlink()
    (tmp_path / 'starting').rmdir()
    with open(d / '.lock', 'w') as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        rows, _ = rows_of(tmp_path)
        report.main([str(d)])
    assert rows['partial']['status'] == 'running'
    line = capsys.readouterr().out.splitlines()[-1]
    assert ' 100/300 running ' in line and line.split()[-3] == '-'  # no test BPC


def test_markdown(study, capsys):
    report.main([str(study), '--markdown', '--at-chars', '500k'])
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == ['### Runs', ''] and out[8:11] == ['', '### Mean ± std over seeds', '']
    head, sep, body = out[2], out[3], out[4:8]
    n = head.count('|')
    assert head.startswith('| run | mode | data | flags | seed | steps |')
    assert head.endswith('| valid BPC @ 500,000 chars |')
    assert sep == '|' + '---|' * (n - 1) and all(x.count('|') == n for x in body)
    ws1 = next(x for x in body if '/ws-s1 |' in x).split(' | ')
    at = 2.5 + (2.2 - 2.5) * (500_000 / CHARS_PER_STEP - 200) / 100  # between steps 200 and 300
    assert ws1[-1] == f'{at:.4f} |'
    assert len(out) == 11 + 2 + 3 and out[-1].startswith('| whitespace | text8-head |')


def test_cli_errors_are_one_line(tmp_path):
    (tmp_path / 'empty').mkdir()
    (tmp_path / 'notalog').mkdir()
    (tmp_path / 'notalog' / 'log.jsonl').write_text('hello\n{"kind": "config"}\n')
    for args, code, says in (([tmp_path / 'empty'], 1, 'is not a run'),
                             ([tmp_path / 'missing'], 1, 'does not exist'),
                             ([tmp_path / 'notalog'], 1, 'line 1 is not JSON'),
                             ([tmp_path / 'empty', '--at-chars', 'lots'], 2, "'lots'")):
        r = run_cli(*args)
        assert r.returncode == code and r.stdout == '', args
        assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith('error: '), r.stderr
        assert says in r.stderr


def test_plot_writes_a_png(study, tmp_path, capsys):
    pytest.importorskip('matplotlib')
    png = tmp_path / 'study.png'
    report.main([str(study), '--plot', str(png)])
    assert png.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n' and png.stat().st_size > 10_000
    assert [p.name for p in tmp_path.iterdir() if p.suffix == '.tmp' or 'tmp' in p.name] == []
    assert f'plot: {png}' in capsys.readouterr().out


def test_plot_without_matplotlib_or_with_a_bad_name(study, tmp_path, monkeypatch, capsys):
    with monkeypatch.context() as m:
        m.setitem(sys.modules, 'matplotlib', None)  # as if it were not installed
        with pytest.raises(report.ReportError, match='pip install matplotlib'):
            report.main([str(study), '--plot', str(tmp_path / 'study.png')])
    pytest.importorskip('matplotlib')
    for name, says in (('study.xyz', 'name it .png'), ('nowhere/study.png', 'does not exist')):
        with pytest.raises(report.ReportError, match=says):
            report.main([str(study), '--plot', str(tmp_path / name)])
    assert capsys.readouterr().out == '' and not list(tmp_path.glob('study*'))


def test_modes_are_dynpool_s():
    """report.py spells out the boundary modes (no torch import): the same, in dynpool's order, so
    every mode gets its colour and its point in the Pareto panel."""
    from dynpool import BOUNDARY_MODES
    assert report.MODES == BOUNDARY_MODES
