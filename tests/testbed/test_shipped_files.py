"""What ships with the package holds no path of the machine that made it."""

import re

from lorazor.testbed import ASSETS

# A machine path: under a usual top-level folder, or a Windows drive.
ABSOLUTE_PATH = re.compile(r'(^|["\s=])/(tmp|home|root|work|Users|mnt|opt|var|srv|scratch)/|[A-Za-z]:\\\\')


def test_shipped_json_files_hold_no_machine_paths():
    files = sorted(ASSETS.rglob("*.json"))
    assert len(files) >= 6  # the adapters' configs, the backbone's, the tokenizer's, the training log
    found = {str(f.relative_to(ASSETS)): m.group(0) for f in files for m in [ABSOLUTE_PATH.search(f.read_text())]
             if m}
    assert not found, found


def test_the_adapters_name_their_backbone_by_folder():
    import json

    for config in ASSETS.glob("adapters/*/adapter_config.json"):
        assert json.loads(config.read_text())["base_model_name_or_path"] == "backbone"
