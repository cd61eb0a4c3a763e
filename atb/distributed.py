"""Tensor parallelism over ``torch.distributed``: one model across N processes, each holding its shard.

Megatron-style, as ATB-Models splits a layer across devices:

* q/k/v (and their biases) are column-parallel by attention head: rank ``r``
  holds query heads ``[r*H/N, (r+1)*H/N)`` and the KV heads those read. With
  fewer KV heads than ranks, each KV head is replicated on the ``N/KH`` ranks
  whose query heads use it. ``o_proj`` is row-parallel over the same heads.
* gate/up are column-parallel over the MLP intermediate, ``down`` is row-parallel.
* A row-parallel projection yields a partial sum per rank; one all-reduce adds
  them. The residual and the o/down bias (rank 0 holds them) are added on rank
  0 before the sum, so the sum is the whole layer output on every rank.
* The embedding table and the LM head are vocab-parallel. A rank looks its
  tokens up in its rows (zeros for the others) and an all-reduce assembles the
  rows: exact, since every row comes from one rank. Logits are all-gathered
  where sampling needs them, or reduced to a distributed argmax for greedy
  decode (one (value, index) pair per sequence and rank instead of V/N logits).
* Norm weights are replicated. Each rank's paged KV cache holds its KV heads.

Every rank runs the same scheduler over the same requests, so all ranks make
the same collective calls in the same order. Gathered logits are the same
bytes on every rank; sampled tokens are still broadcast from rank 0, so that a
request without a seed (its generator drawn from each process's own global
RNG) cannot make the ranks diverge.

Weights: :func:`load_shard` builds the rank's model straight from safetensors
slices (``safe_open(...).get_slice``), never the full tensors: a skeleton of
the family's HF model for the rank's local shapes (fewer heads, a slice of the
intermediate and the vocab) is created on the meta device and each parameter
is filled from its slice. The same skeleton can be filled from a model already
loaded in memory (no memory saved then, but the same code path).

Failures: collectives run under the process group's timeout (set by
:func:`init_process_group`, or by whoever created the group). A rank that dies
or stops answering makes the others raise `TensorParallelError` (its closed
connection is usually seen at once; a hung peer within the timeout).
"""
from __future__ import annotations

import copy
import json
import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.nn.functional as F

DEFAULT_TIMEOUT_S = 60.0


class TensorParallelError(RuntimeError):
    """A collective failed: a peer rank exited, or did not answer within the process group's timeout."""


def init_process_group(backend: str | None = None, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """Joins the default process group from the launcher's environment (``torchrun`` sets ``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``). ``backend`` passes through to torch (default
    ``"gloo"``, the CPU transport; ``"hccl"``/``"nccl"`` where torch has them). ``timeout`` (seconds)
    bounds every collective: a peer that stops answering makes the others fail after it."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    _import_world_capturing_modules()
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise ValueError(f"tensor parallel: no process group is initialized and {', '.join(missing)} "
                         f"{'is' if len(missing) == 1 else 'are'} not set; launch with torchrun or call "
                         f"torch.distributed.init_process_group first")
    dist.init_process_group(backend or "gloo", timeout=timedelta(seconds=timeout))


def _import_world_capturing_modules() -> None:
    """Imports, before any process group exists, the torch modules that capture the default group at import.

    ``torch.distributed.nn.functional`` evaluates ``group=group.WORLD`` as a default argument when it is
    first imported (transformers imports it while reading a config). Imported after
    ``init_process_group``, that default is the live gloo group, held forever: ``destroy_process_group``
    then cannot join gloo's threads, and at interpreter exit a late collective's cleanup on one of them
    takes the GIL during finalization and aborts the process ("terminate called without an active
    exception"). Imported first, the default is a placeholder and nothing holds the group."""
    import torch.distributed.nn.functional  # noqa: F401


def _split(n: int, world: int, rank: int) -> tuple[int, int]:
    """Rank's [start, stop) of ``n`` items split as evenly as possible (the first ranks get one more)."""
    return rank * n // world, (rank + 1) * n // world


@dataclass(frozen=True)
class ShardPlan:
    """What rank ``rank`` of ``world`` holds: head ranges, the intermediate slice, the vocab slice."""

    rank: int
    world: int
    head_dim: int
    heads: tuple[int, int]       # query heads [start, stop)
    kv_heads: tuple[int, int]    # KV heads [start, stop)
    intermediate: tuple[int, int]
    vocab: tuple[int, int]
    num_heads: int               # of the whole model
    num_kv_heads: int
    intermediate_total: int
    vocab_total: int

    @classmethod
    def for_spec(cls, spec, rank: int, world: int) -> "ShardPlan":
        """The plan for an adapter's `ModelSpec`; ValueError when the heads cannot be split over ``world``."""
        H, KH = spec.num_heads, spec.num_kv_heads
        if H % world:
            ok = [n for n in range(1, H + 1) if H % n == 0]
            raise ValueError(f"tensor parallel: num_attention_heads={H} is not divisible by tp={world} (each rank "
                             f"holds whole query heads); tp must divide {H}: one of {ok}")
        if KH >= world and KH % world:
            raise ValueError(f"tensor parallel: num_key_value_heads={KH} is not divisible by tp={world} (each rank "
                             f"holds whole KV heads)")
        if KH < world and world % KH:
            raise ValueError(f"tensor parallel: tp={world} exceeds num_key_value_heads={KH} and is not a multiple "
                             f"of it (each KV head is replicated on tp/num_key_value_heads ranks)")
        hs = H // world
        h0 = rank * hs
        if KH >= world:
            kv = (rank * KH // world, (rank + 1) * KH // world)
        else:
            g = rank * KH // world   # the one KV head this rank's query heads read
            kv = (g, g + 1)
        return cls(rank=rank, world=world, head_dim=spec.head_dim, heads=(h0, h0 + hs), kv_heads=kv,
                   intermediate=_split(spec.intermediate, world, rank), vocab=_split(spec.vocab, world, rank),
                   num_heads=H, num_kv_heads=KH, intermediate_total=spec.intermediate, vocab_total=spec.vocab)

    def local_config(self, config):
        """The HF config of this rank's model: the same family and layout with the rank's head counts,
        intermediate and vocab (an HF model built from it has exactly the shard's shapes)."""
        local = copy.deepcopy(config)
        local.num_attention_heads = self.heads[1] - self.heads[0]
        local.num_key_value_heads = self.kv_heads[1] - self.kv_heads[0]
        local.head_dim = self.head_dim
        local.intermediate_size = self.intermediate[1] - self.intermediate[0]
        local.vocab_size = self.vocab[1] - self.vocab[0]
        return local

    def slice_of(self, role: str) -> tuple[int, int, int, int] | None:
        """``(dim, start, stop, full)`` of a parameter role (a `LayerWeights` field or embed / lm_head /
        final_norm) along its split dimension; None when replicated."""
        D = self.head_dim
        q = (self.heads[0] * D, self.heads[1] * D, self.num_heads * D)
        kv = (self.kv_heads[0] * D, self.kv_heads[1] * D, self.num_kv_heads * D)
        inter = (*self.intermediate, self.intermediate_total)
        vocab = (*self.vocab, self.vocab_total)
        table = {"q": (0, *q), "q_bias": (0, *q), "k": (0, *kv), "k_bias": (0, *kv), "v": (0, *kv),
                 "v_bias": (0, *kv), "o": (1, *q), "gate": (0, *inter), "gate_bias": (0, *inter), "up": (0, *inter),
                 "up_bias": (0, *inter), "down": (1, *inter), "embed": (0, *vocab), "lm_head": (0, *vocab)}
        return table.get(role)

    def holds(self, role: str) -> bool:
        """False for the row-parallel biases on ranks other than 0 (added once, before the sum)."""
        return self.rank == 0 or role not in ("o_bias", "down_bias")


def _settings_dict(config, **settings) -> dict:
    """What must agree across ranks: the model config (without paths and versions) and the engine settings."""
    d = {k: v for k, v in config.to_dict().items() if not k.startswith("_") and k != "transformers_version"}
    d = json.loads(json.dumps(d, sort_keys=True, default=str))
    d.update({f"engine.{k}": str(v) for k, v in settings.items()})
    return d


class TensorParallel:
    """One rank's view of its tensor-parallel group: the plan and the collectives the executors call.

    ``comm_seconds`` / ``comm_calls`` accumulate the wall time spent inside collectives
    (``reset_comm_stats`` zeroes them): the per-step communication overhead.
    """

    def __init__(self, group=None, timeout: float | None = None):
        import torch.distributed as dist

        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.timeout = timeout   # seconds, when known (the group was created here); for error messages
        self.plan: ShardPlan | None = None
        self.reset_comm_stats()

    @classmethod
    def resolve(cls, tp, tp_group) -> "TensorParallel | None":
        """From ``TransformerInfer``'s ``tp`` / ``tp_group``: None for a single process.

        ``tp_group`` names the group; else ``tp`` > 1 asks for the default group (joined from torchrun's
        environment when not yet initialized). ``tp``, when given, must equal the group's size."""
        import torch.distributed as dist

        if tp is not None and (isinstance(tp, bool) or not isinstance(tp, int) or tp < 1):
            raise ValueError(f"TransformerInfer: tp must be a positive int, got {tp!r}")
        if tp_group is None and (tp is None or tp == 1):
            return None
        if not dist.is_available():
            raise RuntimeError("TransformerInfer: tensor parallelism needs torch.distributed, which this torch "
                               "build lacks")
        timeout = None
        if tp_group is None and not dist.is_initialized():
            init_process_group()
            timeout = DEFAULT_TIMEOUT_S
        world = dist.get_world_size(tp_group)
        if tp is not None and tp != world:
            raise ValueError(f"TransformerInfer: tp={tp} but the process group has {world} ranks")
        return cls(tp_group, timeout) if world > 1 else None

    # ---- collectives ----------------------------------------------------------------------------
    def reset_comm_stats(self) -> None:
        self.comm_seconds = 0.0
        self.comm_calls = 0

    def _run(self, op: str, fn):
        t0 = time.perf_counter()
        try:
            out = fn()
        except RuntimeError as e:   # torch's DistBackendError / gloo errors are RuntimeErrors
            within = f"within the group's timeout of {self.timeout:g} s" if self.timeout else "within the group's timeout"
            raise TensorParallelError(f"tensor parallel: {op} failed on rank {self.rank} of {self.world} (a peer rank "
                                      f"exited or did not answer {within}): {str(e).splitlines()[0]}") from e
        self.comm_seconds += time.perf_counter() - t0
        self.comm_calls += 1
        return out

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sums ``t`` over the ranks, in place; returns it."""
        self._run("all_reduce", lambda: self._dist.all_reduce(t, group=self.group))
        return t

    def embedding(self, tokens: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel lookup: this rank's rows ``table`` (its vocab slice), zeros elsewhere, summed."""
        v0 = self.plan.vocab[0]
        local = tokens.long() - v0
        outside = (local < 0) | (local >= table.shape[0])
        x = F.embedding(local.clamp(0, table.shape[0] - 1), table)
        x.masked_fill_(outside.unsqueeze(1), 0)
        return self.all_reduce(x)

    def plan_for(self, spec) -> ShardPlan:
        """Sets and returns this rank's plan for an adapter's `ModelSpec` (ValueError if it cannot be split)."""
        self.plan = ShardPlan.for_spec(spec, self.rank, self.world)
        return self.plan

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        """``[T, V/N]`` logits of this rank's vocab slice -> ``[T, V]`` on every rank."""
        V = self.plan.vocab_total
        splits = [_split(V, self.world, r) for r in range(self.world)]
        padded = local.new_zeros(local.shape[0], max(b - a for a, b in splits))   # all_gather wants one size
        padded[:, :local.shape[1]] = local
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        self._run("all_gather (logits)", lambda: self._dist.all_gather(parts, padded, group=self.group))
        return torch.cat([p[:, :b - a] for p, (a, b) in zip(parts, splits)], dim=1)

    def argmax(self, local: torch.Tensor, argmax: torch.Tensor | None = None) -> list[int]:
        """Greedy tokens over the whole vocab from each rank's ``[B, V/N]`` logits (``argmax``: this rank's
        local argmax, if already computed). Ties go to the lowest token id, as ``torch.argmax``."""
        idx = local.argmax(dim=1) if argmax is None else argmax.long()
        vals = local.gather(1, idx.unsqueeze(1)).squeeze(1)
        pair = torch.stack([vals.double(), (idx + self.plan.vocab[0]).double()], dim=1)
        parts = [torch.empty_like(pair) for _ in range(self.world)]
        self._run("all_gather (argmax)", lambda: self._dist.all_gather(parts, pair, group=self.group))
        allp = torch.stack(parts)                      # [world, B, 2]; ranks in vocab order
        best = allp[:, :, 0].argmax(dim=0)             # first maximum: the lowest rank, so the lowest id
        return allp[best, torch.arange(allp.shape[1]), 1].long().tolist()

    def broadcast_tokens(self, tokens: list[int]) -> list[int]:
        """Rank 0's tokens on every rank."""
        t = torch.tensor(tokens, dtype=torch.int64)
        src = 0 if self.group is None else self._dist.get_global_rank(self.group, 0)
        self._run("broadcast (tokens)", lambda: self._dist.broadcast(t, src, group=self.group))
        return t.tolist()

    def check_same(self, config, **settings) -> None:
        """ValueError on every rank when any rank's model config or engine settings differ from rank 0's."""
        mine = _settings_dict(config, **settings)
        every: list = [None] * self.world
        self._run("all_gather_object (config check)",
                  lambda: self._dist.all_gather_object(every, mine, group=self.group))
        ref = every[0]
        bad = []
        for r, d in enumerate(every[1:], start=1):
            keys = sorted(k for k in set(ref) | set(d) if ref.get(k) != d.get(k))
            if keys:
                shown = ", ".join(f"{k}: {ref.get(k)!r} vs {d.get(k)!r}" for k in keys[:6])
                bad.append(f"rank {r} differs from rank 0 in {shown}" + (" ..." if len(keys) > 6 else ""))
        if bad:
            raise ValueError("tensor parallel: the ranks were given different models or settings: " + "; ".join(bad))


# ---- weights ---------------------------------------------------------------------------------------
class _SafetensorsSource:
    """Tensors of a local safetensors checkpoint (any number of files), read by slice.

    ``safe_open`` maps a file; the slices are copied out (so the rank owns its shard and nothing keeps the
    mapping alive) and one file is mapped at a time: read a file's tensors together (``file_of`` orders
    them) and the pages of the whole checkpoint are never resident at once."""

    def __init__(self, path: str):
        from safetensors import safe_open

        self._safe_open = safe_open
        self._path = path
        names = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not names:
            raise ValueError(f"load_shard: no .safetensors files in {path}")
        self._where: dict[str, str] = {}
        self._shapes: dict[str, tuple] = {}
        for n in names:
            with safe_open(os.path.join(path, n), framework="pt") as f:
                for key in f.keys():
                    self._where[key] = n
                    self._shapes[key] = tuple(f.get_slice(key).get_shape())
        self._open: tuple[str, object] | None = None

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def file_of(self, name: str) -> str:
        return self._where.get(name, "")

    def shape(self, name: str) -> tuple:
        return self._shapes[name]

    def read(self, name: str, dim: int | None, start: int, stop: int) -> torch.Tensor:
        file = self._where[name]
        if self._open is None or self._open[0] != file:
            self.close()
            self._open = (file, self._safe_open(os.path.join(self._path, file), framework="pt"))
        sl = self._open[1].get_slice(name)
        if dim is None:
            t = sl[:]
        else:
            t = sl[start:stop] if dim == 0 else sl[:, start:stop]
        return t.clone()   # a slice may be a view of the mapping

    def close(self) -> None:
        self._open = None   # drops the handle: unmapped

    def first_dtype(self) -> torch.dtype:
        t = self.read(next(iter(self._where)), 0, 0, 1).dtype
        self.close()
        return t


class _ModelSource:
    """Parameters of a model already in memory, read by the same slicing (copied out)."""

    def __init__(self, model):
        self._t = {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}

    def __contains__(self, name: str) -> bool:
        return name in self._t

    def shape(self, name: str) -> tuple:
        return tuple(self._t[name].shape)

    def read(self, name: str, dim: int | None, start: int, stop: int) -> torch.Tensor:
        t = self._t[name]
        if dim is not None:
            t = t[start:stop] if dim == 0 else t[:, start:stop]
        return t.clone()

    def first_dtype(self) -> torch.dtype:
        return next(iter(self._t.values())).dtype

    def file_of(self, name: str) -> str:
        return ""

    def close(self) -> None:
        pass


def load_config(path: str):
    """The HF config of a local model directory."""
    from transformers import AutoConfig

    if not os.path.isdir(path):
        raise ValueError(f"TransformerInfer: a model path must be a local HF model directory (config.json and "
                         f"*.safetensors), got {path}")
    return AutoConfig.from_pretrained(path)


def _roles(adapter, model) -> dict[int, str]:
    """id(parameter) -> its role, through the family adapter (so every family's module tree is covered)."""
    roles = {id(adapter.final_norm(model)): "final_norm", id(adapter.lm_head(model)): "lm_head",
             id(adapter.embed_tokens(model)): "embed"}
    for i in range(adapter.spec.num_layers):
        for field, p in adapter.layer_weights(model, i).tensors().items():
            roles[id(p)] = field
    return roles


def load_shard(source, config, plan: ShardPlan, dtype: torch.dtype | None = None):
    """This rank's model: an HF ``*ForCausalLM`` of ``plan.local_config(config)`` whose parameters are its
    slices of ``source`` (a local safetensors directory, or a loaded model of ``config``), in ``dtype``
    (default: the source's). Nothing but the slices is ever materialized."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from atb.registry import get_adapter

    src = _SafetensorsSource(source) if isinstance(source, (str, os.PathLike)) else _ModelSource(source)
    dtype = dtype or src.first_dtype()
    local = plan.local_config(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(local)
    adapter = get_adapter(local)
    roles = _roles(adapter, model)
    # Every place a parameter is registered (a tied LM head is the embedding's Parameter under two names).
    owners: dict[int, list] = {}
    for mod_name, module in model.named_modules():
        for key, p in module._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((module, key, f"{mod_name}.{key}" if mod_name else key, p))
    work = []
    for places in owners.values():
        names = [name for _, _, name, _ in places]
        present = [n for n in names if n in src]
        p = places[0][3]
        if roles.get(id(p)) is None:
            raise ValueError(f"load_shard: no sharding rule for parameter {names[0]}")
        if not present and plan.holds(roles[id(p)]):
            raise ValueError(f"load_shard: the checkpoint has no tensor {' or '.join(names)}")
        work.append((present[0] if present else names[0], p, places))
    for name, p, places in sorted(work, key=lambda w: src.file_of(w[0])):   # file by file
        new = _load_param(src, name, p, roles[id(p)], plan, dtype)
        for module, key, _, _ in places:
            module.register_parameter(key, new)
    src.close()
    # The rotary module's buffers are derived from the config, not stored: rebuilt on the CPU.
    rotary = adapter.rotary(model)
    with torch.device("cpu"):
        new_rotary = type(rotary)(config=local)
    parent = adapter.decoder(model)
    for attr, mod in parent.named_children():
        if mod is rotary:
            setattr(parent, attr, new_rotary)
    left = [n for n, b in model.named_buffers() if b.is_meta]
    if left:
        raise ValueError(f"load_shard: {type(model).__name__} has buffers atb does not know how to build: "
                         f"{', '.join(left)}")
    if isinstance(source, (str, os.PathLike)):
        try:
            model.generation_config = GenerationConfig.from_pretrained(source)
        except OSError:
            pass   # no generation_config.json: the config's eos_token_id serves
    else:
        model.generation_config = copy.deepcopy(getattr(source, "generation_config", model.generation_config))
    return model.eval()


def _load_param(src, name: str, p, role: str, plan: ShardPlan, dtype) -> torch.nn.Parameter | None:
    """The rank's slice of ``name`` for the skeleton parameter ``p`` (None where the rank holds no copy)."""
    if not plan.holds(role):
        return None
    cut = plan.slice_of(role)
    full = list(p.shape)
    if cut is not None:
        full[cut[0]] = cut[3]
    have = src.shape(name)
    if tuple(have) != tuple(full):
        raise ValueError(f"load_shard: checkpoint tensor {name} has shape {tuple(have)}, the config implies "
                         f"{tuple(full)}")
    t = src.read(name, *(cut[:3] if cut else (None, 0, 0)))
    return torch.nn.Parameter(t.to(dtype).contiguous(), requires_grad=False)
