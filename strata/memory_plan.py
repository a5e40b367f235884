"""Where a model's parts go: the GPU up to a budget, the routed experts that do not fit in host RAM.

Pure arithmetic on byte counts (no torch), so every rule is tested on the CPU with made-up sizes. The
engine measures the sizes (`ModelSizes`), asks for a plan before any weight reaches the device, prints
`Plan.table()`, and applies it at load. The order of placement:

1. what every step reads and nothing can replace: embeddings and LM head, attention and dense
   weights, routers, norms, the MTP head (`ModelSizes.fixed`);
2. the shared experts (run for every token);
3. scratch: activations, kernel workspaces, CUDA graphs (`PlanRequest.scratch_bytes`);
4. the KV pool at its demand (`--kv-size`, else one full context per slot) and recurrent states;
5. the routed experts, layer by layer, as many as fit; the layers that do not fit keep theirs in host
   RAM, counted from the first MoE layer (llama.cpp's `--n-cpu-moe N` names the first N), so N is
   the smallest that fits. `--cpu-moe` and `--n-cpu-moe N` fix the split instead;
6. whatever is left grows the KV pool up to `kv_tokens_max` (room for the prefix cache).

After the load the engine measures what the weights hold on the GPU. Where that is more than the plan's
estimate (`Plan.weight_bytes`), the plan is made again with the difference as one more fixed row
(`beyond_estimate`): a split the planner chose moves more layers' experts to RAM, and one given by
flag that no longer fits says which would.

When even 1-4 do not fit, `PlanError` says so in one line, with what would fit: a shorter context,
an int8 KV cache, more layers' experts in RAM.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

GiB = 1 << 30
MiB = 1 << 20


class PlanError(ValueError):
    """The model cannot start on this budget; the message says what would fit."""


@dataclass(frozen=True)
class ModelSizes:
    fixed: tuple[tuple[str, int], ...]  # (component, bytes) that stay on the GPU
    shared_experts: int = 0
    routed_experts: tuple[int, ...] = ()  # bytes of each MoE layer's routed experts, in layer order
    moe_layers: tuple[int, ...] = ()  # the model layer of each entry of routed_experts
    kv_bytes_per_token: int = 0  # every attention layer's K and V for one token, in the chosen KV format
    kv_bytes_per_token_int8: int | None = None  # the same with an int8 cache (None: already int8)
    state_bytes: int = 0  # recurrent (linear-attention) states of every slot, on the GPU

    def __post_init__(self) -> None:
        if len(self.routed_experts) != len(self.moe_layers):
            raise ValueError("routed_experts and moe_layers must have one entry per MoE layer")


@dataclass(frozen=True)
class PlanRequest:
    sizes: ModelSizes
    gpu_budget: int  # bytes the engine may place on the GPU (--gpu-memory, or the card's free memory x utilization)
    scratch_bytes: int  # activations, workspaces and graphs, estimated by the engine
    kv_tokens: int  # the KV pool's demand: --kv-size, else ctx x parallel
    kv_tokens_max: int | None = None  # grow the pool up to this with what is left (None: the demand only)
    context: int = 0  # tokens per sequence and sequences (for the suggestion of a shorter context)
    parallel: int = 1
    cpu_moe: bool = False  # every layer's routed experts in RAM
    n_cpu_moe: int | None = None  # the first N MoE layers' routed experts in RAM
    # Prompt chunks stream the experts held in RAM to the GPU: two buffers of the largest such layer.
    stream_experts: bool = False


@dataclass(frozen=True)
class PlanRow:
    component: str
    where: str  # "gpu" or "cpu"
    nbytes: int


@dataclass(frozen=True)
class Plan:
    rows: tuple[PlanRow, ...]
    cpu_moe_layers: tuple[int, ...]  # model layers whose routed experts live in host RAM
    kv_tokens: int
    gpu_budget: int
    auto: bool = True  # the split was chosen by the planner (not --cpu-moe / --n-cpu-moe)
    scratch_bytes: int = 0  # the scratch estimate inside gpu_bytes
    notes: tuple[str, ...] = field(default_factory=tuple)
    weight_bytes: int = 0  # the weights inside gpu_bytes (fixed, shared and routed experts), what a load holds

    @property
    def gpu_bytes(self) -> int:
        return sum(r.nbytes for r in self.rows if r.where == "gpu")

    @property
    def host_bytes(self) -> int:
        return sum(r.nbytes for r in self.rows if r.where == "cpu")

    def table(self) -> str:
        """The plan as the engine prints it at start-up: one row per component, then the totals."""
        width = max(len(r.component) for r in self.rows)
        lines = [f"memory plan (GPU budget {size_text(self.gpu_budget)}"
                 f"{'' if self.auto else ', experts placed by flag'}):"]
        lines += [f"  {r.component:<{width}}  {r.where}  {size_text(r.nbytes):>10}" for r in self.rows]
        lines.append(f"  {'total':<{width}}  gpu  {size_text(self.gpu_bytes):>10}"
                     + (f", cpu {size_text(self.host_bytes)}" if self.host_bytes else ""))
        return "\n".join(lines + [f"  {n}" for n in self.notes])


def size_text(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.1f} MiB"


def _layer_span(layers: tuple[int, ...]) -> str:
    if not layers:
        return "none"
    if list(layers) == list(range(layers[0], layers[-1] + 1)):
        return f"{layers[0]}" if len(layers) == 1 else f"{layers[0]}-{layers[-1]}"
    return ",".join(map(str, layers))


def plan_memory(req: PlanRequest) -> Plan:
    s = req.sizes
    n_moe = len(s.routed_experts)
    if req.n_cpu_moe is not None and not 0 <= req.n_cpu_moe:
        raise PlanError(f"--n-cpu-moe must be >= 0, got {req.n_cpu_moe}")
    kv_bytes = req.kv_tokens * s.kv_bytes_per_token
    base = sum(b for _, b in s.fixed) + s.shared_experts + req.scratch_bytes + kv_bytes + s.state_bytes
    if base > req.gpu_budget:
        raise PlanError(_too_small(req, base))
    room = req.gpu_budget - base
    if req.cpu_moe:
        n_cpu, auto = n_moe, False
    elif req.n_cpu_moe is not None:
        n_cpu, auto = min(req.n_cpu_moe, n_moe), False
        on_gpu = sum(s.routed_experts[n_cpu:]) + _stream_bytes(req, n_cpu)
        if on_gpu > room:
            fit = _smallest_split(req, room)
            raise PlanError(f"the routed experts of MoE layers {n_cpu}..{n_moe - 1} take {size_text(on_gpu)} on the GPU "
                            f"but {size_text(room)} is left after the rest: use --n-cpu-moe {fit} or more"
                            f"{' (or --cpu-moe)' if fit == n_moe else ''}")
    else:
        n_cpu, auto = _smallest_split(req, room), True
    gpu_experts = sum(s.routed_experts[n_cpu:])
    streaming = _stream_bytes(req, n_cpu)
    left = room - gpu_experts - streaming
    if left < 0:
        raise PlanError(f"with every routed expert in RAM, streaming them to the GPU for prompt chunks takes two buffers of "
                        f"{size_text(streaming // 2)}, which {size_text(room)} left does not hold: --expert-stream-tokens 0 "
                        "computes every step's experts on the CPU")
    kv_tokens = req.kv_tokens
    if req.kv_tokens_max is not None and req.kv_tokens_max > kv_tokens and s.kv_bytes_per_token and n_cpu == 0:
        # Every expert fits: the rest of the budget holds more K/V (the prefix cache keeps it).
        kv_tokens = min(req.kv_tokens_max, kv_tokens + left // s.kv_bytes_per_token)
    rows = [PlanRow(name, "gpu", b) for name, b in s.fixed if b]
    if s.shared_experts:
        rows.append(PlanRow("shared experts", "gpu", s.shared_experts))
    rows.append(PlanRow("scratch, workspaces, graphs", "gpu", req.scratch_bytes))
    rows.append(PlanRow(f"KV pool ({kv_tokens} tokens)", "gpu", kv_tokens * s.kv_bytes_per_token))
    if s.state_bytes:
        rows.append(PlanRow("recurrent states", "gpu", s.state_bytes))
    cpu_layers = s.moe_layers[:n_cpu]
    if n_moe:
        if n_cpu < n_moe:
            rows.append(PlanRow(f"routed experts, layers {_layer_span(s.moe_layers[n_cpu:])}", "gpu", gpu_experts))
        if n_cpu:
            rows.append(PlanRow(f"routed experts, layers {_layer_span(cpu_layers)}", "cpu",
                                sum(s.routed_experts[:n_cpu])))
        if streaming:
            rows.append(PlanRow("expert streaming buffers (2 layers)", "gpu", streaming))
    notes = ()
    if auto and n_cpu:
        notes = (f"{n_cpu} of {n_moe} MoE layers keep their routed experts in host RAM (as --n-cpu-moe {n_cpu})",)
    weights = sum(b for _, b in s.fixed) + s.shared_experts + gpu_experts
    return Plan(tuple(rows), tuple(cpu_layers), kv_tokens, req.gpu_budget, auto, req.scratch_bytes, notes, weights)


BEYOND = "weights beyond the estimate (measured at load)"


def beyond_estimate(sizes: ModelSizes, plan: Plan, measured: int) -> ModelSizes | None:
    """The sizes to plan again with when a load made by `plan` holds `measured` bytes of weights on the
    GPU: what it holds beyond the estimate as one more fixed row; None when the estimate held."""
    beyond = measured - plan.weight_bytes
    if beyond <= 0:
        return None
    fixed = tuple((name, b) for name, b in sizes.fixed if name != BEYOND)
    earlier = sum(b for name, b in sizes.fixed if name == BEYOND)
    return dataclasses.replace(sizes, fixed=fixed + ((BEYOND, earlier + beyond),))


def _stream_bytes(req: PlanRequest, n_cpu: int) -> int:
    """The streamer's two GPU buffers when the first n_cpu MoE layers keep their experts in RAM."""
    return 2 * max(req.sizes.routed_experts[:n_cpu]) if req.stream_experts and n_cpu else 0


def _smallest_split(req: PlanRequest, room: int) -> int:
    """The fewest first layers whose experts leave the GPU so that the others (and the streaming buffers)
    fit in `room`."""
    experts = req.sizes.routed_experts
    total = sum(experts)
    for n in range(len(experts) + 1):
        if total + _stream_bytes(req, n) <= room:
            return n
        if n < len(experts):
            total -= experts[n]
    return len(experts)


def _too_small(req: PlanRequest, base: int) -> str:
    s = req.sizes
    fixed = sum(b for _, b in s.fixed) + s.shared_experts + req.scratch_bytes + s.state_bytes
    kv_bytes = req.kv_tokens * s.kv_bytes_per_token
    msg = (f"the model does not fit the GPU budget of {size_text(req.gpu_budget)}: weights that must stay on the GPU, "
           f"scratch and states take {size_text(fixed)} and the KV pool of {req.kv_tokens} tokens {size_text(kv_bytes)}")
    if fixed >= req.gpu_budget:
        return msg + "; even without a KV cache it does not fit: a larger --gpu-memory or a smaller quantization"
    room = req.gpu_budget - fixed
    ways = []
    if s.kv_bytes_per_token and req.parallel:
        ctx = room // (s.kv_bytes_per_token * req.parallel)
        if ctx >= 1:
            ways.append(f"--ctx {ctx}" + (f" (with --parallel {req.parallel})" if req.parallel > 1 else ""))
    if s.kv_bytes_per_token_int8 and req.kv_tokens * s.kv_bytes_per_token_int8 <= room:
        ways.append("--kv int8")
    if req.parallel > 1 and s.kv_bytes_per_token and req.kv_tokens // req.parallel * s.kv_bytes_per_token <= room:
        ways.append("--parallel 1")
    return msg + (f"; would fit: {' or '.join(ways)}" if ways else "")
