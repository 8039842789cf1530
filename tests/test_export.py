"""Export: the safetensors file is created as the manifest beside it is, by the umask."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from blockdiff.engine import capture
from blockdiff.export import export_safetensors, load_export, manifest_path
from samples import tinylm


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_exported_files_follow_the_umask(tmp_path, umask):
    dump = tmp_path / "ref.h5"
    capture(tinylm.build(blocks=2), torch.tensor([[1, 2, 3]]), dump)
    out = tmp_path / "ref.safetensors"
    previous = os.umask(umask)
    try:
        export_safetensors(dump, out)
    finally:
        os.umask(previous)
    expected = 0o666 & ~umask
    assert stat.S_IMODE(out.stat().st_mode) == expected
    assert stat.S_IMODE(manifest_path(out).stat().st_mode) == expected
    assert load_export(out)  # still verifies against its manifest
