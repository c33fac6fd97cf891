"""Checkpoints of a :class:`~fastcoll.optim.ShardedOptimizer`: the standard format, and per-rank shards.

* :func:`full_state_dict` / :func:`load_full_state_dict`: the inner optimizer
  class's own state dict, as if it had never been sharded (per-parameter
  state keyed by index in the wrapped optimizer's numbering, full tensors),
  the same on every rank. A plain ``torch.optim.AdamW`` loads it in one
  process; a ShardedOptimizer loads it at any world size (each rank keeps
  its pieces). Making it gathers the whole state on every rank.
* :func:`sharded_state_dict` / :func:`load_sharded_state_dicts`: for models
  whose whole state does not fit one rank. Each rank's dict holds only its
  pieces (``[lo, hi)`` of a parameter in its memory order, with their state)
  plus the layout (every parameter's shape and strides, the param groups),
  and no value of another rank: a run at any world size loads the list of
  every rank's dicts, each rank taking the elements it owns now.
  :func:`save_sharded` / :func:`load_sharded` store them as one file per
  rank (``optim-rank00003-of-00008.pt``, ``torch.save`` format, loadable with
  ``weights_only=True``); :func:`full_from_sharded` turns a directory into
  the standard format without any process group (to resume on one process
  with a plain torch optimizer).

State entries are told apart by shape: a tensor shaped like its parameter
(a 1-D tensor of a piece's length, in the shards) is elementwise and split;
anything else (``step``, NAdam's ``mu_product``) is per-parameter and the same
in every piece.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..reducer.shards import flat_view

__all__ = [
    "FORMAT",
    "MASTER",
    "full_from_directory",
    "full_from_sharded",
    "full_state_dict",
    "load_full_state_dict",
    "load_sharded",
    "load_sharded_state_dicts",
    "save_sharded",
    "sharded_state_dict",
]

FORMAT = "fastcoll.ShardedOptimizer/1"


def _is_elementwise(value: Any, numel: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == numel


def _groups(opt: Any) -> List[Dict[str, Any]]:
    """The param groups in the standard format: hyperparameters, and the parameters' indices."""
    out, start = [], 0
    for g, ps in zip(opt.param_groups, opt._groups_params):
        out.append({**{k: v for k, v in g.items() if k != "params"}, "params": list(range(start, start + len(ps)))})
        start += len(ps)
    return out


#: The key of a piece's float32 master weights in the state dicts (``ShardedOptimizer(master_dtype=torch.float32)``).
MASTER = "fastcoll_master"


def _piece_states(opt: Any) -> List[Tuple[int, Any, Dict[str, Any]]]:
    """(bucket position, piece, its state) for this rank's pieces that have state; master weights included."""
    state = opt._local.state
    out = []
    for k, ((pos, pc), t) in enumerate(zip(opt._pieces, opt._shard_params)):
        st = dict(state[t]) if t in state and state[t] else {}
        if opt._values.has_master(k):
            st[MASTER] = t
        if st:
            out.append((pos, pc, st))
    return out


# --------------------------------------------------------------- standard format


def full_state_dict(opt: Any) -> Dict[str, Any]:
    """The standard state dict of ``opt``'s inner optimizer class, whole, on every rank (a collective).

    Raises:
        RuntimeError: naming fastcoll, when a collective fails (most often: not every rank called it).
    """
    try:
        return _full_state_dict(opt)
    except RuntimeError as exc:
        if "fastcoll" in str(exc):
            raise
        raise RuntimeError(
            "fastcoll.ShardedOptimizer.state_dict(): gathering the state from every rank failed. It is a collective: "
            "every rank must call it (e.g. save on every rank and write the file on one; transformers' Trainer: "
            f"fastcoll.integrations.transformers). The collective said: {exc}"
        ) from exc


def _full_state_dict(opt: Any) -> Dict[str, Any]:
    opt.finish_param_sync()
    opt._push_hyperparameters()
    r = opt.reducer
    index_of_param = {i: k for k, i in enumerate(opt._order_index) if i is not None}
    # Small metadata first: which parameters have state, each elementwise key's dtype per bucket (a model's buckets
    # can differ: float32 LayerNorms beside bfloat16 layers, complex parameters), the per-parameter values.
    mine: Dict[int, Dict[str, Any]] = {}
    keys: Dict[Tuple[int, str], torch.dtype] = {}
    has: Dict[str, List[int]] = {}  # key -> parameters with that elementwise entry
    pieces_by_bucket: Dict[int, List[Tuple[Any, Dict[str, Any]]]] = {}
    for pos, pc, st in _piece_states(opt):
        pieces_by_bucket.setdefault(pos, []).append((pc, st))
        entry = mine.setdefault(pc.param, {})
        for k, v in st.items():
            if _is_elementwise(v, pc.numel):
                keys[(pos, k)] = v.dtype
                has.setdefault(k, []).append(pc.param)
            else:
                entry[k] = v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v
    gathered = r.comm.all_gather_object((mine, keys, has), "optimizer state_dict(): which state each rank holds")
    scalars: Dict[int, Dict[str, Any]] = {}
    all_keys: Dict[Tuple[int, str], torch.dtype] = {}
    with_key: Dict[str, set] = {}
    for m, ks, hs in gathered:
        for i, entry in m.items():
            scalars.setdefault(i, {}).update(entry)
        for (pos, k), dtype in ks.items():
            if all_keys.setdefault((pos, k), dtype) != dtype:  # every rank sees the same union: all raise alike
                raise RuntimeError(
                    f"fastcoll.ShardedOptimizer.state_dict(): the optimizer state '{k}' of bucket {pos} is "
                    f"{all_keys[(pos, k)]} on some pieces and {dtype} on others; one bucket's state must share a dtype"
                )
        for k, ps in hs.items():
            with_key.setdefault(k, set()).update(ps)
    # Elementwise entries: one all-gather per bucket and key of every rank's range.
    full: Dict[int, Dict[str, torch.Tensor]] = {i: dict(v) for i, v in scalars.items()}
    for bs in opt._layout.buckets:
        b = r.buckets[bs.pos]
        with_state = [i for i in b.param_indices if i in scalars]
        if not with_state or not bs.padded:
            continue
        for key in sorted(k for pos, k in all_keys if pos == bs.pos):
            dtype = all_keys[(bs.pos, key)]
            buf = torch.zeros(bs.padded, dtype=dtype, device=b.device)
            own = buf[bs.start : bs.start + bs.shard]
            for pc, st in pieces_by_bucket.get(bs.pos, []):
                if key in st:
                    own[pc.at : pc.at + pc.numel].copy_(st[key])
            if r.comm.active:
                r.comm.wait(r.comm.all_gather(buf, own, f"optimizer state {key} of bucket {bs.pos}"), "optimizer state")
            for i, off in zip(b.param_indices, b.offsets):
                if i in scalars and i in with_key.get(key, ()):
                    p = r.params[i]
                    out = torch.empty_like(p, dtype=dtype)
                    flat_view(out).copy_(buf[off : off + p.numel()])
                    full[i][key] = out
    state = {index_of_param[i]: st for i, st in full.items()}
    state.update({k: dict(st) for k, st in opt._outside_state.items()})
    return {"state": dict(sorted(state.items())), "param_groups": _groups(opt)}


def load_full_state_dict(opt: Any, state_dict: Dict[str, Any]) -> None:
    """Load a standard state dict of the inner class; each rank keeps the pieces it owns."""
    groups = state_dict["param_groups"]
    if len(groups) != len(opt.param_groups) or [len(g["params"]) for g in groups] != [len(ps) for ps in opt._groups_params]:
        raise ValueError(
            "fastcoll.ShardedOptimizer.load_state_dict: the state dict's param groups "
            f"({[len(g['params']) for g in groups]} parameters) do not match this optimizer's "
            f"({[len(ps) for ps in opt._groups_params]})"
        )
    r = opt.reducer
    states = state_dict["state"]
    by_reducer = {i: states.get(k, states.get(str(k))) for k, i in enumerate(opt._order_index) if i is not None}
    piece_state = []
    for _, pc in opt._pieces:
        full = by_reducer.get(pc.param)
        if not full:
            piece_state.append(None)
            continue
        numel = r.params[pc.param].numel()
        piece_state.append({k: flat_view(v)[pc.lo : pc.hi] if _is_elementwise(v, numel) else v for k, v in full.items()})
    _load_inner(opt, groups, piece_state)


def _load_inner(opt: Any, groups: List[Dict[str, Any]], piece_state: List[Optional[Dict[str, Any]]]) -> None:
    """Hand the pieces' state to the inner optimizer through its own ``load_state_dict`` (its casting rules).

    Master weights go into the pieces' float32 copies; without them (a checkpoint of a run that had none) the
    copies start from the 16-bit parameters, with a warning.
    """
    missing = []
    params = opt.reducer.params
    for k, ((_, pc), t) in enumerate(zip(opt._pieces, opt._shard_params)):
        st = piece_state[k]
        master = st.pop(MASTER, None) if st else None
        if not opt._values.has_master(k):
            continue
        with torch.no_grad():
            if master is not None:
                t.copy_(master)
            else:
                t.copy_(flat_view(params[pc.param].detach())[pc.lo : pc.hi])
                missing.append(opt.reducer.names[pc.param])
    if missing:
        warnings.warn(
            f"fastcoll.ShardedOptimizer: the checkpoint has no float32 master weights ({MASTER!r}) for "
            f"{', '.join(sorted(set(missing))[:5])}{' ...' if len(set(missing)) > 5 else ''}: they start from the "
            "16-bit parameters (the rounding of the last step is lost)",
            stacklevel=3,
        )
    number = {id(t): k for k, t in enumerate(p for g in opt._local.param_groups for p in g["params"])}
    inner_state = {number[id(t)]: st for t, st in zip(opt._shard_params, piece_state) if st}
    inner_groups, start = [], 0
    for g, ig in zip(groups, opt._local.param_groups):
        n = len(ig["params"])
        inner_groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": list(range(start, start + n))})
        start += n
    opt._local.load_state_dict({"state": inner_state, "param_groups": inner_groups})
    for g, src in zip(opt.param_groups, groups):
        g.update({k: v for k, v in src.items() if k != "params"})


# ------------------------------------------------------------------ sharded format


def sharded_state_dict(opt: Any) -> Dict[str, Any]:
    """This rank's pieces with their state, and the layout to reshard them (no other rank's values)."""
    opt._push_hyperparameters()
    r = opt.reducer
    number = {i: k for k, i in enumerate(opt._order_index) if i is not None}
    pieces = []
    for _, pc, st in _piece_states(opt):
        pieces.append(
            {
                "param": number[pc.param],
                "lo": pc.lo,
                "hi": pc.hi,
                "state": {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in st.items()},
            }
        )
    return {
        "format": FORMAT,
        "optimizer": f"{type(opt._local).__module__}.{type(opt._local).__qualname__}",
        "world_size": r.world_size,
        "rank": r.rank,
        "params": [{"shape": list(p.shape), "stride": list(p.stride())} for p in opt._order],
        "param_groups": _groups(opt),
        "pieces": pieces,
    }


def _check_sharded(state_dicts: Sequence[Dict[str, Any]]) -> None:
    if not state_dicts:
        raise ValueError("fastcoll.ShardedOptimizer: no sharded state dicts given")
    world = state_dicts[0].get("world_size")
    ranks = sorted(sd.get("rank") for sd in state_dicts)
    if any(sd.get("format") != FORMAT for sd in state_dicts):
        raise ValueError(f"fastcoll.ShardedOptimizer: not {FORMAT} state dicts")
    if ranks != list(range(world)):
        raise ValueError(
            f"fastcoll.ShardedOptimizer: the sharded state dicts of a {world}-rank run are needed, got ranks {ranks}"
        )


def _assemble(state_dicts: Sequence[Dict[str, Any]], param: int, lo: int, hi: int) -> Optional[Dict[str, Any]]:
    """The state of elements ``[lo, hi)`` of parameter ``param``, from every rank's pieces that overlap them."""
    out: Dict[str, Any] = {}
    for sd in state_dicts:
        for pc in sd["pieces"]:
            if pc["param"] != param or pc["hi"] <= lo or pc["lo"] >= hi:
                continue
            a, z = max(lo, pc["lo"]), min(hi, pc["hi"])
            n = pc["hi"] - pc["lo"]
            for k, v in pc["state"].items():
                if _is_elementwise(v, n):
                    t = out.get(k)
                    if t is None:
                        t = out[k] = torch.zeros(hi - lo, dtype=v.dtype)
                    t[a - lo : z - lo].copy_(v[a - pc["lo"] : z - pc["lo"]])
                else:
                    out[k] = v
    return out or None


def load_sharded_state_dicts(opt: Any, state_dicts: Sequence[Dict[str, Any]]) -> None:
    """Load every rank's :func:`sharded_state_dict` of a run at any world size; this rank takes its pieces."""
    _check_sharded(state_dicts)
    number = {i: k for k, i in enumerate(opt._order_index) if i is not None}
    piece_state = [_assemble(state_dicts, number[pc.param], pc.lo, pc.hi) for _, pc in opt._pieces]
    _load_inner(opt, state_dicts[0]["param_groups"], piece_state)


def full_from_sharded(state_dicts: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """The standard state dict of the whole run, from every rank's sharded one (no process group needed)."""
    _check_sharded(state_dicts)
    params = state_dicts[0]["params"]
    state: Dict[int, Dict[str, Any]] = {}
    for k, spec in enumerate(params):
        numel = 1
        for s in spec["shape"]:
            numel *= s
        st = _assemble(state_dicts, k, 0, numel)
        if st is None:
            continue
        full = {}
        for key, v in st.items():
            if _is_elementwise(v, numel):
                t = torch.empty_strided(spec["shape"], spec["stride"], dtype=v.dtype)
                flat_view(t).copy_(v)
                full[key] = t
            else:
                full[key] = v
        state[k] = full
    return {"state": state, "param_groups": state_dicts[0]["param_groups"]}


# ------------------------------------------------------------------ directories


def _file(directory: str, rank: int, world: int) -> str:
    return os.path.join(directory, f"optim-rank{rank:05d}-of-{world:05d}.pt")


def save_sharded(opt: Any, directory: str) -> str:
    """Write this rank's :func:`sharded_state_dict` into ``directory`` (every rank calls it); returns the file."""
    os.makedirs(directory, exist_ok=True)
    sd = sharded_state_dict(opt)
    path = _file(directory, sd["rank"], sd["world_size"])
    tmp = path + ".tmp"
    torch.save(sd, tmp)
    os.replace(tmp, path)
    return path


def _read_directory(directory: str) -> List[Dict[str, Any]]:
    names = sorted(n for n in os.listdir(directory) if n.startswith("optim-rank") and n.endswith(".pt"))
    if not names:
        raise FileNotFoundError(f"fastcoll.ShardedOptimizer: no optim-rank*.pt files in {directory}")
    world = int(names[0].split("-of-")[1][:-3])
    expected = [os.path.basename(_file(directory, r, world)) for r in range(world)]
    if names != expected:
        raise ValueError(f"fastcoll.ShardedOptimizer: {directory} should hold {expected}, holds {names}")
    return [torch.load(os.path.join(directory, n), map_location="cpu", weights_only=True, mmap=True) for n in names]


def load_sharded(opt: Any, directory: str) -> None:
    """Load a directory written by :func:`save_sharded` at any world size (every rank calls it)."""
    load_sharded_state_dicts(opt, _read_directory(directory))


def full_from_directory(directory: str) -> Dict[str, Any]:
    """The standard state dict from a directory written by :func:`save_sharded` (for a plain torch optimizer)."""
    return full_from_sharded(_read_directory(directory))


class CheckpointMethods:
    """:class:`~fastcoll.optim.ShardedOptimizer`'s checkpoint methods: torch's ``state_dict`` protocol (its hooks
    included) in the standard format, and the per-rank shards."""

    def state_dict(self) -> Dict[str, Any]:
        """The inner optimizer class's standard state dict, as if it had never been sharded (a collective).

        Per-parameter state keyed by parameter index (the wrapped optimizer's
        numbering), full tensors, identical on every rank: loadable by the
        plain torch optimizer in a single process, or by :meth:`load_state_dict`
        at any world size.
        """
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        state = full_state_dict(self)
        # Entries that are not a piece's (hooks and user code may keep their own keys in opt.state, as in torch's).
        state["state"].update({k: v for k, v in self._local.state.items() if not isinstance(k, torch.Tensor)})
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            state = post_hook(self, state) or state
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a standard (unsharded) state dict of the inner optimizer's class; each rank keeps its pieces."""
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            state_dict = pre_hook(self, state_dict) or state_dict
        load_full_state_dict(self, _numbered(state_dict))
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def sharded_state_dict(self) -> Dict[str, Any]:
        """This rank's pieces of the state and the layout needed to reshard them (see :mod:`fastcoll.optim.checkpoint`)."""
        return sharded_state_dict(self)

    def load_sharded_state_dict(self, state_dicts: Sequence[Dict[str, Any]]) -> None:
        """Load the :meth:`sharded_state_dict` of every rank of a run at any world size (this rank takes its pieces)."""
        load_sharded_state_dicts(self, state_dicts)


def _numbered(state_dict: Dict[str, Any]) -> Dict[str, Any]:
    """``state_dict`` with its parameters numbered 0, 1, ... in group order, as torch's ``load_state_dict`` reads them.

    torch matches saved parameters to the optimizer's by position, whatever their keys (DCP's
    ``set_optimizer_state_dict`` passes fully qualified names).
    """
    keys = [k for g in state_dict["param_groups"] for k in g["params"]]
    number = {k: n for n, k in enumerate(keys)}
    if list(number) == list(range(len(keys))):
        return state_dict
    groups, start = [], 0
    for g in state_dict["param_groups"]:
        groups.append(dict(g, params=list(range(start, start + len(g["params"])))))
        start += len(g["params"])
    state = {number[k]: v for k, v in state_dict["state"].items() if k in number}
    return {**state_dict, "state": state, "param_groups": groups}
