"""Resolve the GPU install against the package index, without installing it or downloading the big wheels.

``make gpu-install-check`` / ``python tools/gpu_install_check.py [--extras openrlhf,trl,gpu]``: what pip would
install for ``openrlhf-lopti[<extras>]`` on this platform (Linux x86-64 with this Python), as a name / version
table. It runs on a machine without a GPU and without CUDA:

1. the requirements are read from setup.py (its ``setup()`` call, not a build of this package);
2. a throwaway venv gets pip, the build prerequisites (setuptools, wheel, packaging, psutil, ninja) and a torch
   (``--build-torch``, CPU is fine): flash-attn ships only an sdist whose ``setup.py`` imports torch, so its
   metadata is built without build isolation, with ``FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE`` (no nvcc);
3. ``pip install --dry-run --ignore-installed --no-cache-dir --report`` resolves the requirements in that venv.
   With ``--use-feature=fast-deps`` pip reads a wheel's metadata through HTTP range requests into it: the
   multi-GB wheels (torch, vLLM, the CUDA libraries) are not downloaded, the sdists are (flash-attn's is the
   largest, about 8 MB); about 112 MB in all here, most of it index pages. Without fast-deps (``--no-fast-deps``)
   pip 26.3 fetched every wheel whole here, about 5 GB. The last line says what was fetched, from pip's log
   (no cache, so all of it).

The resolution uses the default package index, with pip's configuration files and its index / find-links /
constraint environment variables switched off (a local wheel folder or a constraint file would change what
is picked); ``--use-pip-config`` keeps them (e.g. for a mirror). Depends on the live index: not part of CI.
docs/INSTALL.md holds the table of its last run. ``--parse REPORT.json`` only prints the table of a report.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
DEFAULT_EXTRAS = "openrlhf,trl,gpu"
BUILD_PREREQUISITES = ["setuptools", "wheel", "packaging", "psutil", "ninja"]
# Environment variables that point pip at other packages than the index's (or filter them); dropped unless
# --use-pip-config. Transport settings (PIP_CERT, PIP_PROXY, PIP_DEFAULT_TIMEOUT, ...) are kept.
PIP_SOURCE_VARS = (
    "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_NO_INDEX", "PIP_CONSTRAINT",
    "PIP_REQUIREMENT", "PIP_PRE", "PIP_ONLY_BINARY", "PIP_NO_BINARY", "PIP_PREFER_BINARY", "PIP_TARGET",
    "PIP_PREFIX", "PIP_USER", "PIP_UPGRADE", "PIP_UPGRADE_STRATEGY", "PIP_CONFIG_FILE", "PIP_REQUIRE_VIRTUALENV",
)  # fmt: skip


@dataclass(frozen=True)
class Pick:
    """One distribution of the resolution."""

    name: str
    version: str
    kind: str  # "wheel", "sdist" (built from source at install time) or "other" (a VCS or local directory)
    requested: bool  # named by our requirements (not only pulled in by another package)
    requires: tuple  # its Requires-Dist lines

    @property
    def cuda(self) -> Optional[str]:
        """``"cu13"`` / ``"cu12"`` if this is an NVIDIA CUDA library wheel (``nvidia-*-cu13``), else None."""
        match = re.search(r"-(cu\d+)$", self.name)
        return match.group(1) if match and self.name.startswith("nvidia-") else None


def canonical(name: str) -> str:
    """PEP 503 normalised project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_report(report: dict) -> list[Pick]:
    """The distributions pip would install, sorted by name, from a ``pip install --report`` JSON (format 1)."""
    if str(report.get("version")) != "1":
        raise ValueError(f"unsupported pip report version {report.get('version')!r} (expected '1')")
    picks = []
    install = report.get("install", [])
    if not isinstance(install, list) or not all(isinstance(item, dict) for item in install):
        raise ValueError("'install' must be a list of objects (pip's report format 1)")
    for item in install:
        meta = item.get("metadata") or {}
        if "name" not in meta or "version" not in meta:
            raise ValueError(f"a report entry without metadata name/version: {item.get('download_info')}")
        info = item.get("download_info") or {}
        url = info.get("url", "")
        if "archive_info" in info and url.split("#")[0].endswith(".whl"):
            kind = "wheel"
        elif "archive_info" in info:
            kind = "sdist"
        else:  # vcs_info / dir_info
            kind = "other"
        picks.append(
            Pick(
                name=canonical(meta["name"]),
                version=meta["version"],
                kind=kind,
                requested=bool(item.get("requested")),
                requires=tuple(meta.get("requires_dist") or ()),
            )
        )
    return sorted(picks, key=lambda p: p.name)


def format_table(picks: list[Pick], markdown: bool = True) -> str:
    """A name / version / from table: a Markdown table (docs/INSTALL.md) or aligned plain text."""
    def source(p: Pick) -> str:
        return ("sdist (built here)" if p.kind == "sdist" else p.kind) + (", ours" if p.requested else "")

    rows = [(p.name, p.version, source(p)) for p in picks]
    head = ("package", "version", "from")
    if markdown:
        lines = [f"| {head[0]} | {head[1]} | {head[2]} |", "|---|---|---|"]
        lines += [f"| {n} | {v} | {k} |" for n, v, k in rows]
        return "\n".join(lines)
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(3)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [head] + rows)


def summary(picks: list[Pick]) -> list[str]:
    """Lines on what matters for the GPU install: torch / vLLM / transformers, the CUDA major of the NVIDIA
    wheels, and the packages pip would build from source."""
    by_name = {p.name: p for p in picks}
    lines = []
    key = [f"{n} {by_name[n].version}" for n in ("torch", "vllm", "transformers", "trl", "openrlhf", "flash-attn",
                                                  "deepspeed", "ray", "triton") if n in by_name]  # fmt: skip
    if key:
        lines.append("key versions: " + ", ".join(key))
    cuda = torch_cuda(by_name["torch"]) if "torch" in by_name else None
    if cuda:
        lines.append(f"torch {by_name['torch'].version} is built for CUDA {cuda[0]} (it requires {cuda[1]})")
    suffixes = sorted({p.cuda for p in picks if p.cuda})
    if suffixes:
        counts = ", ".join(f"{s} ({sum(1 for p in picks if p.cuda == s)})" for s in suffixes)
        lines.append(f"NVIDIA wheels named for a CUDA major: {counts}")
    sdists = [f"{p.name} {p.version}" for p in picks if p.kind == "sdist"]
    if sdists:
        lines.append("built from source at install time (sdists): " + ", ".join(sdists))
    lines.append(f"{len(picks)} distributions")
    return lines


def torch_cuda(torch: Pick) -> Optional[tuple]:
    """``(CUDA version, the requirement that says so)`` of a torch wheel, from its Requires-Dist: the
    ``cuda-toolkit==X.Y.Z`` pin (torch >= 2.12) or the ``nvidia-*-cuNN`` libraries (older), else None (a CPU
    or ROCm build)."""
    for req in torch.requires:
        match = re.match(r"cuda-toolkit(?:\[[^\]]*\])?\s*==\s*(\d+)\.(\d+)", req)
        if match:
            return f"{match.group(1)}.{match.group(2)}", re.sub(r"\[[^\]]*\]", "", req.split(";")[0]).strip()
    for req in torch.requires:
        match = re.match(r"nvidia-[a-z0-9-]+-cu(\d+)\b", req)
        if match:
            return match.group(1), req.split(";")[0].strip()
    return None


HTTP_GET = re.compile(r'"GET (\S+) HTTP/[\d.]+" (\d{3}) (\d+)')


def traffic(pip_log: str) -> dict:
    """What a pip ``--log`` says was fetched (urllib3's ``"GET <path> HTTP/1.1" <status> <bytes>`` lines).

    Returns ``{"pages": (count, bytes), "ranges": (requests, files, bytes), "metadata": (count, bytes),
    "whole": [(file name, bytes), ...]}``: index pages (``/simple/...``), HTTP range requests into wheels
    (fast-deps), separate metadata files (PEP 658 ``.metadata``) and whole files (wheels or sdists).
    """
    pages, ranges, metadata, whole = [], [], [], {}
    for path, status, size in HTTP_GET.findall(pip_log):
        size, name = int(size), path.split("?")[0].rstrip("/").rsplit("/", 1)[-1]
        if "/simple/" in path:
            pages.append(size)
        elif status == "206":
            ranges.append((name, size))
        elif name.endswith(".metadata"):
            metadata.append(size)
        elif status == "200":
            whole[name] = whole.get(name, 0) + size
    return {
        "pages": (len(pages), sum(pages)),
        "ranges": (len(ranges), len({n for n, _ in ranges}), sum(b for _, b in ranges)),
        "metadata": (len(metadata), sum(metadata)),
        "whole": sorted(whole.items()),
    }


def megabytes(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def traffic_summary(t: dict) -> str:
    """One line: what the dry run fetched (with --no-cache-dir, everything it needed)."""
    whole = ", ".join(f"{name} ({megabytes(size)})" for name, size in t["whole"]) or "none"
    total = t["pages"][1] + t["ranges"][2] + t["metadata"][1] + sum(size for _, size in t["whole"])
    return (
        f"fetched {megabytes(total)}: {t['pages'][0]} index pages ({megabytes(t['pages'][1])}), "
        f"{t['ranges'][0]} range requests into {t['ranges'][1]} wheels ({megabytes(t['ranges'][2])}), "
        f"{t['metadata'][0]} metadata files ({megabytes(t['metadata'][1])}); whole files: {whole}"
    )


def setup_requirements(extras: list[str]) -> list[str]:
    """install_requires plus the named extras, read from setup.py's ``setup()`` call (nothing is built)."""
    import runpy

    import setuptools

    captured = {}
    real_setup, real_env, real_cwd = setuptools.setup, os.environ.get("OPENRLHF_LOPTI_NO_BUILD"), os.getcwd()
    setuptools.setup = lambda **kwargs: captured.update(kwargs)
    os.environ["OPENRLHF_LOPTI_NO_BUILD"] = "1"  # no torch import for the C++ extension
    try:
        os.chdir(REPO)
        runpy.run_path(str(REPO / "setup.py"), run_name="__main__")
    finally:
        setuptools.setup = real_setup
        os.chdir(real_cwd)
        if real_env is None:
            os.environ.pop("OPENRLHF_LOPTI_NO_BUILD", None)
        else:
            os.environ["OPENRLHF_LOPTI_NO_BUILD"] = real_env
    known = captured.get("extras_require", {})
    unknown = [e for e in extras if e not in known]
    if unknown:
        raise SystemExit(f"unknown extra(s) {unknown}; setup.py has {sorted(known)}")
    reqs = list(captured.get("install_requires", []))
    for extra in extras:
        reqs += [r for r in known[extra] if r not in reqs]
    return reqs


def resolver_env(use_pip_config: bool) -> dict:
    env = dict(os.environ, FLASH_ATTENTION_SKIP_CUDA_BUILD="TRUE", PIP_DISABLE_PIP_VERSION_CHECK="1")
    if not use_pip_config:
        for var in PIP_SOURCE_VARS:
            env.pop(var, None)
        env["PIP_CONFIG_FILE"] = os.devnull  # no pip.conf (global, user or site)
    return env


def run(cmd: list, env: Optional[dict] = None) -> subprocess.CompletedProcess:
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    return subprocess.run(cmd, env=env, text=True, capture_output=True)


def check(proc: subprocess.CompletedProcess, what: str) -> None:
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise SystemExit(f"gpu-install-check: {what} failed (exit {proc.returncode})")


def resolve(reqs: list[str], workdir: Path, python: str, build_torch: str, use_pip_config: bool, fast_deps: bool):
    venv = workdir / "venv"
    check(run([python, "-m", "venv", str(venv)]), "creating the throwaway venv")
    vpy = str(venv / "bin" / "python")
    pip = [vpy, "-m", "pip", "--disable-pip-version-check", "install", "--quiet"]
    # The venv's own tools come through the user's normal pip configuration (a local torch wheel is fine here).
    check(run(pip + ["--upgrade", "pip"]), "upgrading pip")
    check(run(pip + BUILD_PREREQUISITES), "installing the build prerequisites")
    check(run(pip + [build_torch]), f"installing {build_torch} (flash-attn's setup.py imports torch)")

    report, log = workdir / "report.json", workdir / "pip.log"
    cmd = [vpy, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-build-isolation",
           "--report", str(report), "--log", str(log), "--no-cache-dir", "--quiet"]  # fmt: skip
    if fast_deps:
        cmd.append("--use-feature=fast-deps")
    started = time.time()
    proc = run(cmd + reqs, env=resolver_env(use_pip_config))
    if proc.returncode != 0 and fast_deps and "fast-deps" in proc.stderr and "invalid choice" in proc.stderr:
        print("gpu-install-check: this pip has no fast-deps; without it the dry run fetched whole wheels here "
              "(about 5 GB)", file=sys.stderr)  # fmt: skip
        proc = run([c for c in cmd if c != "--use-feature=fast-deps"] + reqs, env=resolver_env(use_pip_config))
    check(proc, "pip's dry-run resolution")
    print(f"resolved in {time.time() - started:.0f} s", file=sys.stderr)
    return json.loads(report.read_text()), traffic_summary(traffic(log.read_text(errors="replace")))


def read_report(path: Path, ap: argparse.ArgumentParser) -> dict:
    """The JSON object of a ``pip install --report`` file; a one-line error (exit 2) for anything else."""
    hint = "pass a report `pip install --dry-run --report FILE` wrote (or --save-report)"
    try:
        report = json.loads(path.read_text())
    except FileNotFoundError:
        ap.exit(2, f"{ap.prog}: error: --parse {path}: no such file; {hint}\n")
    except (OSError, UnicodeDecodeError) as e:
        ap.exit(2, f"{ap.prog}: error: --parse {path}: cannot read it ({getattr(e, 'strerror', None) or e}); {hint}\n")
    except json.JSONDecodeError as e:
        ap.exit(2, f"{ap.prog}: error: --parse {path}: not JSON (line {e.lineno}: {e.msg}); {hint}\n")
    if not isinstance(report, dict):
        ap.exit(2, f"{ap.prog}: error: --parse {path}: a JSON {type(report).__name__}, not a report object; {hint}\n")
    return report


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(prog="gpu_install_check.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--extras", default=DEFAULT_EXTRAS, help=f"extras of openrlhf-lopti to resolve ({DEFAULT_EXTRAS})")
    ap.add_argument("--python", default=sys.executable, help="interpreter of the throwaway venv (its version and "
                    "platform are what pip resolves for)")  # fmt: skip
    ap.add_argument("--build-torch", default="torch==2.13.0",
                    help="torch for flash-attn's metadata build in the venv (any build; default: %(default)s)")
    ap.add_argument("--use-pip-config", action="store_true",
                    help="resolve with this shell's pip configuration and PIP_* variables (default: the default index)")
    ap.add_argument("--no-fast-deps", action="store_true", help="leave out --use-feature=fast-deps")
    ap.add_argument("--save-report", type=Path, help="also write pip's report JSON here")
    ap.add_argument("--parse", type=Path, metavar="REPORT_JSON", help="only print the table of an existing report")
    ap.add_argument("--text", action="store_true", help="a plain-text table instead of Markdown")
    args = ap.parse_args(argv)

    if args.parse:
        report = read_report(args.parse, ap)
    else:
        extras = [e.strip() for e in args.extras.split(",") if e.strip()]
        reqs = setup_requirements(extras)
        print(f"resolving openrlhf-lopti[{','.join(extras)}]: {' '.join(reqs)}", file=sys.stderr)
        with tempfile.TemporaryDirectory(prefix="gpu-install-check-") as tmp:
            report, fetched = resolve(reqs, Path(tmp), args.python, args.build_torch, args.use_pip_config,
                                      not args.no_fast_deps)
        if args.save_report:
            args.save_report.write_text(json.dumps(report, indent=1))
    try:
        picks = parse_report(report)
    except ValueError as e:
        ap.exit(2, f"{ap.prog}: error: --parse {args.parse}: {e}\n" if args.parse else f"{ap.prog}: error: {e}\n")
    env = report.get("environment", {})
    if env:
        where = f"{env.get('sys_platform')} {env.get('platform_machine')}, Python {env.get('python_full_version')}"
        print(f"platform: {where}; pip {report.get('pip_version', '?')}")
    print(format_table(picks, markdown=not args.text))
    print()
    print("\n".join(summary(picks)))
    if not args.parse:
        print(fetched)
    return 0


if __name__ == "__main__":
    sys.exit(main())
