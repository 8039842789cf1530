"""Export: a dump as a flat safetensors file, with a digest manifest beside it.

Keys name the site and the place inside it: ``MODULE#CALL/output/0``,
``MODULE#CALL/args/0``, ``MODULE#CALL/kwargs/NAME/0`` (the last number counts the tensors
of that part, in order) and ``inputs/0``. safetensors has no data checksum, so
``OUT.manifest.json`` records each tensor's sha256 (and the whole file's);
:func:`load_export` checks them on every read. The manifest's ``sites`` list each site in
execution order with its anatomy, its output tensors' keys and the teacher-forced runs that
substitute its value (``replaced_in``): what an engine outside Python needs to implement
the protocol of docs/runtimes.md ("Any other runtime") from the export alone.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from .dtypes import dtype_name
from .dump import DumpReader
from .errors import DumpError
from .site import iter_tensors
from .vocab import REPLACED_RUNS, replaced_in

MANIFEST_FORMAT = "blockdiff.export/1"


def manifest_path(path: str | Path) -> Path:
    path = Path(path)
    return path.with_name(path.name + ".manifest.json")


def _digest(t: torch.Tensor) -> str:
    flat = t.detach().contiguous().reshape(-1)
    data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return hashlib.sha256(f"{t.dtype}{list(t.shape)}".encode() + data).hexdigest()


def _umask() -> int:
    """The process's umask (read by setting it, and setting it back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def export_safetensors(dump_path: str | Path, out: str | Path) -> dict[str, Any]:
    """Write every tensor of a dump to ``out`` (safetensors) and its manifest.

    Returns:
        The manifest.
    """
    from safetensors.torch import save_file

    out = Path(out)
    tensors: dict[str, torch.Tensor] = {}
    sites: list[dict[str, Any]] = []
    with DumpReader(dump_path) as dump:
        steps = dump.steps()  # a decode's sites are named by step: step3/MODULE#CALL/...
        views = [("", dump)] if steps is None else [(f"step{t}/", dump.at_step(t)) for t in range(steps + 1)]
        for prefix, view in views:
            for site in view.iter_sites():
                base = f"{prefix}{site.module}#{site.call}"
                parts: list[tuple[str, Any]] = [("output", site.output), ("args", site.args)]
                parts += [(f"kwargs/{name}", value) for name, value in site.kwargs.items()]
                for part, value in parts:
                    for i, t in enumerate(iter_tensors(value)):
                        tensors[f"{base}/{part}/{i}"] = t.contiguous()
                sites.append(_site_entry(base, site, prefix))
        inputs = dump.inputs()
        for i, t in enumerate(iter_tensors(inputs)):
            tensors[f"inputs/{i}"] = t.contiguous()
        source_meta = {k: v for k, v in dump.meta.items() if isinstance(v, (str, int, float, bool))}
    metadata = {"format": "blockdiff.export", "source": str(dump_path), **{k: str(v) for k, v in source_meta.items()}}
    try:
        save_file(tensors, str(out), metadata=metadata)
        # safetensors creates the file 0600; like the manifest, it follows the umask.
        os.chmod(out, 0o666 & ~_umask())
    except OSError as exc:
        raise DumpError(f"cannot write {out}: {exc.strerror or exc}", path=str(out)) from None
    manifest = {
        "format": MANIFEST_FORMAT,
        "file": out.name,
        "file_sha256": _file_digest(out),
        "tensors": {k: {"sha256": _digest(t), "dtype": dtype_name(t.dtype), "shape": list(t.shape)} for k, t in tensors.items()},
        "sites": sites,
    }
    manifest_path(out).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    return manifest


def _site_entry(base: str, site: Any, prefix: str) -> dict[str, Any]:
    """A site as the manifest lists it: its key prefix, anatomy (as the dump's index records
    it), output tensors' keys, and the teacher-forced runs that substitute its value."""
    outputs = [f"{base}/output/{i}" for i, _ in enumerate(iter_tensors(site.output))]
    entry = {
        "site": base, "module": site.module, "call": site.call, "stage": site.stage,
        "block": -1 if site.block is None else site.block, "subpath": site.subpath or "", "ordinal": site.ordinal,
        "order": site.order, "outputs": outputs,
        "replaced_in": [run for run in REPLACED_RUNS if replaced_in(run, site.stage, site.subpath)],
    }
    return {**entry, "step": int(prefix[4:-1])} if prefix else entry


def load_export(path: str | Path, *, verify: bool = True) -> dict[str, torch.Tensor]:
    """Read an exported file; with ``verify``, check it against its manifest.

    Raises:
        DumpError: no manifest, a damaged manifest, or a tensor or file digest mismatch.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise DumpError(f"{path}: no such file", path=str(path))
    manifest = None
    if verify:
        sidecar = manifest_path(path)
        try:
            manifest = json.loads(sidecar.read_text(encoding="utf-8"))
            if manifest.get("format") != MANIFEST_FORMAT or not isinstance(manifest.get("tensors"), dict):
                raise ValueError("not a blockdiff export manifest")
        except FileNotFoundError:
            raise DumpError(f"{path}: no digest manifest {sidecar.name} beside it", path=str(path)) from None
        except (OSError, ValueError, UnicodeDecodeError, AttributeError) as exc:
            raise DumpError(f"{sidecar}: damaged manifest ({exc})", path=str(sidecar)) from None
        if _file_digest(path) != manifest.get("file_sha256"):
            raise DumpError(f"{path}: file digest mismatch with {sidecar.name}: the file is damaged", path=str(path))
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise DumpError(f"{path}: not a readable safetensors file ({exc})", path=str(path)) from None
    if manifest is not None:
        expected = manifest["tensors"]
        if set(expected) != set(tensors):
            missing = sorted(set(expected) ^ set(tensors))[0]
            raise DumpError(f"{path}: tensor {missing!r} does not match the manifest", path=str(path), site=missing)
        for key, t in tensors.items():
            if _digest(t) != expected[key].get("sha256"):
                raise DumpError(f"{path}: tensor {key!r} digest mismatch: the file is damaged", path=str(path), site=key)
    return tensors
