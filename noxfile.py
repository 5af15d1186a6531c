"""Sessions: test, bench, docs, serve, lint, new_day.

    pip install nox
    nox -s test                  # every day's tests + the bridge/infra tests (CPU; CUDA if present)
    nox -s bench                 # every benchmark; filters: nox -s bench -- --day day009 --quick
    nox -s docs                  # the MkDocs site into site/ (mkdocs build --strict)
    nox -s serve                 # live preview of the site on http://127.0.0.1:8000
    nox -s lint                  # pre-commit on all files
    nox -s new_day -- 21 "title" # scaffold days/day021/

Each session installs what it needs into its own venv. Without network (the GPU machine),
run in an existing environment: `nox --no-venv -s bench` skips the installs, or call what
each session calls directly: `python -m pytest`, `python -m benchmark`, `mkdocs build --strict`.
"""

from __future__ import annotations

import datetime
from pathlib import Path

import nox

nox.options.sessions = ["test"]
nox.options.reuse_existing_virtualenvs = True
ROOT = Path(__file__).parent


def install(session: nox.Session, *extras: str) -> None:
    """Install the project (editable) with `extras`, unless running without a venv."""
    if isinstance(session.virtualenv, nox.virtualenv.PassthroughEnv):
        session.log("no venv: using the packages already installed")
        return
    spec = f".[{','.join(extras)}]" if extras else "."
    session.install("-e", spec)


@nox.session
def test(session: nox.Session) -> None:
    """Run every test (pytest exits non-zero when a test fails or none ran)."""
    install(session, "test", "docs")  # docs: the site test builds the site
    session.run("python", "-m", "pytest", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Time every registered benchmark and append the results to results/<device>/."""
    install(session, "bench")
    session.run("python", "-m", "benchmark", *session.posargs)


@nox.session
def docs(session: nox.Session) -> None:
    """Build the site with --strict: broken links or missing images fail the build."""
    install(session, "docs")
    session.run("mkdocs", "build", "--strict", *session.posargs)


@nox.session
def serve(session: nox.Session) -> None:
    """Preview the site live while editing journals."""
    install(session, "docs")
    session.run("mkdocs", "serve", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff, mojo format and whitespace checks on every file (.pre-commit-config.yaml)."""
    install(session, "lint")
    session.run("pre-commit", "run", "--all-files", "--show-diff-on-failure")


JOURNAL = """# Day {num:03d} — {title}

*{date}*

## What I built

## What I learned

## Pitfalls

## Takeaways

## Results

<!-- results: day{num:03d} -->
"""

KERNEL = """# Day {num:03d}: {title}
from extensibility import register, InputTensor, OutputTensor
from max.gpu.host import DeviceContext


@register("day{num:03d}_op")
struct Day{num:03d}Op:
    @staticmethod
    def execute[target: StaticString, dtype: DType](
        output: OutputTensor[dtype=dtype, rank=2, ...],
        x: InputTensor[dtype=dtype, rank=2, ...],
        ctx: DeviceContext,
    ) raises:
        if output.shape() != x.shape():
            raise Error("day{num:03d}_op: output shape ", output.shape(), " != input shape ", x.shape())
        raise Error("day{num:03d}_op: not written yet")
"""

TEST = '''"""Day {num:03d} smoke test: compare the op with a float64 reference."""

import pytest
import torch


@pytest.mark.skip(reason="day {num:03d} is scaffolded; write the op, then this test")
def test_against_float64_reference(device):
    torch.manual_seed(0)
    x = torch.randn(37, 1001, device=device)
    raise NotImplementedError
'''


@nox.session(venv_backend="none")
def new_day(session: nox.Session) -> None:
    """Scaffold days/dayNNN/: journal, Mojo kernel stub, smoke test. Usage: nox -s new_day -- 21 "title"."""
    if not session.posargs or not session.posargs[0].isdigit():
        session.error('usage: nox -s new_day -- NUMBER "title"')
    num = int(session.posargs[0])
    title = " ".join(session.posargs[1:]) or "untitled"
    day = ROOT / "days" / f"day{num:03d}"
    if day.exists():
        session.error(f"{day} exists already")
    day.mkdir(parents=True)
    fields = {"num": num, "title": title, "date": datetime.date.today().isoformat()}
    (day / "README.md").write_text(JOURNAL.format(**fields))
    (day / "__init__.mojo").write_text("")
    (day / f"day{num:03d}_kernel.mojo").write_text(KERNEL.format(**fields))
    (day / f"test_day{num:03d}.py").write_text(TEST.format(**fields))
    session.log(f"created {day.relative_to(ROOT)}/: README.md, day{num:03d}_kernel.mojo, test_day{num:03d}.py")
