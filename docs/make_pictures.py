"""Regenerate the pictures in docs/ from the sample's planted bug.

Run from the repository root (needs matplotlib: ``pip install -e '.[plot]'``)::

    python docs/make_pictures.py

It diffs ``samples/tinylm.py:build`` against ``samples/bugs.py:gelu_for_silu`` (GELU
planted for SiLU in block 1's FFN) on the token ids ``blockdiff diff`` draws by default
(``--batch 2 --seq 16 --seed 0``), and writes ``docs/sample-bug.png`` with
:func:`blockdiff.plot.write_png`: the picture of
``blockdiff diff samples/tinylm.py:build samples/bugs.py:gelu_for_silu --plot PATH``.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # `samples` is a folder of the repository, not installed

import blockdiff  # noqa: E402
from blockdiff import plot  # noqa: E402
from blockdiff.inputs import random_tokens  # noqa: E402
from samples import bugs, tinylm  # noqa: E402

OUTPUT = ROOT / "docs" / "sample-bug.png"


def main() -> Path:
    """Diff the sample against its planted bug and write :data:`OUTPUT`."""
    model = tinylm.build()
    ids = random_tokens(batch=2, seq=16, vocab=model.cfg.vocab_size, seed=0)
    report = blockdiff.diff(
        model,
        bugs.gelu_for_silu(),
        ids,
        labels=("samples/tinylm.py:build", "samples/bugs.py:gelu_for_silu"),
    )
    first = report.first_divergence
    assert first is not None and (first.block, first.subpath) == (1, "ffn"), "the planted bug moved"
    plot.write_png(report.to_dict(), OUTPUT)
    return OUTPUT


if __name__ == "__main__":
    print(f"wrote {main().relative_to(ROOT)}")
