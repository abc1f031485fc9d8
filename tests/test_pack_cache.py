"""The pack cache of fused_experts (optimized/pack_cache.py, docs/fused_experts.md "The pack cache").

Standard-layout CPU weights are packed once, lazily per routed expert, and reused while the
tensors live unchanged. What must hold: the bits of the prepacked and the unpacked paths
(every format x activation x several policies), a second call packs nothing, only routed
experts are packed, an in-place update / a storage swap / a resized storage repacks, a freed
weight frees its entry, the byte cap evicts and bounds the memory, concurrent first calls
pack each expert once and all get the right bits, and the opt-out restores the old path.
"""
from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
import torch

import optimized
from optimized import dispatch, pack_cache
from optimized.tune.calibrate import random_weights

QUANTS = ["bf16", "fp8_block", "mxfp4"]
ACTS = ["silu", "swiglu_oai"]
POLICIES = ["tiny", "blocked", "per_block", "auto"]


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.delenv("MOELAB_PACK_CACHE", raising=False)
    monkeypatch.delenv("MOELAB_PACK_CACHE_BYTES", raising=False)
    pack_cache.clear()
    pack_cache.set_enabled(None)
    pack_cache.set_max_bytes(None)
    yield
    pack_cache.clear()
    pack_cache.set_enabled(None)
    pack_cache.set_max_bytes(None)


def bits(t):
    return t.view(torch.int16)


def weights(quant, E=8, H=128, I=64, seed=0):
    return random_weights(quant, E, H, I, seed=seed)


def inputs(E, H, T, K, seed=1, act="silu", bias=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    tw = torch.rand(T, K, generator=g)
    kw = dict(activation=act)
    if bias:
        I = 64
        kw["w13_bias"] = torch.randn(E, 2 * I, generator=g) * 0.1
        kw["w2_bias"] = (torch.randn(E, H, generator=g) * 0.1).bfloat16()
    return x, tw, ids, kw


def call(x, w, tw, ids, quant, **kw):
    w13, w2, s13, s2 = w
    return optimized.fused_experts(x, w13, w2, tw, ids, quant=quant, w13_scale=s13, w2_scale=s2, **kw)


def uncached(x, w, tw, ids, quant, **kw):
    pack_cache.set_enabled(False)
    try:
        return call(x, w, tw, ids, quant, **kw)
    finally:
        pack_cache.set_enabled(None)


def explain(x, w, tw, ids, quant, **kw):
    w13, w2, s13, s2 = w
    return dispatch.explain("fused_experts", x, w13, w2, tw, ids, quant=quant, w13_scale=s13, w2_scale=s2, **kw)


# ------------------------------------------------------------------------- bit identity
@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("act", ACTS)
def test_cached_equals_prepacked_and_unpacked(quant, act):
    E, H = 8, 128
    w = weights(quant, E, H)
    pw = optimized.prepack_moe_weights(w[0], w[1], quant, w[2], w[3])
    x, tw, ids, kw = inputs(E, H, T=13, K=3, act=act, bias=True)
    ids[2, 1] = -1
    for p in POLICIES:
        pack_cache.clear()
        want = uncached(x, w, tw, ids, quant, dispatch=p, **kw)
        first = call(x, w, tw, ids, quant, dispatch=p, **kw)
        second = call(x, w, tw, ids, quant, dispatch=p, **kw)
        pre = optimized.fused_experts(x, pw, None, tw, ids, quant=quant, dispatch=p, **kw)
        for name, got in (("first", first), ("second", second), ("prepacked", pre)):
            assert torch.equal(bits(got), bits(want)), (quant, act, p, name)
    # batch invariance through the cache: each token alone gives its row of the batch
    batch = call(x, w, tw, ids, quant, **kw)
    for t in (0, 5, 12):
        alone = call(x[t:t + 1], w, tw[t:t + 1], ids[t:t + 1], quant, **kw)
        assert torch.equal(bits(alone[0]), bits(batch[t])), (quant, act, t)


# -------------------------------------------------------------------- reuse and laziness
@pytest.mark.parametrize("quant", QUANTS)
def test_second_call_packs_nothing(quant):
    E, H = 8, 128
    w = weights(quant, E, H)
    x, tw, ids, kw = inputs(E, H, T=4, K=2)
    routed = int(torch.unique(ids).numel())
    d0 = explain(x, w, tw, ids, quant)
    assert d0.packing == "cached" and d0.packs == routed, str(d0)
    s0 = pack_cache.stats()
    call(x, w, tw, ids, quant)
    s1 = pack_cache.stats()
    assert s1["experts_packed"] - s0["experts_packed"] == routed
    d1 = explain(x, w, tw, ids, quant)
    assert d1.packing == "cached" and d1.packs == 0 and "reuses" in str(d1), str(d1)
    call(x, w, tw, ids, quant)
    s2 = pack_cache.stats()
    assert s2["experts_packed"] == s1["experts_packed"] and s2["reused"] == s1["reused"] + 1
    assert s2["entries_made"] == s1["entries_made"] == s0["entries_made"] + 1


def test_lazy_packs_only_routed_experts():
    E, H = 32, 128
    w = weights("fp8_block", E, H)
    x = torch.randn(1, H).bfloat16()
    tw = torch.rand(1, 4)
    ids = torch.tensor([[3, 17, 30, -1]], dtype=torch.int32)
    call(x, w, tw, ids, "fp8_block")
    (entry,) = pack_cache.entries()
    assert entry["E"] == E and entry["packed"] == 3
    ids2 = torch.tensor([[3, 5, 17, 6]], dtype=torch.int32)
    d = explain(x, w, tw, ids2, "fp8_block")
    assert d.packs == 2 and "packs 2 of 4 routed experts, reuses 2" in str(d), str(d)
    got = call(x, w, tw, ids2, "fp8_block")
    assert pack_cache.entries()[0]["packed"] == 5
    assert torch.equal(bits(got), bits(uncached(x, w, tw, ids2, "fp8_block")))


def test_prepacked_and_unpacked_explained():
    E, H = 8, 128
    w = weights("mxfp4", E, H)
    pw = optimized.prepack_moe_weights(w[0], w[1], "mxfp4", w[2], w[3])
    x, tw, ids, _ = inputs(E, H, T=2, K=2)
    d = dispatch.explain("fused_experts", x, pw, None, tw, ids, quant="mxfp4")
    assert d.packing == "prepacked" and d.packs == 0
    pack_cache.set_enabled(False)
    d = explain(x, w, tw, ids, "mxfp4")
    assert d.packing == "unpacked" and d.packs == -1 and "cache off" in str(d)


# -------------------------------------------------------------------------- invalidation
@pytest.mark.parametrize("quant", QUANTS)
def test_in_place_update_repacks(quant):
    E, H = 8, 128
    w13, w2, s13, s2 = (t.clone() if t is not None else None for t in weights(quant, E, H, seed=0))
    new = weights(quant, E, H, seed=9)
    x, tw, ids, _ = inputs(E, H, T=5, K=2)
    old = call(x, (w13, w2, s13, s2), tw, ids, quant)
    assert explain(x, (w13, w2, s13, s2), tw, ids, quant).packs == 0
    with torch.no_grad():
        w13.copy_(new[0])           # a reload of w13 only: the version counter moves
    d = explain(x, (w13, w2, s13, s2), tw, ids, quant)
    assert d.packs > 0 and "changed" in str(d), str(d)
    got = call(x, (w13, w2, s13, s2), tw, ids, quant)
    want = uncached(x, (w13, w2, s13, s2), tw, ids, quant)
    assert torch.equal(bits(got), bits(want)) and not torch.equal(bits(got), bits(old))
    if s13 is not None:             # a scale alone changes: repacked too (the flags and fp8 copies)
        s13[..., :1].copy_(new[2][..., :1] if quant == "mxfp4" else s13[..., :1] * 4)
        got = call(x, (w13, w2, s13, s2), tw, ids, quant)
        assert torch.equal(bits(got), bits(uncached(x, (w13, w2, s13, s2), tw, ids, quant)))
    w2[ids[0, 0].item()].copy_(new[1][0])   # an update through a view bumps the shared counter
    got = call(x, (w13, w2, s13, s2), tw, ids, quant)
    assert torch.equal(bits(got), bits(uncached(x, (w13, w2, s13, s2), tw, ids, quant)))
    assert len(pack_cache.entries()) == 1   # the stale entries were replaced, not kept


def test_set_swap_and_resized_storage_are_not_served_stale():
    quant, E, H = "fp8_block", 8, 128
    w13, w2, s13, s2 = (t.clone() for t in weights(quant, E, H, seed=0))
    new = weights(quant, E, H, seed=4)
    x, tw, ids, _ = inputs(E, H, T=3, K=2)
    call(x, (w13, w2, s13, s2), tw, ids, quant)
    # .set_() onto another storage: same Python object, other bytes
    other = new[0].clone()
    w13.set_(other.untyped_storage(), other.storage_offset(), other.shape, other.stride())
    got = call(x, (w13, w2, s13, s2), tw, ids, quant)
    assert torch.equal(bits(got), bits(uncached(x, (w13, w2, s13, s2), tw, ids, quant)))
    # The storage resized under the tensor, then rewritten through another tensor on it
    # (that alias has its own version counter): the storage's size and address changed.
    call(x, (w13, w2, s13, s2), tw, ids, quant)
    st = w2.untyped_storage()
    st.resize_(st.nbytes() + 4096)
    alias = torch.empty(0, dtype=w2.dtype).set_(st, 0, w2.shape, w2.stride())
    alias.view(torch.uint8).copy_(new[1].view(torch.uint8))
    got = call(x, (w13, w2, s13, s2), tw, ids, quant)
    assert torch.equal(bits(got), bits(uncached(x, (w13, w2, s13, s2), tw, ids, quant)))


def test_views_of_one_buffer_and_bad_layouts():
    """Contiguous views at different offsets of one buffer are different weight sets; a
    non-contiguous or overlapping (expanded) weight is refused before the cache sees it."""
    quant, E, H = "bf16", 4, 128
    big13, big2, _, _ = weights(quant, 2 * E, H)
    x, tw, ids, _ = inputs(E, H, T=3, K=2)
    a = (big13[:E], big2[:E], None, None)
    b = (big13[E:], big2[E:], None, None)
    for w in (a, b, a, b):
        assert torch.equal(bits(call(x, w, tw, ids, quant)), bits(uncached(x, w, tw, ids, quant)))
    n = len(pack_cache.entries())
    bad13 = big13[:E].transpose(1, 2).contiguous().transpose(1, 2)    # right shape, wrong strides
    with pytest.raises(ValueError, match="w13"):
        call(x, (bad13, big2[:E], None, None), tw, ids, quant)
    over = big13[:1].expand(E, -1, -1)                                 # every expert the same memory
    with pytest.raises(ValueError, match="w13"):
        call(x, (over, big2[:E], None, None), tw, ids, quant)
    assert len(pack_cache.entries()) == n


def test_recycled_ids_and_addresses_get_their_own_pack():
    """Weights made and dropped in a loop (CPython reuses ids, the allocator addresses): every
    call still gets its own weights' result."""
    quant, E, H = "mxfp4", 4, 128
    x, tw, ids, _ = inputs(E, H, T=2, K=2)
    for seed in range(4):
        w = tuple(t.clone() for t in weights(quant, E, H, seed=seed))
        got = call(x, w, tw, ids, quant)
        assert torch.equal(bits(got), bits(uncached(x, w, tw, ids, quant))), seed
        del w, got
        gc.collect()


def test_inference_tensors_take_the_unpacked_path():
    quant, E, H = "bf16", 4, 128
    with torch.inference_mode():
        w = tuple(t.clone() if t is not None else None for t in weights(quant, E, H))
        x, tw, ids, _ = inputs(E, H, T=2, K=2)
        got = call(x, w, tw, ids, quant)
        d = explain(x, w, tw, ids, quant)
    assert d.packing == "unpacked" and "inference" in str(d)
    assert pack_cache.entries() == []
    assert torch.equal(bits(got), bits(uncached(x, w, tw, ids, quant)))


# ------------------------------------------------------------------------------- memory
def test_freed_weights_free_their_entry():
    quant, E, H = "fp8_block", 8, 128
    w = tuple(t.clone() for t in weights(quant, E, H))
    x, tw, ids, _ = inputs(E, H, T=2, K=2)
    call(x, w, tw, ids, quant)
    (entry,) = [e for e in pack_cache._entries.values() if not e.dead]
    buf = weakref.ref(entry.bufs[0])
    del entry
    assert buf() is not None
    freed = pack_cache.stats()["freed"]
    w13 = w[0]
    del w       # w2 and the scales die, w13 lives on: the entry can never be hit again
    gc.collect()
    assert buf() is None, "the packed buffer outlived its weights"
    s = pack_cache.stats()
    assert s["entries"] == 0 and s["bytes"] == 0 and s["freed"] == freed + 1


def test_byte_cap_evicts_lru_and_bounds_memory():
    quant, E, H = "bf16", 8, 128
    x, tw, ids, _ = inputs(E, H, T=2, K=2)
    sets = [tuple(t.clone() if t is not None else None for t in weights(quant, E, H, seed=s)) for s in range(5)]
    call(x, sets[0], tw, ids, quant)
    one = pack_cache.stats()["bytes"]
    assert one >= 2 * E * 3 * 128 * 64   # about the weights' size (bf16: 2 bytes x 3HI per expert)
    pack_cache.set_max_bytes(2 * one + one // 2)    # room for two entries
    for w in sets:
        got = call(x, w, tw, ids, quant)
        assert torch.equal(bits(got), bits(uncached(x, w, tw, ids, quant)))
        s = pack_cache.stats()
        assert s["bytes"] <= s["max_bytes"] and s["entries"] <= 2
        assert sum(e["bytes"] for e in pack_cache.entries()) == s["bytes"]
    assert pack_cache.stats()["evicted"] == 3
    # LRU: touching set 3 makes set 4 the one evicted next
    call(x, sets[3], tw, ids, quant)
    assert explain(x, sets[3], tw, ids, quant).packs == 0
    call(x, sets[0], tw, ids, quant)
    assert explain(x, sets[3], tw, ids, quant).packs == 0
    assert explain(x, sets[4], tw, ids, quant).packs > 0
    # a weight set over the cap is not cached: the unpacked path, same bits
    pack_cache.set_max_bytes(one // 2)
    assert pack_cache.stats()["entries"] == 0
    d = explain(x, sets[1], tw, ids, quant)
    assert d.packing == "unpacked" and "cap" in str(d), str(d)
    got = call(x, sets[1], tw, ids, quant)
    assert torch.equal(bits(got), bits(uncached(x, sets[1], tw, ids, quant)))
    assert pack_cache.stats()["entries"] == 0


def test_env_cap_and_default():
    import os
    assert pack_cache.max_bytes() == int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
                                         * pack_cache.DEFAULT_MAX_BYTES_FRACTION)
    os.environ["MOELAB_PACK_CACHE_BYTES"] = "3M"
    try:
        assert pack_cache.max_bytes() == 3 << 20
    finally:
        del os.environ["MOELAB_PACK_CACHE_BYTES"]


# -------------------------------------------------------------------------------- opt-out
def test_opt_out_by_environment_and_function(monkeypatch):
    quant, E, H = "mxfp4", 8, 128
    w = weights(quant, E, H)
    x, tw, ids, _ = inputs(E, H, T=3, K=2)
    want = call(x, w, tw, ids, quant)
    pack_cache.clear()
    monkeypatch.setenv("MOELAB_PACK_CACHE", "0")
    s0 = pack_cache.stats()
    got = call(x, w, tw, ids, quant)
    s1 = pack_cache.stats()
    assert s1["entries"] == 0 and s1["uncached"] == s0["uncached"] + 1 and s1["experts_packed"] == s0["experts_packed"]
    assert explain(x, w, tw, ids, quant).packing == "unpacked"
    assert torch.equal(bits(got), bits(want))
    monkeypatch.delenv("MOELAB_PACK_CACHE")
    pack_cache.set_enabled(False)
    call(x, w, tw, ids, quant)
    assert pack_cache.stats()["entries"] == 0
    pack_cache.set_enabled(None)
    call(x, w, tw, ids, quant)
    assert pack_cache.stats()["entries"] == 1


# ------------------------------------------------------------------------------- threads
@pytest.mark.parametrize("quant", ["fp8_block", "mxfp4"])
def test_concurrent_first_calls_pack_each_expert_once(quant, monkeypatch):
    """Many Python threads (the GIL is released inside the ops) make their first calls with
    the same weights at once, with a slow pack: every expert is packed by exactly one call,
    no call reads a pack before it is complete, and every thread gets its own right bits."""
    E, H, n = 16, 128, 8
    w = tuple(t.clone() for t in weights(quant, E, H))
    cases = []
    for k in range(n):
        x, tw, ids, _ = inputs(E, H, T=2, K=3, seed=100 + k)
        cases.append((x, tw, ids, uncached(x, w, tw, ids, quant)))
    real = torch.ops.moelab.pack_moe_experts
    packed_by = []

    def slow_pack(topk_ids, done, *args):
        before = done.clone()
        time.sleep(0.05)   # widen the window: another thread must wait, not pack or read
        r = real(topk_ids, done, *args)
        packed_by.append(torch.nonzero(done.bool() & ~before.bool()).flatten().tolist())
        assert r == len(packed_by[-1])
        return r

    monkeypatch.setattr(pack_cache, "_pack_op", slow_pack)
    barrier = threading.Barrier(n)
    results, errors = [None] * n, []

    def worker(k):
        try:
            x, tw, ids, _ = cases[k]
            barrier.wait()
            outs = [call(x, w, tw, ids, quant) for _ in range(3)]
            results[k] = outs
        except BaseException as e:   # report in the main thread
            errors.append(e)

    ths = [threading.Thread(target=worker, args=(k,)) for k in range(n)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    assert not errors, errors
    flat = [e for lst in packed_by for e in lst]
    routed = set(torch.cat([c[2].flatten() for c in cases]).tolist())
    assert sorted(flat) == sorted(routed), "an expert was packed twice or not at all"
    for k, outs in enumerate(results):
        for o in outs:
            assert torch.equal(bits(o), bits(cases[k][3])), k
    assert len(pack_cache.entries()) == 1


def test_direct_op_checks_ids_and_buffers():
    quant, E, H = "fp8_block", 4, 128
    w13, w2, s13, s2 = weights(quant, E, H)
    pw = optimized.prepack_moe_weights(w13, w2, quant, s13, s2)
    bufs = [torch.empty_like(t) for t in (pw.w13, pw.w13_scale, pw.w13_slow, pw.w2, pw.w2_scale, pw.w2_slow)]
    done = torch.zeros(E, dtype=torch.uint8)
    op = torch.ops.moelab.pack_moe_experts
    with pytest.raises(RuntimeError, match="topk_ids"):
        op(torch.tensor([[0, E]], dtype=torch.int32), done, w13, s13, w2, s2, quant, *bufs)
    assert int(done.sum()) == 0
    with pytest.raises(RuntimeError, match="p13"):
        op(torch.tensor([[0]], dtype=torch.int32), done, w13, s13, w2, s2, quant, bufs[0][:1], *bufs[1:])
    ids = torch.tensor([[2, -1, 0], [2, 0, 3]], dtype=torch.int32)
    assert op(ids, done, w13, s13, w2, s2, quant, *bufs) == 3
    assert done.tolist() == [1, 0, 1, 1]
    for e in (0, 2, 3):   # the packed experts hold prepack_moe_weights' bytes
        for got, want in zip(bufs, (pw.w13, pw.w13_scale, pw.w13_slow, pw.w2, pw.w2_scale, pw.w2_slow)):
            assert torch.equal(got[e].view(torch.uint8), want[e].view(torch.uint8)), e
    assert op(ids, done, w13, s13, w2, s2, quant, *bufs) == 0


def test_torch_compile_bypasses_the_cache():
    """Under torch.compile the cache is off (its weakrefs and locks are host-side state); the
    compiled call takes the unpacked path, fullgraph, with the same bits."""
    quant, E, H = "fp8_block", 4, 128
    w = weights(quant, E, H)
    x, tw, ids, _ = inputs(E, H, T=3, K=2)
    want = call(x, w, tw, ids, quant)
    calls = pack_cache.stats()["calls"]
    f = torch.compile(lambda a, b, c: call(a, w, b, c, quant), fullgraph=True)
    assert torch.equal(bits(f(x, tw, ids)), bits(want))
    assert pack_cache.stats()["calls"] == calls
