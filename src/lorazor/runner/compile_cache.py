"""Where compiled code is kept between processes, so a restart does not compile again.

A compiled engine's cold `warm_up()` spends minutes in torch.compile (inductor) and Triton; both keep
what they build in on-disk caches, and a process that finds them there loads instead of compiling.
Their defaults are `/tmp/torchinductor_<user>` (lost at a reboot, or with a container's `/tmp`)
and `~/.triton/cache`. LoRazor points both, when the user has not, at one folder that lasts:
`$LORAZOR_CACHE_DIR` or `~/.cache/lorazor`, subfolders `inductor/` and `triton/`.

The caches key their entries themselves: inductor by the traced graph (so the model's shapes and
architecture), the inductor config and the torch version; Triton by the kernel's source, its
constants (the kernel config's tile sizes) and the Triton version. A changed model, kernel config or
torch recompiles; an unchanged one loads. Set `TORCHINDUCTOR_CACHE_DIR` / `TRITON_CACHE_DIR` to keep
them elsewhere (a volume of a container: docs/deployment.md).
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """`$LORAZOR_CACHE_DIR`, else `$XDG_CACHE_HOME/lorazor`, else `~/.cache/lorazor`."""
    if os.environ.get("LORAZOR_CACHE_DIR"):
        return Path(os.environ["LORAZOR_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lorazor"


def use_compile_cache() -> dict[str, str]:
    """Point inductor's and Triton's caches at `cache_root()` where their variables are unset (before
    the first compile reads them); returns {"inductor": folder, "triton": folder} in use."""
    root = cache_root()
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor"))
    os.environ.setdefault("TRITON_CACHE_DIR", str(root / "triton"))
    return {"inductor": os.environ["TORCHINDUCTOR_CACHE_DIR"], "triton": os.environ["TRITON_CACHE_DIR"]}
