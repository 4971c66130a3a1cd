"""countlens.results: netCDF round-trips, atomic writes, and sweeps that survive SIGKILL."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import xarray as xr

from countlens import files, results
from countlens.errors import CountlensError
from countlens.results import ResultError, ResultNotFoundError, SpecMismatchError
from countlens.sweep_store import SweepStore

KEYS = [f"layer={i}" for i in range(6)]
SPEC = {"model": "toy", "tap": "resid", "keys": KEYS}


def chunk(key: str) -> xr.DataArray:
    """A deterministic chunk of a layer sweep: one layer × 2 heads."""
    layer = int(key.split("=")[1])
    values = np.arange(2, dtype=float)[None, :] + 10 * layer
    return xr.DataArray(
        values,
        dims=("layer", "head"),
        coords={"layer": [layer], "head": np.array(["H0", "H1"], dtype=object)},
        name="score",
        attrs={"model": "toy", "seed": 0},
    )


def run_sweep(path: str, kill_after: int | None = None, kill_in_write: int | None = None) -> list[str]:
    """Run the 6-chunk sweep; SIGKILL this process after `kill_after` chunks, or inside the
    netCDF write of chunk number `kill_in_write` (temp file written, not yet renamed)."""
    store = SweepStore(path, SPEC)
    if kill_in_write is not None:
        write = results._write_netcdf

        def write_then_die(dataset, tmp):
            write(dataset, tmp)
            if len(store.done()) == kill_in_write - 1:
                os.kill(os.getpid(), signal.SIGKILL)

        results._write_netcdf = write_then_die
    computed = []
    for key in store.todo():
        store.write(key, chunk(key))
        computed.append(key)
        if kill_after is not None and len(computed) == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
    return computed


def dataarray() -> xr.DataArray:
    return xr.DataArray(
        np.arange(6, dtype=np.float32).reshape(3, 2),
        dims=("layer", "head"),
        coords={
            "layer": [0, 1, 2],
            "head": np.array(["L0H0", "L0H1"], dtype=object),
            "head_label": ("head", np.array(["first", "second"], dtype=object)),
            "tap": "resid",
        },
        name="attn_to_objects",
        attrs=results.provenance("toy", "qwen2_vl", dataset={"n": 3, "kind": "dots"}, seed=7, note=True),
    )


def dataset() -> xr.Dataset:
    cases = np.array(["1A", "1B", "2A"], dtype=object)
    return xr.Dataset(
        {
            "accuracy": (("case", "count"), np.linspace(0, 1, 12).reshape(3, 4)),
            "correct": (("case", "count"), np.arange(12).reshape(3, 4) % 2 == 0),
            "n": ("case", np.array([5, 6, 7])),
        },
        coords={"case": cases, "count": [1, 2, 3, 4]},
        attrs=results.provenance("toy", "qwen2_vl", dataset="dots-v1", seed=None),
    )


# -- provenance ------------------------------------------------------------------------------


def test_provenance_is_netcdf_safe():
    attrs = results.provenance(
        "toy",
        "qwen2_vl",
        dataset={"b": 2, "a": [1, 2]},
        seed=3,
        flag=False,
        layers=[1, 2],
        lr=np.float32(0.5),
        skip=None,
    )
    assert attrs["model"] == "toy" and attrs["arch"] == "qwen2_vl" and attrs["seed"] == 3
    assert json.loads(attrs["dataset"]) == {"a": [1, 2], "b": 2}
    assert attrs["flag"] == "false" and attrs["layers"] == "[1, 2]" and attrs["lr"] == 0.5
    assert "skip" not in attrs and attrs["countlens_version"] and attrs["date"].endswith("+00:00")
    assert all(type(v) in (str, int, float) for v in attrs.values())
    assert "dataset" not in results.provenance("toy", "qwen2_vl")


# -- save / load -----------------------------------------------------------------------------


@pytest.mark.parametrize("make", [dataarray, dataset])
def test_round_trip(tmp_path, make):
    obj = make()
    path = results.save(obj, tmp_path / "sub" / "result.nc")
    assert path == tmp_path / "sub" / "result.nc" and os.listdir(path.parent) == ["result.nc"]
    back = results.load(path)
    assert type(back) is type(obj)
    xr.testing.assert_identical(back, obj)
    assert back.attrs == obj.attrs  # no countlens_* markers leak out


def test_round_trip_details(tmp_path):
    da = results.load(results.save(dataarray(), tmp_path / "a.nc"))
    assert da.name == "attn_to_objects" and list(da["head"].values) == ["L0H0", "L0H1"]
    assert da.sel(head="L0H1", layer=2).item() == 5 and da["tap"].item() == "resid"
    assert json.loads(da.attrs["dataset"]) == {"kind": "dots", "n": 3}
    ds = results.load(results.save(dataset(), tmp_path / "b.nc"))
    assert ds["correct"].dtype == bool and ds.sel(case="1B")["n"].item() == 6
    unnamed = results.load(results.save(xr.DataArray([1, 2], dims="k"), tmp_path / "c.nc"))
    assert unnamed.name is None


def test_save_overwrites_atomically(tmp_path):
    path = results.save(dataarray(), tmp_path / "r.nc")
    results.save(dataset(), path)
    assert isinstance(results.load(path), xr.Dataset) and os.listdir(tmp_path) == ["r.nc"]


def test_failed_write_leaves_nothing(tmp_path, monkeypatch):
    def write_half_then_fail(dataset, tmp):
        Path(tmp).write_bytes(b"CDF\x01half a file")
        raise OSError("disk full")

    monkeypatch.setattr(results, "_write_netcdf", write_half_then_fail)
    with pytest.raises(OSError, match="disk full"):
        results.save(dataarray(), tmp_path / "r.nc")
    assert os.listdir(tmp_path) == []


def test_failed_overwrite_keeps_old_file(tmp_path, monkeypatch):
    old = dataarray()  # one object: a second dataarray() could carry a later provenance date
    path = results.save(old, tmp_path / "r.nc")

    def interrupted(dataset, tmp):
        Path(tmp).write_bytes(b"CDF\x01")
        raise KeyboardInterrupt

    monkeypatch.setattr(results, "_write_netcdf", interrupted)
    with pytest.raises(KeyboardInterrupt):
        results.save(dataset(), path)
    assert os.listdir(tmp_path) == ["r.nc"]
    xr.testing.assert_identical(results.load(path), old)


def test_save_and_load_errors(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ResultError, match="parent .*file.* is a file"):
        results.save(dataarray(), tmp_path / "file" / "r.nc")
    with pytest.raises(ResultNotFoundError, match=str(tmp_path / "missing.nc")) as err:
        results.load(tmp_path / "missing.nc")
    assert isinstance(err.value, FileNotFoundError) and isinstance(err.value, CountlensError)
    with pytest.raises(ResultError, match="not a netCDF file"):
        results.load(tmp_path / "file")
    xr.Dataset({"x": ("k", [1])}).to_netcdf(tmp_path / "foreign.nc", engine="netcdf4")
    with pytest.raises(ResultError, match="not a countlens result"):
        results.load(tmp_path / "foreign.nc")
    with pytest.raises(ResultError, match="attr 'flag'.*json.dumps"):
        results.save(xr.DataArray([1], dims="k", attrs={"flag": True}), tmp_path / "bad.nc")
    with pytest.raises(ResultError, match="DataArray or Dataset"):
        results.save(np.zeros(2), tmp_path / "bad.nc")
    assert sorted(os.listdir(tmp_path)) == ["file", "foreign.nc"]


# -- sweeps ----------------------------------------------------------------------------------


def test_spec_mismatch_names_both_specs(tmp_path):
    SweepStore(tmp_path / "s", SPEC)
    SweepStore(tmp_path / "s", dict(SPEC))  # same spec: reopens
    with pytest.raises(SpecMismatchError, match=r'"tap": "resid".*"tap": "mlp".*differing: .tap.*new directory'):
        SweepStore(tmp_path / "s", {**SPEC, "tap": "mlp"})


def test_todo_done_read_and_assemble(tmp_path):
    store = SweepStore(tmp_path / "s", {"model": "toy"})
    assert store.done() == set() and store.todo(KEYS) == KEYS
    for key in ["layer=4", "layer=1"]:
        store.write(key, chunk(key))
    assert store.done() == {"layer=1", "layer=4"}
    assert store.todo(KEYS) == ["layer=0", "layer=2", "layer=3", "layer=5"]
    xr.testing.assert_identical(store.read("layer=4"), chunk("layer=4"))
    assert list(store.assemble("layer")["layer"].values) == [4, 1]  # first-written order
    assert list(store.assemble("layer", ["layer=1", "layer=4"])["layer"].values) == [1, 4]
    with pytest.raises(ResultError, match="missing 1 of 2 chunks.*'layer=0'"):
        store.assemble("layer", ["layer=0", "layer=1"])
    with pytest.raises(ResultNotFoundError, match="no chunk 'layer=0'"):
        store.read("layer=0")
    with pytest.raises(ResultError, match="not a safe file name"):
        store.write("../escape", chunk("layer=0"))
    with pytest.raises(ResultError, match="needs keys"):
        store.todo()


def test_assemble_along_a_new_dim(tmp_path):
    store = SweepStore(tmp_path / "s", {"keys": ["a", "b"]})
    for key in ["b", "a"]:
        store.write(key, dataset().assign_coords(task=key))  # a scalar `task` coord, no task dim
    full = store.assemble("task")  # default order: the spec's keys, not the write order
    assert list(full["task"].values) == ["a", "b"] and full["accuracy"].dims == ("task", "case", "count")


def test_reopen_cleans_crash_debris(tmp_path):
    store = SweepStore(tmp_path / "s", SPEC)
    store.write("layer=0", chunk("layer=0"))
    # What a kill leaves: a half-written temp chunk, a chunk renamed before its order line, and
    # an order line cut short.
    dead_pid = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    ).stdout.strip()
    host = files.writer_id().split("~")[0]
    (store.chunks / f".layer=1.nc.{host}~{dead_pid}-deadbeef.tmp").write_bytes(b"CDF\x01half")
    results.save(chunk("layer=2"), store.chunks / "layer=2.nc")
    with open(tmp_path / "s" / "order.txt", "a") as f:
        f.write("layer=")
    store = SweepStore(tmp_path / "s", SPEC)
    assert sorted(os.listdir(store.chunks)) == ["layer=0.nc", "layer=2.nc"]
    assert (tmp_path / "s" / "order.txt").read_text() == "layer=0\nlayer=2\n"
    assert store.todo() == ["layer=1", "layer=3", "layer=4", "layer=5"]


@pytest.mark.parametrize("kill", [{"kill_after": 3}, {"kill_in_write": 4}], ids=["between_writes", "during_write"])
def test_sweep_resumes_after_sigkill(tmp_path, kill):
    path = tmp_path / "killed"
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_results; "
        f"test_results.run_sweep({str(path)!r}, **{kill!r})"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    half_written = list(path.glob("chunks/.*.tmp"))
    assert len(half_written) == (1 if "kill_in_write" in kill else 0)
    assert SweepStore(path, SPEC).done() == set(KEYS[:3])
    assert not any(p.exists() for p in half_written)  # reopening dropped the interrupted write

    calls = []
    resumed = SweepStore(path, SPEC)
    for key in resumed.todo():
        calls.append(key)
        resumed.write(key, chunk(key))
    assert calls == KEYS[3:]
    assert not [p for p in path.rglob("*") if p.name.endswith(".tmp")]

    fresh = SweepStore(tmp_path / "fresh", SPEC)
    assert run_sweep(str(tmp_path / "fresh")) == KEYS
    xr.testing.assert_identical(resumed.assemble("layer"), fresh.assemble("layer"))
    assert list(resumed.assemble("layer")["layer"].values) == list(range(6))
