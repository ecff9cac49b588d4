"""The Llama-family forward pass (Llama, Mistral, Qwen2, Qwen3) over weight views and paged KV.

Functional rather than transformers' nn.Modules: the weights are views into
whichever device slot holds the model, and the KV lives in the engine's
slabs, so there is nothing for a module to own. The arithmetic follows
transformers' modeling code step for step (RMSNorm in float32, rope from
transformers' own frequencies, SDPA with the same scale), which is what the
token-for-token tests against `model.generate` check.

Tokens of all requests of a step are flattened into one `[N, hidden]` batch
for every projection and MLP; only attention is per request (prefill) or
padded with a mask (decode).

On CUDA, decode and prefill run through the fused Triton kernels of
`pool.engines.fused` (decode: 10 launches a layer, attention straight off the
paged KV; prefill: the same layer with flash attention per request); the plain
torch passes below stay the reference and the CPU path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from torch.nn.attention import SDPBackend, sdpa_kernel

from pool.engines import fused as fused_ops
from pool.engines.device import to_device
from pool.engines.weights import ModelSpec

# Prefill attention never goes to cuDNN: it builds an execution plan for every new prompt length (measured on
# the H200: 66 ms of host time per fresh length for 28 layers, 4x the prefill itself); flash attention has none.
PREFILL_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass(slots=True)
class _Layer:
    ln1: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    ln2: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


_ROWS = ("token_ids", "positions", "write_row", "write_offset", "lengths")


@dataclass(slots=True)
class DecodeInputs:
    """One decode step of B requests, packed in one int64 tensor so one copy moves it.

    Rows of B: token_ids (the token fed), positions (its position), write_row /
    write_offset (first KV row of the block its K/V goes to, and the offset in
    it), lengths (tokens to attend: position + 1); then the block table,
    [B, max_blocks] first rows, padded. Under CUDA graphs `packed` is the
    graph's static input.
    """

    packed: torch.Tensor
    batch: int
    max_blocks: int

    @classmethod
    def pack(cls, rows: dict[str, list[int]], table: list[list[int]], device: torch.device) -> DecodeInputs:
        flat = [v for name in _ROWS for v in rows[name]] + [v for row in table for v in row]
        packed = to_device(np.array(flat, dtype=np.int64), device)
        return cls(packed, len(rows["token_ids"]), len(table[0]))

    def row(self, name: str) -> torch.Tensor:
        i = _ROWS.index(name)
        return self.packed[i * self.batch : (i + 1) * self.batch]

    @property
    def table(self) -> torch.Tensor:
        return self.packed[len(_ROWS) * self.batch :].view(self.batch, self.max_blocks)


@dataclass(slots=True)
class PrefillInputs:
    token_ids: torch.Tensor  # [N] all requests' tokens, concatenated
    positions: torch.Tensor  # [N]
    write_row: torch.Tensor  # [N] first KV row of the block each token's K/V goes to
    write_offset: torch.Tensor  # [N] offset in that block
    seq_lens: list[int]  # tokens per request, in order
    ends: torch.Tensor  # [num_requests] index of each request's last token


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: normalise in float32, cast back, then scale."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class SharedTensors:
    """The tensors besides weights and KV that a forward pass reads, one set per (shape, device slot).

    Every decoder of one shape in one slot reads these same tensors, so a CUDA
    graph captured through one of them replays for all (the graph bakes in
    their addresses). The per-model part (Qwen3's q/k norms, stacked per head)
    is written here by `Decoder.bind()` whenever another model takes the slot.
    """

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> None:
        self.inv_freq = torch.tensor(spec.inv_freq, dtype=torch.float32, device=device)
        self.heads = torch.arange(spec.num_kv_heads, device=device)
        rows = spec.num_heads + spec.num_kv_heads
        self.qk_norms = (torch.ones(spec.num_layers, rows, spec.head_dim, dtype=dtype, device=device)
                         if spec.qk_norm else None)
        self.owner: object = None  # (decoder, load) whose norms are in qk_norms


class Decoder:
    """One model's forward pass, bound to its weight views, its KV row view and its shape's shared tensors."""

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], kv: torch.Tensor,
                 fused: bool | None = None, shared: SharedTensors | None = None, comm: Any = None) -> None:
        self.spec = spec
        # A tensor-parallel shard's collectives (`pool.engines.tp.TpComm`): the row-parallel o and down outputs
        # are summed over ranks, the vocabulary-parallel logits gathered. None (tp 1): not a single extra call.
        self.comm = comm
        # Decode through the fused Triton kernels (CUDA; `pool.engines.fused`), else plain torch ops.
        self.fused = fused_ops.usable(kv.device) if fused is None else fused
        self.kv = kv  # [rows, block_size, head_dim]; a block is rows (layer, k/v, head) from its first row
        self.embed, self.norm, self.lm_head = weights["embed"], weights["norm"], weights["lm_head"]
        self.layers = [
            _Layer(*(weights.get(f"{n}.{part}") for part in _Layer.__slots__))  # type: ignore[arg-type]
            for n in range(spec.num_layers)
        ]
        self.shared = shared or SharedTensors(spec, self.embed.dtype, self.embed.device)
        self.inv_freq, self.heads = self.shared.inv_freq, self.shared.heads
        self.scale = spec.head_dim**-0.5
        # Qwen3 normalises q and k per head; one weight of [q heads + kv heads, head_dim] does both at once.
        norms = self.shared.qk_norms
        self.qk_norms: list[torch.Tensor | None] = [None if norms is None else norms[n] for n in range(spec.num_layers)]
        if shared is None:
            self.bind()

    def bind(self, load: int = 0) -> None:
        """Put this model's per-model shared tensors in place, read from its weights; `load` names the copy
        of the weights in the slot (a no-op while the tensors are from that copy already)."""
        norms = self.shared.qk_norms
        if norms is None or self.shared.owner == (self, load):
            return
        s = self.spec
        for n, layer in enumerate(self.layers):
            norms[n, : s.num_heads].copy_(layer.q_norm.expand(s.num_heads, -1))  # type: ignore[union-attr]
            norms[n, s.num_heads :].copy_(layer.k_norm.expand(s.num_kv_heads, -1))  # type: ignore[union-attr]
        self.shared.owner = (self, load)

    # ---- shared pieces ----
    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.spec.rope_scaling).to(self.embed.dtype)
        sin = (emb.sin() * self.spec.rope_scaling).to(self.embed.dtype)
        return cos[:, None, :], sin[:, None, :]

    def _qkv(self, n: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q `[N, heads, hd]`, k and v `[N, kv_heads, hd]`, with norms and rope applied."""
        s, layer, eps = self.spec, self.layers[n], self.spec.rms_norm_eps
        qkv = F.linear(rms_norm(x, layer.ln1, eps), layer.qkv, layer.qkv_bias)
        qk = qkv[:, : s.q_size + s.kv_size].view(-1, s.num_heads + s.num_kv_heads, s.head_dim)
        v = qkv[:, s.q_size + s.kv_size :].view(-1, s.num_kv_heads, s.head_dim)
        qk_norm = self.qk_norms[n]
        if qk_norm is not None:
            qk = rms_norm(qk, qk_norm, eps)
        qk = _rotate(qk, cos, sin)  # q and k together: half the kernels
        return qk[:, : s.num_heads], qk[:, s.num_heads :], v

    def _finish_layer(self, layer: _Layer, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        out = F.linear(attn, layer.o, layer.o_bias)
        if self.comm is not None:
            self.comm.all_reduce(out)
        x = x + out
        h = rms_norm(x, layer.ln2, self.spec.rms_norm_eps)
        gate, up = F.linear(h, layer.gate_up).chunk(2, dim=-1)
        out = F.linear(F.silu(gate) * up, layer.down)
        if self.comm is not None:
            self.comm.all_reduce(out)
        return x + out

    def _rows(self, first_rows: torch.Tensor, n: int, kind: int) -> torch.Tensor:
        """KV rows of layer n, keys (0) or values (1), every head: `first_rows.shape + (kv_heads,)`."""
        return first_rows[..., None] + (2 * n + kind) * self.spec.num_kv_heads + self.heads

    def _write_kv(self, n: int, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, offsets: torch.Tensor) -> None:
        self.kv[self._rows(rows, n, 0), offsets[:, None]] = k
        self.kv[self._rows(rows, n, 1), offsets[:, None]] = v

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return self._head(rms_norm(x, self.norm, self.spec.rms_norm_eps))

    # ---- prefill ----
    def prefill(self, inp: PrefillInputs) -> torch.Tensor:
        """Logits `[num_requests, vocab]` at each request's last token; writes all K/V."""
        if self.fused:
            return self._prefill_fused(inp)
        cos, sin = self._rope(inp.positions)
        x = F.embedding(inp.token_ids, self.embed)
        for n, layer in enumerate(self.layers):
            q, k, v = self._qkv(n, x, cos, sin)
            self._write_kv(n, k, v, inp.write_row, inp.write_offset)
            x = self._finish_layer(layer, x, self._causal_attention(q, k, v, inp.seq_lens))
        return self._logits(x[inp.ends])

    def _prefill_fused(self, inp: PrefillInputs) -> torch.Tensor:
        """`prefill` through decode's fused kernels (norms, rope with the K/V writes, SiLU): ~11 launches a layer
        where the torch ops take ~27 and their host time (the H200 ran a 1.5B prefill of 300 or 1900 tokens in
        the same 32 ms: launch-bound); attention stays flash attention per request."""
        s = self.spec

        def attend(n: int, qk: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
            v = qkv[:, s.q_size + s.kv_size :].view(-1, s.num_kv_heads, s.head_dim)
            return self._causal_attention(qk[:, : s.num_heads], qk[:, s.num_heads :], v, inp.seq_lens)

        h = self._fused_layers(inp.token_ids, inp.positions, inp.write_row, inp.write_offset, attend, keys_out=True)
        return self._head(h[inp.ends])

    def _causal_attention(self, q, k, v, seq_lens: list[int]) -> torch.Tensor:
        out = torch.empty(q.shape[0], self.spec.q_size, dtype=q.dtype, device=q.device)
        start, gqa = 0, self.spec.num_heads != self.spec.num_kv_heads
        real = sum(seq_lens)
        if real < q.shape[0]:  # padded tokens (scheduler.padded_prefill_tokens): no request reads them
            out[real:] = 0
        with sdpa_kernel(PREFILL_ATTENTION):
            for n in seq_lens:
                qi, ki, vi = (t[start : start + n].transpose(0, 1)[None] for t in (q, k, v))
                attn = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=self.scale, enable_gqa=gqa)
                out[start : start + n] = attn[0].transpose(0, 1).reshape(n, -1)
                start += n
        return out

    # ---- decode ----
    def decode(self, inp: DecodeInputs) -> torch.Tensor:
        """Logits `[B, vocab]` for one new token per request. No host syncs (graph-capturable)."""
        if self.fused:
            return self._decode_fused(inp)
        span = inp.max_blocks * self.spec_block_size
        lengths, table = inp.row("lengths"), inp.table
        mask = (torch.arange(span, device=lengths.device)[None, :] < lengths[:, None])[:, None, None, :]
        cos, sin = self._rope(inp.row("positions"))
        x = F.embedding(inp.row("token_ids"), self.embed)
        for n, layer in enumerate(self.layers):
            q, k, v = self._qkv(n, x, cos, sin)
            self._write_kv(n, k, v, inp.row("write_row"), inp.row("write_offset"))
            x = self._finish_layer(layer, x, self._paged_attention(n, q, table, mask))
        return self._logits(x)

    def _decode_fused(self, inp: DecodeInputs) -> torch.Tensor:
        """`decode` in 10 kernels a layer (see `pool.engines.fused`); same roundings, no K/V gather copies."""
        s = self.spec
        lengths, table = inp.row("lengths"), inp.table
        splits = fused_ops.split_plan(inp.batch, s.num_kv_heads, inp.max_blocks, self.spec_block_size, self.kv.device)

        def attend(n: int, q: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
            return fused_ops.paged_attention(q, self.kv, table, lengths, n, s.num_kv_heads, self.scale, splits)

        return self._head(self._fused_layers(inp.row("token_ids"), inp.row("positions"), inp.row("write_row"),
                                             inp.row("write_offset"), attend, keys_out=False))

    def _fused_layers(self, token_ids: torch.Tensor, positions: torch.Tensor, write_row: torch.Tensor,
                      write_offset: torch.Tensor, attend: Any, keys_out: bool) -> torch.Tensor:
        """Every layer through the fused kernels, for decode and prefill alike (they differ in `attend(layer, q,
        qkv)` only); the final norm's output, one row per token."""
        s, eps, ops = self.spec, self.spec.rms_norm_eps, fused_ops
        cos, sin = self._rope(positions)
        cos, sin = cos[:, 0].contiguous(), sin[:, 0].contiguous()
        x = F.embedding(token_ids, self.embed)
        x, h = ops.add_rms_norm(x, None, self.layers[0].ln1, eps)
        for n, layer in enumerate(self.layers):
            qkv = F.linear(h, layer.qkv, layer.qkv_bias)
            q = ops.qkv_rope_write(qkv, cos, sin, self.qk_norms[n], self.kv, write_row, write_offset, n,
                                   s.num_heads, s.num_kv_heads, s.head_dim, eps, keys_out=keys_out)
            out = F.linear(attend(n, q, qkv), layer.o, layer.o_bias)
            if self.comm is not None:
                self.comm.all_reduce(out)
            x, h = ops.add_rms_norm(x, out, layer.ln2, eps)
            mlp = F.linear(ops.silu_mul(F.linear(h, layer.gate_up)), layer.down)
            if self.comm is not None:
                self.comm.all_reduce(mlp)
            following = self.layers[n + 1].ln1 if n + 1 < len(self.layers) else self.norm
            x, h = ops.add_rms_norm(x, mlp, following, eps)
        return h

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits of final-normed rows (gathered over the vocabulary shards under tensor parallelism)."""
        logits = F.linear(h, self.lm_head).float()
        return logits if self.comm is None else self.comm.gather_vocab(logits, self.spec.vocab_size)

    @property
    def spec_block_size(self) -> int:
        return self.kv.shape[1]

    def _paged_attention(self, n: int, q: torch.Tensor, table: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """One query per request over its blocks; GQA by grouping query heads, never copying K/V heads."""
        s = self.spec
        batch, max_blocks = table.shape
        shape = (batch, max_blocks, s.num_kv_heads)  # rows come out [B, kv_heads, blocks] after the transpose
        keys = self._gather(self._rows(table, n, 0).transpose(1, 2), shape)  # [B, kvh, span, hd]
        values = self._gather(self._rows(table, n, 1).transpose(1, 2), shape)
        queries = q.reshape(batch, s.num_kv_heads, s.num_heads // s.num_kv_heads, s.head_dim)
        scores = torch.matmul(queries, keys.transpose(-1, -2)).float() * self.scale  # [B, kvh, group, span]
        probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1).to(q.dtype)
        return torch.matmul(probs, values).reshape(batch, s.q_size)

    def _gather(self, rows: torch.Tensor, shape: tuple[int, int, int]) -> torch.Tensor:
        batch, max_blocks, heads = shape
        picked = self.kv.index_select(0, rows.reshape(-1))  # [B * kvh * blocks, bs, hd], contiguous rows
        return picked.view(batch, heads, max_blocks * self.spec_block_size, self.spec.head_dim)
