"""Numba kernels of the `numba` backend (spec §2-§5, §7), float64 throughout.

Kernel order: RoPE -> cell statistics -> FS-L candidate pools (per block, per kv head) -> cell
scores and top-K (FS / FS-L) -> windowed RoPE attention -> NoPE readout over selected cells ->
token counter. The host functions in `backend.py` lay the arrays out and call these.

Parallel loops run over flattened (batch, head, query block) tasks; query blocks are visited in
a zig-zag order (0, nb-1, 1, nb-2, ...) so that FS, whose cost grows with the block index, is
balanced between threads. Small O(T D) passes (RoPE, cell statistics, pools) stay serial: a
parallel launch costs more than they do on a busy machine. Memory is O(T * D) plus
O(window + K * cell + P + W) scratch per task: no T x T array anywhere. Each query's softmax is
exact (max, exp, sum) over its own window, held in that scratch.

Speed notes (2 cores, AVX2 code from LLVM):
- the local branch takes queries by tiles of 4 sharing the keys of their windows, and computes
  2 keys x 4 queries (logits) and 2 dims x 4 queries (output) per pass, so 8 accumulators share 6
  loads; these kernels use fast-math reassociation (sums in a different order than the oracle's
  BLAS calls, ~1e-16 relative);
- `math.exp` is a scalar libm call here (no SVML), so softmax weights use `_exp_nonpositive`, a
  branch-free exp that LLVM vectorises (<= 2 ulp, tested against libm);
- loops index slices from 0: numba then knows the index is >= 0 and emits no wraparound branch,
  which would otherwise stop vectorisation.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

__all__ = [
    "cell_stats_kernel",
    "fsl_pool_kernel",
    "local_kernel",
    "readout_kernel",
    "rope_kernel",
    "select_kernel",
    "tokens_read_kernel",
]


@njit(cache=True, inline="always")
def _zigzag(jj, nb):
    """Permutation of block indices 0..nb-1: 0, nb-1, 1, nb-2, ... (balances growing costs)."""
    if jj % 2 == 0:
        return jj // 2
    return nb - 1 - jj // 2


@njit(cache=True)
def rope_kernel(x, cos, sin, per_head):
    """Half-split RoPE: x [B, T, H, D], cos / sin [T, D/2] -> [B, T, H, D], or [B, H, T, D] when
    per_head (each head's rows contiguous). Same operations as the oracle (no fused multiply-add)."""
    B, T, H, D = x.shape
    half = D // 2
    out = np.empty((B, H, T, D)) if per_head else np.empty((B, T, H, D))
    for task in range(B * T):  # serial: memory-bound, cheaper than a parallel launch
        b = task // T
        t = task % T
        for h in range(H):
            row = out[b, h, t] if per_head else out[b, t, h]
            for m in range(half):
                x1 = x[b, t, h, m]
                x2 = x[b, t, h, half + m]
                row[m] = x1 * cos[t, m] - x2 * sin[t, m]
                row[half + m] = x2 * cos[t, m] + x1 * sin[t, m]
    return out


@njit(cache=True)
def cell_stats_kernel(k, cell):
    """k [B, T, Hkv, D] -> kbar [B, Hkv, C, D] (mean key), a [B, Hkv, C] (max key norm); C = T // cell."""
    B, T, Hkv, D = k.shape
    C = T // cell
    kbar = np.zeros((B, Hkv, C, D))
    a = np.zeros((B, Hkv, C))
    for task in range(B * Hkv):  # serial: O(T D), and a parallel launch costs more under load
        b = task // Hkv
        g = task % Hkv
        for c in range(C):
            best = 0.0
            for t in range(c * cell, (c + 1) * cell):
                ss = 0.0
                for d in range(D):
                    x = k[b, t, g, d]
                    kbar[b, g, c, d] += x
                    ss += x * x
                norm = math.sqrt(ss)
                if norm > best:  # noqa: PLR1730 (explicit compare: no NaN branch in the loop)
                    best = norm
            a[b, g, c] = best
            for d in range(D):
                kbar[b, g, c, d] /= cell
    return kbar, a


@njit(cache=True)
def fsl_pool_kernel(a, n_blocks, block, cell, pool, recent):
    """FS-L candidate sets of every query block, per kv head (streaming form of spec §5).

    a [B, Hkv, C] -> cand [B, Hkv, n_blocks, pool + recent] int64 (-1 padded), ncand [B, Hkv, n_blocks].
    cand[..., j, :ncand] = the kept pool (sorted by (a_c, c) descending) then the recent cells.
    At each block boundary the cells leaving the recent window compete with the pool on (a_c, c);
    the losers are dropped for ever (equal to the parallel top-P of the older cells: lemma L3).
    """
    B, Hkv, _ = a.shape
    M = pool + recent
    cand = np.full((B, Hkv, n_blocks, M), -1, dtype=np.int64)
    ncand = np.zeros((B, Hkv, n_blocks), dtype=np.int64)
    for task in range(B * Hkv):  # serial: O(C (P + W)) in all
        b = task // Hkv
        g = task % Hkv
        pool_a = np.empty(pool)  # kept pool, sorted by (a, c) descending
        pool_c = np.empty(pool, dtype=np.int64)
        size = 0
        prev_first_recent = 0
        for j in range(n_blocks):
            n_avail = j * block // cell
            first_recent = max(0, n_avail - recent)
            for c in range(prev_first_recent, first_recent):  # cells leaving the recent window
                x = a[b, g, c]
                if size < pool:
                    pos = size
                    size += 1
                elif x > pool_a[size - 1] or (x == pool_a[size - 1] and c > pool_c[size - 1]):
                    pos = size - 1  # evict the smallest
                else:
                    continue
                while pos > 0 and (x > pool_a[pos - 1] or (x == pool_a[pos - 1] and c > pool_c[pos - 1])):
                    pool_a[pos] = pool_a[pos - 1]
                    pool_c[pos] = pool_c[pos - 1]
                    pos -= 1
                pool_a[pos] = x
                pool_c[pos] = c
            prev_first_recent = first_recent
            m = 0
            for n in range(size):
                cand[b, g, j, m] = pool_c[n]
                m += 1
            for c in range(first_recent, n_avail):
                cand[b, g, j, m] = c
                m += 1
            ncand[b, g, j] = m
    return cand, ncand


@njit(cache=True, parallel=True)
def select_kernel(q, kbar, a, cand, ncand, use_pool, sigma, lam, block, cell, top_k):
    """Cell scores (spec §4) and top-K (spec §7) for FS (use_pool=False) or FS-L (use_pool=True).

    q [B, T, Hq, D]; kbar [B, Hkv, C, D]; a [B, Hkv, C]; cand / ncand from `fsl_pool_kernel`
    (ignored for FS); sigma, lam [Hq].
    Returns idx int64 [B, T, Hq, top_k] (descending score, ties larger c first, -1 padded) and
    scored int64 [B, T, Hq] (cells whose score was computed, the instrumented cost).
    """
    B, T, Hq, D = q.shape
    Hkv = kbar.shape[1]
    group = Hq // Hkv
    nb = (T + block - 1) // block
    scale = 1.0 / math.sqrt(D)
    idx = np.full((B, T, Hq, top_k), -1, dtype=np.int64)
    scored = np.zeros((B, T, Hq), dtype=np.int64)
    for task in prange(B * Hq * nb):
        j = _zigzag(task % nb, nb)
        bh = task // nb
        b = bh // Hq
        h = bh % Hq
        g = h // group
        n_avail = j * block // cell
        if use_pool:
            m = ncand[b, g, j]
        else:
            m = n_avail
        if m == 0:
            continue
        cells = np.empty(m, dtype=np.int64)
        for n in range(m):
            cells[n] = cand[b, g, j, n] if use_pool else n
        gathered = np.empty((D, m))  # candidate mean keys, transposed: [D, m]
        amax = np.empty(m)
        for n in range(m):
            c = cells[n]
            amax[n] = a[b, g, c]
            for d in range(D):
                gathered[d, n] = kbar[b, g, c, d]
        dots = np.empty(m)
        best_s = np.empty(top_k)
        best_c = np.empty(top_k, dtype=np.int64)
        sig = sigma[h]
        lm = lam[h]
        for i in range(j * block, min(T, (j + 1) * block)):
            for n in range(m):
                dots[n] = 0.0
            for d in range(D):
                qd = q[b, i, h, d]
                for n in range(m):
                    dots[n] += qd * gathered[d, n]
            cnt = 0
            for n in range(m):
                c = cells[n]
                arg = sig * (i - c * cell) / (2.0 * cell)
                prior = 1.0 if arg >= 6.0 else math.erf(arg)  # libm's erf(x >= 6) is exactly 1.0
                s = scale * dots[n] + lm * amax[n] * prior
                if cnt < top_k:
                    pos = cnt
                    cnt += 1
                elif s > best_s[cnt - 1] or (s == best_s[cnt - 1] and c > best_c[cnt - 1]):
                    pos = cnt - 1
                else:
                    continue
                while pos > 0 and (s > best_s[pos - 1] or (s == best_s[pos - 1] and c > best_c[pos - 1])):
                    best_s[pos] = best_s[pos - 1]
                    best_c[pos] = best_c[pos - 1]
                    pos -= 1
                best_s[pos] = s
                best_c[pos] = c
            for r in range(cnt):
                idx[b, i, h, r] = best_c[r]
            scored[b, i, h] = m
    return idx, scored


# ---- exp, vectorisable ----------------------------------------------------------------------
# math.exp is a scalar libm call (no SVML here); softmax weights use this branch-free version
# instead: Cody-Waite reduction x = k ln2 + r, |r| <= ln2/2, degree-13 Taylor polynomial
# (truncation < 3e-17 relative), 2^k built from its bits. Max relative error vs libm: ~2 ulp.
_LN2_HI = 6.93147180369123816490e-01  # ln 2, upper bits (k * _LN2_HI is exact for |k| < 2^20)
_LN2_LO = 1.90821492927058770002e-10
_INV_LN2 = 1.44269504088896338700e00
_EXP_FLOOR = -708.0  # exp(-708) ~ 3e-308 is still normal; smaller x give 0 (libm: < 3e-308; the sum is >= 1)


@njit(cache=True)
def _exp_nonpositive(x, lo, hi, bits):
    """x[lo:hi] <- exp(x[lo:hi]) for x <= 0 (values below -708 give 0); bits int64 scratch [>= hi]."""
    xs = x[lo:hi]  # slices: indices from 0 are provably >= 0, so no wraparound blocks vectorisation
    bs = bits[lo:hi]
    for t in range(hi - lo):
        raw = xs[t]
        y = max(raw, _EXP_FLOOR)
        kf = math.floor(y * _INV_LN2 + 0.5)
        r = (y - kf * _LN2_HI) - kf * _LN2_LO
        p = 1.0 / 6227020800.0
        p = p * r + 1.0 / 479001600.0
        p = p * r + 1.0 / 39916800.0
        p = p * r + 1.0 / 3628800.0
        p = p * r + 1.0 / 362880.0
        p = p * r + 1.0 / 40320.0
        p = p * r + 1.0 / 5040.0
        p = p * r + 1.0 / 720.0
        p = p * r + 1.0 / 120.0
        p = p * r + 1.0 / 24.0
        p = p * r + 1.0 / 6.0
        p = p * r + 0.5
        p = p * r + 1.0
        p = p * r + 1.0
        xs[t] = p if raw >= _EXP_FLOOR else 0.0  # below exp(-708): 0 (no subnormal weights)
        bs[t] = (np.int64(kf) + 1023) << 52  # the bits of 2^kf
    scale = bs.view(np.float64)
    for t in range(hi - lo):
        xs[t] *= scale[t]


@njit(cache=True, fastmath=True)  # inputs are finite: every fast-math assumption holds
def _softmax_row(row, lo, hi, n, sqrt_d, bits):
    """row[lo:hi] <- softmax(row[lo:hi] / sqrt_d); row[:lo] and row[hi:n] <- 0 (hi > lo)."""
    inv = 1.0 / sqrt_d
    seg = row[lo:hi]  # indices from 0: provably >= 0, no wraparound in the vectorised loops
    m = hi - lo
    # four running maxima: independent chains; `x if x > m else m` because numba's max() handles NaN
    # with a branch that stops vectorisation
    m0 = m1 = m2 = m3 = seg[0]
    t = 0
    while t + 4 <= m:
        a0, a1, a2, a3 = seg[t], seg[t + 1], seg[t + 2], seg[t + 3]
        m0 = a0 if a0 > m0 else m0  # noqa: FURB136
        m1 = a1 if a1 > m1 else m1  # noqa: FURB136
        m2 = a2 if a2 > m2 else m2  # noqa: FURB136
        m3 = a3 if a3 > m3 else m3  # noqa: FURB136
        t += 4
    while t < m:
        m0 = seg[t] if seg[t] > m0 else m0  # noqa: FURB136
        t += 1
    mx = max(max(m0, m1), max(m2, m3))
    for t in range(m):
        seg[t] = (seg[t] - mx) * inv  # <= 0
    _exp_nonpositive(seg, 0, m, bits)
    total = 0.0
    for t in range(m):
        total += seg[t]
    inv_total = 1.0 / total
    for t in range(m):
        seg[t] = seg[t] * inv_total
    head = row[:lo]
    for t in range(lo):
        head[t] = 0.0
    tail = row[hi:n]
    for t in range(n - hi):
        tail[t] = 0.0


_FAST = {"reassoc", "contract", "nsz", "arcp"}  # sums may be reordered (vectorised); no nnan/ninf assumptions
_QT = 4  # queries per tile of the local branch (share every key and value they load)


@njit(cache=True, parallel=True, fastmath=_FAST)
def local_kernel(q_rot, k_rot, vT, window, block):
    """Sliding-window softmax attention over keys i-window < t <= i (spec §2).

    q_rot [B, T, Hq, D] (RoPE applied), k_rot [B, Hkv, T, D] (RoPE applied, per head),
    vT [B, Hkv, D, T] -> out [B, T, Hq, D]. Queries go by tiles of 4 that share the keys of the
    union of their windows (<= window + 3, each row masked to its own window). Scratch per task:
    [4, window + 4] probabilities; no T x T array.
    """
    B, T, Hq, D = q_rot.shape
    Hkv = k_rot.shape[1]
    group = Hq // Hkv
    nb = (T + block - 1) // block
    sqrt_d = math.sqrt(D)
    out = np.zeros((B, T, Hq, D))
    for task in prange(B * Hq * nb):
        j = _zigzag(task % nb, nb)
        bh = task // nb
        b = bh // Hq
        h = bh % Hq
        g = h // group
        probs = np.zeros((_QT, window + _QT))  # rows: one query of the tile each
        bits = np.empty(window + _QT, dtype=np.int64)
        p0 = probs[0]
        p1 = probs[1]
        p2 = probs[2]
        p3 = probs[3]
        end = min(T, (j + 1) * block)
        for i0 in range(j * block, end, _QT):
            nq = min(_QT, end - i0)
            lo = max(0, i0 - window + 1)  # first key of the tile
            n = i0 + nq - lo  # keys of the tile: [lo, i0 + nq)
            q0 = q_rot[b, i0, h]
            q1 = q_rot[b, min(i0 + 1, end - 1), h]
            q2 = q_rot[b, min(i0 + 2, end - 1), h]
            q3 = q_rot[b, min(i0 + 3, end - 1), h]
            # logits: two keys x four queries per pass (8 accumulators share 6 loads)
            keys = k_rot[b, g, lo : lo + n]  # [n, D]
            for t in range(0, n, 2):
                ka = keys[t]
                kb = keys[min(t + 1, n - 1)]
                a0 = a1 = a2 = a3 = 0.0
                c0 = c1 = c2 = c3 = 0.0
                for d in range(D):
                    x = ka[d]
                    y = kb[d]
                    z0, z1, z2, z3 = q0[d], q1[d], q2[d], q3[d]
                    a0 += z0 * x
                    a1 += z1 * x
                    a2 += z2 * x
                    a3 += z3 * x
                    c0 += z0 * y
                    c1 += z1 * y
                    c2 += z2 * y
                    c3 += z3 * y
                p0[t], p1[t], p2[t], p3[t] = a0, a1, a2, a3
                p0[t + 1], p1[t + 1], p2[t + 1], p3[t + 1] = c0, c1, c2, c3  # t + 1 <= n < window + 4
            for r in range(_QT):
                i = min(i0 + r, i0 + nq - 1)
                _softmax_row(probs[r], max(0, i - window + 1) - lo, i - lo + 1, n, sqrt_d, bits)
            # output: two value dims x four queries per pass (D is even)
            for d in range(0, D, 2):
                va = vT[b, g, d, lo : lo + n]
                vb = vT[b, g, d + 1, lo : lo + n]
                a0 = a1 = a2 = a3 = 0.0
                c0 = c1 = c2 = c3 = 0.0
                for t in range(n):
                    x = va[t]
                    y = vb[t]
                    z0, z1, z2, z3 = p0[t], p1[t], p2[t], p3[t]
                    a0 += z0 * x
                    a1 += z1 * x
                    a2 += z2 * x
                    a3 += z3 * x
                    c0 += z0 * y
                    c1 += z1 * y
                    c2 += z2 * y
                    c3 += z3 * y
                out[b, i0, h, d] = a0
                out[b, i0, h, d + 1] = c0
                if nq > 1:
                    out[b, i0 + 1, h, d] = a1
                    out[b, i0 + 1, h, d + 1] = c1
                if nq > 2:
                    out[b, i0 + 2, h, d] = a2
                    out[b, i0 + 2, h, d + 1] = c2
                if nq > 3:
                    out[b, i0 + 3, h, d] = a3
                    out[b, i0 + 3, h, d + 1] = c3
    return out


@njit(cache=True, parallel=True, fastmath=_FAST)
def readout_kernel(q, k_h, vTc, idx, cell, block):
    """NoPE softmax attention over the tokens of the selected cells (spec §7).

    q [B, T, Hq, D], k_h [B, Hkv, T, D] (unrotated, per head), vTc [B, Hkv, C, D, cell] (values
    of each complete cell, transposed), idx int64 [B, T, Hq, K] (-1 = none) -> out [B, T, Hq, D];
    a query with no cell gets 0.
    """
    B, T, Hq, D = q.shape
    Hkv = k_h.shape[1]
    K = idx.shape[3]
    group = Hq // Hkv
    nb = (T + block - 1) // block
    sqrt_d = math.sqrt(D)
    out = np.zeros((B, T, Hq, D))
    for task in prange(B * Hq * nb):
        j = task % nb
        bh = task // nb
        b = bh // Hq
        h = bh % Hq
        g = h // group
        probs = np.empty(K * cell)
        bits = np.empty(K * cell, dtype=np.int64)
        cells = np.empty(K, dtype=np.int64)
        for i in range(j * block, min(T, (j + 1) * block)):
            m = 0
            for r in range(K):
                c = idx[b, i, h, r]
                if c >= 0:
                    cells[m] = c
                    m += 1
            if m == 0:
                continue
            qi = q[b, i, h]
            for r in range(m):
                first = cells[r] * cell
                keys = k_h[b, g, first : first + cell]  # [cell, D]
                pr = probs[r * cell : (r + 1) * cell]
                for t in range(0, cell, 2):  # two tokens per pass share the query loads
                    ka = keys[t]
                    kb = keys[min(t + 1, cell - 1)]
                    sa = 0.0
                    sb = 0.0
                    for d in range(D):
                        z = qi[d]
                        sa += z * ka[d]
                        sb += z * kb[d]
                    pr[t] = sa
                    if t + 1 < cell:
                        pr[t + 1] = sb
            _softmax_row(probs, 0, m * cell, m * cell, sqrt_d, bits)
            for d in range(0, D, 2):  # two value dims per pass share the probability loads (D even)
                acc_a = 0.0
                acc_b = 0.0
                for r in range(m):
                    va = vTc[b, g, cells[r], d]
                    vb = vTc[b, g, cells[r], d + 1]
                    pr = probs[r * cell : (r + 1) * cell]
                    for t in range(cell):
                        z = pr[t]
                        acc_a += z * va[t]
                        acc_b += z * vb[t]
                out[b, i, h, d] = acc_a
                out[b, i, h, d + 1] = acc_b
    return out


@njit(cache=True)
def tokens_read_kernel(idx, window, cell):
    """Tokens read per query: local window tokens + tokens of the selected cells.

    idx int64 [B, T, Hq, K] -> int64 [B, T, Hq] (the loops of `local_kernel` / `readout_kernel`, counted).
    """
    B, T, Hq, K = idx.shape
    out = np.zeros((B, T, Hq), dtype=np.int64)
    for b in range(B):
        for i in range(T):
            local = i - max(0, i - window + 1) + 1
            for h in range(Hq):
                n = local
                for r in range(K):
                    if idx[b, i, h, r] >= 0:
                        n += cell
                out[b, i, h] = n
    return out
