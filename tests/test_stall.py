"""Issue #12, "never hang silently": stall detection and diagnosis (fastcoll.stall) without fastcoll.DDP.

Unit tests drive the culprit rules, the timeout rule, the board on an
in-process HashStore (several "ranks" as boards on one store), the
watchdog's polling and the timed wait with fakes and futures.

Multi-rank tests run 3 gloo ranks (tests/stall_harness.py: every rank
process is killed and reaped before the test returns) through the reducer's
Communicator and fastcoll.stall.run_collective, as the reducer and the
fastcoll.dist helpers will: a SIGKILLed rank, a rank sleeping before its
backward, a rank missing a gradient, the store host's death, an extra
collective on one rank (of the same size; of another size, when gloo aborts
the rank that receives too much and its last words must reach the others:
fastcoll.stall.abort), waits longer than a slice, the watchdog path, and
healthy training whose forward outlasts the stall timeout.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import signal
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist
from stall_harness import run_stall_ranks, survivors_agree

from fastcoll import stall
from fastcoll.stall import diagnosis as diagnose_mod
from fastcoll.stall import verdict as V
from fastcoll.stall.state import SyncState

TIMEOUT = 5.0  # the stall timeout of the multi-rank tests


@pytest.fixture(autouse=True)
def _fresh_emit():
    diagnose_mod._reset_emitted()
    yield
    diagnose_mod._reset_emitted()


# ------------------------------------------------------------------ records


def _rec(rank, seq, *, phase="backward", iteration=3, waiting=None, ring=None, missing=(), stalled=None, answer=1):
    """A record as a board publishes it; ``ring`` entries (seq, what) get hashes chained like SyncState.note's."""
    st = SyncState(rank=rank, group_rank=rank)
    for s, what in ring if ring is not None else [(i, f"bucket {i % 2}") for i in range(1, seq + 1)]:
        while st.seq < s - 1:
            st.note("all_reduce", f"bucket {st.seq % 2}", 100, torch.float32)
        st.note("all_reduce", what, 100, torch.float32)
    st.iteration = iteration
    st.phase = phase
    if waiting is not None:
        st.waiting = (waiting, f"bucket {waiting % 2}", time.time() - 5)
    if missing:
        st.end_backward(list(missing))
        st.phase = phase
    rec = st.snapshot()
    rec["seq"] = seq
    rec["answer"] = answer
    rec["stalled"] = stalled
    return rec


def test_rules_no_answer_names_the_silent_rank_with_its_last_state():
    recs = {0: _rec(0, 6, waiting=5), 1: _rec(1, 6, waiting=5), 2: _rec(2, 4, phase="backward")}
    line, culprits = V.culprit_line(recs, answered={0, 1})
    assert culprits == [2]
    assert line.startswith("fastcoll stall: rank 2 did not answer: dead or stuck outside gradient synchronization")
    assert "backward of iteration 3" in line and "4 collectives issued" in line
    # A rank that never published.
    line, culprits = V.culprit_line({0: _rec(0, 6, waiting=5), 1: None}, answered={0})
    assert culprits == [1] and "(never seen)" in line


def test_rules_behind_names_the_rank_that_has_not_issued_the_awaited_collective():
    recs = {0: _rec(0, 8, waiting=7), 1: _rec(1, 6, phase="forward"), 2: _rec(2, 8, waiting=7)}
    line, culprits = V.culprit_line(recs, answered={0, 1, 2})
    assert culprits == [1]
    assert line == (
        "fastcoll stall: rank 1 is behind: it has not issued collective #7 (bucket 1) that ranks 0, 2 wait for; "
        "last seen in forward of iteration 3, 6 collectives issued"
    )
    # With gradients missing, the first line names the parameters.
    recs[1] = _rec(1, 6, phase="finished backward", missing=["net.fc2.weight"])
    line, culprits = V.culprit_line(recs, answered={0, 1, 2})
    assert culprits == [1] and "no gradient for net.fc2.weight" in line and "finished backward" in line


def test_rules_out_of_step_names_the_rank_with_the_extra_collective():
    base = [(1, "bucket 0"), (2, "bucket 0"), (3, "bucket 0"), (4, "bucket 0")]
    extra = [(1, "bucket 0"), (2, "reduce_mean"), (3, "bucket 0"), (4, "bucket 0"), (5, "bucket 0")]
    recs = {
        0: _rec(0, 4, phase="outside fastcoll", ring=base),
        1: _rec(1, 5, ring=extra, waiting=5),
        2: _rec(2, 4, phase="outside fastcoll", ring=base),
    }
    line, culprits = V.culprit_line(recs, answered={0, 1, 2})
    assert culprits == [1]
    assert "rank 1 is out of step (collective sequence numbers differ)" in line
    assert "collective #2 is all_reduce of reduce_mean (100 x float32) on rank 1 but all_reduce of bucket 0" in line
    # The divergence left the kept window: the chained hashes still tell.
    recs = {
        0: _rec(0, 20, phase="outside fastcoll", ring=[(s, "bucket 0") for s in range(1, 21)]),
        1: _rec(1, 21, waiting=21, ring=[(1, "x")] + [(s, "bucket 0") for s in range(2, 22)]),
        2: _rec(2, 20, phase="outside fastcoll", ring=[(s, "bucket 0") for s in range(1, 21)]),
    }
    line, culprits = V.culprit_line(recs, answered={0, 1, 2})
    assert culprits == [1] and "collective history differs from ranks 0, 2's" in line
    # No majority: gloo aborted rank 0 on the size mismatch; rank 1 (the extra collective) and rank 2 disagree.
    recs = {
        0: _rec(0, 1, phase="forward", ring=base[:1]),
        1: _rec(1, 2, ring=extra[:2], waiting=2),
        2: _rec(2, 2, ring=base[:2], waiting=2),
    }
    line, culprits = V.culprit_line(recs, answered={1, 2})
    assert culprits == [0, 1, 2]
    assert line == (
        "fastcoll stall: ranks 1, 2 are out of step (collective sequence numbers differ): collective #2 is "
        "all_reduce of reduce_mean (100 x float32) on rank 1 but all_reduce of bucket 0 (100 x float32) on rank 2: "
        "one side issued a collective the other did not (no majority tells which); also rank 0 did not answer "
        "(dead or stuck outside gradient synchronization)"
    )


def test_rules_different_sequence_number_and_nobody():
    recs = {0: _rec(0, 9, waiting=9), 1: _rec(1, 9, waiting=7), 2: _rec(2, 9, waiting=9)}
    line, culprits = V.culprit_line(recs, answered={0, 1, 2})
    assert culprits == [1] and "rank 1 waits at a different collective sequence number: #7" in line
    recs = {r: _rec(r, 9, waiting=9) for r in range(3)}
    line, culprits = V.culprit_line(recs, answered={0, 1, 2})
    assert culprits == [] and "no rank is behind" in line


def test_rules_are_canonical_whoever_reads_and_whenever():
    """The first line depends on the records only: not on the reader, not on the ages in them."""
    recs = {0: _rec(0, 8, waiting=7), 1: _rec(1, 6, phase="forward"), 2: _rec(2, 8, waiting=7)}
    later = json.loads(json.dumps(recs))
    for rec in later.values():
        rec["t"] += 3.0
        rec["updated_ago"] += 3.0
        if rec["waiting"]:
            rec["waiting"]["for"] += 3.0
    a = V.culprit_line(recs, {0, 1, 2})
    b = V.culprit_line({int(k): v for k, v in later.items()}, {2, 1, 0})
    assert a == b
    # Group ranks are renamed to global ranks.
    line, culprits = V.culprit_line(recs, {0, 1, 2}, rank_map=[4, 5, 6])
    assert culprits == [5] and line.startswith("fastcoll stall: rank 5 is behind") and "ranks 4, 6 wait" in line


def test_store_unreachable_line_is_rank_independent():
    assert V.store_unreachable_line(0) == (
        "fastcoll stall: rank 0 (the store host) is unreachable: dead, or its machine is; "
        "the other ranks' states cannot be gathered",
        [0],
    )
    assert V.store_unreachable_line(None)[1] == []


def _aborted_info(seq=2, what="bucket 0", received=668, expected=228):
    """What a rank's last words publish when gloo aborts it (fastcoll.stall.abort)."""
    info = {"by": "gloo", "type": "gloo::EnforceNotMet", "seq": seq, "kind": "all_reduce", "what": what}
    info.update(numel=100, dtype="float32", received=received, expected=expected)
    info["error"] = "op.preamble.length <= op.nbytes. 668 vs 228. Received data size doesn't match expected size."
    return info


def test_rules_a_rank_gloo_aborted_answers_and_votes():
    base = [(1, "bucket 0"), (2, "bucket 0")]
    extra = [(1, "bucket 0"), (2, "reduce_mean")]
    # Rank 0 (the store host) was aborted in #2; its last words hold its collectives: ranks 0, 2 outvote rank 1.
    recs = {0: _rec(0, 2, ring=base, waiting=2), 1: _rec(1, 2, ring=extra, waiting=2), 2: _rec(2, 2, ring=base, waiting=2)}
    recs[0]["aborted"] = _aborted_info()
    recs[0]["answer"] = 0  # its board thread never answered: the mark is its answer
    line, culprits = V.culprit_line(recs, answered={0, 1, 2})
    assert culprits == [1]
    assert line == (
        "fastcoll stall: rank 1 is out of step (collective sequence numbers differ): collective #2 is all_reduce of "
        "reduce_mean (100 x float32) on rank 1 but all_reduce of bucket 0 (100 x float32) on ranks 0, 2: a collective "
        "issued on some ranks only; rank 0 was aborted by gloo in collective #2 (all_reduce of bucket 0, 100 x float32): "
        "it received 668 bytes where it expected at most 228"
    )
    report = V.render_report(line, recs, {0, 1, 2}, me=1, now=time.time())
    assert (
        "      aborted by gloo in collective #2 (all_reduce of bucket 0, 100 x float32): it received 668 bytes where it "
        "expected at most 228 (op.preamble.length <= op.nbytes. 668 vs 228." in report
    )
    # No history differs among those that answered: the aborted rank is named (sizes unknown: its exception type).
    recs = {r: _rec(r, 2, ring=base, waiting=2) for r in range(3)}
    recs[2]["aborted"] = _aborted_info(received=None, expected=None)
    line, culprits = V.culprit_line(recs, answered={0, 1, 2})
    assert culprits == [2]
    assert line.startswith(
        "fastcoll stall: rank 2 was aborted by gloo in collective #2 (all_reduce of bucket 0, 100 x float32) "
        "(gloo::EnforceNotMet); no collective history differs"
    ), line


def test_mismatch_sources_says_which_collective_received_what_from_whom():
    base = [(1, "bucket 0"), (2, "bucket 0")]
    extra = [(1, "bucket 0"), (2, "reduce_mean")]
    recs = {0: _rec(0, 2, ring=base), 1: _rec(1, 2, ring=extra), 2: _rec(2, 2, ring=base)}
    odd, text = V.mismatch_sources(recs, 0, received=668, expected=228)
    assert odd == [1]
    assert text == (
        "collective #2 of rank 0 (all_reduce of bucket 0, 100 x float32) received 668 bytes where it expected at most "
        "228 from rank 1, whose collective #2 is all_reduce of reduce_mean (100 x float32), where ranks 0, 2 issued "
        "all_reduce of bucket 0 (100 x float32): rank 1 issued a collective the others did not"
    )
    odd, text = V.mismatch_sources(recs, 1)  # the aborted rank is the one with the extra collective
    assert odd == [1]
    assert text == (
        "collective #2 of rank 1 (all_reduce of reduce_mean, 100 x float32) received data from a rank whose "
        "collective #2 is all_reduce of bucket 0 (100 x float32), as on ranks 0, 2: rank 1 issued a collective the "
        "others did not"
    )
    assert V.mismatch_sources(recs, 0, rank_map=[4, 5, 6])[0] == [5]  # global ranks
    odd, text = V.mismatch_sources({0: recs[0], 1: recs[1]}, 0)
    assert odd == [0, 1] and "no majority tells which" in text
    odd, text = V.mismatch_sources({0: recs[0], 1: None, 2: recs[2]}, 0)
    assert odd == [] and "which rank sent it is unknown" in text
    odd, text = V.mismatch_sources({0: recs[0], 1: None}, 0)
    assert odd == [] and "no other rank's state could be read" in text


def test_abort_hook_installs_once_and_stays_out_of_the_way(monkeypatch):
    from fastcoll.stall import abort

    assert abort._demangle("N4gloo13EnforceNotMetE") == "gloo::EnforceNotMet"
    assert abort._demangle("St13runtime_error") == "St13runtime_error"
    assert abort._exception_info() == ("", None)  # no C++ exception in flight
    assert abort._SIZES.search("op.preamble.length <= op.nbytes. 668 vs 228. Received").groups() == ("668", "228")
    if platform.system() == "Linux" and abort._stdlib() is not None:
        assert abort.install() and abort.install() and abort.installed()
    assert not abort.aborting()
    t = time.time()
    abort.hold()  # nothing is being aborted: returns at once
    assert time.time() - t < 0.1
    monkeypatch.setenv(abort.ENV, "0")
    assert not abort.install() and not abort.register(object())


# ------------------------------------------------------------------ state


def test_sync_state_ring_and_snapshot():
    st = SyncState(rank=3, group_rank=1)
    for i in range(12):
        assert st.note("all_reduce", f"bucket {i}", 10 + i, torch.float16) == i + 1
    ring = st.snapshot()["ring"]
    assert [e[0] for e in ring] == list(range(5, 13))  # the last 8, oldest first
    assert ring[-1][1:5] == ["all_reduce", "bucket 11", 21, "float16"]
    st.begin_forward()
    st.begin_backward()
    st.end_backward(["p%d" % i for i in range(15)])
    snap = st.snapshot()
    assert snap["phase"] == "finished backward" and snap["iteration"] == 1
    assert len(snap["missing"]) == 10 and snap["n_missing"] == 15 and st.urgent
    json.dumps(snap)  # JSON-able
    st.end_iteration()
    assert st.snapshot()["missing"] == [] and stall.describe_phase(st.snapshot()) == "outside fastcoll (after iteration 1)"
    # Two ranks issuing the same collectives have the same history; a sparse gather's size does not count.
    a, b = SyncState(), SyncState()
    for s in (a, b):
        s.note("all_reduce", "bucket 0", 5, torch.float32)
    a.note("all_gather", "bucket 1 (sparse)", 7, torch.float32)
    b.note("all_gather", "bucket 1 (sparse)", 9, torch.float32)
    assert a.history == b.history
    a.note("all_reduce", "x", 1, torch.float32)
    b.note("all_reduce", "y", 1, torch.float32)
    assert a.history != b.history


def test_hot_path_costs_microseconds():
    st = SyncState()
    n = 20000
    t = time.perf_counter()
    for _ in range(n):
        st.note("all_reduce", "bucket 3", 1000, torch.float32)
    per_note = (time.perf_counter() - t) / n
    t = time.perf_counter()
    for i in range(n):
        st.begin_forward(i)
        st.begin_backward()
        st.end_backward()
        st.end_iteration()
    per_iter = (time.perf_counter() - t) / n
    # A bucket all-reduce takes tens of microseconds at least; an iteration milliseconds.
    assert per_note < 10e-6, per_note
    assert per_iter < 20e-6, per_iter


# ------------------------------------------------------------------ timeout rule


def test_timeout_rule(monkeypatch):
    monkeypatch.delenv("FASTCOLL_STALL_TIMEOUT", raising=False)
    assert stall.default_stall_timeout(pg_timeout=1800) == 300.0  # gloo's 30 min default: capped
    assert stall.default_stall_timeout(pg_timeout=120) == 60.0
    assert stall.resolve_stall_timeout(None, pg_timeout=120) == 60.0
    assert stall.resolve_stall_timeout(0, pg_timeout=120) == 0.0
    assert stall.resolve_stall_timeout(7, pg_timeout=120) == 7.0
    assert stall.resolve_stall_timeout(datetime.timedelta(seconds=9)) == 9.0
    monkeypatch.setenv("FASTCOLL_STALL_TIMEOUT", "12.5")
    assert stall.resolve_stall_timeout(None, pg_timeout=120) == 12.5
    assert stall.resolve_stall_timeout(3, pg_timeout=120) == 3.0  # an explicit value wins
    monkeypatch.setenv("FASTCOLL_STALL_TIMEOUT", "0")
    assert stall.resolve_stall_timeout(None, pg_timeout=120) == 0.0
    monkeypatch.setenv("FASTCOLL_STALL_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="FASTCOLL_STALL_TIMEOUT"):
        stall.resolve_stall_timeout(None, pg_timeout=120)
    for bad in (-1, "x", True, float("nan")):
        with pytest.raises(ValueError, match="stall_timeout"):
            stall.resolve_stall_timeout(bad)


def _pg_timeouts(rank, world_size):
    g = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=44))
    pg = dist.distributed_c10d._get_default_group()
    # gloo: timed host waits, for CPU and CUDA tensors alike; guards are cached; 0 disables.
    assert stall.backend_of(pg) == stall.backend_of(pg, "cpu") == stall.backend_of(pg, "cuda") == "gloo"
    guard = stall.guard_for(None, 5)
    assert guard.mode == "blocking" and guard.watchdog is None and stall.guard_for(None, 5) is guard
    assert stall.guard_for(None, 0) is None and stall.guard_for(g, 5) is not guard
    assert stall.state_for(None) is stall.state_for(pg) is guard.state
    return stall.process_group_timeout(), stall.process_group_timeout(g), stall.default_stall_timeout()


def test_process_group_timeout_and_guards():
    out = run_stall_ranks(_pg_timeouts, 2, pg_timeout=70, timeout=60, env={"FASTCOLL_STALL_TIMEOUT": ""})
    for r in range(2):
        assert out[r].kind == "ok", out[r]
        assert out[r].value == (70.0, 44.0, 35.0)


# ------------------------------------------------------------------ board on a HashStore


def _boards(world, store, **kw):
    return [
        stall.StateBoard(SyncState(rank=r, group_rank=r), store, r, world, poll=0.05, store_host=None, **kw) for r in range(world)
    ]


def test_board_publishes_once_per_iteration_and_answers_requests():
    store = dist.HashStore()
    (b,) = _boards(1, store, min_interval=0.0)
    try:
        time.sleep(0.3)
        assert b.writes == 1  # the initial state; nothing changed since
        b.state.begin_forward()
        time.sleep(0.3)
        assert b.writes == 2
        for _ in range(5):  # phase changes inside an iteration are not published...
            b.state.begin_backward()
            b.state.end_iteration()
        time.sleep(0.3)
        assert b.writes == 2
        b.state.end_backward(["w"])  # ...unless gradients are missing
        time.sleep(0.3)
        assert b.writes == 3 and b.read_all()[0]["missing"] == ["w"]
        req = b.request()
        time.sleep(0.3)
        assert b.read_all()[0]["answer"] == req and b.writes == 4
        assert b.settle({"line": "first"}) == {"line": "first"}
        assert b.settle({"line": "second"}) == {"line": "first"}
    finally:
        b.close()


def test_board_rate_limits_fast_iterations():
    store = dist.HashStore()
    (b,) = _boards(1, store, min_interval=0.5)
    try:
        t = time.time()
        while time.time() - t < 1.6:
            b.state.begin_forward()
            time.sleep(0.001)
        assert 2 <= b.writes <= 5, b.writes  # ~1 per 0.5 s although ~1000 iterations ran
    finally:
        b.close()


def _diag_world(store, world=3, answering=(0, 1, 2)):
    boards = _boards(world, store)
    for r, b in enumerate(boards):
        if r not in answering:
            b.close()  # a dead rank: its last record stays, it answers nothing
    return boards


def test_diagnose_in_process_ranks_same_first_line(tmp_path, capsys):
    store = dist.HashStore()
    boards = _diag_world(store, answering=(0, 1))
    try:
        for b in boards:
            b.state.begin_forward(3)
            b.state.begin_backward()
            b.state.note("all_reduce", "bucket 0", 100, torch.float32)
        boards[2].publish()  # rank 2's last words: backward of iteration 3
        boards[2].close()
        for b in boards[:2]:
            b.state.note("all_reduce", "bucket 1", 100, torch.float32)
            b.state.waiting = (2, "bucket 1", time.time() - 5)
        errs = [None, None]

        def run(r):
            errs[r] = stall.diagnose(boards[r], 5.0, waited=5.0, grace=1.0, trace_dir=str(tmp_path))

        threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
        t = time.time()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert time.time() - t < 3.0
        e0, e1 = errs
        assert isinstance(e0, stall.StallError) and isinstance(e0, RuntimeError)
        assert e0.first_line == e1.first_line
        assert e0.first_line.startswith("fastcoll stall: rank 2 did not answer")
        assert "backward of iteration 3, 1 collectives issued" in e0.first_line
        assert e0.culprits == [2] == e1.culprits
        assert str(e0).splitlines()[0] == e0.first_line
        assert "rank 2: no answer: dead or stuck outside gradient synchronization; last state" in e0.report
        assert "waiting for bucket 1 (collective #2) of iteration 3" in e0.report
        # Printed once per process, JSON written once (the first diagnosis of the process).
        err = capsys.readouterr().err
        assert err.count("fastcoll stall report from rank") == 1
        data = json.loads((tmp_path / "stall-rank0.json").read_text()) if (tmp_path / "stall-rank0.json").exists() else None
        data = data or json.loads((tmp_path / "stall-rank1.json").read_text())
        assert data["first_line"] == e0.first_line and data["culprits"] == [2]
    finally:
        for b in boards:
            b.close()


def test_the_store_host_keeps_the_store_until_every_live_rank_has_read():
    """Rank 0 hosts the store: its diagnosis returns (and its process may end, taking the store) only once every
    rank that answered has read the verdict: rank 1, diagnosing itself, when its diagnosis has read (done());
    rank 2, outside fastcoll, when its board thread has kept a copy. Rank 3 is dead: not waited for."""
    store = dist.HashStore()
    boards = [stall.StateBoard(SyncState(rank=r, group_rank=r), store, r, 4, poll=0.05, store_host=0) for r in range(4)]
    try:
        for b in boards:
            b.state.begin_forward(3)
            b.state.note("all_reduce", "bucket 0", 100, torch.float32)
        boards[3].publish()
        boards[3].close()
        for r in (0, 1):
            boards[r].state.waiting = (2, "bucket 1", time.time() - 5)
            boards[r].state.note("all_reduce", "bucket 1", 100, torch.float32)
        boards[1].publish(stalled={"seq": 2, "what": "bucket 1"})  # rank 1 diagnoses (its report is whole)
        t = time.monotonic()
        timer = threading.Timer(2.5, boards[1].done)  # ... and has read 2.5 s from now
        timer.start()
        err = stall.diagnose(boards[0], 5.0, waited=5.0, grace=0.5)
        took = time.monotonic() - t
        timer.join()
        assert err.first_line.startswith("fastcoll stall: rank 3 did not answer") and err.culprits == [3]
        assert 2.4 <= took < 5.0, took
        assert boards[2].seen_verdict["line"] == err.first_line and boards[2].seen_records[3] is not None
        assert boards[1].seen_verdict is not None  # kept too, but rank 1 said it had read only through done()
        # The same wait, bounded: a rank that never reads holds the host until the deadline only.
        t = time.monotonic()
        assert boards[0].hold_for_readers([0, 1, 2, 3], time.monotonic() + 0.5) == {3}
        assert 0.45 <= time.monotonic() - t < 2.0
    finally:
        for b in boards:
            b.close()


def test_a_rank_that_diagnoses_after_the_store_host_left_reports_the_kept_verdict():
    """Rank 2's board thread kept the verdict rank 0 settled; rank 0's process then ended with the store: rank 2's
    own diagnosis, later, reports that verdict (not "the store host is unreachable")."""
    store = dist.HashStore()
    boards = _boards(3, store)
    try:
        for b in boards:
            b.state.note("all_reduce", "bucket 0", 100, torch.float32)
        boards[1].close()  # dead
        boards[0].state.waiting = (1, "bucket 0", time.time() - 5)
        err0 = stall.diagnose(boards[0], 5.0, waited=5.0, grace=0.3)
        deadline = time.time() + 5
        while time.time() < deadline and boards[2].seen_verdict is None:
            time.sleep(0.02)
        assert boards[0].readers([2]) == {2}
        boards[2].close()
        boards[2]._fg = _DeadStore()  # the store went with rank 0's process
        boards[2].state.waiting = (2, "bucket 1", time.time() - 5)
        diagnose_mod._reset_emitted()
        err2 = stall.diagnose(boards[2], 5.0, waited=5.0, cause=RuntimeError("Connection reset by peer"))
        assert err2.first_line == err0.first_line and err2.culprits == [1] and not err2.data["store_reachable"]
        assert "first line as agreed by rank 0" in err2.report
    finally:
        for b in boards:
            b.close()


class _DeadStore:
    def __getattr__(self, name):
        def fail(*a, **k):
            raise RuntimeError("Broken pipe")

        return fail


def test_diagnose_store_unreachable_reports_own_state():
    st = SyncState(rank=2, group_rank=2)
    st.begin_forward(5)
    st.note("all_reduce", "bucket 0", 10, torch.float32)
    st.waiting = (1, "bucket 0", time.time() - 5)
    b = stall.StateBoard(st, _DeadStore(), 2, 3, store_host=0, start=False)
    err = stall.diagnose(b, 5.0, waited=5.0, cause=RuntimeError("Connection closed by peer"))
    assert err.first_line.startswith("fastcoll stall: rank 0 (the store host) is unreachable")
    assert err.culprits == [0]
    lines = err.report.splitlines()
    assert any(line.startswith("  rank 2 (this rank; pid") and "waiting for bucket 0" in line for line in lines)
    assert "cause: RuntimeError: Connection closed by peer" in err.report
    assert not err.data["store_reachable"]


def test_an_announced_abort_reaches_the_other_boards_and_ends_their_waits_at_once():
    store = dist.HashStore()
    boards = _boards(3, store)
    try:
        for b in boards:
            b.state.note("all_reduce", "bucket 0", 100, torch.float32)
        b0 = boards[0]
        channel, lock = b0.abort_store()  # the foreground connection: its lock was free
        assert lock is not None
        req = b0.announce_abort(_aborted_info(seq=1), channel)
        lock.release()
        deadline = time.time() + 5
        while time.time() < deadline and not (boards[1].peer_abort and boards[2].peer_abort):
            time.sleep(0.02)
        assert boards[1].peer_abort["rank"] == 0 and boards[1].peer_abort["received"] == 668
        assert b0.peer_abort is None  # its own announcement
        recs = b0.read_records(store)
        assert recs[0]["aborted"]["seq"] == 1 and all(int(recs[r]["answer"]) >= req for r in (1, 2))
        # Rank 1 waits (for a future that never completes, timeout 60 s): it diagnoses within a slice.
        t = time.time()
        with pytest.raises(stall.StallError) as ei:
            stall.wait_or_diagnose(torch.futures.Future(), boards[1].state, 60.0, boards[1], "bucket 1", 2, grace=1.0)
        assert time.time() - t < stall.WAIT_SLICE_S + 2.0
        err = ei.value
        assert err.data["cause"].startswith("PeerAborted: rank 0 was aborted by gloo in collective #1")
        assert err.first_line.startswith("fastcoll stall: rank 0 was aborted by gloo in collective #1") and err.culprits == [0]
        assert 0 in err.data["answered"]
        # The diagnosing rank said it has read; the other board keeps the verdict and the records, and says so.
        assert b0.readers([1], store) == {1}
        while time.time() < deadline and boards[2].seen_verdict is None:
            time.sleep(0.02)
        assert boards[2].seen_verdict["line"] == err.first_line and boards[2].seen_records[0]["aborted"]
        assert b0.hold_for_readers([0, 1, 2], time.monotonic() + 5.0, store) == set()
    finally:
        for b in boards:
            b.close()


def test_diagnose_falls_back_to_the_kept_verdict_when_the_store_died_after_it():
    st = SyncState(rank=2, group_rank=2)
    st.note("all_reduce", "bucket 0", 100, torch.float32)
    st.waiting = (1, "bucket 0", time.time() - 1)
    b = stall.StateBoard(st, _DeadStore(), 2, 3, store_host=0, start=False)
    kept = "fastcoll stall: rank 1 is out of step (collective sequence numbers differ): collective #1 is ..."
    b.seen_verdict = {"line": kept, "culprits": [1], "by": 1}
    b.seen_records = {0: _rec(0, 1, waiting=1), 1: _rec(1, 1, waiting=1), 2: _rec(2, 1, waiting=1)}
    b.seen_records[0]["aborted"] = _aborted_info(seq=1)
    err = stall.diagnose(b, 5.0, waited=1.0, cause=RuntimeError("Connection reset by peer"))
    assert err.first_line == kept and err.culprits == [1] and not err.data["store_reachable"]
    assert "first line as agreed by rank 1" in err.report and "aborted by gloo in collective #1" in err.report
    assert "rank 2 (this rank; pid" in err.report


# ------------------------------------------------------------------ waiting


def test_wait_or_diagnose_future_timeout_peer_failure_and_other_errors():
    store = dist.HashStore()
    (b,) = _boards(1, store)
    try:
        st = b.state
        done = torch.futures.Future()
        done.set_result(7)
        assert stall.wait_or_diagnose(done, st, 1.0, b, "x") == 7
        t = time.time()
        with pytest.raises(stall.StallError) as ei:
            stall.wait_or_diagnose(torch.futures.Future(), st, 0.5, b, "bucket 4", 9, grace=0.2)
        assert 0.5 <= time.time() - t < 3.0
        assert ei.value.data["waiting_for"] == {"seq": 9, "what": "bucket 4"}
        assert st.waiting is None
        dead = torch.futures.Future()
        dead.set_exception(RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1234"))
        with pytest.raises(stall.StallError) as ei:
            stall.wait_or_diagnose(dead, st, 30.0, b, "bucket 0", grace=0.2)
        assert isinstance(ei.value.__cause__, RuntimeError)
        assert "Connection closed by peer" in ei.value.data["cause"]
        late = torch.futures.Future()  # the backend's own timeout: the Work failed
        late.set_exception(RuntimeError("Timed out waiting 1800000ms for recv operation to complete"))
        with pytest.raises(stall.StallError) as ei:
            stall.wait_or_diagnose(late, st, 30.0, b, "bucket 0", grace=0.2)
        assert "Timed out waiting" in ei.value.data["cause"]
        other = torch.futures.Future()
        other.set_exception(ValueError("bad argument"))
        with pytest.raises(ValueError, match="bad argument"):
            stall.wait_or_diagnose(other, st, 30.0, b)
    finally:
        b.close()


class _CompletesAsTheSliceEnds(dist.Work):
    """A Work whose first bounded wait times out just as it completes (the peer arrives at the slice's end)."""

    def __init__(self):
        super().__init__()
        self.waits = 0

    def wait(self, timeout=None):
        self.waits += 1
        if self.waits == 1:
            raise RuntimeError("Operation timed out!")  # gloo's words for a bounded wait that ran out
        return True

    def is_completed(self):
        return self.waits >= 1


def test_a_work_completing_as_a_wait_slice_ends_is_no_stall():
    """The slice's timeout races the Work's completion: the completed Work's own outcome decides, not a diagnosis."""
    store = dist.HashStore()
    (b,) = _boards(1, store)
    try:
        work = _CompletesAsTheSliceEnds()
        assert stall.wait_or_diagnose(work, b.state, 30.0, b, "bucket 0", grace=0.2) is True
        assert work.waits == 2 and b.state.waiting is None
    finally:
        b.close()


class _FakeWork:
    def __init__(self, done=False, exc=None):
        self.done, self.exc = done, exc

    def is_completed(self):
        return self.done

    def exception(self):
        return self.exc

    def wait(self):
        return True


def test_watchdog_polling_logic():
    st = SyncState()
    calls = []
    aborted = []

    def fake_diagnose(**kw):
        calls.append(kw)
        return stall.StallError("fastcoll stall: x\nreport", "fastcoll stall: x", [1])

    wd = stall.Watchdog(st, None, 5.0, abort=lambda: aborted.append(1), diagnose_fn=fake_diagnose, start=False)
    w1, w2 = _FakeWork(), _FakeWork()
    wd.track(w1, 1, "bucket 0")
    wd.track(w2, 2, "bucket 1")
    t0 = wd._outstanding[0][3]
    assert wd.poll_once(now=t0 + 1) is None
    assert st.waiting[:2] == (1, "bucket 0")
    w1.done = True
    assert wd.poll_once(now=t0 + 2) is None and st.waiting[:2] == (2, "bucket 1")
    w2.done = True
    assert wd.poll_once(now=t0 + 3) is None and st.waiting is None and not wd._outstanding
    wd.check()  # healthy: nothing raised
    # An old incomplete work: diagnose once, abort once, arm the error.
    w3 = _FakeWork()
    wd.track(w3, 3, "bucket 0")
    assert wd.poll_once(now=wd._outstanding[0][3] + 4.9) is None
    err = wd.poll_once(now=wd._outstanding[0][3] + 5.1)
    assert isinstance(err, stall.StallError) and len(calls) == 1 and aborted == [1]
    assert wd.poll_once() is err and len(calls) == 1
    with pytest.raises(stall.StallError):
        wd.check()
    # A work that failed because a peer is gone: diagnosed at once, with the cause.
    calls.clear()
    wd2 = stall.Watchdog(SyncState(), None, 100.0, diagnose_fn=fake_diagnose, start=False)
    wd2.track(_FakeWork(done=True, exc=RuntimeError("NCCL error: remote process exited")), 1, "bucket 0")
    assert wd2.poll_once() is not None and "NCCL error" in str(calls[0]["cause"])


def test_watchdog_diagnoses_before_its_timeout_once_a_peer_settled_the_verdict():
    class _Board:
        seen_verdict = None
        peer_abort = None

    board, calls = _Board(), []
    wd = stall.Watchdog(SyncState(), board, 100.0, diagnose_fn=lambda **kw: calls.append(kw) or stall.StallError("r", "l", []),
                        start=False)  # fmt: skip
    wd.track(_FakeWork(), 1, "bucket 0")
    t0 = wd._outstanding[0][3]
    assert wd.poll_once(now=t0 + 1) is None and not calls
    board.seen_verdict = {"line": "fastcoll stall: rank 1 is behind"}  # a peer with a 5 s timeout diagnosed
    assert isinstance(wd.poll_once(now=t0 + 2), stall.StallError) and len(calls) == 1


def test_watchdog_thread_arms_the_error():
    st = SyncState()
    wd = stall.Watchdog(st, None, 0.3, poll=0.05, diagnose_fn=lambda **kw: stall.StallError("r", "l", []))
    try:
        wd.track(_FakeWork(), 1, "bucket 0")
        deadline = time.time() + 5
        while wd.error is None and time.time() < deadline:
            time.sleep(0.02)
        with pytest.raises(stall.StallError):
            wd.check()
    finally:
        wd.close()


def test_communicator_unprotected_is_a_plain_wait():
    from fastcoll.reducer.comm import DONE, Communicator

    c = Communicator(None, 1)
    assert c.guard is None and c.wait(DONE) is True
    fut = torch.futures.Future()
    fut.set_result(3)
    assert c.wait(fut) == 3
    c.check()
    # Listeners still see the communicator's own numbering.
    f = Communicator(None, 1, force=True)
    seen = []
    f.add_listener(seen.append)
    f.note_hook("bucket 0", torch.zeros(4))
    assert [x.seq for x in seen] == [1] and f.seq == 1 and f.state.seq >= 1


# ------------------------------------------------------------------ multi-rank


def _comm(world_size, timeout=TIMEOUT):
    from fastcoll.reducer.comm import Communicator

    c = Communicator(None, world_size, stall_timeout=timeout)
    assert c.guard is not None and c.guard.mode == "blocking"
    return c


def _iteration(comm, i, buckets=2, numel=256, before=None):
    """One simulated synchronized iteration: forward, bucket all-reduces issued in backward, waits at its end.

    ``before(stage)`` is called at "forward", "backward", "bucket <k>" (before issuing it) and "wait";
    it may sleep, kill the process, or return "skip" to not issue that bucket.
    """
    st = comm.state
    st.begin_forward(i)
    if before:
        before("forward")
    st.begin_backward()
    if before:
        before("backward")
    handles = []
    for b in range(buckets):
        if before and before(f"bucket {b}") == "skip":
            continue
        handles.append((comm.all_reduce(torch.ones(numel), f"bucket {b}"), f"bucket {b}"))
    st.end_backward()
    if before:
        before("wait")
    for h, what in handles:
        comm.wait(h, what)
    st.end_iteration()


def _stall_result(fn):
    """Run ``fn``; the StallError it raises, as picklable data (None if none)."""
    t0 = time.monotonic()
    try:
        fn()
    except stall.StallError as e:
        return {"line": e.first_line, "culprits": e.culprits, "report": e.report, "elapsed": time.monotonic() - t0}
    return None


def _stall_in_third_iteration(world_size, before):
    """Two healthy iterations, then a third whose ``before(comm, stage)`` hook (see _iteration) misbehaves:
    the StallError it ends with, as _stall_result's data."""
    comm = _comm(world_size)
    for i in range(1, 3):
        _iteration(comm, i)
    return _stall_result(lambda: _iteration(comm, 3, before=lambda stage: before(comm, stage)))


def _kill_mid_backward(rank, world_size):
    def before(comm, stage):
        if rank == 2 and stage == "bucket 1":
            os.kill(os.getpid(), signal.SIGKILL)

    return _stall_in_third_iteration(world_size, before)


def _check_trace(trace_dir, ranks, first_line):
    for r in ranks:
        data = json.loads((trace_dir / f"stall-rank{r}.json").read_text())
        assert data["first_line"] == first_line and data["rank"] == r
        assert data["report"].splitlines()[0] == first_line


def test_killed_rank_is_named_by_the_survivors(tmp_path):
    out = run_stall_ranks(_kill_mid_backward, 3, need={0, 1, 2}, env={"FASTCOLL_TRACE_DIR": str(tmp_path)})
    assert out[2].kind == "dead" and out[2].value == -signal.SIGKILL
    res, line = survivors_agree(out, (0, 1))
    assert line.startswith("fastcoll stall: rank 2 did not answer: dead or stuck outside gradient synchronization"), line
    assert res[0]["culprits"] == [2]
    assert max(x["elapsed"] for x in res) < TIMEOUT + 30
    _check_trace(tmp_path, (0, 1), line)


def _sleep_before_backward(rank, world_size):
    def before(comm, stage):
        if rank == 1 and stage == "forward":
            time.sleep(120)

    return _stall_in_third_iteration(world_size, before)


def test_sleeping_rank_is_named_behind(tmp_path):
    out = run_stall_ranks(_sleep_before_backward, 3, need={0, 2}, env={"FASTCOLL_TRACE_DIR": str(tmp_path)})
    assert out[1].kind == "killed", out[1]  # still asleep: killed by the harness
    res, line = survivors_agree(out, (0, 2))
    assert line.startswith("fastcoll stall: rank 1 is behind: it has not issued collective #5 (bucket 0)"), line
    assert "last seen in forward of iteration 3" in line
    assert res[0]["culprits"] == [1]
    assert all(TIMEOUT <= x["elapsed"] < TIMEOUT + 15 for x in res), res
    _check_trace(tmp_path, (0, 2), line)


def _missing_gradient(rank, world_size):
    def before(comm, stage):
        if rank == 2 and stage == "bucket 1":
            return "skip"  # net.fc2.weight got no gradient here: bucket 1 is never complete
        if rank == 2 and stage == "wait":
            comm.state.end_backward(["net.fc2.weight"])
            comm.guard.publish()
            # The reducer raises at the next forward; the script dies.
            os._exit(3)
        return None

    return _stall_in_third_iteration(world_size, before)


def test_rank_missing_a_gradient_is_named_with_the_parameter():
    out = run_stall_ranks(_missing_gradient, 3, need={0, 1, 2})
    assert out[2].kind == "dead" and out[2].value == 3
    res, line = survivors_agree(out, (0, 1))
    assert line.startswith("fastcoll stall: rank 2 did not answer"), line
    assert "finished backward of iteration 3" in line and "no gradient for net.fc2.weight" in line
    assert res[0]["culprits"] == [2]
    assert max(x["elapsed"] for x in res) < TIMEOUT + 30


def _kill_store_host(rank, world_size):
    def before(comm, stage):
        if rank == 0 and stage == "backward":
            os.kill(os.getpid(), signal.SIGKILL)

    return _stall_in_third_iteration(world_size, before)


def test_store_host_death_is_reported_by_every_survivor(tmp_path):
    out = run_stall_ranks(_kill_store_host, 3, need={0, 1, 2}, store="tcp", env={"FASTCOLL_TRACE_DIR": str(tmp_path)})
    assert out[0].kind == "dead"
    res, line = survivors_agree(out, (1, 2))
    assert line.startswith("fastcoll stall: rank 0 (the store host) is unreachable"), line
    assert res[0]["culprits"] == [0]
    for r, x in zip((1, 2), res):
        assert f"rank {r} (this rank; pid" in x["report"] and "waiting for bucket 0 (collective #5) of iteration 3" in x["report"]
    assert max(x["elapsed"] for x in res) < TIMEOUT + 30
    _check_trace(tmp_path, (1, 2), line)


def _extra_collective_of_shape(rank, world_size, shape):
    """Four one-bucket iterations; in the backward of iteration 2, rank 1 alone all-reduces a tensor of ``shape``
    (a fastcoll.dist.reduce_mean of the loss, on rank 1 only). Returns (_stall_result's data, collectives issued)."""
    comm = _comm(world_size)

    def before(stage):
        if rank == 1 and stage == "backward":
            t = torch.ones(shape)
            stall.run_collective(lambda: dist.all_reduce(t, async_op=True), "all_reduce", "reduce_mean", t, stall_timeout=TIMEOUT)

    def train():
        for i in range(1, 5):
            _iteration(comm, i, buckets=1, before=before if i == 2 else None)

    res = _stall_result(train)
    return res, comm.state.seq


def _extra_collective(rank, world_size):
    return _extra_collective_of_shape(rank, world_size, (256,))


def test_extra_collective_on_one_rank_is_named_out_of_step():
    out = run_stall_ranks(_extra_collective, 3, need={0, 1, 2})
    assert all(out[r].kind == "ok" for r in range(3)), out
    # Ranks 0 and 2 finished (their collectives paired with rank 1's, shifted by one); rank 1 waits for a 6th.
    assert out[0].value == (None, 4) and out[2].value == (None, 4)
    res, seq = out[1].value
    assert seq == 5 and res is not None
    line = res["line"]
    assert line.startswith("fastcoll stall: rank 1 is out of step (collective sequence numbers differ)"), line
    assert "collective #2 is all_reduce of reduce_mean (256 x float32) on rank 1 but all_reduce of bucket 0" in line
    assert res["culprits"] == [1]


def _extra_collective_sized(rank, world_size, shape):
    res, _ = _extra_collective_of_shape(rank, world_size, shape)
    return res


# gloo aborts a process whose collective receives more bytes than it expects (an EnforceNotMet in its transport
# thread, then std::terminate): in its ring all-reduce rank r receives from rank r + 1, so rank 1's scalar is overflowed
# by rank 2's bucket (rank 1 aborted), and rank 1's 1000 elements overflow rank 0's bucket (rank 0, the store host,
# aborted). The aborted rank's last words reach the survivors, who name rank 1.
@pytest.mark.parametrize(
    "shape, aborted, store", [((), 1, "file"), ((1000,), 0, "tcp")], ids=["rank1-aborted", "store-host-aborted"]
)
def test_extra_collective_of_another_size_is_blamed_on_its_rank(shape, aborted, store):
    out = run_stall_ranks(_extra_collective_sized, 3, shape, need={0, 1, 2}, store=store, capture_stderr=True)
    assert out[aborted].kind == "dead" and out[aborted].value == -signal.SIGABRT, out[aborted]
    live = [r for r in range(3) if r != aborted]
    res, line = survivors_agree(out, live)
    numel = 1 if shape == () else 1000
    assert line.startswith(
        f"fastcoll stall: rank 1 is out of step (collective sequence numbers differ): collective #2 is all_reduce of "
        f"reduce_mean ({numel} x float32) on rank 1 but all_reduce of bucket 0 (256 x float32) on ranks 0, 2: "
        f"a collective issued on some ranks only; rank {aborted} was aborted by gloo in collective #2"
    ), line
    assert all(x["culprits"] == [1] for x in res), res
    assert max(x["elapsed"] for x in res) < TIMEOUT + 30
    err = out[aborted].stderr
    assert (
        f"fastcoll: collective #2 of rank {aborted} (" in err and f"fastcoll: first line the other ranks agreed on: {line}" in err
    )


def test_without_last_words_the_store_hosts_abort_leaves_the_survivors_blind():
    """FASTCOLL_STALL_ABORT_HOOK=0 (or no libstdc++ hook): gloo's abort kills rank 0 and its store at once; the
    survivors can only say that the store host is unreachable, and rank 0's stderr has gloo's message alone."""
    env = {"FASTCOLL_STALL_ABORT_HOOK": "0"}
    out = run_stall_ranks(_extra_collective_sized, 3, (1000,), need={0, 1, 2}, store="tcp", env=env, capture_stderr=True)
    assert out[0].kind == "dead" and out[0].value == -signal.SIGABRT, out[0]
    res, line = survivors_agree(out, (1, 2))
    assert line.startswith("fastcoll stall: rank 0 (the store host) is unreachable"), line
    assert "fastcoll: " not in out[0].stderr and "gloo::EnforceNotMet" in out[0].stderr


def _uneven(rank, world_size):
    comm = _comm(world_size)
    time.sleep(1.5 * rank)  # ranks 0 and 1 wait for rank 2 through several slices of WAIT_SLICE_S
    t = torch.full((64,), float(rank + 1))
    comm.wait(comm.all_reduce(t, "bucket 0"), "bucket 0")
    return t[0].item(), t[-1].item(), comm.state.seq


def test_waits_longer_than_a_slice_complete():
    out = run_stall_ranks(_uneven, 3, need={0, 1, 2})
    for r in range(3):
        assert out[r].kind == "ok" and out[r].value == (6.0, 6.0, 1), out[r]


def _watchdog(rank, world_size):
    from fastcoll.reducer.comm import Communicator

    comm = Communicator(None, world_size)  # unprotected, then given a watchdog guard as under NCCL
    comm.guard = stall.StallGuard(None, TIMEOUT, mode="watchdog")
    for i in range(1, 3):
        _iteration(comm, i)
    if rank == 1:
        time.sleep(120)
    comm.state.begin_forward(3)
    comm.state.begin_backward()
    comm.all_reduce(torch.ones(8), "bucket 0")
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < 60:  # the training thread never blocks: it keeps checking
            comm.check()
            time.sleep(0.05)
    except stall.StallError as e:
        return {"line": e.first_line, "elapsed": time.monotonic() - t0, "culprits": e.culprits}
    return None


def test_watchdog_path_on_gloo():
    out = run_stall_ranks(_watchdog, 3, need={0, 2})
    res, line = survivors_agree(out, (0, 2))
    assert line.startswith("fastcoll stall: rank 1 is behind"), line
    assert "last seen outside fastcoll (after iteration 2)" in line
    assert all(TIMEOUT <= x["elapsed"] < TIMEOUT + 15 for x in res), res


def _healthy(rank, world_size, iters, forward_s):
    comm = _comm(world_size)
    t = time.monotonic()

    def before(stage):
        if stage == "forward":
            time.sleep(forward_s)

    for i in range(1, iters + 1):
        _iteration(comm, i, before=before)
    for k in range(50):  # fast iterations: publications stay rate-limited
        _iteration(comm, iters + 1 + k)
    t_b = torch.full((4,), float(rank))
    comm.broadcast(t_b, "layout")  # a protected broadcast (async + timed wait)
    assert t_b.tolist() == [0.0] * 4
    b = comm.guard.board
    return {"elapsed": time.monotonic() - t, "writes": b.writes, "polls": b.polls, "seq": comm.state.seq}


def test_healthy_training_with_forward_longer_than_the_timeout_does_not_raise():
    out = run_stall_ranks(_healthy, 3, 2, TIMEOUT + 1.0, need={0, 1, 2})
    for r in range(3):
        assert out[r].kind == "ok", out[r]
        v = out[r].value
        assert v["seq"] == 2 * 52 + 1
        # One initial write, one per slow iteration, at most a couple for the burst of fast ones.
        assert v["writes"] <= 2 + 2 + 2, v
        assert v["polls"] <= v["elapsed"] / 0.5 + 3, v


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-v", *sys.argv[1:]]))
