"""optimized.pack_cache: standard-layout CPU expert weights packed once, lazily, per expert.

`optimized.fused_experts` with standard-layout CPU weights (SPEC 5) used to repack every
routed expert's tiles on every call (docs/fused_experts.md, "Weight layout"). It now keeps,
per weight set, the prepacked layout of `prepack_moe_weights` and fills it expert by expert
the first time an expert is routed to; later calls run the prepacked kernel path on it. The
result is the same bits as the prepacked and the unpacked paths: the bytes and decoder flags
come from the same packing code (csrc/cpu/fused_experts_pack.h, `pack_experts_into`).

Design (docs/fused_experts.md, "The pack cache"):
- Key: (quant, id() of w13, w2, w13_scale, w2_scale). An entry holds weak references to
  those tensors and their state when it was made: data_ptr (storage and offset), shape,
  `_version` (bumped by every in-place op on the tensor or a view of it: copy_, set_,
  resize_, ...) and the storage's byte size. A call whose tensors' state differs (an
  in-place reload, a `.set_()` swap, a resized storage) gets a fresh entry: never a stale
  pack. Weights are checked contiguous before (check_fused_experts), so shape fixes the
  strides; the dtype is fixed by quant.
- Lazy, per expert: an entry allocates the full prepacked buffers once (torch.empty: the
  pages of never-routed experts are never touched, so never resident, except up to 2 MiB on
  each side of a packed expert: its bytes are advised as huge pages before they are written,
  docs/fused_experts.md, "Weight layout") and a flag byte per
  expert. Each call hands topk_ids and the flags to one C++ op (`moelab::pack_moe_experts`)
  that scans the ids (T*K int32 reads, no host copy, no sort), packs the routed experts not
  yet packed, then sets their flags. A decode step touching 8 of 128 experts packs 8.
- Thread safety: one lock per entry around that op, so an expert is packed once and a flag
  is seen set only after both of its matrices are written; the kernel then runs outside the
  lock (other threads only ever write other experts' bytes). A weight change makes a new
  entry instead of rewriting buffers another thread may be reading.
- Memory: at most one entry per live weight set, each the size of the quantized weights
  (plus scales and one flag byte per 64 columns); an entry is freed when any of its tensors
  is (a weakref callback drops the buffers at once). On top, a byte cap over all entries,
  least recently used evicted first: MOELAB_PACK_CACHE_BYTES (bytes; K/M/G/T suffixes) or
  `set_max_bytes`, default half the machine's physical memory (DEFAULT_MAX_BYTES_FRACTION):
  the cache can at most double the resident expert weights, and whoever holds more expert
  weights than a quarter of the memory is told (in the docs) to prepack at load time and drop
  the standard copies instead. An entry is charged its full size even while partly filled.
  A weight set larger than the cap is not cached (the call takes the unpacked path).
- Opt-out: MOELAB_PACK_CACHE=0 (read on every call) or `set_enabled(False)`: every call
  repacks its routed tiles in scratch, as before. `prepack_moe_weights` stays for packing
  at load time. Not cached either: CUDA tensors (the cache is CPU-only), calls being traced
  by torch.compile, and inference-mode tensors (they have no version counter, so an
  in-place update could not be seen).
- Not seen: a write that bypasses the version counter (`w.data.copy_(...)`: `.data` is a
  new tensor with its own counter; numpy views; another tensor made on the same storage with
  `set_`). Call `clear()` after such a reload.
"""
from __future__ import annotations

import os
import threading
import weakref
from collections import OrderedDict
from typing import Optional

import torch

__all__ = ["set_enabled", "enabled", "set_max_bytes", "max_bytes", "clear", "stats", "DEFAULT_MAX_BYTES_FRACTION"]

DEFAULT_MAX_BYTES_FRACTION = 0.5   # of physical memory; see the module docstring
_ENV_ENABLE = "MOELAB_PACK_CACHE"
_ENV_BYTES = "MOELAB_PACK_CACHE_BYTES"

_lock = threading.Lock()               # guards _entries, _stats, _max_bytes_set
_entries: "OrderedDict[tuple, _Entry]" = OrderedDict()   # LRU order: least recent first
_enabled: Optional[bool] = None        # None: follow the environment variable
_max_bytes_set: Optional[int] = None   # None: environment variable, else the default
_stats = {"calls": 0, "reused": 0, "experts_packed": 0, "entries_made": 0, "evicted": 0, "freed": 0,
          "uncached": 0}
# The C++ op; a module attribute so that tests can wrap it (a slow pack, a counter).
_pack_op = None


def _phys_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 << 30


def _parse_bytes(text: str) -> int:
    t = text.strip().upper().rstrip("B")
    mult = 1
    if t and t[-1] in "KMGT":
        mult = 1 << (10 * ("KMGT".index(t[-1]) + 1))
        t = t[:-1]
    v = int(float(t) * mult)
    if v < 0:
        raise ValueError(text)
    return v


def set_enabled(on: Optional[bool]) -> None:
    """Turn the cache on or off for this process (None: follow MOELAB_PACK_CACHE again).
    Off: standard-layout calls repack their routed tiles on every call, as before."""
    global _enabled
    _enabled = None if on is None else bool(on)


def enabled() -> bool:
    if _enabled is not None:
        return _enabled
    return os.environ.get(_ENV_ENABLE, "1").strip().lower() not in ("0", "off", "false", "no")


def set_max_bytes(n: Optional[int]) -> None:
    """Cap the bytes of all entries together (None: MOELAB_PACK_CACHE_BYTES, else the
    default, half the physical memory). Evicts least-recently-used entries at once."""
    global _max_bytes_set
    with _lock:
        _max_bytes_set = None if n is None else max(0, int(n))
        _evict_to(max_bytes(), 0)


def max_bytes() -> int:
    if _max_bytes_set is not None:
        return _max_bytes_set
    env = os.environ.get(_ENV_BYTES)
    if env:
        try:
            return _parse_bytes(env)
        except ValueError:
            pass
    return int(_phys_bytes() * DEFAULT_MAX_BYTES_FRACTION)


class _Entry:
    __slots__ = ("key", "refs", "state", "lock", "done", "bufs", "nbytes", "dead", "__weakref__")

    def __init__(self, key, tensors, state, bufs, done):
        self.key, self.state, self.bufs, self.done = key, state, bufs, done
        self.lock = threading.Lock()
        self.nbytes = sum(t.numel() * t.element_size() for t in (*bufs, done) if t is not None)
        self.dead = False
        me = weakref.ref(self)
        # The callback holds the entry weakly: the entry never keeps a weight (or itself) alive.
        self.refs = tuple(None if t is None else weakref.ref(t, lambda _r, me=me: _on_free(me)) for t in tensors)

    def release(self):
        """Drop the packed buffers (a call already running holds its own references)."""
        self.dead = True
        self.bufs = None
        self.done = None
        self.nbytes = 0

    def packed(self) -> int:
        return 0 if self.done is None else int(self.done.sum())


def _on_free(me) -> None:
    """A weight of the entry was freed: free its buffers now. Runs inside the garbage
    collector or a refcount drop, possibly on a thread holding _lock, so it takes no lock:
    it only marks the entry dead; the next cache operation drops the empty shell."""
    e = me()
    if e is not None and not e.dead:
        e.release()
        _stats["freed"] += 1


def _state(t):
    if t is None:
        return None
    return (t.data_ptr(), tuple(t.shape), t._version, t.untyped_storage().nbytes())


def _purge() -> None:
    for k in [k for k, e in _entries.items() if e.dead]:
        _entries.pop(k, None)


def _total() -> int:
    return sum(e.nbytes for e in list(_entries.values()))


def _evict_to(cap: int, incoming: int) -> None:
    _purge()
    while _entries and _total() + incoming > cap:
        _, e = _entries.popitem(last=False)
        e.release()
        _stats["evicted"] += 1


def _layout(w13, w2, w13_scale, w2_scale, quant) -> list:
    """[(shape, dtype) or None] of p13, q13, f13, p2, q2, f2: prepack_moe_weights' buffers
    (the op called on meta tensors runs its fake kernel: nothing allocated)."""
    out = []
    for w, s in ((w13, w13_scale), (w2, w2_scale)):
        p, q, f = torch.ops.moelab.prepack_moe_weight(w.to("meta"), None if s is None else s.to("meta"), quant)
        out += [(p.shape, p.dtype), None if quant == "bf16" else (q.shape, q.dtype), (f.shape, f.dtype)]
    return out


def _alloc(layout):
    return tuple(None if lt is None else torch.empty(lt[0], dtype=lt[1]) for lt in layout)


def _layout_bytes(layout, E: int) -> int:
    return E + sum(lt[0].numel() * lt[1].itemsize for lt in layout if lt is not None)


def _why_not(w13, tensors) -> Optional[str]:
    """Why a call cannot use the cache, or None."""
    if not enabled():
        return "cache off (MOELAB_PACK_CACHE=0 or pack_cache.set_enabled(False))"
    if w13.device.type != "cpu":
        return "not a CPU tensor"
    if torch.compiler.is_compiling():
        return "traced by torch.compile"
    for t in tensors:
        if t is not None and t.is_inference():
            return "inference-mode tensor (no version counter to see an in-place update)"
    return None


def _lookup(w13, w2, w13_scale, w2_scale, quant, create: bool):
    """(entry or None, reason). create=False never allocates or evicts (for explain)."""
    tensors = (w13, w2, w13_scale, w2_scale)
    why = _why_not(w13, tensors)
    if why:
        return None, why
    state = tuple(_state(t) for t in tensors)
    key = (quant,) + tuple(id(t) for t in tensors)
    with _lock:
        e = _entries.get(key)
        if e is not None and not e.dead and e.state == state and \
                all((r is None and t is None) or (r is not None and r() is t) for r, t in zip(e.refs, tensors)):
            _entries.move_to_end(key)
            return e, "hit"
        stale = e is not None and not e.dead
        if not create:
            return None, ("weights changed since packed (a new entry)" if stale else "new entry")
        bufs = _alloc(_layout(w13, w2, w13_scale, w2_scale, quant))
        done = torch.zeros(w13.shape[0], dtype=torch.uint8)
        ne = _Entry(key, tensors, state, bufs, done)
        cap = max_bytes()
        if e is not None:
            _entries.pop(key, None)
            e.release()
        if ne.nbytes > cap:
            ne.release()
            return None, f"weight set of {ne.nbytes} bytes exceeds the cap of {cap} bytes"
        _evict_to(cap, ne.nbytes)
        _entries[key] = ne
        _stats["entries_made"] += 1
        return ne, "new"


def packed_weights(w13, w2, w13_scale, w2_scale, quant, topk_ids):
    """For a standard-layout CPU call: (p13, p2, q13, q2, f13, f2) of the prepacked layout with
    every expert topk_ids routes to packed, or None (take the unpacked path). Arguments are
    already validated (check_fused_experts)."""
    e, _ = _lookup(w13, w2, w13_scale, w2_scale, quant, create=True)
    if e is None:
        with _lock:
            _stats["calls"] += 1
            _stats["uncached"] += 1
        return None
    global _pack_op
    if _pack_op is None:
        _pack_op = torch.ops.moelab.pack_moe_experts
    with e.lock:
        bufs, done = e.bufs, e.done
        if bufs is None:   # evicted or freed between the lookup and here: this call goes unpacked
            return None
        p13, q13, f13, p2, q2, f2 = bufs
        n = int(_pack_op(topk_ids, done, w13, w13_scale, w2, w2_scale, quant, p13, q13, f13, p2, q2, f2))
    with _lock:
        _stats["calls"] += 1
        _stats["reused" if n == 0 else "experts_packed"] += 1 if n == 0 else n
    return p13, p2, q13, q2, f13, f2


def explain(w13, w2, w13_scale, w2_scale, quant, topk_ids) -> tuple[str, int]:
    """What a fused_experts call with these standard-layout weights would do about packing:
    (a sentence, experts it would pack; -1 for the unpacked path). Allocates and packs nothing."""
    e, why = _lookup(w13, w2, w13_scale, w2_scale, quant, create=False)
    ids = topk_ids.reshape(-1)
    routed = torch.unique(ids[ids >= 0]).to(torch.int64) if ids.numel() else ids.new_zeros(0, dtype=torch.int64)
    if e is None:
        if why in ("new entry", "weights changed since packed (a new entry)"):
            if _layout_bytes(_layout(w13, w2, w13_scale, w2_scale, quant), w13.shape[0]) > max_bytes():
                return f"pack cache: unpacked path (weight set exceeds the cap of {max_bytes()} bytes)", -1
            return (f"pack cache: packs {routed.numel()} of {routed.numel()} routed experts "
                    f"({why}; {w13.shape[0]} experts in all)"), int(routed.numel())
        return f"pack cache: unpacked path, every routed tile repacked in scratch ({why})", -1
    done = e.done
    if done is None:
        return "pack cache: unpacked path (entry evicted)", -1
    todo = int((done[routed] == 0).sum()) if routed.numel() else 0
    if todo == 0:
        return (f"pack cache: reuses the packed copy (all {routed.numel()} routed experts packed; "
                f"{e.packed()} of {done.numel()} in the entry)"), 0
    return (f"pack cache: packs {todo} of {routed.numel()} routed experts, reuses {routed.numel() - todo} "
            f"({e.packed()} of {done.numel()} in the entry)"), todo


def clear() -> None:
    """Drop every entry (e.g. after a weight reload the version counter cannot see)."""
    with _lock:
        for e in _entries.values():
            e.release()
        _entries.clear()


def stats() -> dict:
    """Counters since start: calls (standard-layout CPU calls), reused (calls that packed
    nothing), experts_packed, entries_made, evicted (by the cap), freed (a weight died),
    uncached (calls on the unpacked path); now: entries, bytes (charged, all entries), cap."""
    with _lock:
        _purge()
        out = dict(_stats)
        out.update(entries=len(_entries), bytes=_total(), max_bytes=max_bytes())
        return out


def entries() -> list[dict]:
    """One dict per live entry, least recently used first: quant, E, experts packed, bytes."""
    with _lock:
        _purge()
        return [{"quant": k[0], "E": e.done.numel(), "packed": e.packed(), "bytes": e.nbytes}
                for k, e in _entries.items() if not e.dead]
