"""pytest plugin: blockdiff assertions and golden dumps in a test suite.

A thin front door, registered through the ``pytest11`` entry point as ``blockdiff``: it
defines the options, the marker and the fixtures, resolves each test's tolerance, and
calls :mod:`blockdiff.assertion`, :mod:`blockdiff.golden` and :func:`blockdiff.engine.run`.

- fixture ``blockdiff``: ``diff(reference, candidate, inputs, **kw) -> Report`` and
  ``assert_close(reference, candidate, inputs, **tolerances)``;
- fixture ``blockdiff_golden``: ``check(model, inputs)`` replays ``model`` against
  ``<test dir>/__blockdiff__/<test id>.h5``; a missing golden fails and says how to
  create it, ``--blockdiff-update`` (re)writes it, a mismatch writes
  ``<name>.obtained.h5`` beside it;
- marker ``@pytest.mark.blockdiff(policy=..., ffn=..., ...)``: the test's tolerances;
- options (group ``blockdiff``): ``--blockdiff-update``, ``--blockdiff-policy``,
  ``--blockdiff-tol SUBPATH=VALUE`` (repeatable), ``--blockdiff-dump-dir DIR``.

Tolerance precedence, per name: keyword arguments of the call > the closest
``blockdiff`` marker > command-line options > blockdiff's defaults. A ``None`` value
resets a name to blockdiff's default.

Golden writes under ``--blockdiff-update`` are captured during the test into a staging
directory and moved into place at session end (``pytest_sessionfinish``), then listed in
the terminal summary. Session state lives on ``config.stash``, never in this module, so
nested sessions (pytester) do not share it.

Importing this module imports neither torch nor h5py (like hypothesis's pytest shim): a
session that never uses a blockdiff fixture never loads them.
"""

from __future__ import annotations

import hashlib
import re
import shlex
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import pytest

from . import assertion
from . import golden as golden_files
from .assertion import DivergenceError
from .errors import BlockdiffError, InputError
from .vocab import POLICIES

if TYPE_CHECKING:
    from torch import nn

    from .hookmap import HookMap
    from .inputs import Inputs
    from .report import Report
    from .tolerance import Tolerance

GOLDEN_DIR = "__blockdiff__"
MARKER = "blockdiff"
# Keyword arguments of the fixture methods that go to the engine rather than the tolerance.
ENGINE_OPTIONS = ("reference_hooks", "candidate_hooks", "fast_path", "capacity_factors", "labels", "max_memory")
_MAX_NAME = 120
_STATE = pytest.StashKey["SessionState"]()  # on config: this session's options and writes
_ARTIFACTS = pytest.StashKey[int]()  # on a test item: how many dump-dir folders it has used


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("blockdiff", "blockdiff: where two implementations of a transformer diverge")
    group.addoption(
        "--blockdiff-update",
        action="store_true",
        dest="blockdiff_update",
        default=False,
        help="Write golden dumps that are missing or no longer match (blockdiff_golden.check); "
        "the tests checking them pass.",
    )
    group.addoption(
        "--blockdiff-policy",
        dest="blockdiff_policy",
        choices=POLICIES,
        default=None,
        help="Tolerance policy of blockdiff fixtures [default: calibrated when dtypes or devices differ, else fixed].",
    )
    group.addoption(
        "--blockdiff-tol",
        dest="blockdiff_tols",
        action="append",
        default=[],
        metavar="SUBPATH=VALUE",
        help="Fixed rel-L2 threshold of one sub-path or stage for blockdiff fixtures, e.g. ffn=0.05; repeatable.",
    )
    group.addoption(
        "--blockdiff-dump-dir",
        dest="blockdiff_dump_dir",
        default=None,
        metavar="DIR",
        help="Keep the dumps and JSON reports of diffs that find a divergence, and of golden mismatches, in DIR.",
    )
    group.addoption(
        "--blockdiff-max-memory",
        dest="blockdiff_max_memory",
        default=None,
        metavar="SIZE",
        help="Diffs of blockdiff fixtures read each model's weights from its checkpoint a block at a time, "
        "holding at most SIZE of them (e.g. 2GiB; docs/larger-than-memory.md).",
    )


def parse_tol(item: str) -> tuple[str, float]:
    """``"ffn=0.05"`` → ``("ffn", 0.05)`` (:meth:`Tolerance.parse_override`; this imports
    torch, which a run passing thresholds is about to use anyway).

    Raises:
        pytest.UsageError: not ``SUBPATH=VALUE`` with a number.
    """
    from .tolerance import Tolerance

    try:
        return Tolerance.parse_override(item)
    except BlockdiffError as exc:
        raise pytest.UsageError(f"--blockdiff-tol: {exc}") from None


def _options(config: pytest.Config) -> dict[str, Any]:
    """The tolerance settings given on the command line."""
    settings: dict[str, Any] = {}
    policy = config.getoption("blockdiff_policy")
    if policy is not None:
        settings[assertion.POLICY] = policy
    for item in config.getoption("blockdiff_tols") or []:
        name, value = parse_tol(item)
        if name in settings and settings[name] != value:
            raise pytest.UsageError(
                f"--blockdiff-tol {name} given twice with different values ({settings[name]:g} and {value:g})"
            )
        settings[name] = value
    if config.getoption("blockdiff_tols"):
        # Names and values are checked now, so a typo stops the session before any test runs.
        try:
            assertion.tolerance_from(settings)
        except (TypeError, BlockdiffError) as exc:
            raise pytest.UsageError(f"--blockdiff-tol: {exc}") from None
    return settings


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "blockdiff(policy=None, **thresholds): tolerances of this test's blockdiff fixtures, "
        "e.g. @pytest.mark.blockdiff(policy='fixed', ffn=0.05); keyword arguments of a call win",
    )
    dump_dir = config.getoption("blockdiff_dump_dir", None)
    if dump_dir is not None:
        dump_dir = (config.invocation_params.dir / dump_dir).resolve()
        if dump_dir.exists() and not dump_dir.is_dir():
            raise pytest.UsageError(
                f"--blockdiff-dump-dir {dump_dir} is a file; expected a directory, or a path to create one at"
            )
    max_memory = config.getoption("blockdiff_max_memory", None)
    if max_memory is not None:
        from .diskweights import parse_size

        try:
            max_memory = parse_size(max_memory)
        except ValueError as exc:
            raise pytest.UsageError(f"--blockdiff-max-memory: {exc}") from None
    config.stash[_STATE] = SessionState(
        update=bool(config.getoption("blockdiff_update", False)),
        options=_options(config),
        dump_dir=dump_dir,
        invocation_dir=config.invocation_params.dir,
        max_memory=max_memory,
    )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    state = session.config.stash.get(_STATE, None)
    if state is not None:
        state.flush()


def pytest_unconfigure(config: pytest.Config) -> None:
    state = config.stash.get(_STATE, None)
    if state is not None:
        state.discard_staging()


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    state = config.stash.get(_STATE, None)
    lines = [] if state is None else state.summary()
    if lines:
        terminalreporter.write_sep("-", "blockdiff")
        for line in lines:
            terminalreporter.write_line(line)


# -- session state


def _plural(n: int, word: str, plural: str | None = None) -> str:
    return f"{n} {word if n == 1 else (plural or word + 's')}"


@dataclass
class SessionState:
    """What this session's options are, and what it wrote or kept."""

    update: bool
    options: dict[str, Any]
    dump_dir: Path | None
    invocation_dir: Path
    max_memory: int | None = None  # --blockdiff-max-memory, in bytes
    queued: dict[Path, Path] = field(default_factory=dict)  # golden → staged capture
    written: list[Path] = field(default_factory=list)
    unchanged: list[Path] = field(default_factory=list)
    obtained: list[Path] = field(default_factory=list)
    kept: list[Path] = field(default_factory=list)
    _staging: Path | None = None
    _staged: int = 0

    def staged_path(self) -> Path:
        """A fresh file name in the staging directory (made on first use)."""
        if self._staging is None:
            self._staging = Path(tempfile.mkdtemp(prefix="blockdiff-golden-"))
        self._staged += 1
        return self._staging / f"{self._staged}.h5"

    def queue(self, golden: Path, staged: Path) -> None:
        self.queued[golden] = staged

    def flush(self) -> None:
        """Move every staged golden into place; remove the obtained dump it replaces."""
        for golden, staged in list(self.queued.items()):
            golden.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(staged), str(golden))
            golden_files.obtained_path(golden).unlink(missing_ok=True)
            self.written.append(golden)
            del self.queued[golden]
        self.discard_staging()

    def discard_staging(self) -> None:
        if self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)
            self._staging = None

    def shown(self, path: Path) -> str:
        """``path`` relative to where pytest was started, when it is below it."""
        try:
            return str(path.relative_to(self.invocation_dir))
        except ValueError:
            return str(path)

    def summary(self) -> list[str]:
        lines: list[str] = []
        if self.update:
            written = _plural(len(self.written), "golden dump")
            lines.append(f"blockdiff: wrote {written}" + (":" if self.written else ""))
            lines += [f"  {self.shown(p)}" for p in self.written]
            if self.unchanged:
                lines.append(
                    f"blockdiff: {_plural(len(self.unchanged), 'golden dump')} unchanged "
                    "(the models still match them)"
                )
        if self.obtained:
            lines.append(
                f"blockdiff: {_plural(len(self.obtained), 'golden mismatch', 'golden mismatches')}; "
                "the models' activations are in:"
            )
            lines += [f"  {self.shown(p)}" for p in self.obtained]
            lines.append("  re-run with --blockdiff-update if the changes are intended")
        if self.kept:
            checks = _plural(len(self.kept), "divergent check")
            lines.append(f"blockdiff: kept the dumps and JSON reports of {checks} in:")
            lines += [f"  {self.shown(p)}" for p in self.kept]
        return lines


# -- names


def file_name(text: str) -> str:
    """A file name for a node id part: unsafe characters as ``_``, long names shortened
    with a digest so two tests never share a name by truncation.

    >>> file_name("test_model::test_a[bfloat16-2]")
    'test_model__test_a_bfloat16-2'
    """
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", text.replace("::", "__")).strip("._")
    if len(name) > _MAX_NAME:
        name = name[: _MAX_NAME - 13] + "-" + hashlib.sha256(text.encode()).hexdigest()[:12]
    return name or "test"


def golden_stem(item: pytest.Item) -> str:
    """The golden's name for a test: its module's stem, then its node id within the module
    (``test_model.py::TestA::test_b[x]`` → ``test_model__TestA__test_b_x``)."""
    within = item.nodeid.split("::")[1:]
    return file_name("::".join([item.path.stem, *within]))


def _artifact_dir(item: pytest.Item, state: SessionState) -> Path | None:
    """A fresh folder name under ``--blockdiff-dump-dir`` for this test's next check."""
    if state.dump_dir is None:
        return None
    n = item.stash.get(_ARTIFACTS, 0) + 1
    item.stash[_ARTIFACTS] = n
    name = file_name(item.nodeid.replace("/", "_"))
    folder = state.dump_dir / (name if n == 1 else f"{name}.{n}")
    shutil.rmtree(folder, ignore_errors=True)  # a previous session's, for the same check
    return folder


def _update_command(item: pytest.Item) -> str:
    return f"pytest --blockdiff-update {shlex.quote(item.nodeid)}"


# -- tolerance precedence


def _settings(item: pytest.Item, state: SessionState, explicit: dict[str, Any]) -> dict[str, Any]:
    """Tolerance settings of one call: keyword arguments > closest marker > options."""
    __tracebackhide__ = True
    merged = dict(state.options)
    # iter_markers yields the closest (function) first: apply the farthest first.
    for marker in reversed(list(item.iter_markers(name=MARKER))):
        if marker.args:
            pytest.fail(
                f"@pytest.mark.blockdiff takes keyword arguments only (policy=..., ffn=...), found {marker.args!r}",
                pytrace=False,
            )
        try:
            assertion.tolerance_from(marker.kwargs)
        except (TypeError, BlockdiffError) as exc:
            pytest.fail(f"@pytest.mark.blockdiff: {exc}", pytrace=False)
        merged.update(marker.kwargs)
    merged.update(explicit)
    return {name: value for name, value in merged.items() if value is not None}


def _split(kw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    engine = {k: v for k, v in kw.items() if k in ENGINE_OPTIONS}
    return engine, {k: v for k, v in kw.items() if k not in ENGINE_OPTIONS}


# -- fixtures


class BlockdiffFixture:
    """The ``blockdiff`` fixture: diffs judged with this test's tolerances."""

    def __init__(self, item: pytest.Item, state: SessionState) -> None:
        self._item = item
        self._state = state

    def tolerance(self, **tolerances: Any) -> Tolerance:
        """The :class:`~blockdiff.tolerance.Tolerance` a call with ``tolerances`` uses here,
        after the marker and the command-line options."""
        __tracebackhide__ = True
        return assertion.tolerance_from(_settings(self._item, self._state, tolerances))

    def diff(self, reference: nn.Module, candidate: nn.Module, inputs: Inputs, **kw: Any) -> Report:
        """:func:`blockdiff.diff` with this test's tolerances.

        Args:
            reference, candidate, inputs: as for :func:`blockdiff.diff`.
            **kw: tolerances (``policy=``, ``ffn=0.05``, ...) and the engine options
                ``reference_hooks``, ``candidate_hooks``, ``fast_path``,
                ``capacity_factors``, ``labels``, ``max_memory`` (default:
                ``--blockdiff-max-memory``).

        Returns:
            The report; with ``--blockdiff-dump-dir``, a report with a divergence is kept
            there with both sides' dumps.
        """
        __tracebackhide__ = True
        report, _ = self._diff(reference, candidate, inputs, kw)
        return report

    def _diff(self, reference: Any, candidate: Any, inputs: Any, kw: dict[str, Any]) -> tuple[Report, Path | None]:
        __tracebackhide__ = True
        from .engine import Options, run

        engine, tolerances = _split(kw)
        if self._state.max_memory is not None:
            engine.setdefault("max_memory", self._state.max_memory)
        tolerance = assertion.tolerance_from(_settings(self._item, self._state, tolerances))
        folder = _artifact_dir(self._item, self._state)
        try:
            report = run(reference, candidate, inputs, options=Options(tolerance=tolerance, save_dumps=folder, **engine))
        except BaseException:
            if folder is not None:  # no report to review them with; the error says what failed
                shutil.rmtree(folder, ignore_errors=True)
            raise
        if folder is not None:
            if report.diverged:
                report.write_json(folder / "report.json")
                self._state.kept.append(folder)
            else:
                shutil.rmtree(folder, ignore_errors=True)
                folder = None
        return report, folder

    def assert_close(self, reference: nn.Module, candidate: nn.Module, inputs: Inputs, **kw: Any) -> Report:
        """Fail the test when ``candidate`` diverges from ``reference`` on ``inputs``.

        Takes what :meth:`diff` takes; raises :class:`~blockdiff.assertion.DivergenceError`
        with the readable report.
        """
        __tracebackhide__ = True
        report, folder = self._diff(reference, candidate, inputs, kw)
        if folder is not None:
            keep = f"the dumps and the JSON report are in {self._state.shown(folder)}"
        else:
            keep = "keep the dumps and the JSON report: run pytest with --blockdiff-dump-dir DIR"
        assertion.raise_for_divergence(
            report, heading="blockdiff: the candidate first diverges from the reference there", extra_steps=[keep]
        )
        return report


class GoldenFixture:
    """The ``blockdiff_golden`` fixture: models checked against golden dumps stored in
    ``<test dir>/__blockdiff__/``."""

    def __init__(self, item: pytest.Item, state: SessionState) -> None:
        self._item = item
        self._state = state
        self._unnamed = 0

    @property
    def directory(self) -> Path:
        return self._item.path.parent / GOLDEN_DIR

    def path(self, name: str | None = None) -> Path:
        """The golden of this test: ``<test id>.h5``, or ``<test id>.<name>.h5``."""
        stem = golden_stem(self._item)
        return self.directory / (f"{stem}.h5" if name is None else f"{stem}.{file_name(name)}.h5")

    def check(
        self,
        model: nn.Module,
        inputs: Inputs,
        *,
        name: str | None = None,
        hooks: HookMap | None = None,
        fast_path: bool = False,
        floors: Sequence[str] = (),
        reference: nn.Module | None = None,
        **tolerances: Any,
    ) -> Report | None:
        """Check ``model`` on ``inputs`` against this test's golden dump.

        The model is replayed against the golden, block by block with sub-path verdicts.
        A candidate at another precision than the golden's is judged against the noise
        floors the golden stores for its precision (``floors``), as a live diff would be;
        without them, against fixed thresholds.

        Args:
            model: the model under test.
            inputs: token ids, a tuple of positional arguments or a dict of keyword
                arguments; the golden stores them, and a check on other inputs fails.
            name: tells several checks in one test apart; unnamed checks after the first
                are numbered (``<test id>.2.h5``).
            hooks: the model's hook map; found by class name when ``None``.
            fast_path: as for :func:`blockdiff.diff`.
            floors: precisions (``"bfloat16"``, ``"float16@cuda"``) whose noise floors the
                golden stores, measured when ``--blockdiff-update`` writes it.
            reference: the trusted model the golden is captured from under
                ``--blockdiff-update`` (default: ``model``): a float32 reference for a
                bfloat16 ``model``, say.
            **tolerances: ``policy=`` and thresholds, after the marker and the options.

        Returns:
            The replay's report; ``None`` under ``--blockdiff-update`` (nothing compared
            or the golden was rewritten).

        >>> blockdiff_golden.check(model.to(torch.bfloat16), ids, floors=["bfloat16"], reference=model)  # doctest: +SKIP
        """
        __tracebackhide__ = True
        if name is None:
            self._unnamed += 1
            name = None if self._unnamed == 1 else str(self._unnamed)
        golden = self.path(name)
        settings = _settings(self._item, self._state, tolerances)
        assertion.tolerance_from(settings)  # a bad name fails now, under --blockdiff-update too
        if self._state.update:
            self._update(
                golden, model, inputs, hooks=hooks, fast_path=fast_path, settings=settings, floors=floors, reference=reference
            )
            return None
        shown = self._state.shown(golden)
        update = _update_command(self._item)
        if not golden.exists():
            pytest.fail(
                f"blockdiff: no golden dump for this test: {shown}\n"
                f"create it by running pytest with --blockdiff-update: {update}\n"
                "then commit it with the test",
                pytrace=False,
            )
        try:
            golden_files.check_inputs_match(
                golden, inputs, shown=f"the golden dump {shown}",
                todo=f"the golden must be updated\nif the new inputs are intended, re-run with --blockdiff-update: {update}",
            )
        except InputError as exc:
            pytest.fail(f"blockdiff: {exc}", pytrace=False)
        folder = _artifact_dir(self._item, self._state)
        steps = [f"if the change is intended, re-run with --blockdiff-update: {update}"]
        if folder is not None:
            steps.append(f"the golden, the obtained dump and the JSON report are in {self._state.shown(folder)}")
        try:
            report = golden_files.assert_matches_golden(
                golden,
                model,
                inputs,
                hooks=hooks,
                fast_path=fast_path,
                extra_steps=steps,
                relative_to=self._state.invocation_dir,
                verify_inputs=False,  # checked above, with a message that says how to update
                **settings,
            )
        except DivergenceError as exc:
            assert exc.obtained is not None
            self._state.obtained.append(exc.obtained)
            if folder is not None:
                folder.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(golden, folder / "golden.h5")
                shutil.copyfile(exc.obtained, folder / "obtained.h5")
                exc.report.write_json(folder / "report.json")
                self._state.kept.append(folder)
            raise
        golden_files.obtained_path(golden).unlink(missing_ok=True)  # an earlier mismatch's, now stale
        return report

    def _update(
        self,
        golden: Path,
        model: Any,
        inputs: Any,
        *,
        hooks: Any,
        fast_path: bool,
        settings: dict[str, Any],
        floors: Sequence[str],
        reference: Any,
    ) -> None:
        """Queue a capture of ``reference`` (or ``model``) as ``golden``, unless the
        existing golden still holds (same inputs, the floors asked for, no divergence):
        rewriting it would only change its timestamp."""
        __tracebackhide__ = True
        tolerance = assertion.tolerance_from(settings)
        source = model if reference is None else reference
        if golden_files.still_holds(
            golden, model, inputs, tolerance=tolerance, hooks=hooks, fast_path=fast_path, floors=floors
        ):
            self._state.unchanged.append(golden)
            golden_files.obtained_path(golden).unlink(missing_ok=True)
            return
        staged = self._state.staged_path()
        golden_files.write(staged, source, inputs, hooks=hooks, floors=floors, candidate=model)
        self._state.queue(golden, staged)


@pytest.fixture
def blockdiff(request: pytest.FixtureRequest) -> BlockdiffFixture:
    """Diffs judged with this test's tolerances: ``diff(...) -> Report`` and
    ``assert_close(...)``; see :class:`BlockdiffFixture`."""
    return BlockdiffFixture(request.node, request.config.stash[_STATE])


@pytest.fixture
def blockdiff_golden(request: pytest.FixtureRequest) -> GoldenFixture:
    """Golden dumps: ``check(model, inputs)`` against ``<test dir>/__blockdiff__/<test id>.h5``;
    see :class:`GoldenFixture`."""
    return GoldenFixture(request.node, request.config.stash[_STATE])
