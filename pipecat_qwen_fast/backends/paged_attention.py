"""Decode attention over paged K/V: one new query position per row, its keys in the row's pages.

The batched frame's compiled step wrote the attention as products and sums for the compiler to
fuse (graph.py, `decode_layer`). Over pages that became the round's largest cost: 64 of 80 ms for
512 rows at position ~150 on the H200 (bench/results/2026-11-26-h200-wave3/, the first profile), ~20x
what reading the rows' K/V costs. `paged_attention_triton` is the kernel for it: one program per
(row, kv head) walks the row's pages in order with an online softmax, reading each K/V position
once for the `rep` query heads that share it (GQA) and only the pages up to the row's position.

`paged_attention_reference` is the same math in plain torch (gather the pages, mask, softmax): the
CPU path and what the GPU test compares the kernel with (tests/test_graph_backend.py).

The kernel puts both products on the tensor cores (`tl.dot`), the rep query heads padded to the 16
rows a product needs. The scores' products are exact (bf16 x bf16 into fp32); the probabilities go
in as two bf16 terms (high and low) so the weighted sum keeps ~16 bits of each; fp32 pools use fp32
products. It replaced a form that summed broadcast products in fp32 ([rep, P, head_dim] values a
page, which spilled): predicted 2-4x faster, measured 2.95x at 64 rows to 4.17x at 512 (0.108
against 0.450 ms a layer) on the H200 (bench/results/2026-11-28-h200-session30/probes/).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor


def paged_attention_reference(q: Tensor, k_pool: Tensor, v_pool: Tensor, pages: Tensor, pos: Tensor) -> Tensor:
    """q [bb, H, hd]; k_pool / v_pool [pages, KVH, P, hd]; pages [bb, np] (each row's pages in
    position order); pos [bb]: row r attends over its positions 0..pos[r]. -> [bb, H, hd] in q's dtype,
    computed in fp32."""
    bb, H, hd = q.shape
    _, kvh, P, _ = k_pool.shape
    np_ = pages.shape[1]
    keys = k_pool[pages].transpose(1, 2).reshape(bb, kvh, np_ * P, hd).float()
    values = v_pool[pages].transpose(1, 2).reshape(bb, kvh, np_ * P, hd).float()
    qf = q.float().view(bb, kvh, H // kvh, hd)
    scores = torch.einsum("bgrd,bgnd->bgrn", qf, keys) * hd**-0.5
    valid = torch.arange(np_ * P, device=q.device)[None] <= pos[:, None]  # [bb, n]
    p = scores.masked_fill(~valid[:, None, None], float("-inf")).softmax(-1)
    return torch.einsum("bgrn,bgnd->bgrd", p, values).reshape(bb, H, hd).to(q.dtype)


def paged_attention_triton(q: Tensor, k_pool: Tensor, v_pool: Tensor, pages: Tensor, pos: Tensor) -> Tensor:
    """`paged_attention_reference` as one Triton kernel (CUDA, or Triton's interpreter): grid (rows,
    kv heads)."""
    bb, H, hd = q.shape
    _, kvh, P, _ = k_pool.shape
    rep = H // kvh
    out = torch.empty_like(q)
    args = (q, k_pool, v_pool, pages, pos, out,
            q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
            pages.stride(0), out.stride(0), out.stride(1), hd**-0.5)
    if rep > 16 or P < 16:
        raise ValueError(f"the paged attention kernel takes up to 16 query heads a kv head and pages of >= 16 "
                         f"positions; got {rep} and {P}")
    _triton_kernel()[(bb, kvh)](*args, REP=rep, P=P, HD=hd, FP32=q.dtype == torch.float32)
    return out


@functools.cache
def _triton_kernel():
    """Compiled on first use: triton exists only where CUDA does (or its interpreter runs)."""
    import triton
    import triton.language as tl

    @triton.jit
    def paged_decode_attention(q_ptr, k_ptr, v_ptr, pages_ptr, pos_ptr, out_ptr,
                                   stride_qb, stride_qh, stride_kp, stride_kh, stride_ko,
                                   stride_pb, stride_ob, stride_oh, scale,
                                   REP: tl.constexpr, P: tl.constexpr, HD: tl.constexpr, FP32: tl.constexpr):
        b = tl.program_id(0)
        g = tl.program_id(1)
        pos = tl.load(pos_ptr + b)
        r = tl.arange(0, 16)  # a tensor-core product's fewest rows; rows past REP are zeros
        d = tl.arange(0, HD)
        o = tl.arange(0, P)
        heads = g * REP + r
        rmask = r < REP
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=rmask[:, None], other=0.0)
        m = tl.full([16], float("-inf"), tl.float32)
        l = tl.zeros([16], tl.float32)
        acc = tl.zeros([16, HD], tl.float32)
        for j in range(pos // P + 1):
            page = tl.load(pages_ptr + b * stride_pb + j)
            base = page * stride_kp + g * stride_kh + o[:, None] * stride_ko + d[None, :]
            k = tl.load(k_ptr + base)  # [P, HD]
            if FP32:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))  # exact products, fp32 sums
            s = tl.where((j * P + o <= pos)[None, :], s * scale, float("-inf"))  # [16, P]
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            l = l * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + base)
            if FP32:
                pv = tl.dot(p, v, input_precision="ieee")
            else:
                hi = p.to(v.dtype)
                lo = (p - hi.to(tl.float32)).to(v.dtype)
                pv = tl.dot(hi, v) + tl.dot(lo, v)
            acc = acc * alpha[:, None] + pv
            m = m_new
        acc = acc / l[:, None]
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=rmask[:, None])

    return paged_decode_attention
