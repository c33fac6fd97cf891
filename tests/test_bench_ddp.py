"""Smoke tests of the DDP benchmark (``python -m fastcoll.bench ddp``), so that it does not rot.

The numbers are never checked (the targets are printed, not asserted): only
that a tiny configuration runs end to end on 2 gloo ranks, writes well-formed
JSON and a chart, and finds fastcoll's gradients equal to torch DDP's; plus
the pieces that need no ranks (synthetic models, case lists, comparisons).
"""

from __future__ import annotations

import json

import pytest
import torch

from fastcoll.bench import __main__ as cli
from fastcoll.bench import ddp as bench_ddp
from fastcoll.bench import models, stats


@pytest.mark.timeout(120)
def test_ddp_smoke_run(tmp_path, capsys):
    path = tmp_path / "ddp.json"
    rc = cli.main(["ddp", "--smoke", "--json", str(path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "fastcoll.DDP vs torch DDP" in out and "memory and traffic" in out

    data = json.loads(path.read_text())
    assert data["benchmark"] == "ddp" and data["machine"]["torch"]
    cfg = data["config"]
    assert cfg["smoke"] and cfg["world_size"] == 2 and cfg["backend"] == "gloo" and cfg["threads"] == 1
    rows = [r for r in data["results"] if r["section"] == "fp32"]
    assert {r["model"] for r in rows} == {"mlp", "convbn", "resnet50"}
    assert {r["gradient_as_bucket_view"] for r in rows} == {False, True}
    for r in rows:
        assert set(r["methods"]) == set(bench_ddp.METHODS)
        for name, st in r["methods"].items():
            assert st["median_s"] > 0 and st["n"] == cfg["reps"]
            assert (st["sync_overhead_s"] is None) == (name == "no_sync")
            assert st["buckets"] is None or st["buckets"] >= 1
            assert st["peak_mem_bytes"] is None or st["peak_mem_bytes"] >= 0
        assert r["methods"]["fastcoll"]["sent_bytes_per_step"] > 0  # gloo traffic was seen
        assert r["grads"]["fastcoll"]["close"], r["grads"]
        assert r["ratios"]["fastcoll/torch"] > 0
        assert set(r["targets"]) == {"step", "sync"}
        assert all(t["pass"] in (True, False) for t in r["targets"].values())
        assert r["targets"]["step"]["value"] == pytest.approx(r["ratios"]["fastcoll/torch"])
        assert r["targets"]["step"]["verdict"] in (stats.MET, stats.MISSED, stats.UNRESOLVED)
    comm = [r for r in data["results"] if r["section"] == "comm_dtype"]
    assert data["comm_dtype"]["supported"] and comm and set(comm[0]["methods"]) == set(bench_ddp.COMM_METHODS)
    assert all(c["close"] for c in comm[0]["grads"].values()), comm[0]["grads"]
    assert path.with_suffix(".png").stat().st_size > 1000


def test_shape_model_gradients():
    spec = models.ModelSpec("r", "r", "shapes", {"model": "resnet50", "limit": 5, "divide": 1024})
    storage = models.build_storage(spec, "cpu")
    a, b = models.build_model(spec, "cpu", storage), models.build_model(spec, "cpu", storage)
    params = list(a.parameters())
    assert len(params) == 5 and all(p.data_ptr() == q.data_ptr() for p, q in zip(params, b.parameters()))
    x = models.make_input(spec, rank=1, device="cpu")
    models.loss_of(spec, a(x)).backward()
    for i, p in enumerate(params):
        assert torch.equal(p.grad, torch.full_like(p, float(x[i])))
    assert b.params[0].grad is None  # shared storage, separate autograd leaves


def test_real_models_share_weights_between_instances():
    import torch

    spec = models.ModelSpec("c", "c", "convbn", {"channels": (4, 8)}, batch=2)
    storage = models.build_storage(spec, "cpu")
    a, b = models.build_model(spec, "cpu", storage), models.build_model(spec, "cpu", storage)
    fresh = models.build_model(spec, "cpu")
    for p, q, f in zip(a.state_dict().values(), b.state_dict().values(), fresh.state_dict().values()):
        assert p.data_ptr() == q.data_ptr() and torch.equal(p, f)  # shared, and the seed-0 values
    x = models.make_input(spec, rank=0, device="cpu")
    models.loss_of(spec, a(x)).backward()
    assert all(p.grad is not None for p in a.parameters()) and all(q.grad is None for q in b.parameters())


def test_cases_and_comparisons():
    for level, n_fp32, n_comm in (("smoke", 4, 1), ("default", 7, 2), ("full", 10, 4)):
        cases = bench_ddp.build_cases(level)
        assert len([c for c in cases if c.section == "fp32"]) == n_fp32
        comm = [c for c in cases if c.section == "comm_dtype"]
        assert len(comm) == n_comm and all(c.methods == bench_ddp.COMM_METHODS for c in comm)
    # every model has a row without bucket view in the default run
    names = {c.spec.name for c in bench_ddp.build_cases("default") if c.section == "fp32" and not c.gabv}
    assert names == {"mlp96", "convbn", "encoder", "resnet50", "gpt2_small"}
    assert bench_ddp.collective_passes(2) == [None]

    m1, m2 = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    m2.load_state_dict(m1.state_dict())
    for m in (m1, m2):
        m(torch.ones(4, 3)).sum().backward()
    assert models.compare_grads(m1, m2, 1e-5)["equal"]
    with torch.no_grad():
        m1.weight.grad[0, 0] += 1e-3
    check = models.compare_grads(m1, m2, 1e-5)
    assert not check["equal"] and not check["close"] and check["max_abs_diff"] > 0
    assert models.compare_grads(m1, m2, 1e-2)["close"]
