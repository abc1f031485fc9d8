"""`python -m experiments.micro NAME [ARGS...]`: run one micro-benchmark and save its output.

A micro-benchmark isolates one mechanism a kernel decision rests on (a decoder's instruction
mix, a streaming loop, the read bandwidth...). NAME is a file of this folder: `NAME.cpp` is
compiled with g++ (-O2 -march=native, plus -fopenmp -pthread; the flags the file's own opening
comment gives) into a temporary folder and run with ARGS; `NAME.py` runs as a module with ARGS.
The output goes to the terminal and, with its provenance (command, commit, date, CPU, ISA,
load), to experiments/results/<machine>/NAME.txt, replacing the previous one: one file per
micro-benchmark and machine. `--list` names them; `--no-save` only prints.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import io
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from .. import timing

HERE = Path(__file__).resolve().parent


def available() -> list[str]:
    return sorted(p.stem for p in HERE.iterdir()
                  if p.suffix in (".cpp", ".py") and not p.name.startswith("_"))


def compile_flags(src: Path) -> list[str]:
    """-O2 (or the -O level the file's build line names), -march=native: a micro-benchmark
    measures this CPU's instructions, never a portable build; a file whose build line names
    -march=x86-64-v3 gets that (AVX2 + FMA and 16 ymm registers, the avx2 level's budget, on
    any CPU)."""
    head = src.read_text()[:2000]
    opt = "-O3" if "g++ -O3" in head else "-O2"
    march = "-march=x86-64-v3" if "-march=x86-64-v3" in head else "-march=native"
    return [opt, march, "-fopenmp", "-pthread"]


def run_cpp(src: Path, args: list[str]) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / src.stem
        cmd = ["g++", *compile_flags(src), str(src), "-o", str(exe)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"micro {src.stem}: compile failed ({shlex.join(cmd)}):\n{done.stderr}")
        out = subprocess.run([str(exe), *args], capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(f"micro {src.stem}: exited {out.returncode}:\n{out.stdout}{out.stderr}")
        print(out.stdout, end="")
        return f"# build: g++ {' '.join(compile_flags(src))}\n" + out.stdout


def run_py(name: str, args: list[str]) -> str:
    mod = importlib.import_module(f"{__package__}.{name}")
    buf = io.StringIO()

    class Tee(io.TextIOBase):
        def write(self, s):
            sys.__stdout__.write(s)
            buf.write(s)
            return len(s)

    with contextlib.redirect_stdout(Tee()):
        rc = mod.main(args) if inspect.signature(mod.main).parameters else mod.main()
    if rc:
        raise SystemExit(f"micro {name}: main() returned {rc}")
    return buf.getvalue()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.micro", description=__doc__.splitlines()[0])
    p.add_argument("name", nargs="?", help="the micro-benchmark (a .cpp or .py of experiments/micro)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="passed to the benchmark")
    p.add_argument("--list", action="store_true", help="name the micro-benchmarks")
    p.add_argument("--no-save", action="store_true", help="print only")
    a = p.parse_args(argv)
    if a.list or not a.name:
        print("\n".join(available()))
        return 0
    if a.name not in available():
        p.error(f"unknown micro-benchmark {a.name!r}; known: {', '.join(available())}")
    command = "python -m experiments.micro " + shlex.join([a.name, *a.args])
    header = timing.provenance(command)
    src = HERE / f"{a.name}.cpp"
    text = run_cpp(src, a.args) if src.exists() else run_py(a.name, a.args)
    if not a.no_save:
        print(f"saved {timing.save_result(a.name, header, text)}")
    return 0


if __name__ == "__main__":
    timing.cap_libraries()   # under MOELAB_ISA=avx2 / avx512 torch's baselines run that level too
    sys.exit(main())
