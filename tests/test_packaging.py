"""Packaging contracts: what `recorders` may import, the CLI entry point, CI == README test command."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_importing_recorders_loads_no_analyzer_dependency():
    # recorders runs inside training: it may import torch and polars only. scipy, matplotlib
    # and click belong to the analyzer; transformers/lightning are optional extras.
    code = (
        "import sys, recorders, recorders.schema, recorders.snapshot, recorders.integrations\n"
        "bad = [m for m in ('scipy', 'matplotlib', 'click', 'transformers', 'lightning', 'analyzer')"
        " if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == ""


_HEAVY = "heavy = sorted(m for m in ('torch', 'matplotlib') if m in sys.modules)\n"


@pytest.mark.parametrize("module", ["analyzer.cli", "analyzer.report", "analyzer.load", "analyzer.render"])
def test_importing_the_cli_or_the_report_leaves_torch_and_matplotlib_out(module):
    # a fresh interpreter: the test process itself has imported torch long ago
    code = f"import sys, {module}\n" + _HEAVY + "print(','.join(heavy))\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == ""


@pytest.mark.parametrize("args", [["--help"], ["report", "--help"], ["inspect", "--help"]])
def test_help_answers_without_importing_torch_or_matplotlib(args):
    code = ("import sys\nfrom analyzer.cli import main\n"
            f"try:\n    main({args!r})\nexcept SystemExit as e:\n    assert e.code == 0, e.code\n"
            + _HEAVY + "print('heavy=' + ','.join(heavy))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert "Usage: " in out.stdout and "--help" in out.stdout
    assert out.stdout.strip().splitlines()[-1] == "heavy="


@pytest.mark.parametrize("json_out", [False, True])
def test_reporting_a_run_imports_neither_torch_nor_matplotlib(tmp_path, json_out):
    from tests.analyzer.report.report_traces import every_column, write_trace

    # NaN and Inf sprinkled in every column of two ranks: most checks fire, and their statistics run
    run = write_trace(every_column("sprinkled", lengths=(30, 30)), tmp_path / "run")
    args = ["report", str(run)] + (["--json"] if json_out else [])
    code = ("import sys\nfrom analyzer.cli import main\n"
            f"try:\n    main({args!r})\nexcept SystemExit as e:\n    print('exit', e.code)\n"
            + _HEAVY + "print('heavy=' + ','.join(heavy))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    lines = out.stdout.strip().splitlines()
    assert lines[-1] == "heavy=", out.stderr[-2000:]
    assert "nonfinite_loss" in out.stdout


def test_analyzer_report_help_costs_under_half_a_second_of_cpu_more_than_a_bare_interpreter():
    # whole processes, best of three each, in CPU time (user + system) rather than wall time: the shared
    # machine's load stretches wall time, while the CPU a start-up costs is what importing torch would add
    import resource

    def best(cmd):
        times = []
        for _ in range(3):
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            subprocess.run(cmd, capture_output=True, cwd=ROOT, check=True)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            times.append((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime))
        return min(times)

    bare = best([sys.executable, "-c", "pass"])
    helped = best([sys.executable, "-m", "analyzer.cli", "report", "--help"])
    assert helped - bare < 0.5, (helped, bare)


def test_the_analyzer_console_script_prints_its_commands():
    out = subprocess.run([sys.executable, "-m", "analyzer.cli", "--help"], capture_output=True, text=True,
                         cwd=ROOT, check=True)
    for command in ("autopsy", "replay", "report", "inspect", "demo"):
        assert re.search(rf"^\s+{command}\s", out.stdout, re.M), command


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```(?:bash|sh)\n(.*?)```", text, re.S)
    assert block, "README must start with a bash block holding the two set-up commands"
    lines = [line.split("  #")[0].strip() for line in block.group(1).splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def test_ci_runs_exactly_the_readme_set_up_commands_before_installing_any_extra():
    # The README's first code block holds the two set-up commands: demo first, tests second. CI runs
    # both as written, with nothing but [dev] installed, before it installs the other extras.
    demo, tests = _readme_commands()[:2]
    assert "analyzer demo" in demo and tests.split("&&")[-1].strip().startswith("python -m pytest")
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    for command in (demo, tests):
        assert command in ci_lines, f"CI must run the README command {command!r} verbatim"
    extras = [n for n, line in enumerate(ci_lines) if re.search(r"pip install .*\[(?!dev\])", line)]
    assert extras, "CI installs the optional extras after the README's commands"
    assert ci_lines.index(demo) < ci_lines.index(tests) < min(extras)
    assert ci_lines.index("python -m pytest --skipped-for-extras") > min(extras)


def _next_commands(demo_stdout: str) -> list[list[str]]:
    """The argument lists of the demo's ``next:`` line (``analyzer autopsy ... | analyzer replay ...``)."""
    import shlex

    (line,) = [ln for ln in demo_stdout.splitlines() if ln.startswith("next: ")]
    commands = [shlex.split(part) for part in line.removeprefix("next: ").split("|")]
    assert [c[:2] for c in commands] == [["analyzer", "autopsy"], ["analyzer", "replay"]], line
    return [c[1:] for c in commands]


def _build_wheel(tmp: Path) -> Path:
    """The wheel of a copy of the sources (no build isolation, no index: offline)."""
    import shutil

    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, src / name)
    for pkg in ("recorders", "analyzer", "samples"):
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    wheels = tmp / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(wheels), str(src)], check=True, capture_output=True, text=True)
    (whl,) = wheels.glob("amp_autopsy-*.whl")
    return whl


def _wheel_env(tmp: Path) -> tuple[Path, dict]:
    """Build the wheel from a copy of the sources, unpack it, and return (site dir, environment).

    The environment runs Python with ``-S`` (no ``.pth`` files: not the development install's
    path hooks) on the unpacked wheel, then the virtual environment's site-packages for torch,
    polars and the rest, so only what the wheel installs is importable of amp-autopsy.
    """
    import os
    import site
    import zipfile

    whl = _build_wheel(tmp)
    installed = tmp / "site"
    with zipfile.ZipFile(whl) as z:
        z.extractall(installed)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONPATH"] = os.pathsep.join([str(installed), *site.getsitepackages()])
    return installed, env


@pytest.mark.slow  # builds a wheel and trains a small scenario (~20 s)
def test_pyproject_lists_every_package_of_the_tree():
    # [tool.setuptools] packages is an explicit list (samples/ installs under another name): a new
    # sub-package left out of it is missing from the wheel, which only the slow wheel tests would see.
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    tree = {".".join(p.parent.relative_to(ROOT).parts) for top in ("analyzer", "recorders")
            for p in (ROOT / top).rglob("__init__.py")}
    assert tree - listed == set() and "amp_autopsy_samples" in listed


def test_the_wheel_installs_samples_under_its_own_name_and_the_demo_and_old_snapshots_replay(tmp_path):
    import torch

    installed, env = _wheel_env(tmp_path)
    tops = sorted(p.name for p in installed.iterdir() if not p.name.endswith(".dist-info"))
    assert tops == ["amp_autopsy_samples", "analyzer", "recorders"]  # no top-level "samples"
    away = tmp_path / "elsewhere"  # outside the repository: nothing of the checkout is importable
    away.mkdir()
    py = [sys.executable, "-S"]
    probe = subprocess.run(py + ["-c", "import importlib.util as u, analyzer; print(u.find_spec('samples'), "
                                       "analyzer.__file__)"], cwd=away, env=env, capture_output=True, text=True)
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.startswith("None ") and str(installed) in probe.stdout
    demo = subprocess.run(py + ["-m", "analyzer.cli", "demo", "--scenario", "bf16_nan", "--out", "out"], cwd=away,
                          env=env, capture_output=True, text=True, timeout=600)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert "verdict" in demo.stdout.lower()
    for args in _next_commands(demo.stdout):  # what the demo tells the user to run next, from the same directory
        step = subprocess.run(py + ["-m", "analyzer.cli", *args], cwd=away, env=env, capture_output=True, text=True,
                              timeout=600)
        assert step.returncode == 0, (args, step.stdout + step.stderr)
    (snap,) = sorted((away / "out" / "bf16_nan" / "snapshots").glob("*.pt"))[:1]
    recorded = torch.load(snap, weights_only=True)
    assert recorded["factory"] == "amp_autopsy_samples.models:build_mlp"
    # A snapshot recorded in a checkout names samples.models: it replays from the wheel too.
    recorded["factory"] = "samples.models:build_mlp"
    old = tmp_path / "old.pt"
    torch.save(recorded, old)
    show = subprocess.run(py + ["-m", "analyzer.cli", "replay", "--show", "--json", str(old)], cwd=away, env=env,
                          capture_output=True, text=True)
    assert show.returncode == 0, show.stderr
    factory = json.loads(show.stdout)["imports"][0]
    assert factory["allowed"] and factory["file"] == str(installed / "amp_autopsy_samples" / "models.py")
    replay = subprocess.run(py + ["-m", "analyzer.cli", "replay", "--json", "--dtypes", "fp32,bf16", str(old)],
                            cwd=away, env=env, capture_output=True, text=True, timeout=600)
    assert replay.returncode == 0, replay.stderr
    assert json.loads(replay.stdout)["verdict"] == json.loads(
        subprocess.run(py + ["-m", "analyzer.cli", "replay", "--json", "--dtypes", "fp32,bf16", str(snap)],
                       cwd=away, env=env, capture_output=True, text=True, timeout=600).stdout)["verdict"]


@pytest.mark.slow  # builds a wheel, pip-installs it into a new virtual environment, trains a small scenario (~60 s)
def test_a_wheel_pip_installed_into_a_fresh_venv_demos_and_its_next_commands_work_from_there(tmp_path):
    import os
    import site
    import venv

    whl = _build_wheel(tmp_path)
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    vpy = env_dir / "bin" / "python"
    purelib = Path(subprocess.run([str(vpy), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  check=True, capture_output=True, text=True).stdout.strip())
    # torch, polars, click...: this environment's site-packages, after the new one's own. A .pth line
    # adds the folder only: the development install's own .pth hooks there never run.
    (purelib / "_deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    pip = subprocess.run([sys.executable, "-m", "pip", "--python", str(vpy), "install", "-q", "--no-deps",
                          "--no-index", str(whl)], capture_output=True, text=True)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    script = env_dir / "bin" / "analyzer"  # the console script pip wrote from the wheel's entry points
    assert script.is_file()
    away = tmp_path / "elsewhere"
    away.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON") and k != "VIRTUAL_ENV"}
    env["PATH"] = f"{env_dir / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    probe = subprocess.run([str(vpy), "-c", "import importlib.util as u, analyzer; print(u.find_spec('samples'), "
                                            "analyzer.__file__)"], cwd=away, env=env, capture_output=True, text=True)
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.split() == ["None", str(purelib / "analyzer" / "__init__.py")]  # the wheel's, not the checkout
    demo = subprocess.run([str(script), "demo", "--scenario", "bf16_nan", "--out", "d"], cwd=away, env=env,
                          capture_output=True, text=True, timeout=600)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    for args in _next_commands(demo.stdout):
        step = subprocess.run([str(script), *args], cwd=away, env=env, capture_output=True, text=True, timeout=600)
        assert step.returncode == 0, (args, step.stdout + step.stderr)
        assert "numerical_bug" in step.stdout and "Error" not in step.stderr, step.stdout + step.stderr


# How an editable install imports amp-autopsy: the checkout's packages by path, the checkout
# itself not on sys.path (what setuptools' editable finder does).
_EDITABLE = """
import importlib.util, sys
for name in ("recorders", "analyzer"):
    spec = importlib.util.spec_from_file_location(name, f"{ROOT}/{name}/__init__.py",
                                                  submodule_search_locations=[f"{ROOT}/{name}"])
    sys.modules[name] = mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
assert importlib.util.find_spec("samples") is None, "the checkout must not be importable here"
"""


@pytest.mark.slow  # trains a small scenario (~15 s)
def test_an_editable_install_run_from_elsewhere_demos_and_replays_the_checkouts_samples(tmp_path):
    import os
    import site

    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONPATH"] = os.pathsep.join(site.getsitepackages())
    code = _EDITABLE.replace("{ROOT}", str(ROOT)) + (
        "from analyzer.load import samples_package\n"
        "print('package', samples_package())\n"
        "from analyzer.cli import main\n"
        "main(['demo', '--scenario', 'bf16_nan', '--out', 'out'])\n")
    res = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "package samples\n" in res.stdout
    assert "verdict: numerical_bug" in res.stdout  # the replay of its snapshot imported samples.models
    # Each next command, in a fresh process from the same directory: samples.models is not on its
    # sys.path, and is found as the checkout's own module.
    for args in _next_commands(res.stdout):
        step = subprocess.run([sys.executable, "-S", "-c", _EDITABLE.replace("{ROOT}", str(ROOT))
                               + f"from analyzer.cli import main\nmain({args!r})\n"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=600)
        assert step.returncode == 0, (args, step.stdout + step.stderr)
        assert "numerical_bug" in step.stdout, step.stdout


def _editable_console_script() -> Path | None:
    """The ``analyzer`` script of a ``pip install -e .`` of this checkout, when that is how it is installed."""
    script = Path(sys.executable).with_name("analyzer")
    if not script.is_file():
        return None
    probe = subprocess.run([str(script.with_name("python")), "-c", "import analyzer; print(analyzer.__file__)"],
                           cwd="/", capture_output=True, text=True)
    return script if probe.stdout.strip() == str(ROOT / "analyzer" / "__init__.py") else None


@pytest.mark.slow  # trains a small scenario (~15 s), then runs its autopsy and replay again
def test_the_demos_next_commands_work_from_its_directory_under_pip_install_editable(tmp_path):
    import os

    script = _editable_console_script()
    if script is None:
        pytest.skip("amp-autopsy is not installed with pip install -e . from this checkout")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    demo = subprocess.run([str(script), "demo", "--scenario", "bf16_nan", "--out", "d"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    for args in _next_commands(demo.stdout):
        step = subprocess.run([str(script), *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=600)
        assert step.returncode == 0, (args, step.stdout + step.stderr)
        assert "numerical_bug" in step.stdout and "Error" not in step.stderr, step.stdout + step.stderr
