"""An adapter folder's file names and the rule for adapter names (no torch: the command line reads
them before anything heavy is imported)."""

import re

CONFIG_FILE = "adapter_config.json"
SAFE_FILE = "adapter_model.safetensors"
LEGACY_FILE = "adapter_model.bin"
# Adapter names become folder names (release policies are saved per adapter) and model names in a
# server: letters, digits, '_', '-' and '.', not starting with '.', no path separators.
ADAPTER_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}")


def adapter_name_problem(name) -> str | None:
    """Why `name` is no valid adapter name, or None."""
    if isinstance(name, str) and ADAPTER_NAME.fullmatch(name):
        return None
    return (f"invalid adapter name {name!r}: use 1-128 letters, digits, '_', '-' or '.', not starting with '.' "
            "(no path separators: names are used as folder names)")
