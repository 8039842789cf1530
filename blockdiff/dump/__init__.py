"""HDF5 activation dumps: the on-disk :class:`~blockdiff.store.SiteStore`.

Capture streams sites into a :class:`DumpWriter`; localization (or a person with plain
h5py / h5dump) reads them back with :class:`DumpReader`, one block at a time. The format
is schema 4, documented in ``docs/dump-format.md``:

- file attributes: ``format`` (``"blockdiff.dump"``), ``schema_version``, versions,
  creation time, the capture's ``meta``, a ``metadata_digest`` and ``complete`` (last);
- ``/tensors/<dtype>.<n>``: the elements of every tensor, in 1-D datasets of their stored
  dtype, one per batch the writer wrote (a compressed dump: one ``<dtype>`` dataset per
  dtype);
- ``/index``: one JSON document: each tensor's dataset, offset, count, dtype, shape and
  CRC-32C; each site's stage, block, sub-path, module, order and ``args``/``kwargs``/
  ``output`` structure; the model inputs and noise floors of the run.

Tensors are stored losslessly: dtypes numpy has as themselves, the others (bfloat16,
float8, ...) as raw bits with the torch dtype named in the index. A dump is written under
a temporary name and renamed only after a clean close, so a file at the final path is
always complete. Dumps of schema 1-3 (a group per site) are still read. Reading never
raises anything but :class:`~blockdiff.errors.DumpError` for a damaged or foreign file.

The package, by role: :mod:`.format` (format name, schema version, dtype encodings,
checksums, attributes, the metadata digest, reading the index), :mod:`.packing` (writing
a schema-4 file without torch: datasets, index, attributes, rename), :mod:`.writer`
(:class:`DumpWriter`: torch sites on a thread of its own, through :mod:`.packing`),
:mod:`.reader` (:class:`DumpReader`), :mod:`.foreign` (the reference as a foreign writer reads it), :mod:`.probe` (:func:`probe_file`, the hostile-file
probe the reader runs first) and :mod:`.memory` (handing freed memory back between
blocks). :mod:`blockdiff.dumpfile`, the writer for other runtimes, writes through
:mod:`.packing` too.
"""

from __future__ import annotations

import importlib
from typing import Any

# docs/dump-format.md names ``blockdiff.dump.metadata_digest`` the reference implementation.
from .format import FORMAT, SCHEMA_VERSION, metadata_digest
from .probe import probe_file

# The reader and writer import torch: loaded on first access (PEP 562), so that
# :mod:`blockdiff.dumpfile`, the writer for other runtimes, uses the format without torch.
_LAZY = {"DumpReader": ".reader", "VerifySummary": ".reader", "DumpWriter": ".writer"}

__all__ = ["DumpWriter", "DumpReader", "VerifySummary", "FORMAT", "SCHEMA_VERSION", "metadata_digest", "probe_file"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value
