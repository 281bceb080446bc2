"""Numba kernels of the `numba` backend (spec §2-§5, §7), float64 throughout.

Kernel order: cell statistics -> FS-L candidate pools (per block, per kv head) -> cell scores and
top-K (FS / FS-L) -> windowed RoPE attention -> NoPE readout over selected cells. The host
functions in `numba_backend.py` allocate, rotate (RoPE in NumPy, same arithmetic as the oracle)
and call these.

Parallel loops run over flattened (batch, head, query block) tasks; query blocks are visited in
a zig-zag order (0, nb-1, 1, nb-2, ...) so that FS, whose cost grows with the block index, is
balanced between threads. Memory is O(T * D) plus O(window + P + W) scratch per task: no
T x T array anywhere.

Inner loops are laid out so that LLVM can vectorise them without reassociating sums: a dot product
of one query against many keys runs over a key-major transposed layout `kT [D, T]` with the
key index innermost (one independent accumulator per key).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

__all__ = [
    "cell_stats_kernel",
    "fsl_pool_kernel",
    "select_kernel",
    "local_kernel",
    "readout_kernel",
    "tokens_read_kernel",
]


@njit(cache=True, inline="always")
def _zigzag(jj, nb):
    """Permutation of block indices 0..nb-1: 0, nb-1, 1, nb-2, ... (balances growing costs)."""
    if jj % 2 == 0:
        return jj // 2
    return nb - 1 - jj // 2


@njit(cache=True, parallel=True)
def cell_stats_kernel(k, cell):
    """k [B, T, Hkv, D] -> kbar [B, Hkv, C, D] (mean key), a [B, Hkv, C] (max key norm); C = T // cell."""
    B, T, Hkv, D = k.shape
    C = T // cell
    kbar = np.zeros((B, Hkv, C, D))
    a = np.zeros((B, Hkv, C))
    for task in prange(B * Hkv):
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
                if norm > best:
                    best = norm
            a[b, g, c] = best
            for d in range(D):
                kbar[b, g, c, d] /= cell
    return kbar, a


@njit(cache=True, parallel=True)
def fsl_pool_kernel(a, n_blocks, block, cell, pool, recent):
    """FS-L candidate sets of every query block, per kv head (streaming form of spec §5).

    a [B, Hkv, C] -> cand [B, Hkv, n_blocks, pool + recent] int64 (-1 padded), ncand [B, Hkv, n_blocks].
    cand[..., j, :ncand] = the kept pool (sorted by (a_c, c) descending) then the recent cells.
    At each block boundary the cells leaving the recent window compete with the pool on (a_c, c);
    the losers are dropped for ever (equal to the parallel top-P of the older cells: lemma L3).
    """
    B, Hkv, C = a.shape
    M = pool + recent
    cand = np.full((B, Hkv, n_blocks, M), -1, dtype=np.int64)
    ncand = np.zeros((B, Hkv, n_blocks), dtype=np.int64)
    for task in prange(B * Hkv):
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
                s = scale * dots[n] + lm * amax[n] * math.erf(sig * (i - c * cell) / (2.0 * cell))
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


@njit(cache=True, parallel=True)
def local_kernel(q_rot, kT_rot, v, window, block):
    """Sliding-window softmax attention over keys i-window < t <= i (spec §2).

    q_rot [B, T, Hq, D] (RoPE applied), kT_rot [B, Hkv, D, T] (RoPE applied, transposed),
    v [B, T, Hkv, D] -> out [B, T, Hq, D]. Scratch per task: [window] logits, no T x T array.
    """
    B, T, Hq, D = q_rot.shape
    Hkv = kT_rot.shape[1]
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
        logits = np.empty(window)
        acc = np.empty(D)
        for i in range(j * block, min(T, (j + 1) * block)):
            lo = max(0, i - window + 1)
            n = i - lo + 1
            for t in range(n):
                logits[t] = 0.0
            for d in range(D):
                qd = q_rot[b, i, h, d]
                for t in range(n):
                    logits[t] += qd * kT_rot[b, g, d, lo + t]
            mx = -np.inf
            for t in range(n):
                logits[t] = logits[t] / sqrt_d
                if logits[t] > mx:
                    mx = logits[t]
            total = 0.0
            for t in range(n):
                logits[t] = math.exp(logits[t] - mx)
                total += logits[t]
            for d in range(D):
                acc[d] = 0.0
            for t in range(n):
                p = logits[t] / total
                for d in range(D):
                    acc[d] += p * v[b, lo + t, g, d]
            for d in range(D):
                out[b, i, h, d] = acc[d]
    return out


@njit(cache=True, parallel=True)
def readout_kernel(q, kT, v, idx, cell, block):
    """NoPE softmax attention over the tokens of the selected cells (spec §7).

    q [B, T, Hq, D], kT [B, Hkv, D, T] (unrotated, transposed), v [B, T, Hkv, D],
    idx int64 [B, T, Hq, K] (-1 = none) -> out [B, T, Hq, D]; a query with no cell gets 0.
    """
    B, T, Hq, D = q.shape
    Hkv = kT.shape[1]
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
        logits = np.empty(K * cell)
        acc = np.empty(D)
        for i in range(j * block, min(T, (j + 1) * block)):
            n = 0
            for r in range(K):
                c = idx[b, i, h, r]
                if c < 0:
                    continue
                for t in range(cell):
                    logits[n + t] = 0.0
                for d in range(D):
                    qd = q[b, i, h, d]
                    for t in range(cell):
                        logits[n + t] += qd * kT[b, g, d, c * cell + t]
                n += cell
            if n == 0:
                continue
            mx = -np.inf
            for t in range(n):
                logits[t] = logits[t] / sqrt_d
                if logits[t] > mx:
                    mx = logits[t]
            total = 0.0
            for t in range(n):
                logits[t] = math.exp(logits[t] - mx)
                total += logits[t]
            for d in range(D):
                acc[d] = 0.0
            n = 0
            for r in range(K):
                c = idx[b, i, h, r]
                if c < 0:
                    continue
                for t in range(cell):
                    p = logits[n + t] / total
                    for d in range(D):
                        acc[d] += p * v[b, c * cell + t, g, d]
                n += cell
            for d in range(D):
                out[b, i, h, d] = acc[d]
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
