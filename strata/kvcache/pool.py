"""KV pools: one preallocated store of K and V per attention layer, addressed by slot.

Rules every pool follows:
- Storage is allocated once, at start-up; nothing allocates per step except the gathered views the
  torch reference attention needs.
- A slot is `block_id * block_size + offset`; the block allocator hands out block ids, the runner
  turns (block table, position) into slots. Block 0 is the allocator's padding block: writes to it
  are harmless and reads from it are masked out.
- `write(layer, slots, k, v)` stores the step's new K/V ([N, Hkv, D]); `gather(layer, index)` returns
  K and V at the slots in `index` (any shape) in the compute dtype, dequantized if need be;
  `gather_blocks` those of whole blocks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class KVPool(ABC):
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, n_kv: int, head_dim: int, device):
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.n_kv, self.head_dim, self.device = n_kv, head_dim, torch.device(device)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @abstractmethod
    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None: ...

    @abstractmethod
    def gather(self, layer: int, index: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]: ...

    def gather_blocks(self, layer: int, blocks: torch.Tensor, length: int,
                      dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the first `length` positions of the sequences whose block tables are the rows of
        `blocks` [R, B] (int32 or int64, B * block_size >= length): [R, length, Hkv, D], whole blocks
        copied at once rather than slot by slot."""
        slots = blocks.long()[:, :, None] * self.block_size + torch.arange(self.block_size, device=blocks.device)
        return self.gather(layer, slots.flatten(1)[:, :length], dtype)


def kv_bytes_per_token(num_layers: int, n_kv: int, head_dim: int, kind: str, model_dtype: torch.dtype) -> int:
    if kind == "int8":
        return num_layers * 2 * n_kv * (head_dim + 4)  # int8 values + one fp32 scale per head
    dtype = torch.bfloat16 if kind == "bf16" else model_dtype
    return num_layers * 2 * n_kv * head_dim * torch.empty(0, dtype=dtype).element_size()


class DensePool(KVPool):
    """K/V stored as they are computed (bf16, or the model's dtype)."""

    def __init__(self, num_layers, num_blocks, block_size, n_kv, head_dim, device, dtype: torch.dtype,
                 pin: bool = False):
        super().__init__(num_layers, num_blocks, block_size, n_kv, head_dim, device)
        shape = (num_layers, num_blocks * block_size, n_kv, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=self.device, pin_memory=pin)
        self.v = torch.zeros(shape, dtype=dtype, device=self.device, pin_memory=pin)

    def write(self, layer, slots, k, v):
        self.k[layer].index_copy_(0, slots, k.to(self.k.dtype))
        self.v[layer].index_copy_(0, slots, v.to(self.v.dtype))

    def gather_blocks(self, layer, blocks, length, dtype):
        r, b = blocks.shape
        flat, shape = blocks.reshape(-1), (r, b * self.block_size, self.n_kv, self.head_dim)
        k = self.k[layer].view(self.num_blocks, -1).index_select(0, flat).view(shape)[:, :length]
        v = self.v[layer].view(self.num_blocks, -1).index_select(0, flat).view(shape)[:, :length]
        return (k, v) if k.dtype == dtype else (k.to(dtype), v.to(dtype))

    def gather(self, layer, index, dtype):
        flat, shape = index.reshape(-1), (*index.shape, self.n_kv, self.head_dim)
        k = self.k[layer].index_select(0, flat).view(shape)
        v = self.v[layer].index_select(0, flat).view(shape)
        return (k, v) if k.dtype == dtype else (k.to(dtype), v.to(dtype))


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one scale per token per head: x [N, H, D] → (q int8 [N, H, D], scale [N, H])."""
    amax = x.float().abs().amax(dim=-1)
    scale = (amax / 127.0).clamp(min=1e-8)
    q = torch.round(x.float() / scale[..., None]).clamp(-127, 127).to(torch.int8)
    return q, scale


class Int8Pool(KVPool):
    """K/V as int8 with a per-token, per-head fp32 scale; attention dequantizes on the fly."""

    def __init__(self, num_layers, num_blocks, block_size, n_kv, head_dim, device, pin: bool = False):
        super().__init__(num_layers, num_blocks, block_size, n_kv, head_dim, device)
        slots = num_blocks * block_size
        self.k = torch.zeros((num_layers, slots, n_kv, head_dim), dtype=torch.int8, device=self.device, pin_memory=pin)
        self.v = torch.zeros((num_layers, slots, n_kv, head_dim), dtype=torch.int8, device=self.device, pin_memory=pin)
        self.k_scale = torch.zeros((num_layers, slots, n_kv), dtype=torch.float32, device=self.device, pin_memory=pin)
        self.v_scale = torch.zeros((num_layers, slots, n_kv), dtype=torch.float32, device=self.device, pin_memory=pin)

    def write(self, layer, slots, k, v):
        for store, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            q, s = quantize_int8(x)
            store[layer].index_copy_(0, slots, q)
            scales[layer].index_copy_(0, slots, s)

    def gather(self, layer, index, dtype):
        k = self.k[layer][index].float() * self.k_scale[layer][index][..., None]
        v = self.v[layer][index].float() * self.v_scale[layer][index][..., None]
        return k.to(dtype), v.to(dtype)


def make_pool(kind: str, num_layers: int, num_blocks: int, block_size: int, n_kv: int, head_dim: int,
              device, model_dtype: torch.dtype, pin: bool = False) -> KVPool:
    """`pin`: page-locked host memory (the host tier's pool on a CUDA machine)."""
    if kind == "int8":
        return Int8Pool(num_layers, num_blocks, block_size, n_kv, head_dim, device, pin)
    dtype = torch.bfloat16 if kind == "bf16" else model_dtype
    return DensePool(num_layers, num_blocks, block_size, n_kv, head_dim, device, dtype, pin)


def pool_tensors(pool: KVPool) -> list[torch.Tensor]:
    """Every storage tensor of a pool, each [layers, slots, ...] (values, then scales)."""
    if isinstance(pool, Int8Pool):
        return [pool.k, pool.v, pool.k_scale, pool.v_scale]
    return [pool.k, pool.v]
