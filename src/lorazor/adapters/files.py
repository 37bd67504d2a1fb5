"""How an adapter folder's files are opened and bounded, before a byte of their tensors is used.

- **Links**: a folder registered from under a server's `--lora-root` (`AdapterSource.root`) is
  re-checked at every read: the folder must still resolve to where it did at registration, under
  the root, and each file is opened without following a link (`O_NOFOLLOW`), so a file turned into
  a link after registration is refused instead of read from outside the root. A hard link is an
  ordinary file to every path check: no check of this kind can detect one.
- **Size**: an adapter's tensors can never need more bytes than the served model's shapes allow at
  `max_lora_rank` (`weights_bound`). A `.bin` file is a zip archive: its members' sizes are read
  from the archive's directory and compressed members are refused (PyTorch never writes them), so a
  small file that would expand to gigabytes inside `torch.load` is refused in microseconds.
- **Changes**: every read from disk hashes what it read (`digest_of`) and compares it with the digest
  taken at registration (`check_unchanged`): a folder rewritten in place is refused, never served
  with new weights under the old digest (the prefix cache keys KV by that digest).
"""

from __future__ import annotations

import hashlib
import os
import stat
import zipfile
from pathlib import Path

from ..lora.types import AdapterError

# Bytes an adapter may hold beyond its LoRA tensors' bound (safetensors headers, pickle records).
FILE_OVERHEAD_BYTES = 1 << 20
# Bytes per value for the bound: float64 is the widest dtype an adapter's tensors may have.
MAX_ITEM_BYTES = 8


def weights_bound(module_sizes: dict[str, tuple[int, int]], max_rank: int) -> int:
    """The most bytes an adapter's tensors can take on this model: lora_A `[r, in]` and lora_B
    `[out, r]` for every LoRA target at rank `max_rank`, in float64."""
    return sum((k + n) * max_rank for k, n in module_sizes.values()) * MAX_ITEM_BYTES


def check_inside_root(name: str, folder: Path, root: Path | None) -> None:
    """With a root: `folder` (as registered, already resolved) must still resolve to itself under
    `root` (no component replaced by a link since)."""
    if root is None:
        return
    real = os.path.realpath(folder)
    if real != str(folder) or os.path.commonpath([real, str(root)]) != str(root):
        raise AdapterError(f"adapter {name!r}: its folder {folder} no longer resolves to itself under the "
                           f"server's --lora-root ({real}): a link was put in its path since it was registered")


def open_file(name: str, path: Path, root: Path | None):
    """`path` opened for reading (binary); with a root, without following a link, and only a
    regular file."""
    if root is None:
        return open(path, "rb")
    check_inside_root(name, path.parent, root)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as err:
        if os.path.islink(path):
            raise AdapterError(f"adapter {name!r}: {path} is a link, which adapters under --lora-root may not "
                               "hold (it could point outside the root)") from None
        raise AdapterError(f"adapter {name!r}: {path} cannot be read ({err.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise AdapterError(f"adapter {name!r}: {path} is not a regular file")
    return os.fdopen(fd, "rb")


def fd_path(f, path: Path) -> str:
    """A path that names the very file `f` has open (Linux: `/proc/self/fd/N`), for readers that
    take a path (safetensors' memory map); elsewhere `path` itself."""
    proc = f"/proc/self/fd/{f.fileno()}"
    return proc if os.path.exists(proc) else str(path)


def check_archive(name: str, f, path: Path, max_bytes: int | None) -> None:
    """Refuse a `.bin` zip archive with compressed members, or whose members would expand past
    `max_bytes`, from its directory alone (nothing is decompressed). Other files (PyTorch's legacy
    non-zip format) are bounded by their size."""
    size = os.fstat(f.fileno()).st_size
    if not zipfile.is_zipfile(f):
        f.seek(0)
        if max_bytes is not None and size > max_bytes + FILE_OVERHEAD_BYTES:
            raise AdapterError(f"adapter {name!r}: {path} is {size} bytes, more than an adapter of this model at "
                               f"max_lora_rank can need ({max_bytes + FILE_OVERHEAD_BYTES})")
        return
    f.seek(0)
    with zipfile.ZipFile(f) as archive:
        members = archive.infolist()
    f.seek(0)
    packed = [m.filename for m in members if m.compress_type != zipfile.ZIP_STORED]
    if packed:
        raise AdapterError(f"adapter {name!r}: {path} holds compressed members (e.g. {packed[0]!r}), which PyTorch "
                           "never writes: refused unread (a compressed file can expand to any size)")
    total = sum(m.file_size for m in members)
    if max_bytes is not None and total > max_bytes + FILE_OVERHEAD_BYTES:
        raise AdapterError(f"adapter {name!r}: {path} would expand to {total} bytes, more than an adapter of this "
                           f"model at max_lora_rank can need ({max_bytes + FILE_OVERHEAD_BYTES})")


def digest_of(config_bytes: bytes, weights_file) -> bytes:
    """sha256 of an adapter's config bytes and its safetensors file (read from `weights_file`'s
    start, in chunks)."""
    weights_file.seek(0)
    return hashlib.file_digest(weights_file, lambda: hashlib.sha256(config_bytes)).digest()


def check_unchanged(name: str, folder: Path, registered: bytes, found: bytes) -> None:
    """Refuse files whose digest differs from the one taken at registration."""
    if registered and found != registered:
        raise AdapterError(f"adapter {name!r}: its files in {folder} changed on disk since it was registered "
                           f"(digest {found.hex()[:12]} != {registered.hex()[:12]}): it is out of service until an "
                           "operator registers it again (e.g. load_inplace), so KV cached from the old weights is "
                           "never served with the new ones")
