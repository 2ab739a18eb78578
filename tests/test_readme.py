"""Every command in README.md and in every docs/*.md page runs as written (issue 17: the first hour has no surprises;
issue 38: every code block of the docs is executed by a test).

What is extracted (:func:`blocks`), from each page of :data:`PAGES`: every ```bash / ```sh / ```console block, one command a line (``# comments``
and a console block's ``$`` prompt dropped), and every ```python block.

How the shell lines run:

- ``make TARGET`` is not run (``make test`` would run this suite again; both set up a venv): TARGET must be a
  target of the Makefile.
- The lines of one block run in order in one temporary directory, so a later line reads what an earlier one
  wrote (``plan.json``). The directory holds what the pages take for granted: ``path/to/my_model.py`` and
  ``my_model.py`` (a ``factory()`` returning a tiny LLaMA) and ``benchmarks/`` (the repository's).
- ``rpcompile ...`` lines run in this process through :func:`rpcompile.cli.main` (the console script is that
  function; an interpreter per line would cost most of the time budget), any other line through bash. The
  ``slow`` test runs every line through bash and the installed ``rpcompile`` script, exactly as written.
- Fast mode rewrites the slow commands mechanically (:func:`shrink`): a published-shape model (``llama-8b``,
  ``llama-1.7b``, ``llama-32b``, ``qwen3-30b-a3b``, ``qwen3-235b-a22b``) becomes ``llama-demo``, ``--gpus 8`` becomes ``--gpus 2``,
  ``--microbatches 16`` becomes ``--microbatches 4``, ``plan``, ``simulate`` and ``check`` get
  ``--time-limit 1`` unless they name a limit, and a ``plan`` that would measure its costs on this CPU gets
  ``--spec cpu`` (analytic: measuring takes seconds, and the cuts it gives vary with the machine's load).
- A test's id names the page and the block's first line (``docs/training.md:line12``); a block repeated on a
  later page (the README's loop opens the training page) runs once.
- A line passes when it exits 0 (``rpcompile diff``: 0 or 1, as documented) and prints no traceback.

The Python blocks run unmodified on a tiny LLaMA, except where they name hardware this machine lacks
(:func:`adapt`, without CUDA only): ``gpus=N`` in ``rpcompile.compile(...)`` becomes ``devices=["cpu", "cpu"]``
(the alternative the pages name beside it) and ``device="cuda:0"`` becomes ``device="cpu"``. The names they use
(``model``, ``input_ids``, ``loss_fn``, ``data``, ``x``, ``y``, ``lm_loss``) come from :func:`namespace`.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from rpcompile.cli import main
from rpcompile.cli.parser import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: Every page whose code blocks run: the README and the user guide (docs/).
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
BIG_MODELS = ("llama-8b", "llama-1.7b", "llama-32b", "qwen3-30b-a3b", "qwen3-235b-a22b")
MODEL_FILE = '''from rpcompile.models.registry import load_model


def factory():
    """A tiny LLaMA: (model, example_inputs, loss_fn, example_target)."""
    return load_model("llama-demo", batch_size=16, seq_len=8)
'''


def blocks(text: str) -> list[tuple[str, int, str]]:
    """``(language, first line number, body)`` of every fenced block of ``text``."""
    out, lang, start, body = [], None, 0, []
    for i, line in enumerate(text.splitlines(), 1):
        fence = re.match(r"^```(\w*)\s*$", line)
        if fence and lang is None:
            lang, start, body = fence.group(1) or "text", i + 1, []
        elif line.startswith("```") and lang is not None:
            out.append((lang, start, "\n".join(body)))
            lang = None
        elif lang is not None:
            body.append(line)
    return out


def commands(body: str, lang: str) -> list[str]:
    """The commands of a shell block: comments and blank lines dropped, a console prompt (``$ ``) removed;
    a console block's output lines (no prompt) are not commands."""
    out = []
    for line in body.splitlines():
        if lang == "console":
            if not line.startswith("$ "):
                continue
            line = line[2:]
        line = _strip_comment(line).strip()
        if line:
            out.append(line)
    return out


def _strip_comment(line: str) -> str:
    """The command before its ``# comment`` (a ``#`` that starts the line or follows whitespace, as bash reads
    it); the command itself is kept as written, pipes and quotes included."""
    return re.split(r"(?:^|\s)#", line, maxsplit=1)[0]


def _name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def _page_blocks(langs: tuple[str, ...]) -> list[tuple[str, int, str, str]]:
    """``(page, first line, language, body)`` of the blocks in ``langs``; a block that repeats one an earlier page
    holds (the README's loop, opening the training page) runs once, at its first place."""
    out, seen = [], set()
    for page in PAGES:
        for lang, start, body in blocks(page.read_text()):
            if lang in langs and body not in seen:
                seen.add(body)
                out.append((_name(page), start, lang, body))
    return out


def shell_blocks() -> list[tuple[str, int, list[str]]]:
    """``(page, first line, commands)`` of every shell block of every page."""
    return [(page, start, commands(body, lang))
            for page, start, lang, body in _page_blocks(("bash", "sh", "shell", "console"))]


def python_blocks() -> list[tuple[str, int, str]]:
    """``(page, first line, source)`` of every Python block of every page."""
    return [(page, start, body) for page, start, _, body in _page_blocks(("python",))]


def _ids(found: list[tuple[Any, ...]]) -> list[str]:
    return [f"{page}:line{start}" for page, start, *_ in found]


def shrink(line: str) -> str:
    """The fast form of a command of the pages (the module docstring's rules)."""
    argv = shlex.split(line)
    if argv[:1] != ["rpcompile"]:
        return line
    argv = ["llama-demo" if a in BIG_MODELS else a for a in argv]
    for flag, small in (("--gpus", "2"), ("--microbatches", "4")):
        if flag in argv:
            argv[argv.index(flag) + 1] = small
    if len(argv) > 1 and argv[1] in ("plan", "simulate", "check") and "--time-limit" not in argv:
        argv += ["--time-limit", "1"]
    if argv[1:2] == ["plan"] and "--spec" not in argv and "--device" not in argv:
        argv += ["--spec", "cpu"]
    return shlex.join(argv)


def adapt(source: str) -> str:
    """A Python block made runnable here (the module docstring): only hardware this machine lacks changes."""
    if torch.cuda.is_available():
        return source
    source = re.sub(r"(rpcompile\.compile\([^\n]*?)\bgpus=\d+", r'\1devices=["cpu", "cpu"]', source)
    return source.replace('device="cuda:0"', 'device="cpu"')


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A directory with what the pages' commands take for granted."""
    (tmp_path / "path" / "to").mkdir(parents=True)
    (tmp_path / "path" / "to" / "my_model.py").write_text(MODEL_FILE)
    (tmp_path / "my_model.py").write_text(MODEL_FILE)
    (tmp_path / "benchmarks").symlink_to(ROOT / "benchmarks")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _allowed(line: str) -> set[int]:
    return {0, 1} if shlex.split(line)[:2] == ["rpcompile", "diff"] else {0}


def _run_here(line: str, capsys) -> tuple[int, str]:
    """``line`` in this process (rpcompile) or through bash; its exit code and its stderr."""
    argv = shlex.split(line)
    if argv[0] != "rpcompile":
        done = subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=60)
        return done.returncode, done.stderr
    try:
        code = main(argv[1:])
    except SystemExit as e:  # argparse: a flag a page names no longer exists
        code = int(e.code or 0)
    return code, capsys.readouterr().err


def _make_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.MULTILINE))


def test_the_readme_has_its_commands():
    """The extraction itself: a reshuffle of the pages that hid the commands from this test would fail here."""
    lines = [c for _, _, block in shell_blocks() for c in block]
    assert len(lines) >= 18 and sum(c.startswith("rpcompile ") for c in lines) >= 16
    assert len(python_blocks()) >= 3 and any(name.startswith("docs/") for name, _, _ in python_blocks())
    assert any(lang == "python" for lang, _, _ in blocks(README.read_text())), "the README's training loop"
    assert shrink("rpcompile plan llama-8b --gpus 8 --spec rtx4090 -o plan.json") == (
        "rpcompile plan llama-demo --gpus 2 --spec rtx4090 -o plan.json --time-limit 1")
    assert shrink("rpcompile plan llama-demo --gpus 2 --emit stages/") == (
        "rpcompile plan llama-demo --gpus 2 --emit stages/ --time-limit 1 --spec cpu")
    assert shrink("rpcompile profile llama-demo") == "rpcompile profile llama-demo"
    line = 'pipe = rpcompile.compile(model, (x,), loss_fn=f, gpus=8)   # or devices=["cpu"]'
    here = line.replace("gpus=8", 'devices=["cpu", "cpu"]') if not torch.cuda.is_available() else line
    assert adapt(line) == here and adapt('plan(model, (x,), gpus=8, spec="h200")') == 'plan(model, (x,), gpus=8, spec="h200")'


def test_a_broken_command_would_fail(workdir, capsys):
    """What the block tests rely on: a flag the CLI lost, or a file a line needs, gives a failing exit code."""
    assert _run_here("rpcompile plan llama-demo --gpus 2 --no-such-flag", capsys)[0] == 2
    assert _run_here("rpcompile show missing.json", capsys)[0] == 2
    assert _run_here("ls no-such-file", capsys)[0] != 0


#: Inline flags of the pages that belong to other tools.
NOT_OURS = {"--system-site-packages", "--durations=10"}  # venv and pytest flags
#: Placeholders of the pages' inline commands and what the parser gets for them.
PLACEHOLDERS = {"MODEL": "llama-demo", "NAME": "llama-demo", "N": "2", "[--head-chunks K|auto]": "--head-chunks auto"}


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_inline_commands_and_flags_exist(capsys):
    """The pages' inline `rpcompile ...` spans parse (placeholders filled in), and every `--flag` they name is
    a flag of some rpcompile command: a renamed or removed flag fails here too."""
    text = "\n".join(page.read_text() for page in PAGES)
    subs = _subparsers()
    for span in re.findall(r"`(rpcompile [^`]*)`", text):
        span = span.replace("[--head-chunks K|auto]", PLACEHOLDERS["[--head-chunks K|auto]"])
        argv = [PLACEHOLDERS.get(w, w) for w in shlex.split(span)[1:]]
        if len(argv) == 1 and argv[0] in subs:
            continue  # the command named alone
        try:
            build_parser().parse_args(argv)
        except SystemExit as e:
            assert e.code == 0, f"`{span}`: {capsys.readouterr().err}"
    flags = {o for p in [build_parser(), *subs.values()] for a in p._actions for o in a.option_strings}
    named = {m.split()[0] for m in re.findall(r"`(--[a-z][a-z-]*[^`]*)`", text)} - NOT_OURS
    assert named and named <= flags, sorted(named - flags)


# `rpcompile profile llama-demo` measures on this machine, which the other pytest worker keeps busy
@pytest.mark.filterwarnings("ignore:measured node times do not add up:RuntimeWarning")
@pytest.mark.parametrize("page,start,lines", shell_blocks(), ids=_ids(shell_blocks()))
def test_shell_block_runs(page, start, lines, workdir, capsys):
    targets = _make_targets()
    for line in lines:
        argv = shlex.split(line)
        if argv[0] == "make":
            assert argv[-1] in targets, f"{page}:{start}: `{line}`: the Makefile has no target {argv[-1]}"
            continue
        code, err = _run_here(shrink(line), capsys)
        assert code in _allowed(line) and "Traceback" not in err, (
            f"{page}:{start}: `{shrink(line)}` exited {code}: {err}")


@pytest.fixture
def namespace():
    """What the pages' Python blocks name: a one-layer LLaMA, a batch of 12 rows (enough for 8 GPUs' 9
    microbatches), a loss and two batches of data."""
    from rpcompile.models.llama import Llama, LlamaConfig
    from rpcompile.models.registry import lm_loss

    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, max_seq_len=16))
    ids, labels = torch.randint(0, 64, (12, 16)), torch.randint(0, 64, (12, 16))
    data = [(ids[:6], labels[:6]), (ids[6:], labels[6:])]
    return {"model": model, "input_ids": ids, "loss_fn": lm_loss, "data": data, "x": ids, "y": labels,
            "lm_loss": lm_loss}


@pytest.mark.parametrize("page,start,source", python_blocks(), ids=_ids(python_blocks()))
def test_python_block_runs(page, start, source, namespace, workdir):
    code = compile(adapt(source), f"{page}:{start}", "exec")
    exec(code, namespace)


@pytest.mark.slow
@pytest.mark.parametrize("page,start,lines", shell_blocks(), ids=_ids(shell_blocks()))
def test_shell_block_runs_verbatim(page, start, lines, workdir):
    """Each line exactly as written, through bash and the installed ``rpcompile`` script (minutes: llama-8b)."""
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    targets = _make_targets()
    for line in lines:
        if shlex.split(line)[0] == "make":
            assert shlex.split(line)[-1] in targets
            continue
        done = subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=600, env=env)
        assert done.returncode in _allowed(line) and "Traceback" not in done.stderr, (
            f"{page}:{start}: `{line}` exited {done.returncode}: {done.stderr}")
