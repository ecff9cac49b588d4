"""Fused decode kernels (Triton) for the Llama-family forward pass on CUDA.

The eager decode step launched ~49 kernels per layer (unfused RMSNorm, rope,
index_put KV writes, an index_select copy of every request's K and V per
layer, masked softmax). These kernels cut a layer to 10 launches:

    add+RMSNorm | qkv GEMM | rope+qk-norm+KV write | paged attention | split merge
    | o GEMM | add+RMSNorm | gate_up GEMM | SiLU*mul | down GEMM

Attention reads K/V straight from the paged KV rows through the block table
(no gather copy), split over blocks of the context (flash-decoding) so a
batch of one still fills the GPU; a second small kernel merges the splits.
Every reduction runs in float32; roundings to the model dtype happen where
transformers' modeling code rounds (after the residual add, after the
normalisation, around rope's two products, after SiLU), so bf16 results
stay within bf16 rounding of the eager path and float32 results within
float32 rounding. Values of tokens past a request's length are never loaded
(a NaN left in an unused block tail cannot reach the output).

Runs only where Triton does: CUDA, or the CPU under TRITON_INTERPRET=1 (tests).
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl

    AVAILABLE = True
except Exception:  # pragma: no cover - no triton (CPU-only boxes): the plain torch decode runs
    AVAILABLE = False
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # its bf16 dot is wrong: float32 products there


def usable(device: torch.device) -> bool:
    """Whether the fused path runs on `device` (MODELPOOL_FUSED=0 switches it off, =1 forces it)."""
    flag = os.environ.get("MODELPOOL_FUSED", "")
    if not AVAILABLE or flag == "0":
        return False
    if device.type == "cuda":
        return True
    return flag == "1" and os.environ.get("TRITON_INTERPRET") == "1"


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


if AVAILABLE:

    @triton.jit(do_not_specialize=["n_cols"])
    def _add_rms_norm_kernel(x_ptr, add_ptr, w_ptr, res_ptr, out_ptr, n_cols, eps,
                             HAS_ADD: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
        if HAS_ADD:
            a = tl.load(add_ptr + row * n_cols + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + a.to(tl.float32)).to(x_ptr.dtype.element_ty)
            tl.store(res_ptr + row * n_cols + cols, x, mask=mask)
        xf = x.to(tl.float32)
        var = tl.sum(xf * xf, axis=0) / n_cols
        normed = (xf * tl.rsqrt(var + eps)).to(x_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * n_cols + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit(do_not_specialize=["inter"])
    def _silu_mul_kernel(x_ptr, out_ptr, inter, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        g = tl.load(x_ptr + row * 2 * inter + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + row * 2 * inter + inter + cols, mask=mask, other=0.0).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + row * inter + cols, (act * u).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit(do_not_specialize=["layer"])
    def _qkv_rope_write_kernel(qkv_ptr, cos_ptr, sin_ptr, norm_ptr, q_ptr, kv_ptr, write_row_ptr, write_off_ptr,
                               layer, eps,
                               H: tl.constexpr, KVH: tl.constexpr, HD: tl.constexpr, HALF: tl.constexpr,
                               BS: tl.constexpr, HAS_NORM: tl.constexpr, KEYS_OUT: tl.constexpr, QROW: tl.constexpr):
        """One (token, head) per program: q heads -> q buffer, k heads (normed, rotated) and v heads -> KV rows;
        with KEYS_OUT the k heads also go to the q buffer, after the q heads (prefill attends over them)."""
        b = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        dt = qkv_ptr.dtype.element_ty
        d = tl.arange(0, HALF)
        dm = d < HD // 2
        src = qkv_ptr + b * ((H + 2 * KVH) * HD) + head * HD
        x1 = tl.load(src + d, mask=dm, other=0.0)
        x2 = tl.load(src + HD // 2 + d, mask=dm, other=0.0)
        if head >= H + KVH:  # v: straight into its KV row
            kvh = head - H - KVH
            row = tl.load(write_row_ptr + b) + (2 * layer + 1) * KVH + kvh
            dst = kv_ptr + (row * BS + tl.load(write_off_ptr + b)) * HD
            tl.store(dst + d, x1, mask=dm)
            tl.store(dst + HD // 2 + d, x2, mask=dm)
        else:
            f1 = x1.to(tl.float32)
            f2 = x2.to(tl.float32)
            if HAS_NORM:  # Qwen3: RMSNorm per head, before rope
                var = (tl.sum(f1 * f1, axis=0) + tl.sum(f2 * f2, axis=0)) / HD
                r = tl.rsqrt(var + eps)
                w1 = tl.load(norm_ptr + head * HD + d, mask=dm, other=0.0).to(tl.float32)
                w2 = tl.load(norm_ptr + head * HD + HD // 2 + d, mask=dm, other=0.0).to(tl.float32)
                f1 = (w1 * (f1 * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
                f2 = (w2 * (f2 * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            c = tl.load(cos_ptr + b * HD + d, mask=dm, other=0.0).to(tl.float32)
            s = tl.load(sin_ptr + b * HD + d, mask=dm, other=0.0).to(tl.float32)
            o1 = ((f1 * c).to(dt).to(tl.float32) + (-f2 * s).to(dt).to(tl.float32)).to(dt)
            o2 = ((f2 * c).to(dt).to(tl.float32) + (f1 * s).to(dt).to(tl.float32)).to(dt)
            if head < H:
                dst = q_ptr + (b * QROW + head) * HD
            else:
                kvh = head - H
                row = tl.load(write_row_ptr + b) + (2 * layer) * KVH + kvh
                dst = kv_ptr + (row * BS + tl.load(write_off_ptr + b)) * HD
                if KEYS_OUT:
                    out = q_ptr + (b * QROW + head) * HD
                    tl.store(out + d, o1, mask=dm)
                    tl.store(out + HD // 2 + d, o2, mask=dm)
            tl.store(dst + d, o1, mask=dm)
            tl.store(dst + HD // 2 + d, o2, mask=dm)

    @triton.jit(do_not_specialize=["layer", "max_blocks", "num_splits"])
    def _paged_attention_kernel(q_ptr, kv_ptr, table_ptr, lengths_ptr, m_ptr, l_ptr, acc_ptr,
                                layer, max_blocks, num_splits, scale,
                                H: tl.constexpr, KVH: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                                HD: tl.constexpr, HDP: tl.constexpr, BS: tl.constexpr, TILE: tl.constexpr,
                                IEEE: tl.constexpr):
        """Program (request, kv head, split): the G query heads of one kv head over a run of TILE-token tiles.

        Each request's own tiles are shared evenly over the splits, so a short request beside a long one (whose
        length sets the table width, hence the number of splits) is spread over every split, not left whole to
        one program: the step's attention time follows the batch's total context, not its longest request.

        A tile's tokens are gathered through the block table (any block size); both products run on the
        matrix units (float32 inputs in full precision), query heads padded to GP >= 16 rows.
        """
        b = tl.program_id(0).to(tl.int64)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        g = tl.arange(0, GP)
        d = tl.arange(0, HDP)
        t = tl.arange(0, TILE)
        gm = g < G
        dm = d < HD
        heads = kvh * G + g
        q = tl.load(q_ptr + (b * H + heads[:, None]) * HD + d[None, :], mask=gm[:, None] & dm[None, :], other=0.0)
        length = tl.load(lengths_ptr + b).to(tl.int32)
        tiles = (length + TILE - 1) // TILE
        per = (tiles + num_splits - 1) // num_splits
        start = split * per
        end = tl.minimum(start + per, tiles)
        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, HDP], tl.float32)
        for i in range(start, end):
            tok = i * TILE + t
            valid = tok < length
            first = tl.load(table_ptr + b * max_blocks + tok // BS, mask=valid, other=0)
            k_row = first + (2 * layer) * KVH + kvh
            k_at = (k_row * BS + tok % BS) * HD
            v_at = k_at + KVH * BS * HD
            tmask = valid[:, None] & dm[None, :]
            k = tl.load(kv_ptr + k_at[:, None] + d[None, :], mask=tmask, other=0.0)
            v = tl.load(kv_ptr + v_at[:, None] + d[None, :], mask=tmask, other=0.0)
            if IEEE:
                s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(valid[None, :], s * scale, float("-inf"))  # [GP, TILE]
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if IEEE:
                pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        part = (b * H + heads) * num_splits + split
        tl.store(m_ptr + part, m_i, mask=gm)
        tl.store(l_ptr + part, l_i, mask=gm)
        tl.store(acc_ptr + part[:, None] * HD + d[None, :], acc, mask=gm[:, None] & dm[None, :])

    @triton.jit(do_not_specialize=["num_splits"])
    def _merge_splits_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, num_splits,
                             H: tl.constexpr, HD: tl.constexpr, HDP: tl.constexpr, SP: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        sp = tl.arange(0, SP)
        d = tl.arange(0, HDP)
        sm = sp < num_splits
        dm = d < HD
        base = (b * H + h) * num_splits
        m = tl.load(m_ptr + base + sp, mask=sm, other=float("-inf"))
        l = tl.load(l_ptr + base + sp, mask=sm, other=0.0)
        acc = tl.load(acc_ptr + (base + sp[:, None]) * HD + d[None, :], mask=sm[:, None] & dm[None, :], other=0.0)
        big = tl.max(m, axis=0)
        w = tl.where(m > float("-inf"), tl.exp(m - big), 0.0)
        out = tl.sum(w[:, None] * acc, axis=0) / tl.sum(w * l, axis=0)
        tl.store(out_ptr + (b * H + h) * HD + d, out.to(out_ptr.dtype.element_ty), mask=dm)


def add_rms_norm(x: torch.Tensor, add: torch.Tensor | None, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + add, rms_norm(x + add) * weight); without `add`, (x, rms_norm(x) * weight). Rows of `x` are tokens."""
    n, cols = x.shape
    out = torch.empty_like(x)
    res = torch.empty_like(x) if add is not None else x
    block = _pow2(cols)
    _add_rms_norm_kernel[(n,)](x, add if add is not None else x, weight, res, out, cols, eps,
                               HAS_ADD=add is not None, BLOCK=block, num_warps=8 if block >= 2048 else 4)
    return res, out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a `[N, 2 * inter]` tensor (gate first)."""
    n, two = gate_up.shape
    inter = two // 2
    out = torch.empty(n, inter, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(n, triton.cdiv(inter, block))](gate_up, out, inter, BLOCK=block, num_warps=4)
    return out


def qkv_rope_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, norm: torch.Tensor | None,
                   kv: torch.Tensor, write_row: torch.Tensor, write_offset: torch.Tensor, layer: int,
                   num_heads: int, num_kv_heads: int, head_dim: int, eps: float, keys_out: bool = False
                   ) -> torch.Tensor:
    """q `[N, heads, head_dim]` (normed, rotated); k (normed, rotated) and v written into the KV rows of `layer`.
    With `keys_out`, `[N, heads + kv_heads, head_dim]`: the rotated k heads follow the q heads."""
    batch = qkv.shape[0]
    rows = num_heads + (num_kv_heads if keys_out else 0)
    q = torch.empty(batch, rows, head_dim, dtype=qkv.dtype, device=qkv.device)
    _qkv_rope_write_kernel[(batch, num_heads + 2 * num_kv_heads)](
        qkv, cos, sin, norm if norm is not None else qkv, q, kv, write_row, write_offset, layer, eps,
        H=num_heads, KVH=num_kv_heads, HD=head_dim, HALF=_pow2(head_dim // 2), BS=kv.shape[1],
        HAS_NORM=norm is not None, KEYS_OUT=keys_out, QROW=rows, num_warps=1 if head_dim <= 128 else 2)
    return q


TILE = 64  # tokens per attention step


def split_plan(batch: int, num_kv_heads: int, max_blocks: int, block_size: int, device: torch.device) -> int:
    """Splits per (request, kv head): enough programs to cover the GPU about twice over, at most one per tile
    of the widest request the table holds (each request shares its own tiles over them)."""
    tiles = -(-max_blocks * block_size // TILE)
    want = max(1, -(-2 * _sm_count(device) // (batch * num_kv_heads)))
    return min(tiles, want)


def paged_attention(q: torch.Tensor, kv: torch.Tensor, table: torch.Tensor, lengths: torch.Tensor, layer: int,
                    num_kv_heads: int, scale: float, splits: int) -> torch.Tensor:
    """Decode attention of q `[B, heads, head_dim]` over each request's first `lengths` tokens: `[B, heads * hd]`."""
    batch, heads, hd = q.shape
    max_blocks = table.shape[1]
    group = heads // num_kv_heads
    m = torch.empty(batch, heads, splits, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty(batch, heads, splits, hd, dtype=torch.float32, device=q.device)
    hdp = max(16, _pow2(hd))
    _paged_attention_kernel[(batch, num_kv_heads, splits)](
        q, kv, table, lengths, m, l, acc, layer, max_blocks, splits, scale,
        H=heads, KVH=num_kv_heads, G=group, GP=max(16, _pow2(group)), HD=hd, HDP=hdp, BS=kv.shape[1], TILE=TILE,
        IEEE=q.dtype == torch.float32 or _INTERPRET, num_warps=4)
    out = torch.empty(batch, heads * hd, dtype=q.dtype, device=q.device)
    _merge_splits_kernel[(batch, heads)](m, l, acc, out, splits, H=heads, HD=hd, HDP=hdp, SP=_pow2(splits),
                                         num_warps=2)
    return out
