"""The mixture-of-experts layer: the router (softmax or sigmoid with group-limited top-k) and the routed
experts (plus shared ones), with the paths a device can run them on (`MoE.path`)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from strata.config import ModelConfig
from strata.kernels import invariant as k_invariant
from strata.kernels import moe_decode as k_moe
from strata.kernels import moe_invariant as k_moe_inv
from strata.kernels import moe_routing as k_route
from strata.kernels import moe_sort as k_sort
from strata.kernels import kernels_run, triton_available, use_triton
from strata.kernels.quant import moe_decode_q
from strata.kernels.scratch import scratch
from strata.models.host_experts import ExpertStreamer, HostExperts, HostStagingPool
from strata.models.layers import MLP, silu_mul

log = logging.getLogger("strata")

class Router(nn.Module):
    """Top-k expert choice. Softmax (Qwen3-MoE) or sigmoid with a correction bias and optional
    group limit (DeepSeek-V3 / GLM-4.5). Scores are computed in fp32 in both cases."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))
        self.scoring, self.top_k, self.norm = cfg.scoring, cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.n_group, self.topk_group, self.scale = cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor
        if self.scoring == "sigmoid":
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_experts, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None
        # The fp32 copy of a 16-bit router weight, made once by MoE.pack_experts() instead of every call.
        self.register_buffer("weight_f32", None, persistent=False)
        # Counters of the fused routing kernel (which leaves them at zero), set by MoE.pack_experts() on CUDA.
        self.route_ws: torch.Tensor | None = None
        self.batch_invariant = False  # CausalLM.set_batch_invariant

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns (weights [N, k] fp32, expert ids [N, k], router logits [N, E] fp32). On CUDA without a
        gradient, strata.kernels.moe_routing: one launch for up to 16 tokens, else cuBLAS logits + one;
        with `batch_invariant`, `_route_invariant` for every token count."""
        weight = self.weight_f32 if self.weight_f32 is not None else self.weight.float()
        if self.batch_invariant and x.dim() == 2 and use_triton(x):
            return self._route_invariant(x, weight)
        if (self.route_ws is not None and x.dim() == 2 and use_triton(x)
                and not (weight.requires_grad and torch.is_grad_enabled())):
            return k_route.router_decode(x, weight, scoring=self.scoring, top_k=self.top_k, norm_topk_prob=self.norm,
                                         n_group=self.n_group, topk_group=self.topk_group,
                                         bias=self.e_score_correction_bias, scale=self.scale, workspace=scratch(self.route_ws))
        n = x.shape[0]
        if self.batch_invariant:  # scores on a padded tensor whose size does not follow the batch
            w, ids, logits = self._route(k_invariant.pad_rows(x.float()), weight)
            return w[:n], ids[:n], logits[:n]
        return self._route(x.float(), weight)

    def _route_invariant(self, x: torch.Tensor,
                         weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """--batch-invariant on CUDA: fp32 logits from the row-invariant GEMM (never cuBLAS, nor the fused
        decode router, whose H order differs from it), then `moe_routing.route`: one program per row, its
        configuration a function of (E, k) only. Settings that kernel does not serve fall back to torch's
        softmax/topk (`route_ref`), per-row kernels whose launch configuration may follow the row count."""
        logits = k_moe_inv.router_logits(x, weight, workspace=scratch(self.route_ws))
        w, ids = k_route.route(logits, scoring=self.scoring, top_k=self.top_k, norm_topk_prob=self.norm,
                               n_group=self.n_group, topk_group=self.topk_group, bias=self.e_score_correction_bias,
                               scale=self.scale)
        return w, ids, logits

    def _route(self, x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(x, weight)
        if self.scoring == "softmax":
            probs = logits.softmax(dim=-1)
            w, ids = probs.topk(self.top_k, dim=-1)
            if self.norm:
                w = w / w.sum(-1, keepdim=True)
            return w, ids, logits
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias
        if self.n_group > 1:
            n, e = choice.shape
            grouped = choice.view(n, self.n_group, e // self.n_group)
            group_score = grouped.topk(2, dim=-1)[0].sum(-1)
            keep = torch.zeros_like(group_score).scatter_(1, group_score.topk(self.topk_group, dim=-1)[1], 1.0)
            keep = keep.unsqueeze(-1).expand_as(grouped).reshape(n, e)
            choice = choice.masked_fill(keep == 0, float("-inf"))
        ids = choice.topk(self.top_k, dim=-1)[1]
        w = scores.gather(1, ids)
        if self.norm:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return (w * self.scale if self.scale != 1.0 else w), ids, logits


def grouped_mm_works(w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """One tiny call of `torch._grouped_mm` on the real weights, checked against F.linear.

    The op is private and its kernels accept only some dtypes, shapes and alignments (CUDA may reject
    fp32 or dims that are not multiples of 8/16, or run a fallback that reads the group offsets on the
    host), so it is tried once here, at pack time, rather than failing or syncing in the middle of a step."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    e, two_i, h = w13.shape
    dev = w13.device
    # Uneven groups with some empty, as real routing gives.
    counts = torch.arange(e, device=dev) % 3
    offs = counts.cumsum(0).to(torch.int32)
    rows = int(counts.sum())
    x = torch.randn(rows, h, device=dev, dtype=w13.dtype)
    a = torch.randn(rows, two_i // 2, device=dev, dtype=w2.dtype)
    on_cuda = dev.type == "cuda"
    try:
        if on_cuda:
            # A fallback that copies `offs` to the host would defeat the point of this path.
            old_mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")
        try:
            y13 = torch._grouped_mm(x, w13.transpose(1, 2), offs=offs)
            y2 = torch._grouped_mm(a, w2.transpose(1, 2), offs=offs)
        finally:
            if on_cuda:
                torch.cuda.set_sync_debug_mode(old_mode)
    except (RuntimeError, NotImplementedError):
        # Unsupported dtype/shape/alignment/device on this build: the loop path serves instead.
        return False
    bounds = [0] + offs.tolist()
    ref13 = torch.cat([F.linear(x[bounds[i] : bounds[i + 1]], w13[i]) for i in range(e)])
    ref2 = torch.cat([F.linear(a[bounds[i] : bounds[i + 1]], w2[i]) for i in range(e)])
    # Loose enough for 16-bit rounding and TF32; a wrong layout is off by O(1).
    tol = 1e-2 if w13.dtype == torch.float32 else 3e-2
    return all(
        got.shape == ref.shape and bool((got.float() - ref.float()).abs().max() <= tol * ref.float().abs().max())
        for got, ref in ((y13, ref13), (y2, ref2))
    )


def moe_decode_works(w13: torch.Tensor, w2: torch.Tensor, top_k: int) -> bool:
    """One call of the fused decode kernels on the real weights, checked against their reference, at
    pack time: a kernel this device cannot build or run leaves the grouped path serving every step."""
    e, two_i, h = w13.shape
    if not (w13.is_cuda and triton_available() and k_moe.moe_decode_supported(2, top_k, h, two_i // 2, w13.dtype)):
        return False
    x = torch.randn(2, h, device=w13.device, dtype=w13.dtype)
    ids = torch.stack([torch.randperm(e, device=w13.device)[:top_k] for _ in range(2)])
    w = torch.rand(2, top_k, device=w13.device)
    try:
        got = k_moe.moe_experts_decode_triton(x, ids, w, w13, w2)
    except Exception as err:  # a compiler or launch failure: fall back rather than fail every step
        log.warning("fused MoE decode kernels unavailable (%s); using grouped GEMMs", err)
        return False
    ref = k_moe.moe_experts_decode_ref(x, ids, w, w13, w2)
    return bool(((got.float() - ref.float()).norm() <= 1e-2 * ref.float().norm()).item())


def pcie_serves(x: torch.Tensor, top_k: int, w13, w2) -> bool:
    """Whether the fused decode kernels take this step over the stacks (w13, w2) wherever they are (the
    pinned host copy of experts in RAM): `QExpertStack`s, or float tensors of x's dtype. Host metadata
    only."""
    if isinstance(w13, torch.Tensor):
        return (x.dtype == w13.dtype and x.dim() == 2 and x.stride(1) == 1 and kernels_run(x, k_moe._gate_up_kernel)
                and k_moe.moe_decode_supported(x.shape[0], top_k, x.shape[1], w13.shape[1] // 2, x.dtype))
    return moe_decode_q.serves(x, top_k, w13, w2)


def pcie_decode(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, w13, w2, config=None) -> torch.Tensor:
    """The chosen experts' weighted sum by the fused decode kernels over (w13, w2) (`pcie_serves`);
    `config`: the quantized kernels' tiles (`moe_decode_q.pcie_configs`), else their default."""
    if isinstance(w13, torch.Tensor):
        return k_moe.moe_experts_decode_triton(x, ids, w, w13, w2)
    return moe_decode_q.moe_decode_q_triton(x, ids, w, w13, w2, config=config)


class MoE(nn.Module):
    """Routed experts plus optional shared experts. Experts keep the HF per-expert layout as loaded.

    Three forward paths, named by `self.path`:
    - "loop" (reference; any unpacked module): groups tokens by expert so each expert runs one matmul;
      it reads the group sizes on the host, one device sync per call.
    - "grouped" (after `pack_experts()`): all experts in two `torch._grouped_mm` calls over stacked
      weights, with no host sync, so a step can be queued on the GPU without the host waiting.
    - "masked" (after `pack_experts()` on CUDA where grouped_mm cannot serve, e.g. fp32): `_masked`.
    Whatever the path, a packed module on the CPU runs steps of few tokens (decodes) through `_picked`,
    two products per (token, expert) pair.
    With `batch_invariant` the CPU runs "loop" through the row-invariant linear, and CUDA runs
    `_grouped_invariant` on the stacked float experts whatever the path (kept-quantized experts are not
    covered: the engine refuses them)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_experts = cfg.num_experts
        self.gate = Router(cfg)
        self.experts = nn.ModuleList(MLP(cfg.hidden_size, cfg.moe_intermediate_size) for _ in range(cfg.num_experts))
        self.shared_experts = (
            MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts) if cfg.n_shared_experts else None
        )
        # Set by a trainer that balances load (aux-loss-free bias update); the serving path ignores it.
        self.last_expert_ids: torch.Tensor | None = None
        self.keep_routing = False
        self.path = "loop"
        self.num_experts_per_tok = cfg.num_experts_per_tok
        # The fused decode kernels (strata.kernels.moe_decode) serve steps of few tokens; set by
        # pack_experts() once a probe has checked them on this device.
        self.decode_kernel = False
        # Stacked expert weights, set by pack_experts(). Non-persistent: the checkpoint names stay HF's.
        self.register_buffer("w13", None, persistent=False)  # [E, 2*I, H]: gate rows, then up rows
        self.register_buffer("w2", None, persistent=False)  # [E, H, I]
        # With `pack_experts(extra=...)`: every expert, the extra one (a shared expert) last; w13 and w2
        # are views of their first E rows.
        self.register_buffer("w13_ext", None, persistent=False)
        self.register_buffer("w2_ext", None, persistent=False)
        self.sort_ws: torch.Tensor | None = None  # the token sort's counters (CUDA), set by pack_experts()
        self.batch_invariant = False  # CausalLM.set_batch_invariant
        # --quantize fp8: (w13, its scales, w2, its scales) in e4m3 instead of w13 / w2
        # (`strata.models.quantize.quantize_fp8`).
        self.fp8: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        # GGUF experts kept quantized: (w13, w2) `QExpertStack`s instead of w13 / w2 (`_pack_quantized`).
        self.quant: tuple | None = None
        # The stacks of `fp8` or `quant` when decode-sized steps run `moe_decode_q`'s kernels (probed at pack).
        self.qdecode: tuple | None = None
        # `--cpu-moe` / `--n-cpu-moe`: the loader leaves this layer's routed experts on the CPU and names
        # their CPU format here; `pack_experts` moves them into `host` (path "host").
        self.host_format: str | None = None
        self.host: HostExperts | None = None
        # Set by the engine on CUDA: the pinned buffers a step's rows pass through to the CPU, and the
        # streamer that brings the experts to the GPU for steps of `stream_min_tokens` or more (0: never).
        self.host_staging: HostStagingPool | None = None
        self.streamer: ExpertStreamer | None = None
        self.stream_min_tokens = 0
        # `--host-expert-decode pcie`: the pinned stacks kept for streaming (w13, w2: `QExpertStack`s or
        # tensors), which the GPU's fused decode kernels read in place over PCIe for decode-sized steps,
        # with the quantized kernels' tile configuration the start-up probe chose (None: their default).
        self.pcie_stacks: tuple | None = None
        self.pcie_config = None
        # `--host-expert-decode both`: each row's first `cpu_slots` chosen experts go to the CPU while the
        # GPU reads the others over PCIe (0: the GPU reads them all).
        self.cpu_slots = 0
        # Set by the runner while it captures CUDA graphs of steps with experts in RAM: an object with
        # `capturing` and `cut(host_part, beside)` (`strata.runner.graph_pieces.GraphCutter`).
        self.graph_cut = None

    @torch.no_grad()
    def pack_experts(self, extra: MLP | None = None) -> str:
        """Stack the experts' weights into `w13`/`w2` and make each expert's weights views of them
        (no second copy), then pick the path. Call after the weights are on their final device and
        dtype: moving the module afterwards copies the views apart. `extra`: an MLP of the experts'
        shape stacked after them (`w13_ext`/`w2_ext`; its gate|up a view too), for a subclass that
        runs it as one more expert. Returns `self.path`."""
        if self.host is not None:  # built by the loader, layer by layer
            self._host_ready()
            return self.path
        if self.host_format is not None:
            self._pack_host()
            return self.path
        if self._pack_quantized():  # experts the loader kept quantized: stacked as blocks
            return self.path
        members = list(self.experts) + ([extra] if extra is not None else [])
        params = [p for m in members for p in (m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight)]
        if any(p.requires_grad for p in params) or any(p.is_meta for p in params):
            # The grouped path reads the stacked buffers, which autograd would not train.
            self.path = "loop"
            return self.path
        first = self.experts[0]
        inter, hidden = first.gate_proj.weight.shape
        ref = first.gate_proj.weight
        w13 = torch.empty(len(members), 2 * inter, hidden, device=ref.device, dtype=ref.dtype)
        w2 = torch.empty(len(members), hidden, inter, device=ref.device, dtype=ref.dtype)
        for e, m in enumerate(members):
            w13[e, :inter].copy_(m.gate_proj.weight)
            w13[e, inter:].copy_(m.up_proj.weight)
            w2[e].copy_(m.down_proj.weight)
            m.gate_proj.weight = nn.Parameter(w13[e, :inter], requires_grad=False)
            m.up_proj.weight = nn.Parameter(w13[e, inter:], requires_grad=False)
            m.down_proj.weight = nn.Parameter(w2[e], requires_grad=False)
        if extra is not None:
            extra.gate_up_weight = w13[-1]  # packed already: MLP.pack leaves it
            self.w13_ext, self.w2_ext = w13, w2
        self.w13, self.w2 = w13[: self.num_experts], w2[: self.num_experts]
        if self.gate.weight.dtype != torch.float32:
            self.gate.weight_f32 = self.gate.weight.detach().float()
        if w13.is_cuda and triton_available():
            self.sort_ws = k_sort.sort_tokens_workspace(w13.device)
            self.gate.route_ws = k_moe_inv.router_workspace(self.num_experts, hidden, w13.device)
        if grouped_mm_works(self.w13, self.w2):
            self.path = "grouped"
            self.decode_kernel = moe_decode_works(self.w13, self.w2, self.num_experts_per_tok)
        else:
            # On CUDA a step must not read expert counts on the host (CUDA graphs, overlapped steps).
            self.path = "masked" if w13.is_cuda else "loop"
        return self.path

    def _pack_quantized(self) -> bool:
        """`pack_experts` for experts the loader kept quantized (`quant_raw` parked on each expert's
        projections, as `load_model(keep_quantized=True)` leaves them): gate|up rows of each expert
        concatenated, the experts stacked, into `self.quant` = (w13, w2) `QExpertStack`s; the float
        weights are never made. The rest of what `pack_experts` sets up for the grouped path (router fp32
        copy, sort and routing workspaces) is set up the same way. Returns False, changing nothing, when
        no expert was kept quantized; where only some were, or formats differ within a stack, the kept
        ones are expanded to float parameters (router dtype) and False tells `pack_experts` to pack floats."""
        from strata.kernels.quant import format_module
        from strata.kernels.quant.moe_q import QExpertStack

        linears = [(m.gate_proj, m.up_proj, m.down_proj) for m in self.experts]
        raws = [[lin.__dict__.pop("quant_raw", None) for lin in trio] for trio in linears]
        flat = [r for trio in raws for r in trio]
        if all(r is None for r in flat):
            return False
        dtype = self.gate.weight.dtype
        types13 = {r[0] for trio in raws for r in trio[:2] if r is not None}
        types2 = {trio[2][0] for trio in raws if trio[2] is not None}
        if any(r is None for r in flat) or len(types13) > 1 or len(types2) > 1:
            for trio, lins in zip(raws, linears):
                for r, lin in zip(trio, lins):
                    if r is not None:
                        mod = format_module(r[0])
                        w = mod.dequantize(mod.repack(r[1]), r[1].shape[0], lin.in_features)
                        lin.weight = nn.Parameter(w.to(dtype), requires_grad=False)
            return False
        w13 = QExpertStack.from_raw(types13.pop(), torch.stack([torch.cat([g[1], u[1]]) for g, u, _ in raws]))
        w2 = QExpertStack.from_raw(types2.pop(), torch.stack([d[1] for _, _, d in raws]))
        del raws, flat
        self.quant = (w13, w2)
        if dtype != torch.float32:
            self.gate.weight_f32 = self.gate.weight.detach().float()
        if w13.device.type == "cuda" and triton_available():
            self.sort_ws = k_sort.sort_tokens_workspace(w13.device)
            self.gate.route_ws = k_route.router_decode_workspace(w13.device)
        self.decode_kernel = False  # the bf16 fused decode kernels; few-token steps take `moe_decode_q`'s if it serves:
        self.qdecode = moe_decode_q.decode_stacks(w13, w2, self.num_experts_per_tok, dtype)
        self.path = "grouped"
        return True

    def _pack_host(self) -> None:
        """The routed experts' float parameters into host RAM in `host_format` (`HostExperts`), emptied."""
        w13 = torch.stack([torch.cat([m.gate_proj.weight, m.up_proj.weight]) for m in self.experts])
        w2 = torch.stack([m.down_proj.weight for m in self.experts])
        self.host = HostExperts.from_stacks(w13.cpu(), w2.cpu(), self.host_format)
        for m in self.experts:
            for lin in (m.gate_proj, m.up_proj, m.down_proj):
                lin.weight = nn.Parameter(torch.empty(0, dtype=lin.weight.dtype), requires_grad=False)
        self._host_ready()

    def _host_ready(self) -> None:
        if self.gate.weight.dtype != torch.float32:
            self.gate.weight_f32 = self.gate.weight.detach().float()
        if self.gate.weight.is_cuda and triton_available():
            self.sort_ws = k_sort.sort_tokens_workspace(self.gate.weight.device)
        self.path = "host"

    def _host_forward(self, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor,
                      during: Callable[[], None] | None = None) -> torch.Tensor:
        """The routed experts in RAM. A step of `stream_min_tokens` or more on the GPU runs them there,
        copied up by the streamer; a smaller one sends its rows, ids and routing weights to the host (a
        wait for the router), runs them on the CPU and sends their sum back. `during`: GPU work to queue
        while the CPU computes (the shared expert). Experts the CPU cannot compute (`HostExperts.on_cpu`:
        the file's blocks alone) are read over PCIe where the fused decode kernels take the step, else
        streamed."""
        if self._streams(x, ids):
            with self.streamer.lock:
                slot, stacks = self.streamer.acquire(self)
                if isinstance(stacks[0], torch.Tensor) and not self.streamer.float_grouped:
                    # A dtype torch._grouped_mm does not take (fp32): each chosen expert's rows in turn.
                    w13, w2 = stacks
                    out = self._loop(x, w, ids, lambda e, rows: F.linear(silu_mul(F.linear(rows, w13[e])), w2[e]))
                else:
                    out = self._grouped(x, w, ids, stacks)
                self.streamer.release(slot)
        elif slots := self._pcie_slots(x, ids):
            if slots == ids.shape[1]:
                out = pcie_decode(x, ids, w, *self.pcie_stacks, config=self.pcie_config)
            else:
                out, during = self._both(x, w, ids, during), None
        elif x.device.type == "cpu":
            out = self.host.forward(x, ids, w).to(x.dtype)
        elif self.host_staging is not None and x.shape[0] <= self.host_staging.tokens:
            staging = self.host_staging.get()
            cut = self.graph_cut is not None and self.graph_cut.capturing
            xh, idh, wh = staging.down(x, ids, w, mark=not cut)
            if during is not None:
                during()
                during = None
            if cut:
                out = self._cut_graph(staging, xh, idh, wh)
            else:
                staging.event.synchronize()
                out = staging.up(self.host.forward(xh, idh, wh, out=staging.out[: x.shape[0]]))
        else:
            out = self.host.forward(x.cpu(), ids.cpu(), w.float().cpu()).to(device=x.device, dtype=x.dtype)
        if during is not None:
            during()
        return out

    def _streams(self, x: torch.Tensor, ids: torch.Tensor) -> bool:
        """Whether this step brings the layer's experts to the GPU (the streamer) to compute them there."""
        if not x.is_cuda or self.streamer is None:
            return False
        if not self.host.on_cpu:
            return not self._pcie_slots(x, ids)
        return bool(self.stream_min_tokens) and x.shape[0] >= self.stream_min_tokens

    def _pcie_slots(self, x: torch.Tensor, ids: torch.Tensor) -> int:
        """How many of each row's chosen experts this step's GPU reads over PCIe (`pcie_stacks`): all of
        them, those past `cpu_slots` (the CPU computing the others at the same time), or none (the CPU
        path serves the step)."""
        if self.pcie_stacks is None or self.batch_invariant:
            return 0
        slots = ids.shape[1] - self.cpu_slots
        if self.cpu_slots and x.is_cuda and (self.host_staging is None or x.shape[0] > self.host_staging.tokens):
            return 0
        return slots if pcie_serves(x, slots, *self.pcie_stacks) else 0

    def _both(self, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor,
              during: Callable[[], None] | None) -> torch.Tensor:
        """Each row's first `cpu_slots` chosen experts on the CPU while the GPU reads the others over
        PCIe and runs `during`; the two sums added on the GPU."""
        c, t = self.cpu_slots, x.shape[0]

        def read() -> torch.Tensor:
            return pcie_decode(x, ids[:, c:].contiguous(), w[:, c:].contiguous(), *self.pcie_stacks,
                               config=self.pcie_config)

        if not x.is_cuda:
            return self.host.forward(x, ids[:, :c], w[:, :c]).to(x.dtype) + read()
        staging = self.host_staging.get()
        cut = self.graph_cut is not None and self.graph_cut.capturing
        xh, idh, wh = staging.down(x, ids[:, :c], w[:, :c], mark=not cut)
        if cut:
            side: list[torch.Tensor] = []

            def beside() -> None:
                side.append(read())
                if during is not None:
                    during()

            host_sum = self._cut_graph(staging, xh, idh, wh, beside)
            return host_sum + side[0]
        gpu_sum = read()
        if during is not None:
            during()
        staging.event.synchronize()
        return staging.up(self.host.forward(xh, idh, wh, out=staging.out[:t])) + gpu_sum

    def _cut_graph(self, staging, xh: torch.Tensor, idh: torch.Tensor, wh: torch.Tensor,
                   beside: Callable[[], None] | None = None) -> torch.Tensor:
        """Under a graph capture: the piece ends after the rows' copy down; at replay the host part
        computes the step's real rows into the pinned sum (while the GPU runs `beside`, a graph of its
        own), and the next piece starts with its copy up."""
        host, t = self.host, xh.shape[0]

        def host_part(rows: int | None) -> None:
            n = t if rows is None else min(rows, t)
            staging.out_cast[:n].copy_(host.forward(xh[:n], idh[:n], wh[:n], out=staging.out[:n]))

        self.graph_cut.cut(host_part, beside)
        return staging.dev[:t].copy_(staging.out_cast[:t], non_blocking=True)

    def routed(self, x: torch.Tensor, during: Callable[[], None] | None = None) -> torch.Tensor:
        """The routed experts' weighted sum; `during` runs once, while the CPU computes where it does."""
        w, ids, _ = self.gate(x)
        if self.keep_routing:
            self.last_expert_ids = ids.detach()
        if self.host is not None:
            return self._host_forward(x, w, ids, during)
        out = self._routed_on_device(x, w, ids)
        if during is not None:
            during()
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.shared_experts is None:
            return self.routed(x)
        shared: list[torch.Tensor] = []
        out = self.routed(x, lambda: shared.append(self.shared_experts(x)))
        return out + shared[0]

    def _routed_on_device(self, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant and not x.is_cuda:
            out = self._loop(x, w, ids)  # each expert's rows through the row-invariant linear, in expert order
        elif self.batch_invariant and self.w13 is not None and x.dtype == self.w13.dtype and use_triton(x):
            out = self._grouped_invariant(x, w, ids)  # never the fused decode kernel: its order is its own
        elif self.qdecode is not None and moe_decode_q.serves(x, ids.shape[1], *self.qdecode):
            out = moe_decode_q.moe_decode_q_triton(x, ids, w, *self.qdecode)
        elif self.fp8 is not None or self.quant is not None:
            out = self._grouped(x, w, ids)
        elif self.decode_kernels_serve(x, ids.shape[1], self.w13):
            out = k_moe.moe_experts_decode_triton(x, ids, w, self.w13, self.w2)
        elif (self.w13 is not None and not x.is_cuda and 0 < ids.numel() <= self.picked_pairs
              and x.dtype == self.w13.dtype):
            out = self._picked(x, w, ids)
        elif self.path == "grouped" and x.dtype == self.w13.dtype:
            out = self._grouped(x, w, ids)
        elif self.path == "masked":
            out = self._masked(x, w, ids)
        else:
            out = self._loop(x, w, ids)
        return out

    def decode_kernels_serve(self, x: torch.Tensor, pairs: int, w13: torch.Tensor | None) -> bool:
        """Whether the fused decode kernels run this step's experts over the stack `w13` with `pairs`
        experts a token (probed at pack; the stack's dtype; few tokens; CUDA)."""
        # The dtype test is on host metadata (no sync): under autocast x may differ from the weights.
        return (self.decode_kernel and w13 is not None and x.dtype == w13.dtype and use_triton(x)
                and k_moe.moe_decode_supported(x.shape[0], pairs, x.shape[1], w13.shape[1] // 2, x.dtype))

    def _loop(self, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor,
              expert: Callable[[int, torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """Each chosen expert over its rows, the group sizes read on the host; `expert(e, rows)`: another
        way to run expert e than its module."""
        expert = expert or (lambda e, rows: self.experts[e](rows))
        out = torch.zeros_like(x)
        flat_ids = ids.reshape(-1)
        order = flat_ids.argsort(stable=True)
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        token_of = order // ids.shape[1]
        weight_of = w.reshape(-1)[order]
        start = 0
        for e, c in enumerate(counts):
            if c == 0:
                continue
            tok = token_of[start : start + c]
            y = expert(e, x[tok]) * weight_of[start : start + c, None]
            out.index_add_(0, tok, y.to(x.dtype))
            start += c
        return out

    @property
    def picked_pairs(self) -> int:
        """The most (token, expert) pairs a CPU step runs through `_picked`: the grouped path's products
        run once per expert group (empty ones too), `_picked`'s once per pair, so pairs up to half the
        experts (8 experts of 256 x 128: 59 against 108 us at 2 pairs, even at 6, 409 against 259 at 16)."""
        return max(2, self.num_experts // 2)

    def _picked(self, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The CPU's few-token steps: each (token, expert) pair's two products on views of the stacked
        weights, its expert read from the ids on the host (no device to wait for). `_grouped` on the
        CPU runs a matmul per expert group, empty ones included, and gathering the chosen experts'
        weights for one batched matmul copies them; this reads each chosen expert once. The combine is
        `_grouped`'s: fp32 routing weights, each contribution rounded to x.dtype, a sum over k."""
        n, k = ids.shape
        pairs = [F.linear(silu_mul(F.linear(x[t : t + 1], self.w13[e])), self.w2[e])
                 for t, row in enumerate(ids.tolist()) for e in row]
        y = (torch.cat(pairs) * w.reshape(-1, 1)).to(x.dtype)
        return y.view(n, k, y.shape[-1]).sum(1)

    def _masked(self, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Every expert over every token, weighted by a routing weight that is 0 where the token did
        not choose it: E/k times the loop's work, but no host sync. Per token it adds the same terms
        as the loop in the same (expert) order, and adding an exact 0 changes nothing."""
        dense_w = torch.zeros(x.shape[0], self.num_experts, dtype=w.dtype, device=w.device).scatter_(1, ids, w)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out += (expert(x) * dense_w[:, e : e + 1]).to(x.dtype)
        return out

    def _grouped(self, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, streamed: tuple | None = None
                 ) -> torch.Tensor:
        """`streamed`: (w13, w2) the streamer brought up, float stacks or `QExpertStack`s, in place of the
        layer's own."""
        n, k = ids.shape
        # Pairs stably sorted by expert and the group ends, with no host sync (not bincount: on CUDA it
        # reads the ids' max on the host). Two launches on CUDA, argsort + searchsorted elsewhere.
        order, offs = k_sort.sort_tokens(ids, self.num_experts, workspace=scratch(self.sort_ws))
        xs = x[order // k]
        if self.fp8 is not None:  # --quantize fp8: the experts in e4m3 (strata.kernels.quant.fp8)
            from strata.kernels.quant import fp8

            w13, s13, w2, s2 = self.fp8
            h13 = fp8.grouped_matmul(xs, w13, s13, offs)
            y = fp8.grouped_silu_mul_matmul(h13, w2, s2, offs)
        elif self.quant is not None or (streamed is not None and not isinstance(streamed[0], torch.Tensor)):
            from strata.kernels.quant import moe_q  # GGUF experts kept quantized

            q13, q2 = streamed or self.quant
            h13 = moe_q.grouped_matmul(xs, q13, offs)
            y = moe_q.grouped_matmul(silu_mul(h13), q2, offs)
        else:
            w13, w2 = streamed or (self.w13, self.w2)
            h13 = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs)
            y = torch._grouped_mm(silu_mul(h13), w2.transpose(1, 2), offs=offs)
        # As the loop: fp32 routing weights, each expert's contribution rounded to x.dtype.
        y = (y * w.reshape(-1)[order, None]).to(x.dtype)
        # Back to (token, k) order and a plain sum over k: no atomics, so the result is deterministic.
        unsorted = torch.empty_like(y)
        unsorted[order] = y
        return unsorted.view(n, k, y.shape[-1]).sum(1)

    def _grouped_invariant(self, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """As `_grouped`, each step leaving a token's row independent of the batch: the sort only permutes
        (a stable argsort of the ids), the expert GEMMs are `moe_invariant.grouped_matmul_invariant`,
        SiLU·mul is elementwise, and the combine weights each contribution, rounds it to x.dtype (as
        `_grouped`) and adds the k of a token in slot order in fp32, rounded once
        (`moe_invariant.moe_combine_invariant`). No host sync, as `_grouped`."""
        order, offs = k_sort.sort_tokens(ids, self.num_experts, workspace=scratch(self.sort_ws))
        xs = x[order // ids.shape[1]]
        h13 = k_moe_inv.grouped_matmul_invariant(xs, self.w13, offs)
        y = k_moe_inv.grouped_matmul_invariant(silu_mul(h13), self.w2, offs)
        return k_moe_inv.moe_combine_invariant(y, order, w)
