"""From every rank's gathered state to a report: who is the culprit, said the same way on every rank.

Pure functions over records (the JSON-able dicts of
:meth:`fastcoll.stall.state.SyncState.snapshot`, plus ``answer``/``stalled``
from the board), so they are unit-tested without processes.

The first line is computed only from the records, in a canonical way (ranks
sorted, no ages, no "this rank"), by the first rule that applies:

1. **out of step**: two ranks' collective histories (a CRC chained over
   every collective's kind, label, dtype and size) differ at a sequence
   number both still keep: a collective issued on some ranks only. The
   ranks outside the largest group are named, with the first collective seen
   to differ; without a majority (two ranks, or the ones that could tell are
   dead) every side is named. Ranks that did not answer are added, and a
   rank the backend aborted (gloo on a size mismatch: its last words, see
   :mod:`fastcoll.stall.abort`) is said to be so, with what it received;
   its record counts as an answer, and its collectives as a vote;
2. **aborted**: a rank the backend aborted, when no history differs;
3. **no answer**: ranks that did not answer the stall request (dead, or stuck
   holding the interpreter outside fastcoll), with their last recorded state;
4. **behind**: ranks not waiting in fastcoll that have not issued the
   lowest collective some rank waits for (last seen where, with which
   parameters still missing);
5. **different sequence number**: every rank waits, at different collectives
   (ranks outside the largest group named);
6. otherwise every rank issued the awaited collective: no rank can be
   named (suspect the network or the backend).

Ranks read the store at slightly different moments, so two diagnosing ranks
may still compute different lines (a rank moved on in between);
:func:`fastcoll.stall.diagnose` has them adopt the first line written to the
store, so the line printed is the same on every live rank.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from .state import describe_phase

__all__ = ["NO_ANSWER", "PREFIX", "aborted_text", "culprit_line", "mismatch_sources", "render_report", "store_unreachable_line"]

PREFIX = "fastcoll stall: "
NO_ANSWER = "no answer: dead or stuck outside gradient synchronization"

Records = Dict[int, Optional[Dict[str, Any]]]  # group rank -> record (None: never published)


def _ranks_text(ranks: Sequence[int]) -> str:
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks))


def _verb(ranks: Sequence[int], one: str, many: str) -> str:
    return one if len(ranks) == 1 else many


def _size(entry: Sequence[Any]) -> str:
    """``1000 x float32`` for a ring entry ``[seq, kind, what, numel, dtype, ...]`` (callers leave it out when numel is 0)."""
    return f"{entry[3]} x {entry[4]}"


def _sig_text(entry: Sequence[Any]) -> str:
    """``all_reduce of bucket 0 (1000 x float32)`` for a ring entry ``[seq, kind, what, numel, dtype, ...]`` (no size
    for a collective without data: a barrier)."""
    return f"{entry[1]} of {entry[2]}" + (f" ({_size(entry)})" if entry[3] else "")


def _entry_text(entry: Sequence[Any]) -> str:
    """``all_reduce of bucket 0, 340 x float32`` (for text that already sits in parentheses)."""
    return f"{entry[1]} of {entry[2]}" + (f", {_size(entry)}" if entry[3] else "")


def aborted_text(rank: int, info: Dict[str, Any]) -> str:
    """``rank 0 was aborted by gloo in collective #8 (all_reduce of bucket 0, 340 x float32): it received ...``."""
    seq = info.get("seq")
    where = f" in collective #{seq}" if seq is not None else ""
    if info.get("kind"):
        where += f" ({_entry_text([None, info['kind'], info.get('what'), info.get('numel'), info.get('dtype')])})"
    text = f"rank {rank} was aborted by {info.get('by') or 'the backend'}{where}"
    if info.get("received") is not None and info.get("expected") is not None:
        text += f": it received {info['received']} bytes where it expected at most {info['expected']}"
    elif info.get("type"):
        text += f" ({info['type']})"
    return text


def _aborted(records: "Records") -> List[int]:
    return sorted(r for r, rec in records.items() if rec and rec.get("aborted"))


def _sig(entry: Sequence[Any]) -> Tuple[Any, ...]:
    kind = entry[1]
    return (kind, entry[2], entry[4], None if kind == "all_gather" else entry[3])


def _missing_text(rec: Dict[str, Any], limit: int = 3) -> str:
    names = rec.get("missing") or []
    n = int(rec.get("n_missing") or len(names))
    if not n:
        return ""
    shown = ", ".join(names[:limit])
    more = f" (+{n - min(n, limit)} more)" if n > min(n, limit) else ""
    return f"; no gradient for {shown}{more}"


def _last_seen(rec: Optional[Dict[str, Any]]) -> str:
    if rec is None:
        return "never seen"
    return f"{describe_phase(rec)}, {rec.get('seq', 0)} collectives issued{_missing_text(rec)}"


def _seen(rec: Optional[Dict[str, Any]]) -> str:
    """``last seen in forward of iteration 3, ...`` / ``last seen outside fastcoll ...`` / ``never seen``."""
    text = _last_seen(rec)
    if rec is None:
        return text
    return ("last seen " if text.startswith("outside") else "last seen in ") + text


def _global(rank_map: Sequence[int], r: int) -> int:
    return rank_map[r] if 0 <= r < len(rank_map) else r


def _largest_first(groups: Dict[Any, List[int]]) -> List[List[int]]:
    """Groups of ranks, largest first; ties broken by the lowest rank (canonical)."""
    return sorted((sorted(g) for g in groups.values()), key=lambda g: (-len(g), g[0]))


# ----------------------------------------------------------------- rules


def _out_of_step(records: Records) -> Optional[Tuple[List[int], str]]:
    by_seq: Dict[int, Dict[int, Sequence[Any]]] = {}
    for r, rec in records.items():
        if not rec:
            continue
        for e in rec.get("ring") or []:
            if len(e) >= 7:
                by_seq.setdefault(int(e[0]), {})[r] = e
    split_at = None
    for seq in sorted(by_seq):
        entries = by_seq[seq]
        if len(entries) >= 2 and len({e[6] for e in entries.values()}) > 1:
            split_at = seq
            break
    if split_at is None:
        return None
    entries = by_seq[split_at]
    groups: Dict[Any, List[int]] = {}
    for r, e in entries.items():
        groups.setdefault(e[6], []).append(r)
    ordered = _largest_first(groups)
    if len(ordered[0]) == len(ordered[1]):
        # No majority (two ranks, or the ranks that could tell are dead): name every side.
        return _out_of_step_tie(by_seq, split_at, ordered)
    ref, culprits = ordered[0], sorted(r for g in ordered[1:] for r in g)
    # The first collective whose own signature differs between a culprit and the reference group.
    for seq in sorted(s for s in by_seq if s >= split_at):
        ents = by_seq[seq]
        ref_e = next((ents[r] for r in ref if r in ents), None)
        bad = [r for r in culprits if r in ents and ref_e is not None and _sig(ents[r]) != _sig(ref_e)]
        if bad:
            first = bad[0]
            same = [r for r in bad if _sig(ents[r]) == _sig(ents[first])]
            holders = [r for r in ref if r in ents]
            text = (
                f"{_ranks_text(culprits)} {_verb(culprits, 'is', 'are')} out of step (collective sequence numbers "
                f"differ): collective #{seq} is {_sig_text(ents[first])} on {_ranks_text(same)} but "
                f"{_sig_text(ref_e)} on {_ranks_text(holders)}: a collective issued on some ranks only"
            )
            return culprits, text
    text = (
        f"{_ranks_text(culprits)} {_verb(culprits, 'is', 'are')} out of step (collective sequence numbers differ): "
        f"{_verb(culprits, 'its', 'their')} collective history differs from {_ranks_text(ref)}'s at #{split_at}: "
        "a collective issued on some ranks only, earlier"
    )
    return culprits, text


def _out_of_step_tie(
    by_seq: Dict[int, Dict[int, Sequence[Any]]], split_at: int, ordered: List[List[int]]
) -> Tuple[List[int], str]:
    culprits = sorted(r for g in ordered for r in g)
    for seq in sorted(s for s in by_seq if s >= split_at):
        ents = by_seq[seq]
        by_sig: Dict[Any, List[int]] = {}
        for r in culprits:
            if r in ents:
                by_sig.setdefault(_sig(ents[r]), []).append(r)
        if len(by_sig) > 1:
            sides = sorted((sorted(g) for g in by_sig.values()), key=lambda g: g[0])
            parts = " but ".join(f"{_sig_text(ents[g[0]])} on {_ranks_text(g)}" for g in sides)
            text = (
                f"{_ranks_text(culprits)} are out of step (collective sequence numbers differ): collective #{seq} is "
                f"{parts}: one side issued a collective the other did not (no majority tells which)"
            )
            return culprits, text
    text = (
        f"{_ranks_text(culprits)} are out of step (collective sequence numbers differ): their collective histories "
        f"differ at #{split_at} (no majority tells which rank issued a collective the others did not)"
    )
    return culprits, text


def _aborted_rule(records: Records, answered: Set[int]) -> Optional[Tuple[List[int], str]]:
    gone = _aborted(records)
    if not gone:
        return None
    parts = "; ".join(aborted_text(r, records[r]["aborted"]) for r in gone)
    text = (
        f"{parts}; no collective history differs among the ranks that answered "
        "(what it received came from a collective no longer kept, or from outside fastcoll)"
    )
    return gone, text


def _no_answer(records: Records, answered: Set[int]) -> Optional[Tuple[List[int], str]]:
    dead = sorted(r for r in records if r not in answered)
    if not dead:
        return None
    if len(dead) == 1:
        seen = _seen(records.get(dead[0]))
    else:
        parts = [f"rank {r} {_seen(records.get(r))}" for r in dead[:4]]
        seen = "; ".join(parts) + ("; ..." if len(dead) > 4 else "")
    text = f"{_ranks_text(dead)} did not answer: dead or stuck outside gradient synchronization ({seen})"
    return dead, text


def _waiting(rec: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    return (rec or {}).get("waiting") or None


def _behind(records: Records, answered: Set[int]) -> Optional[Tuple[List[int], str]]:
    waiters = {r: _waiting(records[r]) for r in answered if _waiting(records.get(r))}
    if not waiters:
        return None
    w_min = min(int(w["seq"]) for w in waiters.values())
    behind = sorted(r for r in answered if r not in waiters and int((records[r] or {}).get("seq", 0)) < w_min)
    if not behind:
        return None
    at = sorted(r for r, w in waiters.items() if int(w["seq"]) == w_min)
    what = waiters[at[0]].get("what") or "a collective"
    if len(behind) == 1:
        seen = _seen(records[behind[0]])
    else:
        seen = "; ".join(f"rank {r} {_seen(records[r])}" for r in behind[:4])
    text = (
        f"{_ranks_text(behind)} {_verb(behind, 'is', 'are')} behind: {_verb(behind, 'it has', 'they have')} not issued "
        f"collective #{w_min} ({what}) that {_ranks_text(at)} {_verb(at, 'waits', 'wait')} for; {seen}"
    )
    return behind, text


def _different_seq(records: Records, answered: Set[int]) -> Optional[Tuple[List[int], str]]:
    groups: Dict[int, List[int]] = {}
    for r in answered:
        w = _waiting(records.get(r))
        if w:
            groups.setdefault(int(w["seq"]), []).append(r)
    if len(groups) < 2:
        return None
    ordered = _largest_first(groups)
    ref = ordered[0]
    ref_seq = int(_waiting(records[ref[0]])["seq"])
    others = sorted(r for g in ordered[1:] for r in g)
    parts = []
    for g in ordered[1:]:
        w = _waiting(records[g[0]])
        parts.append(f"#{w['seq']} ({w.get('what') or 'a collective'}) on {_ranks_text(g)}")
    ref_what = _waiting(records[ref[0]]).get("what") or "a collective"
    text = (
        f"{_ranks_text(others)} {_verb(others, 'waits', 'wait')} at a different collective sequence number: "
        f"{'; '.join(parts)} where {_ranks_text(ref)} {_verb(ref, 'waits', 'wait')} at #{ref_seq} ({ref_what})"
    )
    return others, text


def _nobody(records: Records, answered: Set[int]) -> Tuple[List[int], str]:
    waiters = sorted(r for r in answered if _waiting(records.get(r)))
    if waiters:
        w = _waiting(records[waiters[0]])
        return [], (
            f"no rank is behind: every rank issued collective #{w['seq']} ({w.get('what') or 'a collective'}) and "
            f"{_ranks_text(waiters)} {_verb(waiters, 'waits', 'wait')} for it; suspect the network or the communication backend"
        )
    return [], "no rank could be named: no rank waits in fastcoll any more"


def culprit_line(records: Records, answered: Iterable[int], rank_map: Optional[Sequence[int]] = None) -> Tuple[str, List[int]]:
    """The report's first line and the culprits it names (global ranks).

    Args:
        records: Every group rank's latest record (None: never published).
        answered: Group ranks that answered the stall request.
        rank_map: Global rank of each group rank (identity when None).

    Ranks in the text are group ranks mapped through ``rank_map``.
    """
    answered = set(answered)
    n = max(records) + 1 if records else 0
    rank_map = list(range(n)) if rank_map is None else list(rank_map)
    if rank_map != list(range(len(rank_map))):
        # Rename group ranks to global ranks before writing any text.
        records = {_global(rank_map, r): rec for r, rec in records.items()}
        answered = {_global(rank_map, r) for r in answered}
    found = _out_of_step(records)
    if found is not None:
        culprits, text = found
        dead = sorted(r for r in records if r not in answered)
        gone = [r for r in _aborted(records) if r not in dead]
        if gone:  # gloo aborts a process on a size mismatch (the receiver's): its last words say so
            text += "; " + "; ".join(aborted_text(r, records[r]["aborted"]) for r in gone)
        if dead:  # e.g. gloo aborted a process that could not say so: not always the culprit's
            text += f"; also {_ranks_text(dead)} did not answer (dead or stuck outside gradient synchronization)"
        return PREFIX + text, sorted(set(culprits) | set(dead))
    for rule in (_aborted_rule, _no_answer, _behind, _different_seq):
        found = rule(records, answered)
        if found is not None:
            culprits, text = found
            return PREFIX + text, sorted(culprits)
    culprits, text = _nobody(records, answered)
    return PREFIX + text, culprits


def mismatch_sources(
    records: Records,
    me: int,
    rank_map: Optional[Sequence[int]] = None,
    received: Optional[int] = None,
    expected: Optional[int] = None,
) -> Tuple[List[int], str]:
    """Which collective of ``me`` received what from whom: the sentence a rank the backend aborts prints.

    Compares ``me``'s kept collectives with every other rank's at the first
    sequence number where their signatures (kind, label, dtype, size)
    differ. ``received``/``expected``: the sizes in bytes the backend
    reported, if known. Returns the ranks whose collective there differs
    from the majority's (global ranks; every side without a majority) and
    the sentence, e.g. ``collective #8 of rank 0 (all_reduce of bucket 0, 340
    x float32) received 668 bytes where it expected at most 228 from rank 1,
    whose collective #8 is all_reduce of fastcoll.dist (1000 x float32) ...``.
    """
    n = max(records) + 1 if records else 0
    rank_map = list(range(n)) if rank_map is None else list(rank_map)
    mine = {int(e[0]): e for e in ((records.get(me) or {}).get("ring") or []) if len(e) >= 7}
    others = {r: rec for r, rec in records.items() if r != me and rec}
    g = _global(rank_map, me)
    got = " data"
    if received is not None and expected is not None:
        got = f" {received} bytes where it expected at most {expected}"
    if not others:
        return [], f"rank {g} received{got}; no other rank's state could be read: which rank sent it is unknown"
    ents: Dict[int, Sequence[Any]] = {}
    split = None
    for seq in sorted(mine):
        ents = {r: e for r, rec in others.items() for e in (rec.get("ring") or []) if len(e) >= 7 and int(e[0]) == seq}
        if any(_sig(e) != _sig(mine[seq]) for e in ents.values()):
            split = seq
            break
    if split is None:
        seen = sorted(_global(rank_map, r) for r in others)
        return [], (
            f"rank {g} received{got}, but {_ranks_text(seen)} issued the same collectives as rank {g} up to their "
            "last kept ones: which rank sent it is unknown"
        )
    seq = split
    by_sig: Dict[Any, List[int]] = {_sig(mine[seq]): [me]}
    entry_of: Dict[Any, Sequence[Any]] = {_sig(mine[seq]): mine[seq]}
    for r, e in sorted(ents.items()):
        by_sig.setdefault(_sig(e), []).append(r)
        entry_of.setdefault(_sig(e), e)
    groups = sorted(by_sig.items(), key=lambda kv: (-len(kv[1]), min(kv[1])))

    def ranks(rs: Sequence[int]) -> List[int]:
        return sorted(_global(rank_map, r) for r in rs)

    head = f"collective #{seq} of rank {g} ({_entry_text(mine[seq])}) received{got}"
    own = _sig(mine[seq])
    if len(groups[0][1]) > len(groups[1][1]):
        major_sig, major = groups[0]
        odd = sorted(r for k, rs in groups if k != major_sig for r in ranks(rs))
        if own == major_sig:
            theirs = "; ".join(
                f"{_ranks_text(ranks(rs))}, whose collective #{seq} is {_sig_text(entry_of[k])}"
                for k, rs in groups
                if k != major_sig
            )
            return odd, (
                f"{head} from {theirs}, where {_ranks_text(ranks(major))} issued {_sig_text(mine[seq])}: "
                f"{_ranks_text(odd)} issued a collective the others did not"
            )
        return odd, (
            f"{head} from a rank whose collective #{seq} is {_sig_text(entry_of[major_sig])}, as on "
            f"{_ranks_text(ranks(major))}: rank {g} issued a collective the others did not"
        )
    sides = "; ".join(f"{_sig_text(entry_of[k])} on {_ranks_text(ranks(rs))}" for k, rs in groups)
    every = sorted(r for _k, rs in groups for r in ranks(rs))
    return every, (
        f"{head}; collective #{seq} is {sides}: one side issued a collective the other did not (no majority tells which)"
    )


def store_unreachable_line(store_host: Optional[int]) -> Tuple[str, List[int]]:
    """The first line when the store cannot be read (every survivor computes the same one)."""
    if store_host is None:
        return PREFIX + "the process group's store is unreachable: the other ranks' states cannot be gathered", []
    return (
        PREFIX + f"rank {store_host} (the store host) is unreachable: dead, or its machine is; "
        "the other ranks' states cannot be gathered",
        [store_host],
    )


# ---------------------------------------------------------------- report


def _fmt_s(x: float) -> str:
    return f"{x:.1f} s"


def _rank_lines(r: int, rec: Optional[Dict[str, Any]], answered: bool, now: float, mine: bool = False) -> List[str]:
    if rec is None:
        return [f"  rank {r}: {NO_ANSWER}; it never published a state"]
    who = ("this rank; " if mine else "") + f"pid {rec.get('pid')} on {rec.get('host')}"
    lag = max(0.0, now - float(rec.get("t", now)))
    head = describe_phase(rec)
    w = rec.get("waiting")
    if w:
        head += f" for {_fmt_s(float(w.get('for', 0.0)) + lag)}"
    head += f"; {rec.get('seq', 0)} collectives issued"
    stalled = rec.get("stalled")
    if rec.get("aborted"):
        stalled = None  # its own line below says what happened
    if stalled:
        head += f"; stalled after waiting {_fmt_s(float(stalled.get('waited') or 0.0))}"
        if stalled.get("cause"):
            head += f" ({stalled['cause']})"
    if answered:
        lines = [f"  rank {r} ({who}): {head}"]
    else:
        lines = [f"  rank {r}: {NO_ANSWER}; last state {_fmt_s(lag)} ago ({who}): {head}"]
    ring = rec.get("ring") or []
    if ring:
        items = [
            f"#{e[0]} {e[1]} of {e[2]} ({f'{_size(e)}, ' if e[3] else ''}{_fmt_s(float(e[5]) + lag)} ago)" for e in reversed(ring)
        ]
        lines.append("      last collectives: " + "; ".join(items))
    names = rec.get("missing") or []
    if names:
        n = int(rec.get("n_missing") or len(names))
        more = f" (+{n - len(names)} more)" if n > len(names) else ""
        lines.append(f"      still without gradients ({n}): " + ", ".join(names) + more)
    info = rec.get("aborted")
    if info:
        text = aborted_text(r, info).split(" was ", 1)[1]
        lines.append(f"      {text}" + (f" ({info['error']})" if info.get("error") else ""))
    return lines


def render_report(
    first_line: str,
    records: Records,
    answered: Iterable[int],
    *,
    me: int,
    now: float,
    rank_map: Optional[Sequence[int]] = None,
    header: str = "",
    footer: Sequence[str] = (),
) -> str:
    """The whole report: the first line, one block per rank (group rank order), then ``footer`` lines."""
    answered = set(answered)
    rank_map = list(range(max(records) + 1 if records else 0)) if rank_map is None else list(rank_map)
    lines = [first_line]
    if header:
        lines.append(header)
    for r in sorted(records):
        g = _global(rank_map, r)
        lines.extend(_rank_lines(g, records[r], r in answered, now, mine=r == me))
    lines.extend(footer)
    return "\n".join(lines)
