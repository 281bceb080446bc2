"""Fused Triton decode step (n = 1 new token per row) for FS-L and FS over `FreeSoloCache`'s
torch state (`freesolo.streaming.torch_state.TorchCacheState`, spec §9).

One decode step = one kernel (FS-L) or two kernels (FS), plus `pos += 1`:

- `_fs_score_kernel` (FS only), grid (B * Hkv, NCHUNK): the archive's cells in chunks of CHUNK;
  per query head the chunk's cell scores (§4, position prior included) and the chunk's top-K
  (score desc, then larger c), written as partial candidates [B, Hq, NCHUNK * K]. The top-K of
  the union of the chunks' top-K is the global top-K (a total order), so this is exact.
- `_decode_kernel`, grid (B * Hkv,): one program per (batch row, kv head), looping over its G
  query heads. It
  1. reads the token position `pos` from the device (no host sync), rotates the new key and the
     queries at `pos` (cos / sin of `pos * inv_freq` in float64, cast to float32, as the torch path),
     writes the new token into the ring (rotated) and into the block buffer (unrotated);
  2. local branch: online softmax over the ring slots holding positions pos-w+1 .. pos-1 (slot
     pos % w still holds token pos-w, outside the window: masked) plus the new token (registers);
  3. long branch: scores the candidates (FS-L: the <= P+W cells held in the store, which are
     exactly C_j; FS: the partial candidates of `_fs_score_kernel`), takes the top-K with K
     argmax passes (ties: larger c), reads the selected cells' raw tokens (NoPE) as one tile with a
     softmax, RMSNorm, beta, and writes o = o_loc + beta * rmsnorm(o_long).
  Rounding points follow the torch path: rotated q / k and the two branch outputs are rounded to
  the storage dtype (the torch path runs SDPA in the storage dtype), everything else is float32.

The block-boundary state update (cells becoming available, FS-L pool) stays the torch state's
`_advance` (torch ops, no host sync for FS-L, captured in `DecodeGraph`'s boundary graph).
No `.item()`, no host branch on tensor values: the launch depends only on host-known sizes
(FS: the archive's capacity, which changes only when the store grows at a block boundary).

Use: `FreeSoloCache(cfg, B, Hq, Hkv, D, backend="torch", decode_kernel="triton")` (or "auto":
triton on CUDA); every `extend` of one token then runs this step, and `cache.decode_graph()`
captures it in a CUDA graph. Each program touches only its own batch row (row independence,
L12). Not supported: rows at different positions (the torch state holds one `pos` for all rows).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

__all__ = ["decode_step", "decode_supported_reasons"]


# ---- kernels --------------------------------------------------------------------------------
# Reductions call `tl.reduce` with triton's own combine functions: the same code as tl.sum /
# tl.max when compiled, and the interpreter's numpy fast path (tl.sum / tl.max are jit functions
# whose every call costs the interpreter ~10 ms of patching).
_ADD = tl.standard._sum_combine
_MAX = tl.standard._elementwise_max


@triton.jit
def _fs_score_kernel(
    q_ptr,
    pos_ptr,
    kbar_ptr,
    a_ptr,
    sigma_ptr,
    lam_ptr,
    part_score_ptr,
    part_id_ptr,
    stride_qb,
    stride_qh,
    scale,
    CAP: tl.constexpr,
    HKV: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    CELL: tl.constexpr,
    QBLOCK: tl.constexpr,
    TOPK: tl.constexpr,
    NCHUNK: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """FS: per (b, kv head, chunk of CHUNK cells) and query head, the chunk's top-K candidates.

    q [B, 1, Hq, D] (strides stride_qb, stride_qh, 1); kbar [B, Hkv, CAP, D], a [B, Hkv, CAP]
    (float32); sigma, lam [Hq] float32. Writes part_score [B, Hq, NCHUNK*TOPK] float32 (-inf = none)
    and part_id [B, Hq, NCHUNK*TOPK] int64 (cell id, -1 = none). Available cells:
    c < n_avail = (pos // QBLOCK) * QBLOCK // CELL.
    """
    pid = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1).to(tl.int64)
    b = pid // HKV
    kvh = pid % HKV
    pos = tl.load(pos_ptr)
    n_avail = (pos // QBLOCK) * QBLOCK // CELL
    cells = chunk * CHUNK + tl.arange(0, CHUNK).to(tl.int64)  # [CHUNK]
    valid = (cells < n_avail) & (cells < CAP)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    row = pid * CAP + cells  # [CHUNK]
    kbar = tl.load(kbar_ptr + row[:, None] * D + d[None, :], mask=valid[:, None] & dmask[None, :], other=0.0)
    a = tl.load(a_ptr + row, mask=valid, other=0.0)
    dist = (pos - cells * CELL).to(tl.float32)  # i - p_c
    for g in tl.static_range(G):
        h = kvh * G + g
        q = tl.load(q_ptr + b * stride_qb + h * stride_qh + d, mask=dmask, other=0.0).to(tl.float32)
        sigma = tl.load(sigma_ptr + h)
        lam = tl.load(lam_ptr + h)
        dots = tl.reduce(kbar * q[None, :], 1, _ADD)  # [CHUNK]
        prior = tl.math.erf(sigma * dist / (2.0 * CELL))
        sc = dots * scale + lam * a * prior
        sc = tl.where(valid, sc, float("-inf"))
        base = (b * (HKV * G) + h) * (NCHUNK * TOPK) + chunk * TOPK
        for kk in tl.static_range(TOPK):
            # argmax pass: best score, then the larger cell; then remove it
            best = tl.reduce(sc, 0, _MAX)
            best_id = tl.reduce(tl.where(sc == best, cells, -1), 0, _MAX)
            sc = tl.where(cells == best_id, float("-inf"), sc)
            ok = best > float("-inf")
            tl.store(part_score_ptr + base + kk, best)
            tl.store(part_id_ptr + base + kk, tl.where(ok, best_id, -1))


@triton.jit
def _decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    beta_ptr,
    out_ptr,
    pos_ptr,
    inv_freq_ptr,
    sigma_ptr,
    lam_ptr,
    ring_k_ptr,
    ring_v_ptr,
    block_k_ptr,
    block_v_ptr,
    ids_ptr,
    kbar_ptr,
    a_ptr,
    cell_k_ptr,
    cell_v_ptr,
    part_score_ptr,
    part_id_ptr,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_vb,
    stride_vh,
    stride_ob,
    stride_oh,
    scale,
    eps,
    HKV: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    WINDOW: tl.constexpr,
    QBLOCK: tl.constexpr,
    CELL: tl.constexpr,
    TOPK: tl.constexpr,
    TOPK_P2: tl.constexpr,
    SLOTS: tl.constexpr,
    FS: tl.constexpr,
    NPART: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_CELL: tl.constexpr,
):
    """One decode token for (b, kv head) = program 0 axis and its G query heads.

    q [B, 1, Hq, D], k / v [B, 1, Hkv, D] (storage dtype, last stride 1); beta [Hq]; out
    [B, 1, Hq, D]; pos [] int64; inv_freq [D/2] float64; sigma, lam [Hq] float32;
    ring_k / ring_v [B, Hkv, WINDOW, D]; block_k / block_v [B, Hkv, QBLOCK, D];
    ids [B, Hkv, SLOTS] int64; kbar [B, Hkv, SLOTS, D], a [B, Hkv, SLOTS] float32;
    cell_k / cell_v [B, Hkv, SLOTS, CELL, D].
    FS-L (FS=False): candidates = the SLOTS held cells (id >= 0). FS (FS=True): candidates =
    part_score / part_id [B, Hq, NPART] from `_fs_score_kernel`, slot = cell id.
    """
    pid = tl.program_id(0).to(tl.int64)
    b = pid // HKV
    kvh = pid % HKV
    dtype = ring_k_ptr.dtype.element_ty
    HALF: tl.constexpr = D // 2
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    pos = tl.load(pos_ptr)

    # RoPE at pos: element d pairs with d +- D/2 (rotate_half); angles in float64
    dh = tl.where(d < HALF, d, d - HALF)
    partner = tl.where(d < HALF, d + HALF, d - HALF)
    sign = tl.where(d < HALF, -1.0, 1.0)
    inv_freq = tl.load(inv_freq_ptr + dh, mask=dmask, other=0.0)
    angle = pos.to(tl.float64) * inv_freq
    cos = tl.cos(angle).to(tl.float32)
    sin = tl.sin(angle).to(tl.float32)

    # the new token: rotated key into the ring, raw key / value into the block buffer
    k_row = k_ptr + b * stride_kb + kvh * stride_kh
    k_new = tl.load(k_row + d, mask=dmask, other=0.0)
    k_par = tl.load(k_row + partner, mask=dmask, other=0.0).to(tl.float32)
    v_new = tl.load(v_ptr + b * stride_vb + kvh * stride_vh + d, mask=dmask, other=0.0)
    k_rot = (k_new.to(tl.float32) * cos + sign * k_par * sin).to(dtype)
    w_slot = pos % WINDOW
    b_slot = pos % QBLOCK
    tl.store(ring_k_ptr + (pid * WINDOW + w_slot) * D + d, k_rot, mask=dmask)
    tl.store(ring_v_ptr + (pid * WINDOW + w_slot) * D + d, v_new.to(dtype), mask=dmask)
    tl.store(block_k_ptr + (pid * QBLOCK + b_slot) * D + d, k_new.to(dtype), mask=dmask)
    tl.store(block_v_ptr + (pid * QBLOCK + b_slot) * D + d, v_new.to(dtype), mask=dmask)
    k_rot = k_rot.to(tl.float32)
    v_new = v_new.to(tl.float32)

    slots = tl.arange(0, BLOCK_S)
    rows = tl.arange(0, TOPK_P2 * BLOCK_CELL)
    row_cell = rows // BLOCK_CELL  # which chosen cell (0 .. TOPK-1; >= TOPK: padding)
    row_tok = rows % BLOCK_CELL  # token inside it

    for g in range(G):
        h = kvh * G + g
        q_row = q_ptr + b * stride_qb + h * stride_qh
        q_raw = tl.load(q_row + d, mask=dmask, other=0.0)
        q_par = tl.load(q_row + partner, mask=dmask, other=0.0).to(tl.float32)
        q_rot = (q_raw.to(tl.float32) * cos + sign * q_par * sin).to(dtype).to(tl.float32)
        q = q_raw.to(tl.float32)

        # ---- local branch: the new token, then the ring's other slots --------------------------
        m_i = tl.reduce(q_rot * k_rot, 0, _ADD) * scale
        l_i = tl.full([], 1.0, tl.float32)
        acc = v_new
        for w0 in range(0, WINDOW, BLOCK_W):
            u = w0 + tl.arange(0, BLOCK_W).to(tl.int64)
            held_pos = pos - ((pos - u) % WINDOW + WINDOW) % WINDOW  # position in slot u
            ok = (u < WINDOW) & (u != w_slot) & (held_pos >= 0)
            off = (pid * WINDOW + u)[:, None] * D + d[None, :]
            kt = tl.load(ring_k_ptr + off, mask=ok[:, None] & dmask[None, :], other=0.0).to(tl.float32)
            vt = tl.load(ring_v_ptr + off, mask=ok[:, None] & dmask[None, :], other=0.0).to(tl.float32)
            logit = tl.where(ok, tl.reduce(kt * q_rot[None, :], 1, _ADD) * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.reduce(logit, 0, _MAX))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(logit - m_new)
            l_i = l_i * alpha + tl.reduce(p, 0, _ADD)
            acc = acc * alpha + tl.reduce(p[:, None] * vt, 0, _ADD)
            m_i = m_new
        o_loc = (acc / l_i).to(dtype).to(tl.float32)

        # ---- long branch: candidates' scores, top-K, sparse NoPE readout -------------------------
        if FS:
            pbase = (b * (HKV * G) + h) * NPART
            sc = tl.load(part_score_ptr + pbase + slots, mask=slots < NPART, other=float("-inf"))
            cid = tl.load(part_id_ptr + pbase + slots, mask=slots < NPART, other=-1)
        else:  # FS-L: the held cells (loaded per head: fewer live registers in the window loop)
            ids = tl.load(ids_ptr + pid * SLOTS + slots, mask=slots < SLOTS, other=-1)
            held = ids >= 0
            kbar = tl.load(
                kbar_ptr + (pid * SLOTS + slots)[:, None] * D + d[None, :],
                mask=held[:, None] & dmask[None, :],
                other=0.0,
            )
            a = tl.load(a_ptr + pid * SLOTS + slots, mask=held, other=0.0)
            dist = (pos - ids * CELL).to(tl.float32)
            sigma = tl.load(sigma_ptr + h)
            lam = tl.load(lam_ptr + h)
            dots = tl.reduce(kbar * q[None, :], 1, _ADD)
            prior = tl.math.erf(sigma * dist / (2.0 * CELL))
            sc = tl.where(held, dots * scale + lam * a * prior, float("-inf"))
            cid = ids
        # selection: TOPK argmax passes; the chosen cells' slots go to the rows of one token tile
        # (row r = token r % BLOCK_CELL of the (r // BLOCK_CELL)-th chosen cell), read in one load
        row_slot = tl.zeros([TOPK_P2 * BLOCK_CELL], tl.int64)
        row_len = tl.zeros([TOPK_P2 * BLOCK_CELL], tl.int32)  # tokens of the row's cell: CELL, 0 = none
        for kk in tl.static_range(TOPK):
            best = tl.reduce(sc, 0, _MAX)  # best score, then the larger cell
            best_id = tl.reduce(tl.where(sc == best, cid, -1), 0, _MAX)
            sc = tl.where((cid == best_id) & (sc == best), float("-inf"), sc)
            ok = best > float("-inf")
            if FS:
                slot = best_id
            else:
                slot = tl.reduce(tl.where(cid == best_id, slots.to(tl.int64), -1), 0, _MAX)
            row_slot = tl.where(row_cell == kk, tl.where(ok, slot, 0), row_slot)
            row_len = tl.where(row_cell == kk, tl.where(ok, CELL, 0), row_len)
        # sparse NoPE readout of the chosen cells' raw tokens (query unrotated, storage dtype)
        live = row_tok < row_len
        off = ((pid * SLOTS + row_slot) * CELL + row_tok)[:, None] * D + d[None, :]
        lmask = live[:, None] & dmask[None, :]
        kt = tl.load(cell_k_ptr + off, mask=lmask, other=0.0).to(tl.float32)
        vt = tl.load(cell_v_ptr + off, mask=lmask, other=0.0).to(tl.float32)
        logit = tl.where(live, tl.reduce(kt * q[None, :], 1, _ADD) * scale, float("-inf"))
        m_l = tl.maximum(tl.reduce(logit, 0, _MAX), -1.0e30)  # finite when no cell is chosen
        p = tl.exp(logit - m_l)
        l_l = tl.reduce(p, 0, _ADD)
        acc_l = tl.reduce(p[:, None] * vt, 0, _ADD)
        o_long = tl.where(l_l > 0.0, acc_l / tl.maximum(l_l, 1e-30), 0.0).to(dtype).to(tl.float32)
        ms = tl.reduce(o_long * o_long, 0, _ADD) / D
        normed = o_long * (1.0 / tl.sqrt(ms + eps))
        beta = tl.load(beta_ptr + h).to(tl.float32)
        out = o_loc + beta * normed
        tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=dmask)


# ---- host launcher --------------------------------------------------------------------------
def _pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def decode_supported_reasons(state) -> list[str]:
    """Why the fused step cannot run this torch state ([] when it can)."""
    reasons = []
    if state.cfg.variant not in ("fs", "fsl"):
        reasons.append(f"variant={state.cfg.variant!r}: the fused decode implements 'fs' and 'fsl'")
    if state.allocated:
        if state.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            reasons.append(f"dtype={state.dtype}: the fused decode runs float32 / bfloat16 / float16")
        if state.device.type != "cuda" and not _interpreting():
            reasons.append(f"device={state.device}: Triton needs CUDA (or TRITON_INTERPRET=1 on CPU tensors)")
    return reasons


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _fs_chunk(cap: int) -> int:
    """Cells per program of `_fs_score_kernel`: 128, more when the archive would need > 2048 chunks."""
    return max(min(128, _pow2(cap)), _pow2(-(-cap // 2048)))


def _scratch(state, n_part: int):
    """FS partial candidates [B, Hq, n_part] (score float32, id int64), reused while the size holds."""
    cached = getattr(state, "_triton_fs_scratch", None)
    shape = (state.B, state.Hq, n_part)
    if cached is None or tuple(cached[0].shape) != shape or cached[0].device != state.device:
        score = torch.empty(state.B, state.Hq, n_part, dtype=torch.float32, device=state.device)
        ids = torch.empty(state.B, state.Hq, n_part, dtype=torch.int64, device=state.device)
        cached = (score, ids)
        state._triton_fs_scratch = cached
    return cached


def _float32_params(state):
    """sigma, lam [Hq] float32 (cached on the state: they never change)."""
    cached = getattr(state, "_triton_params", None)
    if cached is None or cached[0].device != state.device:  # (a re-allocated state may move)
        cached = tuple(x.reshape(-1).to(torch.float32).contiguous() for x in (state.sigma, state.lam))
        state._triton_params = cached
    return cached


def decode_step(state, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, out=None) -> torch.Tensor:
    """The fused one-token step of a `TorchCacheState` (FS-L or FS), without host sync.

    Args:
        state: an allocated `TorchCacheState` whose block boundary (if any) was applied already.
        q: [B, 1, Hq, D]; k, v: [B, 1, Hkv, D] (storage dtype, last dim contiguous).
        beta: [Hq] long-range mixing coefficient (any float dtype, same device).
        out: optional [B, 1, Hq, D] tensor of the storage dtype to write (default: a new one).
    Returns:
        o [B, 1, Hq, D] in the storage dtype. Writes the token into the ring and block buffers;
        does not advance `state.pos` (the caller does: `state.pos += 1`).
    """
    cfg, B, Hq, Hkv, G, D = state.cfg, state.B, state.Hq, state.Hkv, state.group, state.D
    reasons = decode_supported_reasons(state)
    if reasons:
        raise ValueError("fused Triton decode unavailable: " + "; ".join(reasons))
    if q.shape != (B, 1, Hq, D) or k.shape != (B, 1, Hkv, D) or v.shape != (B, 1, Hkv, D):
        raise ValueError(f"decode_step takes one token: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim (stride {x.stride(-1)})")
    if state.cell_kbar.dtype != torch.float32:
        raise ValueError(f"cell statistics dtype {state.cell_kbar.dtype}: the fused decode reads float32")
    beta = beta.contiguous()
    sigma, lam = _float32_params(state)
    scale = 1.0 / math.sqrt(D)  # rounded to float32 at the launch, as the torch path's python scalar
    if out is None:
        out = torch.empty(B, 1, Hq, D, dtype=state.dtype, device=state.device)
    elif out.shape != (B, 1, Hq, D) or out.dtype != state.dtype or out.stride(-1) != 1:
        raise ValueError(
            f"out {tuple(out.shape)} {out.dtype} must be ({B}, 1, {Hq}, {D}) {state.dtype}, last dim contiguous"
        )
    slots = state.cell_ids.shape[2]
    fs = cfg.variant == "fs"
    BLOCK_D = _pow2(D)
    if fs:
        chunk = _fs_chunk(slots)
        nchunk = -(-slots // chunk)
        n_part = nchunk * cfg.top_k
        part_score, part_id = _scratch(state, n_part)
        _fs_score_kernel[(B * Hkv, nchunk)](
            q,
            state.pos,
            state.cell_kbar,
            state.cell_a,
            sigma,
            lam,
            part_score,
            part_id,
            q.stride(0),
            q.stride(2),
            scale,
            CAP=slots,
            HKV=Hkv,
            G=G,
            D=D,
            CELL=cfg.cell,
            QBLOCK=cfg.block,
            TOPK=cfg.top_k,
            NCHUNK=nchunk,
            CHUNK=chunk,
            BLOCK_D=BLOCK_D,
            num_warps=4,
        )
        block_s = _pow2(n_part)
    else:
        n_part = 1
        part_score, part_id = sigma, state.cell_ids  # unused placeholders
        block_s = _pow2(slots)
    _decode_kernel[(B * Hkv,)](
        q,
        k,
        v,
        beta,
        out,
        state.pos,
        state.inv_freq,
        sigma,
        lam,
        state.ring_k,
        state.ring_v,
        state.block_k,
        state.block_v,
        state.cell_ids,
        state.cell_kbar,
        state.cell_a,
        state.cell_k,
        state.cell_v,
        part_score,
        part_id,
        q.stride(0),
        q.stride(2),
        k.stride(0),
        k.stride(2),
        v.stride(0),
        v.stride(2),
        out.stride(0),
        out.stride(2),
        scale,
        float(cfg.eps),
        HKV=Hkv,
        G=G,
        D=D,
        WINDOW=cfg.window,
        QBLOCK=cfg.block,
        CELL=cfg.cell,
        TOPK=cfg.top_k,
        TOPK_P2=_pow2(cfg.top_k),
        SLOTS=slots,
        FS=fs,
        NPART=n_part,
        BLOCK_D=BLOCK_D,
        BLOCK_W=min(_pow2(cfg.window), max(16, 8192 // BLOCK_D)),
        BLOCK_S=block_s,
        BLOCK_CELL=_pow2(cfg.cell),
        num_warps=8,
    )
    return out

