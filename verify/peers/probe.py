"""python -m verify.peers.probe IMPL [START]: run an adapter's malformed calls, one JSON line each.

Runs in its own process (verify/peers/check.py starts it), so a peer that crashes on a bad
input is recorded as a crash; a line {"start": ...} precedes each call. Outcomes:
  error     the call raised (the message is kept: does it say what is wrong?)
  silent    the call returned without an error (SPEC: a bad input must raise): the output's
            finiteness is recorded, since garbage is what a silent call usually returns
(check.py adds crash: the process died during the call; hang: no answer within the timeout)
"""
from __future__ import annotations

import json
import re
import sys

import torch

from . import load


# A peer's message may name a file of the machine it was built on (an absolute path in a
# C++ check); the report keeps the file's name and drops the folders, which say nothing about
# the input and would put someone's machine layout into a committed report.
_ABS_PATH = re.compile(r"(?:/[\w.+-]+)+/([\w.+-]+)")


def _message(e: Exception) -> str:
    first = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {_ABS_PATH.sub(lambda m: m.group(1), first)[:200]}"


def main(argv) -> int:
    name = argv[0]
    start = int(argv[1]) if len(argv) > 1 else 0
    impl = load(name)
    if not impl.available or impl.bad_inputs is None:
        print(json.dumps({"total": 0}), flush=True)
        return 0
    probes = impl.bad_inputs()
    print(json.dumps({"total": len(probes)}), flush=True)
    for i, (desc, thunk) in enumerate(probes):
        if i < start:
            continue
        print(json.dumps({"start": True, "index": i, "probe": desc}), flush=True)
        try:
            out = thunk()
        except Exception as e:
            rec = {"outcome": "error", "detail": _message(e)}
        else:
            outs = out if isinstance(out, (tuple, list)) else (out,)
            fin = all(bool(torch.isfinite(o.float()).all()) for o in outs if isinstance(o, torch.Tensor)
                      and o.is_floating_point())
            rec = {"outcome": "silent", "detail": "returned without an error; outputs "
                   + ("finite" if fin else "hold NaN/inf")}
        rec.update(index=i, probe=desc)
        print(json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
