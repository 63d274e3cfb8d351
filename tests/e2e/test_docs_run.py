"""Docs that run (issue 33): every ```python block in README.md and docs/*.md runs as written, or is
marked as a fragment that a tested example completes.

Each block runs on its own, as a reader would paste it into a file: ``python block.py`` with this
suite's interpreter (the venv's), in an empty temporary directory (the ONNX example writes
``model.onnx`` there), with a timeout. A failure names the block's file and line, and the
traceback's lines are rewritten to the document's lines.

A block may instead be marked, on the line right before its fence::

    <!-- fragment: completed by examples/gpt_shaping.py -->

Then the named file must exist and be run by a test: a ``tests/**/test_*.py`` file itself, or an
example whose file name a test module names (``examples/gpt_shaping.py`` is run by
tests/client/test_client_torch_transformer.py). Every other python block is run; a block that is neither
(a python fence this parser does not see, an untagged block of Python with imports) fails.

What a block is given, and why:

- **a server**: blocks written against ``http://127.0.0.1:8000`` (where docs/service.md starts one) run
  against one ``sigprop serve`` that this module starts on a free loopback port, shared by all of
  them: the literal URL in the block is rewritten to that port before it runs. Port 8000 itself may
  be taken on a shared machine (or by a developer's own server, whose cache and keys the test must
  not touch), and a reader should see the plain URL rather than an environment lookup. The server is
  in the embedded mode (no ``SIGPROP_REDIS_URL``: a SQLite file in a temporary directory), where
  validations train in the API process, so the validation example finishes without a worker.
- **an API key**: the server lists ``KEY`` in ``SIGPROP_API_KEYS``; blocks read it from
  ``SIGPROP_API_KEY``, as docs/client.md's validation example does (a key does not belong in code).
- **torchvision**, for docs/client.md's ResNet-18 examples: this machine's CPU build of PyTorch cannot
  load torchvision's wheel, so when ``import torchvision`` fails the blocks get a stand-in package
  whose ``torchvision.models.resnet18``/``resnet50`` are tests/torchvision_style.py's
  re-implementation (torchvision's module names and post-activation blocks; the same models
  tests/client/test_client_torchvision_resnet.py checks). The block's text is unchanged.

SIGPROP_* settings of the caller's shell and PYTHONPATH are removed from a block's environment, and
Keras keeps its config in the temporary directory. The blocks run two at a time, started ahead of
their tests (a module fixture); the module costs about 80 s of CPU, most of it importing torch, JAX
and Keras and compiling XLA programs (the Flax examples), and the validation example's training in
the server: about 45 s on an idle 2-core machine.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from ..service_fixtures import start_service

ROOT = Path(__file__).resolve().parents[2]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PYTHON_TAGS = {"python", "py", "python3"}
DOC_URL = "http://127.0.0.1:8000"  # the server the docs' examples talk to
KEY = "docs-run-key-4f1c9a7e2b"
BLOCK_TIMEOUT_S = 300
PARALLEL = 2  # blocks running at once

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
_FRAGMENT = re.compile(r"^\s*<!--\s*fragment:\s*completed by\s+(?P<target>\S+)\s*-->\s*$")
_ANY_FRAGMENT = re.compile(r"<!--\s*fragment\b", re.IGNORECASE)
_DOC_URL = re.compile(r"http://(?:127\.0\.0\.1|localhost):8000\b")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    tag: str  # the fence's info string, first word
    code: str
    fragment: str | None  # the target of a fragment marker right before the fence
    marker_line: int | None  # that marker's line

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def doc_blocks(path: Path) -> list[Block]:
    """Every fenced block of a Markdown file (backticks or tildes, indented or not), in order."""
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, info = m["indent"], m["fence"], m["info"].strip()
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines):
            close = _FENCE.match(lines[i])
            if (
                close
                and close["fence"][0] == fence[0]
                and len(close["fence"]) >= len(fence)
                and not close["info"].strip()
            ):
                break
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        i += 1  # past the closing fence (or the end of the file)
        before = next((j for j in range(start - 1, -1, -1) if lines[j].strip()), None)
        marker = _FRAGMENT.match(lines[before]) if before is not None else None
        tag = info.split()[0].lower() if info else ""
        target, marker_line = (marker["target"], before + 1) if marker else (None, None)
        blocks.append(Block(path, start + 1, tag, "\n".join(body) + "\n", target, marker_line))
    return blocks


ALL_BLOCKS = [b for path in DOC_FILES for b in doc_blocks(path)]
PYTHON_BLOCKS = [b for b in ALL_BLOCKS if b.tag in PYTHON_TAGS]


# -- what is collected ----------------------------------------------------------------------------


def test_every_python_fence_is_collected():
    """A python fence the parser missed would silently not run: count them a second, naive way."""
    naive = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in DOC_FILES
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.match(r"^\s*(```|~~~)\s*(python3?|py)\b", line, re.IGNORECASE)
    ]
    assert naive == [b.where for b in PYTHON_BLOCKS]
    assert len(PYTHON_BLOCKS) >= 10, "README.md and docs/*.md have about eleven python blocks"


def test_no_untagged_python_and_no_stray_markers():
    """An untagged block of Python (one that parses and imports something) or a Python session
    (```pycon) is neither run nor marked: write it as a ```python block. A fragment marker must sit
    right before a python fence, and name its target."""
    problems = []
    markers = {(b.path, b.marker_line) for b in PYTHON_BLOCKS if b.marker_line}
    for b in ALL_BLOCKS:
        if b.tag == "" and _imports(b.code):
            problems.append(f"{b.where}: an untagged block of Python: tag it ```python (it is then run)")
        elif b.tag not in PYTHON_TAGS and ("python" in b.tag or b.tag.startswith("py")):
            problems.append(f"{b.where}: a ```{b.tag} block is not run: write it as a ```python block")
    for path in DOC_FILES:
        lines = path.read_text().splitlines()
        for n, line in enumerate(lines, 1):
            if _ANY_FRAGMENT.search(line) and not _FRAGMENT.match(line):
                problems.append(
                    f"{path.relative_to(ROOT)}:{n}: write the marker as <!-- fragment: completed by PATH -->"
                )
            elif _FRAGMENT.match(line) and (path, n) not in markers:
                problems.append(f"{path.relative_to(ROOT)}:{n}: a fragment marker with no python block after it")
    assert not problems, "\n".join(problems)


def _imports(code: str) -> bool:
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return False
    return any(isinstance(node, (ast.Import, ast.ImportFrom)) for node in ast.walk(tree))


# -- running them ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def docs_server(tmp_path_factory):
    """One `sigprop serve` for every block that talks to a server (embedded mode, an API key)."""
    tmp = tmp_path_factory.mktemp("docs-server")
    env = {"SIGPROP_API_KEYS": KEY, "SIGPROP_REDIS_URL": None, "SIGPROP_DATA_DIR": str(tmp / "data")}
    svc = start_service(tmp, env)
    yield svc
    svc.stop()


def _torchvision_path(tmp: Path) -> str | None:
    """A directory holding a stand-in ``torchvision`` package when the real one does not import."""
    probe = subprocess.run([sys.executable, "-c", "import torchvision"], capture_output=True, timeout=120)
    if probe.returncode == 0:
        return None
    models = tmp / "torchvision" / "models"
    models.mkdir(parents=True)
    (tmp / "torchvision" / "__init__.py").write_text('"""tests/e2e/test_docs_run.py: a stand-in for torchvision."""\n')
    style = ROOT / "tests" / "torchvision_style.py"
    (models / "__init__.py").write_text(
        textwrap.dedent(f"""\
            import importlib.util

            _spec = importlib.util.spec_from_file_location("torchvision_style", {str(style)!r})
            _style = importlib.util.module_from_spec(_spec)
            _spec.loader.exec_module(_style)
            resnet18, resnet50 = _style.resnet18, _style.resnet50
        """)
    )
    return str(tmp)


@dataclass
class Run:
    script: Path
    returncode: int | None  # None: killed at the timeout
    stdout: str
    stderr: str
    seconds: float


def _run_block(block: Block, tmp: Path, base_url: str | None, torchvision_path: str | None) -> Run:
    code = _DOC_URL.sub(base_url, block.code) if base_url else block.code
    script = tmp / f"{block.path.stem.replace('.', '_')}_L{block.line}.py"
    script.write_text(code)
    cwd = tmp / "cwd"
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIGPROP_") and k != "PYTHONPATH"}
    env.update(SIGPROP_API_KEY=KEY, KERAS_HOME=str(tmp / "keras"), PYTHONUNBUFFERED="1")
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    env.setdefault("JAX_PLATFORMS", "cpu")
    if torchvision_path:
        env["PYTHONPATH"] = torchvision_path
    start = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, str(script)],
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=BLOCK_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as exc:  # subprocess.run has killed it
        out, err = (x.decode(errors="replace") if isinstance(x, bytes) else x or "" for x in (exc.stdout, exc.stderr))
        return Run(script, None, out, err, time.monotonic() - start)
    return Run(script, done.returncode, done.stdout, done.stderr, time.monotonic() - start)


@pytest.fixture(scope="module")
def block_runs(request, tmp_path_factory):
    """The runs of the selected blocks, started ahead of their tests, PARALLEL at a time.

    Most of a block's time is importing torch, JAX or Keras and compiling, so two overlap well; the
    tests then only wait for their own block. Only the blocks whose tests were selected run
    (``pytest -k``); the server starts only when one of them needs it."""
    selected = [
        item.callspec.params["block"]
        for item in request.session.items
        if item.module is sys.modules[__name__] and getattr(item, "originalname", "") == "test_docs_block_runs"
    ]
    runnable = [b for b in selected if b.fragment is None]
    base_url = (
        request.getfixturevalue("docs_server").base_url if any(_DOC_URL.search(b.code) for b in runnable) else None
    )
    torchvision_path = _torchvision_path(tmp_path_factory.mktemp("torchvision-shim"))
    pool = ThreadPoolExecutor(max_workers=PARALLEL, thread_name_prefix="docs-block")
    futures = {
        b: pool.submit(_run_block, b, tmp_path_factory.mktemp("docs-block"), base_url, torchvision_path)
        for b in runnable
    }
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


def _fragment_is_tested(target: str) -> str | None:
    """Why the fragment's target does not complete it, or None when it exists and a test runs it."""
    path = ROOT / target
    if not path.is_file():
        return f"its target {target} does not exist"
    tests = [p for p in (ROOT / "tests").rglob("test_*.py") if p != Path(__file__).resolve()]
    if (ROOT / "tests") in path.parents:
        return None if path in tests else f"its target {target} is not a test module (tests/**/test_*.py)"
    name = re.compile(rf"(?<![\w.]){re.escape(path.name)}\b|[\"']{re.escape(path.stem)}[\"']")
    if not any(name.search(p.read_text()) for p in tests):
        return f"no tests/**/test_*.py runs its target {target} (none names {path.name})"
    return None


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=[b.where for b in PYTHON_BLOCKS])
def test_docs_block_runs(block: Block, block_runs):
    if block.fragment is not None:
        problem = _fragment_is_tested(block.fragment)
        assert problem is None, f"{block.where}: a fragment marker, but {problem}"
        return
    run = block_runs[block].result()
    if run.returncode is None:
        pytest.fail(f"{block.where}: the block ran past {BLOCK_TIMEOUT_S} s\n{_in_doc(block, run.script, run.stderr)}")
    if run.returncode != 0:
        pytest.fail(
            f"{block.where}: the block exited with {run.returncode} after {run.seconds:.1f} s\n"
            f"--- stderr (the block's lines as {block.path.name}'s) ---\n{_in_doc(block, run.script, run.stderr)}\n"
            f"--- stdout ---\n{run.stdout[-2000:]}"
        )


def _in_doc(block: Block, script: Path, text: str) -> str:
    """The output's last 6000 characters, with the script's line numbers turned into the document's."""
    rel = block.path.relative_to(ROOT)
    return re.sub(
        rf'File "{re.escape(str(script))}", line (\d+)',
        lambda m: f'File "{rel}", line {block.line + int(m.group(1))}',
        text[-6000:],
    )
