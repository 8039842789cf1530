"""An uncompressed dump's file, HDF5 structures and all, written without libhdf5.

A dump without compression is a small tree: the file's attributes, ``/tensors`` holding
1-D contiguous datasets, and ``/index`` (``docs/dump-format.md``). :class:`RawFile`
writes it in the HDF5 1.10 file format (what libhdf5 writes with
``libver=("v110", "v110")``): the tensors' bytes go where they are placed, one dataset
after another from the first byte after the superblock, and every structure — an object
header (version 2) per dataset and group, with their dataspace, datatype, fill value,
layout, attribute, link info, group info and link messages — goes after them at close,
then the superblock (version 3), each with its Jenkins lookup3 checksum, as libhdf5
writes them. Datatype messages are libhdf5's own encoding (``H5Tencode``, through
h5py). libhdf5 reads the file as any other.

Why: creating a file through libhdf5, a dataset per batch and closing it cost 3-5 ms a
dump whatever its size, on the writer's thread between its writes, which made a dump of
60 MB 0.62-0.72 of ``numpy.tofile``'s speed (``benchmarks/overhead.py``, figure 3;
``docs/performance.md``). Attributes are stored in their object header (compact), where
one message holds at most 64 KiB: a file with a larger attribute is written by libhdf5
(:class:`~.packing.PackedFile` decides).
"""

from __future__ import annotations

import functools
import os
import struct
from typing import Any, Callable

import h5py
import numpy as np

from .format import _string_type, scalar

UNDEFINED = 0xFFFF_FFFF_FFFF_FFFF  # an address that is not there ("undefined address")
SUPERBLOCK_BYTES = 48
# A message's body is at most this long (its size is two bytes).
MESSAGE_MAX = 0xFFFF
# Datasets of this many bytes or more start at a multiple of this many bytes (libhdf5's
# alignment the dump asked for before: whole pages of the page cache).
ALIGN_ABOVE, ALIGN = 64 * 2**10, 4096

# Object header message types.
_DATASPACE, _LINK_INFO, _DATATYPE, _FILL_VALUE, _LINK, _LAYOUT, _GROUP_INFO, _ATTRIBUTE, _ATTRIBUTE_INFO = (
    0x01, 0x02, 0x03, 0x05, 0x06, 0x08, 0x0A, 0x0C, 0x15
)
_CONSTANT, _NOT_SHARED = 0x01, 0x04  # message flags, as libhdf5 sets them
# Object header flag: the attribute phase change values are stored (compact up to 65535).
_PHASE_CHANGE = 0x10
_SCALAR_SPACE = bytes((2, 0, 0, 0))  # dataspace message version 2, rank 0, scalar
# Fill value message version 3: space allocated early, never filled (every byte written).
_FILL_NEVER = bytes((3, 0x05))
_NO_DENSE = struct.pack("<QQ", UNDEFINED, UNDEFINED)  # no fractal heap, no name index


class TooLarge(ValueError):
    """An attribute that does not fit in one object header message (64 KiB)."""


# ---------------------------------------------------------------------------------------
# checksums


def _lookup3_python(data: bytes, initval: int = 0) -> int:
    """Bob Jenkins' lookup3 ``hashlittle``: the checksum of HDF5's metadata."""
    n, m = len(data), 0xFFFFFFFF
    a = b = c = (0xDEADBEEF + n + initval) & m
    if n == 0:
        return c
    rounds = (n - 1) // 12
    w = struct.unpack(f"<{(n + 11) // 12 * 3}I", data + bytes(-n % 12))
    for j in range(0, rounds * 3, 3):
        a = (a + w[j]) & m
        b = (b + w[j + 1]) & m
        c = (c + w[j + 2]) & m
        a = (a - c) & m; a ^= ((c << 4) | (c >> 28)) & m; c = (c + b) & m  # noqa: E702
        b = (b - a) & m; b ^= ((a << 6) | (a >> 26)) & m; a = (a + c) & m  # noqa: E702
        c = (c - b) & m; c ^= ((b << 8) | (b >> 24)) & m; b = (b + a) & m  # noqa: E702
        a = (a - c) & m; a ^= ((c << 16) | (c >> 16)) & m; c = (c + b) & m  # noqa: E702
        b = (b - a) & m; b ^= ((a << 19) | (a >> 13)) & m; a = (a + c) & m  # noqa: E702
        c = (c - b) & m; c ^= ((b << 4) | (b >> 28)) & m; b = (b + a) & m  # noqa: E702
    j = rounds * 3
    a = (a + w[j]) & m
    b = (b + w[j + 1]) & m
    c = (c + w[j + 2]) & m
    c ^= b; c = (c - (((b << 14) | (b >> 18)) & m)) & m  # noqa: E702
    a ^= c; a = (a - (((c << 11) | (c >> 21)) & m)) & m  # noqa: E702
    b ^= a; b = (b - (((a << 25) | (a >> 7)) & m)) & m  # noqa: E702
    c ^= b; c = (c - (((b << 16) | (b >> 16)) & m)) & m  # noqa: E702
    a ^= c; a = (a - (((c << 4) | (c >> 28)) & m)) & m  # noqa: E702
    b ^= a; b = (b - (((a << 14) | (a >> 18)) & m)) & m  # noqa: E702
    c ^= b; c = (c - (((b << 24) | (b >> 8)) & m)) & m  # noqa: E702
    return c


@functools.lru_cache(maxsize=1)
def _lookup3() -> Callable[[bytes], int]:
    """libhdf5's own lookup3 (``H5_checksum_lookup3``: exported, though not in its public
    headers; 0.9 ms for 5 KB in Python, microseconds in C) from the libhdf5 h5py loaded,
    when it is there and agrees with :func:`_lookup3_python`; else that one."""
    import ctypes

    from .memory import _hdf5_library

    fn = getattr(_hdf5_library(), "H5_checksum_lookup3", None)
    if fn is None:
        return _lookup3_python
    fn.argtypes, fn.restype = (ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint32), ctypes.c_uint32

    def native(data: bytes) -> int:
        return fn(data, len(data), 0)

    probe = bytes(range(256)) * 3 + b"blockdiff"
    if all(native(probe[:n]) == _lookup3_python(probe[:n]) for n in (0, 1, 12, 13, 24, len(probe))):
        return native
    return _lookup3_python


def lookup3(data: bytes) -> int:
    """The lookup3 checksum HDF5 puts after its superblock and every object header."""
    return _lookup3()(data)


# ---------------------------------------------------------------------------------------
# messages


@functools.lru_cache(maxsize=None)
def datatype(dtype: np.dtype) -> bytes:
    """The datatype message of a numpy dtype as h5py stores it (``float32``, a boolean
    enum, ...): libhdf5's own encoding (``H5Tencode`` puts the message after two bytes)."""
    return h5py.h5t.py_create(np.dtype(dtype), logical=1).encode()[2:]


@functools.lru_cache(maxsize=None)
def string_type(size: int) -> bytes:
    """The datatype message of a fixed-length, NUL-padded UTF-8 string of ``size`` bytes."""
    return _string_type(size).encode()[2:]


def dataspace(count: int) -> bytes:
    """A 1-D dataspace of ``count`` elements (its maximum the same), version 2."""
    return struct.pack("<BBBBQQ", 2, 1, 1, 1, count, count)


def contiguous(address: int, size: int) -> bytes:
    """A data layout message (version 3): ``size`` bytes at ``address``."""
    return struct.pack("<BBQQ", 3, 1, address, size)


def attribute(name: str, value: Any) -> tuple[bytes, Any]:
    """An attribute message (version 3) for one scalar, as :func:`~.format.set_attr`
    writes it (strings as fixed-length UTF-8; bool, int64, float64), and the value as a
    reader gets it back."""
    key = name.encode("utf-8")
    dtype, data, back = scalar(name, value)
    if len(key) + len(data) > MESSAGE_MAX - 64:  # with the message's header, type and space
        raise TooLarge(f"attribute {name!r} takes {len(key) + len(data)} bytes, more than one message holds")
    kind = string_type(len(data)) if dtype is None else datatype(dtype)
    body = b"".join((
        struct.pack("<BBHHHB", 3, 0, len(key) + 1, len(kind), len(_SCALAR_SPACE), 0 if key.isascii() else 1),
        key, b"\0", kind, _SCALAR_SPACE, data,
    ))
    return body, back


def link(name: str, address: int) -> bytes:
    """A hard link message (version 1) to the object header at ``address``."""
    key = name.encode("utf-8")
    width = 0 if len(key) < 2**8 else 1 if len(key) < 2**16 else 2
    flags = width | (0 if key.isascii() else 0x10)
    charset = b"" if key.isascii() else b"\x01"
    return b"".join((bytes((1, flags)), charset, len(key).to_bytes(1 << width, "little"), key, address.to_bytes(8, "little")))


def object_header(messages: list[tuple[int, int, bytes]], *, attributes: bool = False) -> bytes:
    """An object header (version 2) holding ``messages`` (type, flags, body) in one chunk;
    ``attributes``: with the attribute phase change values stored (attributes compact up
    to 65535), and an attribute info message saying there is no dense storage."""
    if attributes:
        messages = [(_ATTRIBUTE_INFO, _NOT_SHARED, b"\0\0" + _NO_DENSE), *messages]
    body = b"".join(struct.pack("<BHB", kind, len(data), flags) + data for kind, flags, data in messages)
    width = 0 if len(body) < 2**8 else 1 if len(body) < 2**16 else 2 if len(body) < 2**32 else 3
    prefix = b"OHDR" + bytes((2, width | (_PHASE_CHANGE if attributes else 0)))
    if attributes:
        prefix += struct.pack("<HH", 0xFFFF, 0)
    head = prefix + len(body).to_bytes(1 << width, "little") + body
    return head + struct.pack("<I", lookup3(head))


def group(links: list[tuple[str, int]], attributes: list[bytes] | None = None) -> bytes:
    """A group's object header: its links (compact: all in the header), and attribute messages."""
    messages = [
        (_LINK_INFO, 0, b"\0\0" + _NO_DENSE),
        (_GROUP_INFO, _CONSTANT, struct.pack("<BBHH", 0, 1, 0xFFFF, 0)),  # links compact up to 65535
        *((_ATTRIBUTE, 0, body) for body in attributes or ()),
        *((_LINK, 0, link(name, address)) for name, address in links),
    ]
    return object_header(messages, attributes=attributes is not None)


def dataset(kind: bytes, space: bytes, address: int, size: int, attributes: list[bytes] | None = None) -> bytes:
    """A contiguous dataset's object header: datatype message ``kind``, dataspace message
    ``space``, ``size`` bytes at ``address`` (undefined when empty)."""
    messages = [
        (_DATASPACE, 0, space),
        (_DATATYPE, _CONSTANT, kind),
        (_FILL_VALUE, _CONSTANT, _FILL_NEVER),
        (_LAYOUT, _CONSTANT, contiguous(address if size else UNDEFINED, size)),
        *((_ATTRIBUTE, 0, body) for body in attributes or ()),
    ]
    return object_header(messages, attributes=attributes is not None)


def superblock(eof: int, root: int) -> bytes:
    """The superblock (version 3, 8-byte addresses and lengths), at the file's first byte."""
    head = b"\x89HDF\r\n\x1a\n" + bytes((3, 8, 8, 0)) + struct.pack("<QQQQ", 0, UNDEFINED, eof, root)
    return head + struct.pack("<I", lookup3(head))


def _aligned(offset: int, nbytes: int) -> int:
    return -(-offset // ALIGN) * ALIGN if nbytes >= ALIGN_ABOVE else offset


# ---------------------------------------------------------------------------------------
# the file


class RawFile:
    """A dump file being written without libhdf5 (see the module's docstring): created at
    ``path``; :meth:`place` gives each dataset its bytes' place in the order they come,
    the caller writes them through :attr:`fd`; once the last is placed, :meth:`encode_end`
    encodes every structure (while the bytes may still be being written) and
    :meth:`finish` writes them and closes the file. Not thread-safe."""

    def __init__(self, path: str | os.PathLike) -> None:
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
        self.fd: int | None = os.open(path, flags, 0o644)
        self.end = SUPERBLOCK_BYTES  # the end of what is placed so far
        self.datasets: list[tuple[str, np.dtype, int, int]] = []  # name, dtype, count, offset

    def place(self, name: str, dtype: np.dtype, count: int) -> int:
        """Room for dataset ``tensors/<name>`` of ``count`` elements: its offset."""
        nbytes = count * np.dtype(dtype).itemsize
        offset = _aligned(self.end, nbytes)
        self.end = offset + nbytes
        self.datasets.append((name, np.dtype(dtype), count, offset))
        return offset

    def encode_end(self, attributes: list[bytes], index: bytes, index_attributes: list[bytes]) -> tuple[bytes, bytes]:
        """What :meth:`finish` writes: the bytes after the data —
        each dataset's header, ``/tensors``, ``/index`` (``index``, a fixed-length string,
        then its header), the root group with the file's ``attributes`` (messages) — and
        the superblock. Only the datasets placed so far are in them; nothing is written."""
        parts: list[bytes] = []
        pos = self.end

        def put(data: bytes) -> int:
            nonlocal pos
            parts.append(data)
            pos += len(data)
            return pos - len(data)

        links = [
            (name, put(dataset(datatype(dtype), dataspace(count), offset, count * dtype.itemsize)))
            for name, dtype, count, offset in self.datasets
        ]
        tensors = put(group(links))
        size = max(len(index), 1)
        where = put(index.ljust(size, b"\0"))
        index_header = put(dataset(string_type(size), _SCALAR_SPACE, where, size, index_attributes))
        root = put(group([("index", index_header), ("tensors", tensors)], attributes))
        return b"".join(parts), superblock(pos, root)

    def finish(self, encoded: tuple[bytes, bytes]) -> None:
        """Write what :meth:`encode_end` encoded after the last dataset placed (after the
        data, then the superblock) and close the file."""
        tail, first = encoded
        try:
            _pwrite_whole(self.fd, tail, self.end)
            _pwrite_whole(self.fd, first, 0)
        finally:
            self.close()

    def close(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)


def _pwrite_whole(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        done = os.pwrite(fd, view, offset)
        if done <= 0:
            raise OSError(f"write returned {done}")
        view, offset = view[done:], offset + done
