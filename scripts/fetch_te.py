#!/usr/bin/env python3
"""Fetch Transformer Engine for the GPU machines and split it into device-call-sized folders.

    python3 scripts/fetch_te.py            # -> .te/part0 .. .te/partN-1 and .te/rest (ignored by git)

The GPU machines reach no package index and one device call carries at most 64 MiB, so TE
(``TE_VERSION``, default 2.20.2) travels as files made here (docs/transformer-engine.md):

* ``transformer_engine_cu13`` (the core library, a ~277 MB wheel) split into parts of at most
  ``--part-mb`` MB, one folder per part: each is carried by one call (``scripts/gpu_te.sh stash``);
* ``.te/rest``: the meta package ``transformer_engine``, the ``transformer_engine_torch`` sdist (the
  only form PyPI has; built for sm_90 on the GPU machine), TE's runtime dependencies the GPU image
  lacks, and the megatron-core wheel for Python 3.12 (the GPU image's).

The sdist is downloaded through pip's own finder and session rather than ``pip download``, which
would first run the sdist's ``setup.py`` to read its metadata, and that needs CUDA.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "any")
# Runtime dependencies of TE 2.20 (core and torch) missing from, or too old on, the GPU image.
TE_DEPENDENCIES = ("pydantic==2.14.4", "pydantic-core==2.50.5", "annotated-types", "typing-inspection",
                   "typing_extensions>=4.16", "nvdlfw-inspect", "nvidia-cudnn-frontend>=1.29", "einops")


def pip_download(dest: str, *requirements: str) -> None:
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", dest, *requirements],
                   check=True)


def download_sdist(name: str, version: str, dest: str) -> str:
    from pip._internal.index.collector import LinkCollector
    from pip._internal.index.package_finder import PackageFinder
    from pip._internal.models.search_scope import SearchScope
    from pip._internal.models.selection_prefs import SelectionPreferences
    from pip._internal.network.session import PipSession

    session = PipSession()
    collector = LinkCollector(session=session, search_scope=SearchScope.create(
        find_links=[], index_urls=["https://pypi.org/simple"], no_index=False))
    finder = PackageFinder.create(link_collector=collector, selection_prefs=SelectionPreferences(allow_yanked=False))
    links = [c.link for c in finder.find_all_candidates(name)
             if str(c.version) == version and c.link.filename.endswith(".tar.gz")]
    if not links:
        raise SystemExit(f"no sdist of {name}=={version} on PyPI")
    response = session.get(links[0].url.split("#")[0])
    response.raise_for_status()
    path = os.path.join(dest, links[0].filename)
    with open(path, "wb") as f:
        f.write(response.content)
    return path


def split(path: str, out_root: str, part_bytes: int) -> int:
    size, index = os.path.getsize(path), 0
    with open(path, "rb") as src:
        while True:
            chunk = src.read(part_bytes)
            if not chunk:
                return index
            folder = os.path.join(out_root, f"part{index}")
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, f"{os.path.basename(path)}.part{index:02d}"), "wb") as f:
                f.write(chunk)
            index += 1
            assert index * part_bytes < size + part_bytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--version", default=os.environ.get("TE_VERSION", "2.20.2"))
    p.add_argument("--megatron-core", default="0.19.2")
    p.add_argument("--out", default=os.path.join(REPO, ".te"))
    p.add_argument("--part-mb", type=float, default=56.0,
                   help="largest part in MB (10^6 bytes): with the ~8.5 MB working tree under 64 MiB a call")
    args = p.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    rest, download = os.path.join(args.out, "rest"), os.path.join(args.out, "download")
    os.makedirs(rest)
    os.makedirs(download)
    pip_download(download, f"transformer_engine_cu13=={args.version}")
    pip_download(rest, f"transformer_engine=={args.version}", *TE_DEPENDENCIES,
                 f"megatron-core=={args.megatron_core}")
    download_sdist("transformer_engine_torch", args.version, rest)
    (core,) = [os.path.join(download, f) for f in os.listdir(download)]
    parts = split(core, args.out, int(args.part_mb * 1e6))
    shutil.rmtree(download)
    print(f"{args.out}: {parts} parts of {os.path.basename(core)}, and rest/ with {sorted(os.listdir(rest))}")
    print(f"carry them one call each: PHASE=stash scripts/gpu_te.sh with carry .te/part0 ... .te/part{parts - 1}, "
          f"then PHASE=install with carry .te/rest (scripts/gpu_te.sh)")


if __name__ == "__main__":
    main()
