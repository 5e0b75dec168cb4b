"""study.sh: the paper's experiments as a plan of commands (data preparation first, then the
runs), checked before anything runs, placed on GPUs or handed to a scheduler, and resumed where
it stopped. Its commands are checked through what study.sh starts: a stand-in `python` and
`torchrun` earlier on PATH record them; the dry run and the runner share one command builder,
so what the dry run prints is compared with what the runner starts."""
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import flags
import dataset
from conftest import random_words, shared_data, write_dataset

ROOT = Path(__file__).parent
# a boundary source of one's own, in a file outside the project (README's every_k.py)
EVERY_K = """import dataclasses

import torch
from dynpool import ExternalBoundaries, register_source


@dataclasses.dataclass
class EveryOptions:
    every: int = 4


class EveryBoundaries(ExternalBoundaries):
    Options = EveryOptions

    def derive(self, x, offset):
        t = torch.arange(offset, offset + x.size(1), device=x.device)
        return ((t + 1) % self.options.every == 0).expand_as(x)


register_source('every', EveryBoundaries)
"""
STUDY = str(ROOT / 'study.sh')
# A tiny model and short sequences: every run here takes a second or two on one CPU core.
TINY = ['--device', 'cpu', '--d-model', '32', '--n-head', '2', '--d-head', '16', '--d-inner', '64',
        '--layers', '1,1,1', '--seq-len', '32', '--batch-size', '4', '--eval-window', '32',
        '--eval-step', '8', '--eval-batch-size', '32', '--eval-subset-chars', '400',
        '--eval-max-chars', '400', '--log-interval', '1', '--warmup', '2', '--lr', '3e-3']


def read_log(out):
    return [json.loads(line) for line in (Path(out) / 'log.jsonl').read_text().splitlines()]


def stand_ins(tmp_path):
    """A `python` and a `torchrun` first on PATH → (env, calls): each records the command it is
    given as "tool|working directory|CUDA_VISIBLE_DEVICES|arguments" in the file calls and exits
    with $FAKE_RC (default 0) after $FAKE_HOLD seconds, or with 75 on SIGUSR1 or SIGTERM (as
    train.py), recording "signal"; `python study.py` (study.sh's planner) runs the real Python. A
    GPU given to a second run while the first holds it is recorded as a clash."""
    bin_dir = tmp_path / 'bin'
    bin_dir.mkdir()
    calls = tmp_path / 'calls'
    for tool in ('python', 'torchrun'):
        (bin_dir / tool).write_text(f"""#!/bin/bash
if [ "${{1##*/}}" = study.py ]; then exec {shlex.quote(sys.executable)} "$@"; fi
tool={tool}
# docs/slurm-array.sh runs torchrun's launcher as `python -c SCRIPT ARGS`
if [ "$1" = -c ]; then tool=torchrun; shift 2; fi
gpu=${{CUDA_VISIBLE_DEVICES-}}
if [ -n "$gpu" ] && ! mkdir "{bin_dir}/busy-$gpu" 2>/dev/null; then echo clash >> {calls}; fi
echo "$tool|$PWD|$gpu|$*" >> {calls}
trap 'echo "$tool|$PWD|$gpu|signal" >> {calls}; exit 75' USR1 TERM
sleep "${{FAKE_HOLD:-0}}" &
wait $!
if [ -n "$gpu" ]; then rmdir "{bin_dir}/busy-$gpu"; fi
exit "${{FAKE_RC:-0}}"
""")
        (bin_dir / tool).chmod(0o755)
    env = dict(os.environ, PATH=f'{bin_dir}:{os.environ["PATH"]}')
    return env, calls


def recorded(calls):
    """The commands the stand-ins were given: [(tool, cwd, gpus, argv)]."""
    if not calls.exists():
        return []
    rows = [line.split('|', 3) for line in calls.read_text().splitlines() if line != 'clash']
    return [(tool, cwd, gpus, args.split()) for tool, cwd, gpus, args in rows]


def study(*flags, cwd=ROOT, env=None, timeout=300):
    return subprocess.run(['bash', STUDY, *map(str, flags)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def commands(stdout):
    """The commands a dry run prints (comments and the total left out), each as its words."""
    return [shlex.split(line, comments=True) for line in stdout.splitlines()
            if line and not line.startswith(('#', 'total: '))]


def test_study_plans_the_papers_experiments(tmp_path):
    """study.sh --dry-run: table1 is the paper's grid (6 datasets x 8 sources x 3 seeds, the GPU
    preset's 200k steps on a GPU) with each command's FLOPs (train.py's parser and presets) and a
    GPU-hours total; scaling grows the shortened stage between 2 + 2 outer layers; fixed k of
    any k by name. Its data folder is its own: the project's data/text8 after the quick start
    is a slice, which the paper's parts rightly refuse."""
    data = os.path.relpath(tmp_path / 'data', ROOT)

    def plan(*flags):
        r = subprocess.run(['bash', 'study.sh', '--dry-run', '--data-dir', data, *flags],
                           cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        lines = [x for x in r.stdout.splitlines() if x.startswith('python train.py')]
        assert all(' FLOPs at SF ' in x.split('    # ')[1] for x in lines)
        cmds = [shlex.split(x.split('    #')[0]) for x in lines]
        return [dict(zip(c[2::2], c[3::2])) for c in cmds], r.stdout.splitlines()[-1]
    table1, total = plan('--part', 'table1', '--device', 'cuda')
    assert len(table1) == 6 * 8 * 3 and 'GPU-hours' in total
    grid = {(c['--data'], c['--boundary'], c.get('--fixed-factor'), c['--seed']) for c in table1}
    assert len(grid) == 144 and {c['--max-steps'] for c in table1} == {'200000'}
    assert {d.split('/')[-1] for d, *_ in grid} == {'text8', 'wiki40b-en', 'wiki40b-fi',
                                                    'wiki40b-he', 'wiki40b-vi', 'cc100-en'}
    assert {k for _, b, k, _ in grid if b == 'fixed'} == {'2', '3', '4'}
    for part in ('table2', 'scaling'):  # on a GPU at the paper's scale: the whole text8, 200k steps
        runs, _ = plan('--part', part, '--device', 'cuda')
        assert {(c['--data'], c['--max-steps']) for c in runs} == {(f'{data}/text8', '200000')}
    table2, _ = plan('--part', 'table2')  # on the CPU the slice
    slice_run = (f'{data}/text8-head-u10000', '1000')
    assert {(c['--data'], c['--max-steps']) for c in table2} == {slice_run}
    scaling, _ = plan('--part', 'scaling', '--modes', 'none fixed5', '--seeds', '1')
    want = {(b, k, f'2,{n - 4},2') for b, k in (('none', None), ('fixed', '5'))
            for n in (8, 12, 16, 20)}
    assert {(c['--boundary'], c.get('--fixed-factor'), c['--layers']) for c in scaling} == want
    # a run trained to a FLOP budget is counted at its budget: vanilla's FLOPs, not its steps'
    r = subprocess.run(['bash', 'study.sh', '--dry-run', '--part', 'languages', '--langs', 'fi',
                        '--modes', 'none whitespace', '--seeds', '1', '--steps', '10'],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    flops = {x.split(' --out ')[1].split()[0].split('/')[-1]: float(x.split('# ')[1].split()[0])
             for x in r.stdout.splitlines() if x.startswith('python train.py')}
    assert flops['fi-whitespace-flops-s1'] == flops['fi-none-s1'] > flops['fi-whitespace-s1']


def echoing_python(tmp_path):
    """An environment whose `python` runs study.py for real and echoes any other command's
    arguments (report.py's, the runs'): → env."""
    stand_in = tmp_path / 'bin' / 'python'
    stand_in.parent.mkdir()
    stand_in.write_text(f'#!/bin/bash\nif [ "${{1##*/}}" = study.py ]; then exec '
                        f'{shlex.quote(sys.executable)} "$@"; fi\necho "$@"\n')
    stand_in.chmod(0o755)
    env = dict(os.environ, PATH=f'{stand_in.parent}:{os.environ["PATH"]}')
    return env


def test_study_pareto_reports_each_language_with_the_text8_runs_unprefixed(tmp_path):
    """study.sh --part pareto --langs 'text8 fi': the text8 slice's runs keep part seeds' names
    (no language prefix) and still make the text8 panel, the fi- runs the fi panel. Finished runs
    (a test record in log.jsonl) are skipped; a stand-in `python` echoes report.py's arguments."""
    env = echoing_python(tmp_path)
    flags = ['--part', 'pareto', '--langs', 'text8 fi', '--data-dir', str(tmp_path / 'data'),
             '--out', str(tmp_path / 'runs'), '--steps', '4']
    dry = subprocess.run(['bash', 'study.sh', '--dry-run', *flags], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    runs = [x.split(' --out ')[1].split()[0] for x in dry.stdout.splitlines()
            if x.startswith('python train.py')]
    assert len(runs) == 2 * 17, dry.stdout + dry.stderr
    for run in runs:
        (ROOT / run).mkdir(parents=True)
        (ROOT / run / 'log.jsonl').write_text('{"split": "test"}\n')
    for x in dry.stdout.splitlines():
        if x.startswith('python train.py'):
            data = ROOT / x.split('--data ')[1].split()[0]
            data.mkdir(parents=True, exist_ok=True)
            (data / 'meta.json').write_text('{}')
    r = subprocess.run(['bash', 'study.sh', *flags], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    panels = {lang: (tmp_path / 'runs' / f'pareto-{lang}.md').read_text().split()
              for lang in ('text8', 'fi')}
    names = {lang: {a.split('/')[-1] for a in args if a.endswith('-s1337')}
             for lang, args in panels.items()}
    assert len(names['text8']) == len(names['fi']) == 17
    assert 'unigram-u200-s1337' in names['text8'] and 'fi-unigram-u200-s1337' in names['fi']
    assert not any(n.startswith('fi-') for n in names['text8'])


def test_study_reports_each_language_with_its_own_runs(tmp_path):
    """study.sh --part languages --langs 'fi wiki40b-fi': a wiki40b-L run is filed under its
    language, not under the first word of its name; each language's table names its runs
    only (a stand-in `python` echoes report.py's arguments)."""
    env = echoing_python(tmp_path)
    for name in ('fi', 'wiki40b-fi'):
        (tmp_path / 'data' / name).mkdir(parents=True)
        (tmp_path / 'data' / name / 'meta.json').write_text('{}')
        (tmp_path / 'runs' / f'{name}-none-s1').mkdir(parents=True)
        (tmp_path / 'runs' / f'{name}-none-s1' / 'log.jsonl').write_text('{"split": "test"}\n')
    r = study('--part', 'languages', '--langs', 'fi wiki40b-fi', '--modes', 'none', '--seeds',
              '1', '--data-dir', tmp_path / 'data', '--out', tmp_path / 'runs', env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    for lang in ('fi', 'wiki40b-fi'):
        words = (tmp_path / 'runs' / f'languages-{lang}.md').read_text().split()
        assert {w.split('/')[-1] for w in words if w.endswith('-s1')} == {f'{lang}-none-s1'}


@pytest.mark.slow
def test_study_languages_trains_at_equal_steps_and_flops_with_a_report_per_language(tmp_path):
    """study.sh --part languages: per language vanilla, each pooled mode at equal steps and at
    vanilla's FLOP budget (no more FLOPs than vanilla, more steps), one table and plot each; the
    same command again skips what is finished."""
    pytest.importorskip('matplotlib')
    for lang in ('en', 'fi'):
        write_dataset(tmp_path / 'data' / lang, random_words(20_000, seed=len(lang)), unigram=False)
    flags = [f for f in TINY if f not in ('--device', 'cpu')]
    cmd = ['bash', 'study.sh', '--part', 'languages', '--langs', 'en fi', '--modes',
           'none whitespace', '--seeds', '1', '--steps', '4', '--data-dir', str(tmp_path / 'data'),
           '--out', str(tmp_path / 'runs'), '--', *flags]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    runs = tmp_path / 'runs'
    for lang in ('en', 'fi'):
        none, ws, flops = (read_log(runs / f'{lang}-{n}-s1')
                           for n in ('none', 'whitespace', 'whitespace-flops'))
        def last(log):
            return [x for x in log if x['kind'] == 'train'][-1]
        assert last(none)['step'] == last(ws)['step'] == 4
        assert flops[0]['flop_budget'] == pytest.approx(last(none)['train_flops'])
        assert last(flops)['step'] > 4 and last(flops)['train_flops'] >= flops[0]['flop_budget']
        md = (runs / f'languages-{lang}.md').read_text()
        assert f'{lang}-whitespace-flops-s1' in md and ' FLOPs |' in md
        assert ('fi-' in md) == (lang == 'fi')  # each language's runs only
        assert (runs / f'languages-{lang}.png').stat().st_size > 10_000
    summary = (runs / 'languages.md').read_text().split('by dataset')[1]
    assert '| mode | budget | en | fi |' in summary
    assert (runs / 'languages.png').stat().st_size > 10_000
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and again.stdout.count('finished, skipped') == 6, again.stdout


@pytest.mark.slow
def test_study_scaling_plots_bpc_against_depth_and_flops(tmp_path):
    """study.sh --part scaling (tiny runs at 5 and 6 layers, vanilla and whitespace): its
    figure is the scaling study's, test BPC against the layers and the training FLOPs, with
    the tables beside it."""
    pytest.importorskip('matplotlib')
    write_dataset(tmp_path / 'data' / 'text8-head-u10000', random_words(20_000, seed=3),
                  unigram=False)
    at = TINY.index('--layers')
    flags = [f for f in TINY[:at] + TINY[at + 2:] if f not in ('--device', 'cpu')]
    runs = tmp_path / 'runs'
    r = study('--part', 'scaling', '--scaling-layers', '5 6', '--seeds', '1', '--steps', '4',
              '--data-dir', tmp_path / 'data', '--out', runs, '--', *flags, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    said = f'plot: {runs}/scaling.png (test BPC against the layers and the training FLOPs)'
    assert said in r.stdout.splitlines()
    assert (runs / 'scaling.png').stat().st_size > 10_000
    md = (runs / 'scaling.md').read_text()
    assert all(f'{m}-l{n}-s1' in md for m in ('none', 'whitespace') for n in (5, 6))


def test_study_table1_dry_run_prepares_each_dataset_first_at_the_papers_settings(tmp_path):
    """--part table1 --device cuda --dry-run: one prepare_data.py command per dataset, before
    any run, with the paper's Unigram V (Finnish and Hebrew 200, English and Vietnamese 10000),
    then the runs (Gumbel's prior 0.37 for Finnish, 0.2 elsewhere), each parsed by train.py's own
    parser as printed; the cost without a measured speed is a range that says it is assumed."""
    r = study('--part', 'table1', '--device', 'cuda', '--dry-run', '--seeds', '1',
              '--data-dir', tmp_path / 'data', '--out', tmp_path / 'runs')
    assert r.returncode == 0, r.stderr
    cmds = commands(r.stdout)
    scripts = [c[1] for c in cmds]
    n_prep = scripts.count('prepare_data.py')
    assert n_prep == 6 and set(scripts[:n_prep]) == {'prepare_data.py'}
    assert set(scripts[n_prep:]) == {'train.py'} and len(cmds) == 6 + 6 * 8
    unigram = {c[c.index('--name') + 1]: c[c.index('--unigram') + 1] for c in cmds[:n_prep]}
    assert unigram == {'text8': '10000', 'wiki40b-en': '10000', 'wiki40b-fi': '200',
                       'wiki40b-he': '200', 'wiki40b-vi': '10000', 'cc100-en': '10000'}
    for c in cmds[n_prep:]:
        args = flags.parser().parse_args(c[2:])
        assert Path(args.data).name in unigram and args.device == 'cuda'
        if args.boundary == 'gumbel':
            assert args.prior == (0.37 if args.data.endswith('-fi') else 0.2), c
    total = r.stdout.splitlines()[-1]
    assert 'GPU-hours at 20%-40% MFU' in total and '(assumed: bench.py --preset paper' in total


def test_study_prices_the_plan_at_the_speed_bench_measured(tmp_path):
    """The dry run's cost is FLOPs / flops_per_s of bench.py --preset paper's entry for the
    device the runs use (here 'CPU, N threads': --jobs 2 runs each on half the cores), and the
    wall-clock time of the two jobs."""
    device = f'CPU, {max(1, len(os.sched_getaffinity(0)) // 2)} threads'
    bench = tmp_path / 'bench-paper.json'
    bench.write_text(json.dumps({device: dict(flops_per_s=2e9, date='2026-01-02',
                                              torch='2.13.0')}))
    r = study('--part', 'table2', '--dry-run', '--jobs', '2', '--bench', bench,
              '--data-dir', tmp_path / 'data', '--out', tmp_path / 'runs')
    assert r.returncode == 0, r.stderr
    total = r.stdout.splitlines()[-1]
    flops = float(total.split()[1])
    hours = float(total.split('about ')[1].split()[0])
    assert hours == pytest.approx(flops / 2e9 / 3600, rel=0.05, abs=0.05)
    assert device in total and '2026-01-02' in total and 'MFU' not in total
    assert total.endswith(' hours on 2 jobs')


def test_study_runs_exactly_the_commands_its_dry_run_prints(tmp_path):
    """The runner starts the dry run's commands: the missing dataset prepared first (the
    present one used as it is), then every run, a FLOP-budget run without
    --max-steps (which would cap it); --jobs 2 splits the machine's cores between the two
    (train.py's --threads)."""
    env, calls = stand_ins(tmp_path)
    (tmp_path / 'data' / 'fi').mkdir(parents=True)
    (tmp_path / 'data' / 'fi' / 'meta.json').write_text('{}')
    flags = ['--part', 'languages', '--langs', 'fi he', '--modes', 'none whitespace',
             '--seeds', '1', '--steps', '3', '--data-dir', tmp_path / 'data',
             '--raw-dir', tmp_path / 'raw', '--out', tmp_path / 'runs', '--jobs', '2']
    dry = study(*flags, '--dry-run')
    assert dry.returncode == 0, dry.stderr
    printed = commands(dry.stdout)
    assert [c[1] for c in printed].count('prepare_data.py') == 1
    budget = [c for c in printed if '--flop-budget' in c]
    assert len(budget) == 2 and not any('--max-steps' in c for c in budget)
    threads = str(max(1, len(os.sched_getaffinity(0)) // 2))
    trains = [c for c in printed if c[1] == 'train.py']
    assert len(trains) == 6 and all(c[c.index('--threads') + 1] == threads for c in trains)
    r = study(*flags, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    ran = [[tool, *args] for tool, _, _, args in recorded(calls)]
    # the preparation before any run; the runs themselves, two at a time, may record
    # themselves in either order of a pair
    assert ran[0] == printed[0] and ran[0][1] == 'prepare_data.py'
    assert sorted(ran) == sorted(printed)


def test_study_gpus_gives_each_gpu_one_run_at_a_time(tmp_path):
    """--gpus 0,1: every run with --device cuda and its own CUDA_VISIBLE_DEVICES, both GPUs
    used, never two runs on one GPU at once; with --nproc 2 each run is torchrun's on two."""
    env, calls = stand_ins(tmp_path)
    env['FAKE_HOLD'] = '0.3'
    (tmp_path / 'data' / 'fi').mkdir(parents=True)
    (tmp_path / 'data' / 'fi' / 'meta.json').write_text('{}')
    flags = ['--part', 'languages', '--langs', 'fi', '--modes', 'fixed2 whitespace', '--seeds',
             '1', '--steps', '2', '--data-dir', tmp_path / 'data', '--out', tmp_path / 'runs']
    r = study(*flags, '--gpus', '0,1', env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    runs = recorded(calls)
    assert 'clash' not in calls.read_text() and len(runs) == 4
    assert {gpus for _, _, gpus, _ in runs} == {'0', '1'}
    for tool, _, _, args in runs:
        assert tool == 'python' and args[0].endswith('train.py')
        assert args[args.index('--device') + 1] == 'cuda'
    calls.unlink()
    r = study(*flags, '--gpus', '0,1,2,3', '--nproc', '2', env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    runs = recorded(calls)
    assert 'clash' not in calls.read_text() and len(runs) == 4
    assert {gpus for _, _, gpus, _ in runs} == {'0,1', '2,3'}
    for tool, _, _, args in runs:
        assert tool == 'torchrun' and args[:3] == ['--standalone', '--nproc_per_node=2',
                                                    'train.py']


def test_study_emit_writes_commands_that_run_from_any_directory(tmp_path):
    """--emit FILE (study.sh run by its absolute path from another folder, paths relative to
    it): one command a line for the runs left to do (a finished run left out, one with a
    checkpoint resumed), nothing run; each line, run from a third folder, starts train.py of
    this project on the dataset and run folder meant."""
    env, calls = stand_ins(tmp_path)
    home = tmp_path / "a user's home"  # a path the shell must read quoted
    (home / 'data' / 'fi').mkdir(parents=True)
    (home / 'data' / 'fi' / 'meta.json').write_text('{}')
    for run, name, text in (('fi-none-s1', 'log.jsonl', '{"split": "test"}\n'),
                            ('fi-whitespace-s1', 'ckpt.pt', 'x')):
        (home / 'runs' / run).mkdir(parents=True)
        (home / 'runs' / run / name).write_text(text)
    r = study('--part', 'languages', '--langs', 'fi', '--modes', 'none whitespace', '--seeds',
              '1', '--steps', '3', '--device', 'cuda', '--nproc', '2', '--data-dir', 'data',
              '--out', 'runs',
              '--emit', 'jobs.txt', cwd=home, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert not calls.exists()
    lines = (home / 'jobs.txt').read_text().splitlines()
    assert len(lines) == 2 and not any('fi-none-s1' in line for line in lines)
    elsewhere = tmp_path / 'elsewhere'
    elsewhere.mkdir()
    for task in (1, 2):  # as Slurm runs them: docs/slurm-array.sh, task i runs line i
        done = subprocess.run(['bash', ROOT / 'docs' / 'slurm-array.sh', home / 'jobs.txt'],
                              cwd=elsewhere, env=dict(env, SLURM_ARRAY_TASK_ID=str(task)),
                              timeout=60)
        assert done.returncode == 0
    runs = recorded(calls)
    assert len(runs) == 2
    for tool, cwd, _, args in runs:
        assert tool == 'torchrun' and Path(args[2]) == ROOT / 'train.py'
        data = Path(cwd) / args[args.index('--data') + 1]
        out = Path(cwd) / args[args.index('--out') + 1]
        assert (data / 'meta.json').exists() and out.parent == home / 'runs'
        assert ('--resume' in args) == (out.name == 'fi-whitespace-s1')


def test_study_reports_runs_stopped_to_be_resumed_and_resumes_them(tmp_path):
    """train.py's exit 75 (stopped by SIGTERM or SIGUSR1, to be resumed) is no failure: the
    study names those runs in its one error line and exits 75; the same command again resumes
    a run with a checkpoint and skips a finished one."""
    env, calls = stand_ins(tmp_path)
    (tmp_path / 'data' / 'text8-head-u10000').mkdir(parents=True)
    (tmp_path / 'data' / 'text8-head-u10000' / 'meta.json').write_text('{}')
    runs = tmp_path / 'runs'
    flags = ['--part', 'table2', '--modes', 'fixed2', '--seeds', '1', '--steps', '2',
             '--data-dir', tmp_path / 'data', '--out', runs]
    r = study(*flags, env=dict(env, FAKE_RC='75'))
    assert r.returncode == 75, r.stdout + r.stderr
    err = r.stderr.splitlines()
    assert len(err) == 1 and err[0].startswith('error: stopped to be resumed')
    assert 'fixed2-mean-s1' in err[0] and 'fixed2-last-s1' in err[0]
    (runs / 'fixed2-mean-s1').mkdir(parents=True)
    (runs / 'fixed2-mean-s1' / 'ckpt.pt').write_text('x')
    (runs / 'fixed2-last-s1').mkdir(parents=True)
    (runs / 'fixed2-last-s1' / 'log.jsonl').write_text('{"split": "test"}\n')
    calls.unlink()
    r = study(*flags, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    trained = [args for _, _, _, args in recorded(calls) if args[0] == 'train.py']
    assert len(trained) == 1 and '--resume' in trained[0]
    assert str(runs / 'fixed2-mean-s1') in trained[0]
    assert 'fixed2-last-s1: finished, skipped' in r.stdout


@pytest.mark.parametrize('flags', [
    ['--part', 'table2', '--modes', 'whitespace bogus', '--steps', '2'],
    ['--part', 'bogus'],
    ['--part', 'table2', '--steps', '2', '--', '--bogus-flag'],
    ['--part', 'table2', '--dry-run', '--', '--layers', '1,2'],
    ['--part', 'table2', '--gpus', '0,1,2', '--nproc', '2'],
    ['--part', 'table1', '--dry-run', '--mfu', 'abc'],
    ['--part', 'table1', '--dry-run', '--peak-tflops', '0'],
    ['--part', 'table2', '--gpus', '0,1,0'],
    ['--part', 'table2', '--jobs', ''],
    ['--part', 'table2', '--seeds', '1 2 1'],
    ['--part', 'table2', '--modes', 'fixed2 fixed2'],
    ['--part', 'table2', '--emit', '/'],
    ['--part', 'languages', '--langs', 'xx'],
], ids=['mode', 'part', 'train-flag', 'train-flag-dry-run', 'gpus-nproc', 'mfu', 'peak',
        'gpu-twice', 'jobs-empty', 'seed-twice', 'mode-twice', 'emit-folder', 'language'])
def test_study_refuses_bad_input_before_anything(tmp_path, flags):
    """A mistake in a mode, a part, a list (a GPU, seed or mode twice), a number, an output
    path (--emit naming a folder), or a train.py flag after -- (train.py's own parser says so),
    from any working directory: exit 2, one error line, nothing printed, prepared or run."""
    env, calls = stand_ins(tmp_path)
    r = study(*flags, '--data-dir', tmp_path / 'data', '--out', tmp_path / 'runs', cwd='/',
              env=env)
    assert r.returncode == 2 and r.stdout == '', r.stdout + r.stderr
    err = r.stderr.splitlines()
    assert len(err) == 1 and err[0].startswith('error: '), r.stderr
    assert not calls.exists() and not (tmp_path / 'data').exists()
    assert not (tmp_path / 'runs').exists()


def test_study_plans_from_any_working_directory(tmp_path):
    """cd / && bash /path/to/study.sh --dry-run: train.py's modules are found beside the script
    and the commands name its scripts by their paths."""
    r = study('--part', 'table2', '--dry-run', '--out', tmp_path / 'runs', cwd='/')
    assert r.returncode == 0, r.stderr
    cmds = commands(r.stdout)
    assert {Path(c[1]) for c in cmds} == {ROOT / 'prepare_data.py', ROOT / 'train.py'}


def test_slurm_array_script_passes_slurms_signal_on_to_the_run(tmp_path):
    """docs/slurm-array.sh: Slurm's SIGUSR1 before the time limit reaches the script only; it
    passes it to train.py's process, which saves and exits 75, and exits with its status."""
    env, calls = stand_ins(tmp_path)
    jobs = tmp_path / 'jobs.txt'
    jobs.write_text(f'cd {shlex.quote(str(ROOT))} && python train.py --out runs/x\n')
    script = subprocess.Popen(['bash', ROOT / 'docs' / 'slurm-array.sh', jobs], cwd=tmp_path,
                              env=dict(env, SLURM_ARRAY_TASK_ID='1', FAKE_HOLD='60'),
                              stdout=subprocess.DEVNULL)
    for _ in range(300):
        if calls.exists():
            break
        time.sleep(0.1)
    time.sleep(0.5)  # the script's trap is set right after it starts the run
    script.send_signal(signal.SIGUSR1)
    assert script.wait(timeout=30) == 75
    assert [args for *_, args in recorded(calls)] == [['train.py', '--out', 'runs/x'],
                                                      ['signal']]


def test_study_stopped_by_sigterm_stops_its_runs_so_they_save_first(tmp_path):
    """SIGTERM to study.sh (a scheduler's, a spot machine's) reaches every run it started (runs
    in the background ignore Ctrl-C's SIGINT, and a scheduler may signal study.sh alone): each
    saves and exits, then the study, with 75 (stopped to be resumed) and one error line."""
    env, calls = stand_ins(tmp_path)
    (tmp_path / 'data' / 'text8-head-u10000').mkdir(parents=True)
    (tmp_path / 'data' / 'text8-head-u10000' / 'meta.json').write_text('{}')
    flags = ['--part', 'table2', '--modes', 'fixed2', '--seeds', '1', '--steps', '2', '--jobs',
             '2', '--data-dir', tmp_path / 'data', '--out', tmp_path / 'runs']
    run = subprocess.Popen(['bash', STUDY, *map(str, flags)], cwd=ROOT, text=True,
                           env=dict(env, FAKE_HOLD='60'), stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE)
    for _ in range(600):
        if len(recorded(calls)) == 2:
            break
        time.sleep(0.1)
    time.sleep(0.5)  # each stand-in sets its trap right after recording its start
    run.send_signal(signal.SIGTERM)
    _, err = run.communicate(timeout=30)
    assert run.returncode == 75
    assert [args for *_, args in recorded(calls)][2:] == [['signal'], ['signal']]
    assert len(err.splitlines()) == 1 and err.startswith('error: interrupted')


def make_dataset(tmp_path, name, *flags):
    """A dataset made by prepare_data.py as a user makes one → its folder."""
    r = subprocess.run([sys.executable, ROOT / 'prepare_data.py', *map(str, flags), '--out-dir',
                        tmp_path / 'data', '--name', name], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    return tmp_path / 'data' / name


def test_study_refuses_data_that_is_not_the_papers_and_names_a_slice(tmp_path):
    """A study part that reproduces the paper (table1) refuses a text8 that is a slice (made
    from --input), in dataset.paper_data_problem's one line naming the command that makes the
    whole one, before anything runs; a CPU part on the same slice runs and names it."""
    text = tmp_path / 'text8-part.txt'
    text.write_text(shared_data('text8-head.txt').read_text()[:200_000])
    slice8 = make_dataset(tmp_path, 'text8', '--input', text, '--dataset', 'text8',
                          '--unigram', '0')
    problem = dataset.paper_data_problem(slice8)
    assert problem and 'prepare_data.py' in problem
    r = study('--part', 'table1', '--langs', 'text8', '--modes', 'none', '--seeds', '1',
              '--device', 'cuda', '--dry-run', '--data-dir', tmp_path / 'data')
    assert r.returncode == 1 and r.stdout == ''
    assert r.stderr.splitlines() == [f'error: {problem}']
    named = make_dataset(tmp_path, 'text8-head-u10000', '--input', text, '--dataset', 'text8',
                         '--unigram', '0')
    r = study('--part', 'table2', '--modes', 'fixed2', '--seeds', '1', '--dry-run',
              '--data-dir', tmp_path / 'data', '--out', tmp_path / 'runs')
    assert r.returncode == 0, r.stderr
    note = dataset.paper_data_problem(named)
    assert f"# {named}: prepared, used as it is (not the paper's data: {note})" in r.stdout


def test_study_prices_each_run_at_the_sf_its_data_records(tmp_path):
    """The dry run prices Finnish Unigram at V = 200 at its labels' SF from meta.json (about 2,
    not an assumed 4.5): more FLOPs than entropy at the assumed SF; gumbel at 1 / prior;
    whitespace at the whitespace SF meta.json records (assumed where it records none)."""
    text = tmp_path / 'fi.txt'
    text.write_text(shared_data('raw/fi.txt').read_text()[:300_000])
    fi = make_dataset(tmp_path, 'fi', '--input', text, '--lang', 'fi', '--unigram', '200')
    meta = json.loads((fi / 'meta.json').read_text())
    labels = meta['unigram_sets']['200']
    modes = 'unigram entropy gumbel whitespace'
    r = study('--part', 'languages', '--langs', 'fi', '--modes', modes, '--seeds', '1',
              '--device', 'cuda', '--dry-run', '--data-dir', tmp_path / 'data',
              '--out', tmp_path / 'runs')
    assert r.returncode == 0, r.stderr
    priced = {}
    for line in r.stdout.splitlines():
        if line.startswith('python') and ' at SF ' in line:
            run = line.split(' --out ')[1].split()[0].split('/')[-1]
            cost = line.split('    # ')[1].split()
            priced[run] = float(cost[0]), float(cost[4]), 'assumed' in line
    sf = labels['shortening_factor']['train']
    assert priced['fi-unigram-s1'] == (pytest.approx(priced['fi-unigram-s1'][0]),
                                       round(sf, 2), False) and sf < 3
    assert priced['fi-entropy-s1'][1:] == (4.5, True)
    assert priced['fi-gumbel-s1'][1:] == (round(1 / 0.37, 2), False)
    assert priced['fi-unigram-s1'][0] > priced['fi-gumbel-s1'][0] > priced['fi-entropy-s1'][0]
    spaces = meta.get('whitespace_shortening_factor')
    if spaces:
        assert priced['fi-whitespace-s1'][1:] == (round(spaces['train'], 2), False)
    else:
        assert priced['fi-whitespace-s1'][1:] == (4.5, True)


def test_study_passes_an_imported_source_to_its_runs(tmp_path):
    """--import FILE, as train.py takes it: the file's source is a mode of the study, and each
    run gets the same --import (checked and priced by train.py's parser with it)."""
    source = tmp_path / 'every_k.py'
    source.write_text(EVERY_K)
    r = study('--part', 'table2', '--modes', 'every fixed2', '--seeds', '1', '--dry-run',
              '--import', source, '--data-dir', tmp_path / 'data', '--out', tmp_path / 'runs',
              cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    runs = [c for c in commands(r.stdout) if c[1].endswith('train.py')]
    assert len(runs) == 4
    assert all(c[c.index('--import') + 1] == str(source) for c in runs)
    assert {c[c.index('--boundary') + 1] for c in runs} == {'every', 'fixed'}
