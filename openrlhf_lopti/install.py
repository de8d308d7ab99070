"""The pip command that installs this package, with an extra, from where this copy of it came from.

openrlhf-lopti is not on the package index: ``pip install "openrlhf-lopti[trl]"`` fails for everyone who got it
from a checkout, a git URL or a wheel file. So every "install X" message asks this module, which answers for
the copy that is running: a source checkout (``pip install -e "/path/to/checkout[trl]"``), else the source pip
recorded when it installed this copy (PEP 610's ``direct_url.json``: a folder, a git URL or a wheel/sdist
file), else the index name (once it is published there).

Nothing here imports torch, transformers or the rest of the package: every layer may import it.
"""

import json
from urllib.parse import unquote, urlparse
from importlib import metadata
from pathlib import Path
from typing import Optional

DISTRIBUTION = "openrlhf-lopti"
PACKAGE_DIR = Path(__file__).resolve().parent


def checkout() -> Optional[Path]:
    """The source checkout this copy is imported from (a setup.py beside the package), else None."""
    root = PACKAGE_DIR.parent
    return root if (root / "setup.py").is_file() and (root / "csrc").is_dir() else None


def _recorded_source() -> Optional[dict]:
    """pip's record of where it installed this copy from (``direct_url.json``), when it is this copy's."""
    try:
        dist = metadata.distribution(DISTRIBUTION)
        text = dist.read_text("direct_url.json")
        installed_here = Path(dist.locate_file("openrlhf_lopti")).resolve() == PACKAGE_DIR
    except (metadata.PackageNotFoundError, OSError, ValueError):
        return None
    if not text or not installed_here:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return None


def pip_install(extra: str = "") -> str:
    """A command that installs this package (with ``extra``, e.g. ``"trl"``) from where this copy came from."""
    suffix = f"[{extra}]" if extra else ""
    root = checkout()
    if root is not None:
        return f'pip install -e "{root}{suffix}"'
    source = _recorded_source()
    if source and source.get("url"):
        url = source["url"]
        if "vcs_info" in source:
            vcs = source["vcs_info"]
            revision = vcs.get("requested_revision")
            url = f"{vcs.get('vcs', 'git')}+{url}" + (f"@{revision}" if revision else "")
        elif "dir_info" in source and url.startswith("file://"):
            editable = "-e " if source["dir_info"].get("editable") else ""
            return f'pip install {editable}"{unquote(urlparse(url).path)}{suffix}"'
        return f'pip install "{DISTRIBUTION}{suffix} @ {url}"'
    return f'pip install "{DISTRIBUTION}{suffix}"'
