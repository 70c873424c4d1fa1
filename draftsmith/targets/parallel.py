"""How one replica of the target is laid out over devices, and which ranks act for it.

`target.parallel` (tp, pp, ep) becomes transformers' own `DistributedConfig`: the target is sharded
at load time on a torch `DeviceMesh` (NCCL on GPUs, gloo on CPU), launched by `torchrun` or
`accelerate launch`. Data parallelism is what the world size leaves, dp = world / (tp * pp): the
mesh is (pp, dp, tp) in that order, so ranks r with the same r // tp form one tensor-parallel
group. The ranks of one replica see the same batch and compute the same outputs (the residual
stream and the logits are replicated across a tensor-parallel group); the first of them writes."""
from __future__ import annotations

import os
from dataclasses import dataclass

# What each stage can run with. Pipeline stages hold a slice of the decoder layers on each rank, so a
# stage that reads hidden states through hooks on every layer (capture, training, the runtime) cannot
# use them; regeneration only needs the logits, which transformers hands to every stage.
PIPELINE_STAGES = {"regen"}
WHAT_WORKS_INSTEAD = ("use tp (and ep for a mixture-of-experts target) for this stage: tp 8 holds a 140 GB "
                      "target on 8 x 80 GB, tp 16 / ep 16 over two nodes a 671B one")


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    ep: int = 1
    world: int = 1
    rank: int = 0

    @property
    def replica_size(self) -> int:
        return self.tp * self.pp

    @property
    def dp(self) -> int:
        return self.world // self.replica_size

    @property
    def replica(self) -> int:
        """Which data-parallel replica this rank belongs to (the mesh's dp coordinate)."""
        return (self.rank // self.tp) % self.dp

    @property
    def is_writer(self) -> bool:
        """Exactly one rank per replica writes: tp coordinate 0 of pipeline stage 0."""
        return self.rank % self.tp == 0 and self.rank // (self.dp * self.tp) == 0

    @property
    def sharded(self) -> bool:
        return self.replica_size > 1 or self.ep > 1

    def distributed_config(self):
        """transformers' DistributedConfig for this layout (None: every rank loads a whole replica).
        Replicas are `dp_replicate_size` so the mesh spans the world, as transformers requires."""
        if not self.sharded:
            return None
        from transformers.distributed import DistributedConfig
        return DistributedConfig(tp_size=self.tp, pp_size=self.pp, ep_size=self.ep, dp_replicate_size=self.dp)

    def describe(self) -> str:
        return f"tp {self.tp} x pp {self.pp} (ep {self.ep}), dp {self.dp}: {self.world} process(es)"


def is_sharded(tensor) -> bool:
    """A DTensor: one rank's shard of a tensor-parallel (or expert-parallel) weight or activation."""
    return hasattr(tensor, "full_tensor")


def full(tensor):
    """A tensor-parallel weight (a DTensor shard) gathered to the full tensor; plain tensors as they are."""
    return tensor.full_tensor() if is_sharded(tensor) else tensor


def num_experts(config) -> int:
    """Routed experts of a mixture-of-experts config (0 for a dense one), whatever the family calls them."""
    text = config.get_text_config()
    return next((getattr(text, k) for k in ("n_routed_experts", "num_experts", "num_local_experts")
                 if getattr(text, k, None)), 0)


def shard_like(value, param):
    """A whole tensor cut to this rank's slice of `param`'s layout (no communication): how a checkpoint of
    gathered tensors loads back into tensor-parallel shards."""
    if not is_sharded(param) or is_sharded(value) or value.shape != param.shape:
        return value
    from torch.distributed.tensor import distribute_tensor
    return distribute_tensor(value.to(param.device), param.device_mesh, param.placements, src_data_rank=None)


def clip_grad_norm(parameters, max_norm: float):
    """torch's clip_grad_norm_ over a mix of plain tensors and DTensor shards (LoRA adapters on a
    tensor-parallel target), which torch's own takes as local norms: each norm is made whole over its
    mesh first. Returns the total norm."""
    import torch
    grads = [p.grad for p in parameters if p.grad is not None]
    total = torch.linalg.vector_norm(torch.stack([full(torch.linalg.vector_norm(g.float())) for g in grads]))
    scale = float((max_norm / (total + 1e-6)).clamp(max=1.0))
    for grad in grads:
        grad.mul_(scale)
    return total


def replica_group(layout: Layout):
    """The process group of this rank and its counterparts in the other replicas (the same tp coordinate):
    what averages a gradient DDP cannot see (a tensor-parallel adapter's shard) over data parallelism.
    Every rank creates every group, in the same order, as torch requires."""
    import torch.distributed as dist
    mine = None
    for coordinate in range(layout.tp):
        group = dist.new_group([coordinate + layout.tp * d for d in range(layout.dp)])
        if layout.rank % layout.tp == coordinate:
            mine = group
    return mine


def average_over_replicas(parameters, group, dp: int) -> None:
    """Each gradient (a DTensor's local shard, or a plain tensor) averaged over the replicas in `group`."""
    import torch.distributed as dist
    for param in parameters:
        if param.grad is not None:
            local = param.grad.to_local() if is_sharded(param.grad) else param.grad
            dist.all_reduce(local, group=group)
            local.div_(dp)


def whole_optimizer_state(optimizer) -> None:
    """Optimizer checkpoints hold whole tensors whatever the layout: state_dict() gathers the moments
    of DTensor parameters (a collective: accelerate calls it on every rank) and load_state_dict() cuts
    them back to this rank's slice, so a run resumes on the layout it was saved with or another."""
    params = [p for group in optimizer.param_groups for p in group["params"]]

    def gather(_, state):
        state["state"] = {i: {k: full(v) for k, v in s.items()} for i, s in state["state"].items()}
        return state

    def scatter(_, state):
        state["state"] = {i: {k: shard_like(v, params[int(i)]) for k, v in s.items()} for i, s in state["state"].items()}
        return state
    optimizer.register_state_dict_post_hook(gather)
    optimizer.register_load_state_dict_pre_hook(scatter)


def one_replica(layout: Layout, stage: str) -> None:
    """Stages that run one replica (validation, economics) refuse extra data-parallel ranks."""
    if layout.dp > 1:
        raise ValueError(f"target.parallel tp={layout.tp} pp={layout.pp}: {stage} runs one replica of the target, but "
                         f"{layout.world} processes make dp {layout.dp}; launch tp * pp = {layout.replica_size} "
                         f"processes (torchrun --nproc-per-node {layout.replica_size})")


def world_and_rank() -> tuple[int, int]:
    return int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))


def is_first_rank() -> bool:
    """The rank that writes what every rank of a launch computed alike (rank 0; the only one without a launch)."""
    return world_and_rank()[1] == 0


def rank_device(fallback):
    """This rank's GPU under torchrun/accelerate (LOCAL_RANK), else `fallback`."""
    import torch
    return torch.device(f"cuda:{os.environ.get('LOCAL_RANK', 0)}") if torch.cuda.is_available() else fallback


def layout_for(recipe, stage: str) -> Layout:
    """The recipe's layout in this launch, refused at start (before any weight is read) where it cannot
    run: a world size that is not a multiple of tp * pp, pipeline stages where hooks read every layer,
    pipeline with data parallelism (transformers shards replicas with FSDP2, which it cannot combine
    with pipeline stages)."""
    par = recipe.target.parallel
    world, rank = world_and_rank()
    layout = Layout(par.tp, par.pp, par.ep, world, rank)
    where = f"target.parallel tp={par.tp} pp={par.pp} ep={par.ep}"
    if world % layout.replica_size:
        raise ValueError(f"{where}: {world} process(es) launched, not a multiple of tp * pp = {layout.replica_size}; "
                         f"launch tp * pp * dp processes (torchrun --nproc-per-node ...)")
    if layout.pp > 1 and stage not in PIPELINE_STAGES:
        raise ValueError(f"{where}: {stage} reads hidden states from decoder layers that pipeline stages spread over "
                         f"ranks; pp serves regeneration (draftsmith data --regen) only; {WHAT_WORKS_INSTEAD}")
    if layout.pp > 1 and layout.dp > 1:
        raise ValueError(f"{where}: {world} processes make dp {layout.dp} replicas, and transformers cannot combine "
                         "pipeline stages with data-parallel replicas; launch exactly tp * pp processes")
    return layout


def check_config(layout: Layout, config, where: str = "target.parallel") -> None:
    """Shapes the tensor-parallel plan splits must divide by tp; experts by ep. Read from the config
    before loading, so a bad layout fails in seconds, not after reading the weights."""
    text = config.get_text_config()
    for key in ("num_attention_heads", "num_key_value_heads"):
        value = getattr(text, key, None)
        if value and layout.tp > 1 and value % layout.tp:
            raise ValueError(f"{where}: tp={layout.tp} does not divide the target's {key}={value}; "
                             f"choose a tp that does ({', '.join(str(t) for t in range(1, value + 1) if value % t == 0)})")
    experts = num_experts(config)
    if layout.ep > 1 and not experts:
        raise ValueError(f"{where}: ep={layout.ep} but the target has no experts (not a mixture-of-experts model); set ep=1")
    if layout.ep > 1 and experts % layout.ep:
        raise ValueError(f"{where}: ep={layout.ep} does not divide the target's {experts} experts")
    if layout.tp > 1 and not getattr(text, "base_model_tp_plan", None):
        raise ValueError(f"{where}: tp={layout.tp} but transformers has no tensor-parallel plan for "
                         f"{type(text).__name__}; use tp=1")
    if layout.pp > 1 and not getattr(text, "base_model_pp_plan", None):
        raise ValueError(f"{where}: pp={layout.pp} but transformers has no pipeline plan for {type(text).__name__}; use pp=1")


def init_process_group() -> None:
    """The process group of a torchrun/accelerate launch: NCCL on GPUs, gloo on CPU. transformers
    builds its mesh on it."""
    import torch
    import torch.distributed as dist
    if dist.is_available() and not dist.is_initialized() and world_and_rank()[0] > 1:
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")


def shutdown() -> None:
    """Ends this process's part of a finished multi-process stage: every rank waits for the others, then
    destroys its process groups while the interpreter is whole. Left to interpreter exit, gloo's worker
    threads can abort the process (SIGABRT, 'terminate called without an active exception') after all
    its work is written. Called on success only: a rank that failed must not wait on the others."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def barrier() -> None:
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
