"""Shared fixtures: token ids and a helper that reads what a report blames."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

# Tiny models: one thread is faster than two (OpenMP start-up per op dominates), and keeps
# the suite steady on a 2-core CI machine.
torch.set_num_threads(1)


ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _at_repository_root(monkeypatch):
    """Model specs in tests (samples/tinylm.py:build) are relative to the repository root."""
    monkeypatch.chdir(ROOT)


def sample_ids() -> torch.Tensor:
    """The token ids the tests diff the sample on: 2 x 16 within its vocabulary, seed 0."""
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))


@pytest.fixture
def ids() -> torch.Tensor:
    return sample_ids()


# Reports that several test modules only read, diffed once per session.


@pytest.fixture(scope="session")
def gelu_report():
    """GELU planted for SiLU in block 2's FFN, float32: one divergence, drift from block 2 on."""
    from blockdiff import diff
    from samples import bugs, tinylm

    return diff(tinylm.build(), bugs.gelu_for_silu(block=2), sample_ids())


@pytest.fixture(scope="session")
def moe_report():
    """The MoE sample with block 1's router weights not renormalized, in bfloat16."""
    from blockdiff import diff
    from samples import bugs, tinylm

    return diff(tinylm.build_moe(), bugs.moe_not_renormalized().to(torch.bfloat16), sample_ids())


@pytest.fixture(scope="session")
def clean_report():
    """The sample against itself in bfloat16: precision only, no divergence."""
    from blockdiff import diff
    from samples import tinylm

    return diff(tinylm.build(), tinylm.build().to(torch.bfloat16), sample_ids())


def blamed(report) -> tuple | None:
    """(stage, block, subpath) of the first divergence, or None."""
    first = report.first_divergence
    return None if first is None else (first.stage, first.block, first.subpath)


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    """Exit code (0 when the command returns), stdout and stderr of one in-process CLI call."""
    from blockdiff.cli import main

    try:
        main(args)
        code = 0
    except SystemExit as exited:
        code = exited.code
    out, err = capsys.readouterr()
    return code, out, err
