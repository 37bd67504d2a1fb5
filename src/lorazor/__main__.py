"""`python -m lorazor`: the `lorazor` command."""

import os
import sys


def _unshadow() -> None:
    """Run from a folder that holds a directory named `lorazor` (a clone of the repository), `python
    -m` imports that directory as a namespace package instead of the installed package (an editable
    install's finder comes after Python's own). Drop the working directory from the path and import
    the package again; the `lorazor` console script never meets that directory."""
    package = sys.modules.get("lorazor")
    if package is None or getattr(package, "__file__", None) is not None:
        return
    shadows = {os.path.dirname(os.path.abspath(p)) for p in package.__path__}
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) not in shadows]
    for name in [n for n in sys.modules if n == "lorazor" or n.startswith("lorazor.")]:
        del sys.modules[name]


_unshadow()
from lorazor.cli import main  # noqa: E402

sys.exit(main())
