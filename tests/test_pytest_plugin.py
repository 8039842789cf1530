"""The pytest plugin: assertions, tolerance precedence, golden dumps, options, import cost.

The plugin is exercised in real pytest sessions run by ``pytester`` (in-process, except
where the point is what a fresh interpreter imports), on the sample model and its
planted bugs.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# Loaded before pytester snapshots sys.modules, so the sessions it runs in-process share
# these modules (and their classes) with this one instead of importing them again.
import blockdiff
import blockdiff.assertion
import blockdiff.dump
import blockdiff.engine
import blockdiff.pytest_plugin
from blockdiff.assertion import DivergenceError, assert_no_divergence
from blockdiff.dump import DumpReader
from blockdiff.errors import InputError
from blockdiff.pytest_plugin import file_name
from samples import bugs, tinylm

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parent.parent
USAGE_ERROR = pytest.ExitCode.USAGE_ERROR

# The head of every generated test module: the samples importable, fixed token ids.
HEADER = f"""
import os, sys
sys.path.insert(0, {str(ROOT)!r})
import pytest, torch
from samples import bugs, tinylm

IDS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
"""


def write_tests(pytester: pytest.Pytester, body: str, name: str = "test_model") -> Path:
    return pytester.makepyfile(**{name: HEADER + body})


@pytest.fixture
def session(pytester: pytest.Pytester, monkeypatch):
    """Runs pytest in-process with only blockdiff among the installed plugins, loaded by
    its entry point name (``-p blockdiff``): other plugins (hypothesis, ...) would be
    imported afresh by every in-process run."""
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")

    def run(*args: str) -> pytest.RunResult:
        return pytester.runpytest("-p", "blockdiff", *args)

    return run


# -- the assertion helper, without pytest in between


def test_assert_no_divergence_raises_an_assertion_error_naming_block_and_subpath(ids, monkeypatch):
    monkeypatch.setenv("FORCE_COLOR", "1")  # must not put escape codes into the message
    with pytest.raises(DivergenceError) as raised:
        assert_no_divergence(tinylm.build(), bugs.gelu_for_silu(block=2), ids)
    error = raised.value
    assert isinstance(error, AssertionError)
    first = error.report.first_divergence
    assert (first.stage, first.block, first.subpath, first.module) == ("block", 2, "ffn", "blocks.2.ffn")
    message = str(error)
    lines = message.splitlines()
    assert lines[0].startswith("block 2 ffn (blocks.2.ffn): rel_l2 0.178 > threshold 0.0001")
    # fixed order: first divergence, the table, what to do next
    table = next(i for i, line in enumerate(lines) if line.split()[:2] == ["site", "attention"])
    block2 = next(i for i, line in enumerate(lines) if line.strip().startswith("block 2 ") and "!" in line)
    advice = lines.index("what to do next:")
    assert 0 < table < block2 < advice
    assert "ffn=VALUE" in message and "--json PATH" not in message
    assert "\x1b[" not in message
    copy = pickle.loads(pickle.dumps(error))  # e.g. raised in a worker process
    assert str(copy) == message and copy.report.first_divergence.block == 2


def test_assert_no_divergence_passes_a_clean_precision_change_for_every_input_form(ids):
    for inputs in (ids, (ids,), {"input_ids": ids}):
        report = assert_no_divergence(tinylm.build(), tinylm.build().to(torch.bfloat16), inputs)
        assert report.first_divergence is None
        assert report.tolerance["policy"] == "calibrated"


def test_assert_no_divergence_takes_tolerances_as_keywords(ids):
    # the planted bug's local errors are 0.178 (ffn) and 0.057 (whole block): 0.5 tolerates both
    report = assert_no_divergence(tinylm.build(), bugs.gelu_for_silu(block=2), ids, ffn=0.5, block=0.5, policy="fixed")
    assert report.tolerance["overrides"] == {"ffn": 0.5, "block": 0.5} and report.tolerance["policy"] == "fixed"
    with pytest.raises(DivergenceError, match=r"^block 2 ffn"):
        assert_no_divergence(tinylm.build(), bugs.gelu_for_silu(block=2), ids, ffn=0.1)


@pytest.mark.parametrize(
    ("tolerances", "error", "message"),
    [
        ({"mlp": 0.1}, TypeError, r"unknown tolerance 'mlp': expected policy= or a sub-path or stage name \(embed, .*ffn"),
        ({"ffn": "0.1"}, TypeError, r"tolerance ffn= must be a number, found '0.1'"),
        ({"policy": "loose"}, InputError, r"unknown tolerance policy 'loose'"),
        ({"ffn": 0.0}, InputError, r"tolerance for ffn must be a positive number"),
    ],
)
def test_assert_no_divergence_rejects_bad_tolerances(ids, tolerances, error, message):
    with pytest.raises(error, match=message):
        assert_no_divergence(tinylm.build(), tinylm.build(), ids, **tolerances)


def test_file_names_from_node_ids():
    assert file_name("test_model::TestA::test_b[bfloat16-2]") == "test_model__TestA__test_b_bfloat16-2"
    long = file_name("test_model::test_" + "x" * 300)
    assert len(long) == 120 and long != file_name("test_model::test_" + "x" * 299)


# -- fixtures in real sessions


def test_planted_bug_fails_naming_block_and_subpath_and_precision_passes(pytester, session):
    write_tests(
        pytester,
        """
def test_gelu_for_silu(blockdiff):
    blockdiff.assert_close(tinylm.build(), bugs.gelu_for_silu(block=2), IDS)

def test_bfloat16(blockdiff):
    report = blockdiff.assert_close(tinylm.build(), tinylm.build().to(torch.bfloat16), IDS)
    assert report.first_divergence is None
""",
    )
    result = session()
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*E * blockdiff.DivergenceError: block 2 ffn (blocks.2.ffn): rel_l2 0.178 > threshold 0.0001 *",
            "*block 2 * 1.78e-01! *",
            "*what to do next:",
            "FAILED test_model.py::test_gelu_for_silu - blockdiff.DivergenceError: block 2*",
        ]
    )
    out = result.stdout.str()
    # __tracebackhide__: the traceback ends in the test, not inside blockdiff
    assert "assertion.py" not in out and "pytest_plugin.py" not in out


def test_tolerance_precedence_keywords_then_marker_then_options_then_defaults(pytester, session):
    write_tests(
        pytester,
        """
def test_options_reach_the_diff(blockdiff):
    t = blockdiff.tolerance()
    assert (t.policy, t.overrides) == ("calibrated", {"ffn": 0.1, "attention": 0.2})
    # same dtype: blockdiff's default would be fixed
    assert blockdiff.diff(tinylm.build(), tinylm.build(), IDS).tolerance["policy"] == "calibrated"

@pytest.mark.blockdiff(policy="fixed", ffn=0.5)
def test_marker_beats_options(blockdiff):
    t = blockdiff.tolerance()
    assert (t.policy, t.overrides) == ("fixed", {"ffn": 0.5, "attention": 0.2})

@pytest.mark.blockdiff(policy="fixed", ffn=0.5)
def test_keywords_beat_marker(blockdiff):
    t = blockdiff.tolerance(ffn=0.05, norm=0.3, policy=None)  # None: blockdiff's default
    assert (t.policy, t.overrides) == (None, {"ffn": 0.05, "attention": 0.2, "norm": 0.3})

@pytest.mark.blockdiff(residual=0.2, ffn=0.4)
class TestClassMarker:
    @pytest.mark.blockdiff(ffn=0.6)
    def test_closest_marker_wins(self, blockdiff):
        assert blockdiff.tolerance().overrides == {"ffn": 0.6, "attention": 0.2, "residual": 0.2}

@pytest.mark.blockdiff(ffn=0.5, block=0.5)
def test_marker_threshold_tolerates_the_bug(blockdiff):
    report = blockdiff.assert_close(tinylm.build(), bugs.gelu_for_silu(block=2), IDS)
    assert report.tolerance["overrides"]["ffn"] == 0.5

@pytest.mark.blockdiff(ffn=0.5, block=0.5)
def test_keyword_threshold_beats_marker_and_fails(blockdiff):
    blockdiff.assert_close(tinylm.build(), bugs.gelu_for_silu(block=2), IDS, ffn=0.1)
""",
    )
    options = ["--blockdiff-policy", "calibrated", "--blockdiff-tol", "ffn=0.1", "--blockdiff-tol", "attention=0.2"]
    result = session("--strict-markers", *options)
    result.assert_outcomes(passed=5, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*def test_keyword_threshold_beats_marker_and_fails(blockdiff):",
            "E * blockdiff.DivergenceError: block 2 ffn (blocks.2.ffn): rel_l2 0.178 > threshold 0.1 (1.8x)",
            "FAILED test_model.py::test_keyword_threshold_beats_marker_and_fails - *",
        ]
    )

    write_tests(
        pytester,
        """
def test_defaults(blockdiff):
    t = blockdiff.tolerance()
    assert (t.policy, t.overrides) == (None, {})
    assert blockdiff.diff(tinylm.build(), tinylm.build(), IDS).tolerance["policy"] == "fixed"
    assert blockdiff.diff(tinylm.build(), tinylm.build().to(torch.bfloat16), IDS).tolerance["policy"] == "calibrated"
""",
        name="test_defaults",
    )
    session("test_defaults.py").assert_outcomes(passed=1)


def test_bad_marker_fails_its_test(pytester, session):
    write_tests(
        pytester,
        """
@pytest.mark.blockdiff(0.1)
def test_positional(blockdiff):
    blockdiff.diff(tinylm.build(), tinylm.build(), IDS)

@pytest.mark.blockdiff(mlp=0.1)
def test_unknown_name(blockdiff):
    blockdiff.diff(tinylm.build(), tinylm.build(), IDS)
""",
    )
    result = session()
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(
        [
            "*@pytest.mark.blockdiff takes keyword arguments only (policy=..., ffn=...), found (0.1,)",
            "*@pytest.mark.blockdiff: unknown tolerance 'mlp'*",
        ]
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--blockdiff-tol", "ffn"], "--blockdiff-tol: expected SUBPATH=VALUE (e.g. ffn=0.05), found 'ffn'"),
        (["--blockdiff-tol", "ffn=small"], "--blockdiff-tol: expected SUBPATH=VALUE (e.g. ffn=0.05), found 'ffn=small'"),
        (["--blockdiff-tol", "mlp=0.1"], "--blockdiff-tol: unknown tolerance 'mlp'*"),
        (["--blockdiff-tol", "ffn=-1"], "--blockdiff-tol: tolerance for ffn must be a positive number, found -1.0"),
        (["--blockdiff-tol", "ffn=0.1", "--blockdiff-tol", "ffn=0.2"], "--blockdiff-tol ffn given twice with different values (0.1 and 0.2)"),
        (["--blockdiff-update", "--blockdiff-dump-dir", "a_file"], "--blockdiff-dump-dir */a_file is a file; expected a directory, or a path to create one at"),
        (["--blockdiff-policy", "loose"], "*argument --blockdiff-policy: invalid choice: 'loose'*"),
    ],
)
def test_bad_or_conflicting_options_are_usage_errors(pytester, session, args, message):
    write_tests(pytester, "def test_never_runs():\n    pass\n")
    (pytester.path / "a_file").write_text("")
    result = session(*args)
    assert result.ret == USAGE_ERROR
    result.stderr.fnmatch_lines([f"*{message}"])
    assert "passed" not in result.stdout.str()


def test_help_lists_the_option_group(pytester, session):
    result = session("--help")
    result.stdout.fnmatch_lines(
        [
            "blockdiff: where two implementations of a transformer diverge:",
            "*--blockdiff-update*",
            "*--blockdiff-policy={fixed,calibrated}*",
            "*--blockdiff-tol=SUBPATH=VALUE*",
            "*--blockdiff-dump-dir=DIR*",
        ]
    )


def test_dump_dir_keeps_dumps_and_reports_of_divergent_diffs_only(pytester, session):
    write_tests(
        pytester,
        """
def test_bug(blockdiff):
    blockdiff.assert_close(tinylm.build(), bugs.gelu_for_silu(block=2), IDS)

def test_clean(blockdiff):
    blockdiff.assert_close(tinylm.build(), tinylm.build(), IDS)

def test_two_diffs(blockdiff):
    assert not blockdiff.diff(tinylm.build(), tinylm.build(), IDS).diverged
    assert blockdiff.diff(tinylm.build(), bugs.residual_dropped(block=1), IDS).first_divergence.block == 1
""",
    )
    result = session("--blockdiff-dump-dir", "kept")
    result.assert_outcomes(passed=2, failed=1)
    kept = pytester.path / "kept"
    assert sorted(p.name for p in kept.iterdir()) == ["test_model.py__test_bug", "test_model.py__test_two_diffs.2"]
    for folder, (block, subpath) in (("test_model.py__test_bug", (2, "ffn")), ("test_model.py__test_two_diffs.2", (1, "residual"))):
        assert sorted(p.name for p in (kept / folder).iterdir()) == ["candidate.h5", "reference.h5", "report.json"]
        first = json.loads((kept / folder / "report.json").read_text())["first_divergence"]
        assert (first["block"], first["subpath"]) == (block, subpath)
        with DumpReader(kept / folder / "candidate.h5") as dump:
            assert dump.block_indices() == [0, 1, 2, 3]
    result.stdout.fnmatch_lines(
        [
            "*the dumps and the JSON report are in kept/test_model.py__test_bug",
            "blockdiff: kept the dumps and JSON reports of 2 divergent checks in:",
            "  kept/test_model.py__test_bug",
            "  kept/test_model.py__test_two_diffs.2",
        ]
    )


# -- golden dumps

GOLDEN_TESTS = """
def model():
    return bugs.gelu_for_silu(block=2) if os.environ.get("PLANT_BUG") else tinylm.build()

def test_model(blockdiff_golden):
    blockdiff_golden.check(model(), IDS[:, : int(os.environ.get("SEQ", 16))])
"""


def test_golden_workflow_missing_update_pass_change_update_pass(pytester, session, monkeypatch):
    write_tests(pytester, GOLDEN_TESTS)
    golden = pytester.path / "__blockdiff__" / "test_model__test_model.h5"
    obtained = golden.with_name("test_model__test_model.obtained.h5")

    # missing: fails and says how to create it
    result = session()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "blockdiff: no golden dump for this test: __blockdiff__/test_model__test_model.h5",
            "create it by running pytest with --blockdiff-update: pytest --blockdiff-update test_model.py::test_model",
        ]
    )
    assert not golden.exists()

    # --blockdiff-update writes it (at session end) and says so; the test passes
    result = session("--blockdiff-update")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["blockdiff: wrote 1 golden dump:", "  __blockdiff__/test_model__test_model.h5"])
    assert golden.is_file()
    session().assert_outcomes(passed=1)

    # the model changes: fails naming block and sub-path, writes the obtained dump beside it
    monkeypatch.setenv("PLANT_BUG", "1")
    written = golden.read_bytes()
    result = session("--blockdiff-dump-dir", "kept")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "E * blockdiff.DivergenceError: block 2 ffn (blocks.2.ffn): rel_l2 0.178 > threshold 0.0001 *",
            "E * blockdiff: the model first diverges from its golden dump __blockdiff__/test_model__test_model.h5 there",
            "E * - the model's activations are in __blockdiff__/test_model__test_model.obtained.h5",
            "E * - compare them offline (drift only): blockdiff diff __blockdiff__/test_model__test_model.h5 "
            "__blockdiff__/test_model__test_model.obtained.h5",
            "E * - if the change is intended, re-run with --blockdiff-update: pytest --blockdiff-update test_model.py::test_model",
            "blockdiff: 1 golden mismatch; the models' activations are in:",
            "  __blockdiff__/test_model__test_model.obtained.h5",
        ]
    )
    assert golden.read_bytes() == written
    with DumpReader(obtained) as dump:
        assert dump.block_indices() == [0, 1, 2, 3]
    # what `blockdiff diff GOLDEN OBTAINED` and `blockdiff diff GOLDEN MODEL` run
    assert blockdiff.engine.compare_dumps(golden, obtained).first_divergence.block == 2
    first = blockdiff.engine.replay(golden, bugs.gelu_for_silu(block=2)).first_divergence
    assert (first.block, first.subpath) == (2, "ffn")
    kept = pytester.path / "kept" / "test_model.py__test_model"
    assert sorted(p.name for p in kept.iterdir()) == ["golden.h5", "obtained.h5", "report.json"]

    # update again: rewritten, the stale obtained dump removed; passes from then on
    result = session("--blockdiff-update")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["blockdiff: wrote 1 golden dump:"])
    assert golden.read_bytes() != written and not obtained.exists()
    session().assert_outcomes(passed=1)

    # an update that changes nothing leaves the file alone
    rewritten = golden.read_bytes()
    result = session("--blockdiff-update")
    result.stdout.fnmatch_lines(["blockdiff: wrote 0 golden dumps", "blockdiff: 1 golden dump unchanged *"])
    assert golden.read_bytes() == rewritten

    # other inputs than the golden's: fails, and says the golden must be updated
    monkeypatch.setenv("SEQ", "8")
    result = session()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["blockdiff: the golden dump __blockdiff__/test_model__test_model.h5 was captured on other inputs *"]
    )


def test_golden_file_names_for_classes_parameters_and_several_checks(pytester, session):
    write_tests(
        pytester,
        """
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_dtypes(blockdiff_golden, dtype):
    blockdiff_golden.check(tinylm.build().to(dtype), IDS)

class TestSeveral:
    def test_checks(self, blockdiff_golden):
        blockdiff_golden.check(tinylm.build(), IDS)
        blockdiff_golden.check(tinylm.build(), IDS[:1])
        blockdiff_golden.check(tinylm.build(), IDS[:, :4], name="short")
        assert blockdiff_golden.path("short").name == "test_model__TestSeveral__test_checks.short.h5"
""",
    )
    result = session("--blockdiff-update")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(["blockdiff: wrote 5 golden dumps:"])
    assert sorted(p.name for p in (pytester.path / "__blockdiff__").iterdir()) == [
        "test_model__TestSeveral__test_checks.2.h5",
        "test_model__TestSeveral__test_checks.h5",
        "test_model__TestSeveral__test_checks.short.h5",
        "test_model__test_dtypes_bf16.h5",
        "test_model__test_dtypes_fp32.h5",
    ]
    session().assert_outcomes(passed=3)


def test_works_under_x_without_cacheprovider_and_flushes_goldens_on_early_stop(pytester, session):
    write_tests(
        pytester,
        """
def test_a_golden(blockdiff_golden):
    blockdiff_golden.check(tinylm.build(), IDS)

def test_b_bug(blockdiff):
    blockdiff.assert_close(tinylm.build(), bugs.attention_scale(block=3), IDS)

def test_c_never_runs():
    pass
""",
    )
    result = session("-x", "-p", "no:cacheprovider", "--blockdiff-update")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*blockdiff.DivergenceError: block 3 attention (blocks.3.attn)*",
            "blockdiff: wrote 1 golden dump:",
            "*stopping after 1 failures*",
        ]
    )
    assert (pytester.path / "__blockdiff__" / "test_model__test_a_golden.h5").is_file()
    assert not (pytester.path / ".pytest_cache").exists()
    result = session("-x", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)


def test_the_readme_example_file_runs(pytester, session):
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## pytest plugin") :]
    example = section[section.index("```python\n") + len("```python\n") : section.index("```\n", section.index("```python"))]
    (pytester.path / "tests").mkdir()
    (pytester.path / "tests" / "test_port.py").write_text(f"import sys\nsys.path.insert(0, {str(ROOT)!r})\n" + example)
    result = session("tests")
    result.assert_outcomes(passed=4, failed=1)
    result.stdout.fnmatch_lines(["blockdiff: no golden dump for this test: tests/__blockdiff__/test_port__test_matches_golden.h5"])
    session("tests", "--blockdiff-update").assert_outcomes(passed=5)
    session("tests").assert_outcomes(passed=5)


# -- import cost


def test_importing_the_plugin_imports_neither_torch_nor_h5py():
    code = "import blockdiff.pytest_plugin, sys; assert 'torch' not in sys.modules and 'h5py' not in sys.modules"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_a_session_that_uses_no_blockdiff_fixture_never_imports_torch(pytester, monkeypatch):
    """The entry point registers the plugin in a fresh interpreter, which loads no torch."""
    monkeypatch.delenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    pytester.makepyfile(
        test_plain="""
import sys

def test_plugin_registered_and_light(request):
    plugin = request.config.pluginmanager.get_plugin("blockdiff")
    assert plugin is not None and plugin.__name__ == "blockdiff.pytest_plugin"
    assert "torch" not in sys.modules and "h5py" not in sys.modules
"""
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
