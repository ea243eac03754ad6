"""The hardware profiler and its calibration: tier 1 (files, fits, interpolation) and tier 3 (gloo)."""

from __future__ import annotations

import argparse
import json
import math
import os

import pytest
import torch

from autoplan.cli import exit_now
from autoplan.cluster import preset
from autoplan.cost_model.calibration import E_MAX, GemmEfficiency, device_spec_from_profile, effective_link
from autoplan.profiler.cli import add_profile_parser, cmd_profile, slowest_rank
from autoplan.profiler.collectives import fit_alpha_beta, group_sizes, ring_byte_factor
from autoplan.profiler.profile import (
    AttentionSample,
    CollectiveFit,
    CollectiveSample,
    GemmSample,
    HardwareProfile,
    MemorySample,
    ProfileError,
    local_device_name,
)

SIZES = (256, 1024, 4096)


def _linear_eff(m: int, n: int, k: int) -> float:
    """A synthetic efficiency, linear in log2 m, log2 n, log2 k: trilinear interpolation is exact on it."""
    return 0.10 + 0.06 * math.log2(m / 256) + 0.05 * math.log2(n / 256) + 0.02 * math.log2(k / 256)


def _profile(peak: float = 1e15, kind: str = "cuda", name: str = "NVIDIA H200", fits=(), drop=()) -> HardwareProfile:
    """Samples on the SIZES^3 grid with time = 2mnk / (_linear_eff * peak), less the shapes in `drop`."""
    gemm = tuple(
        GemmSample(m, n, k, "bfloat16", 2.0 * m * n * k / (_linear_eff(m, n, k) * peak))
        for m in SIZES for n in SIZES for k in SIZES if (m, n, k) not in drop
    )
    return HardwareProfile(name, kind, 141_000_000_000, 8, "2.13.0", "2026-11-20T00:00:00+00:00", gemm,
                           MemorySample(2**30, 2**31 / 4.0e12), "nccl" if fits else "", (), tuple(fits))


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_profile_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["profile", *argv])


# ------------------------------------------------------------------------------ profile files


def test_quick_cpu_profile_runs_and_round_trips(tmp_path, capsys):
    path = tmp_path / "cpu.json"
    assert cmd_profile(_parse(["--quick", "--device", "cpu", "--no-collectives", "-o", str(path)])) == 0
    out = capsys.readouterr().out
    assert "memory bandwidth" in out and "launch floor" in out
    profile = HardwareProfile.load(path, expect_device=local_device_name("cpu"))
    assert profile.device_kind == "cpu" and len(profile.gemm) == 8
    assert 1e-8 < profile.kernel_floor_s < 1e-3  # an eager op's dispatch: microseconds
    assert profile.host_kernel_s >= 0 and "eager dispatch" in out  # eager's cost per kernel beyond the floor
    assert len(profile.fresh_copies) == 2 and len(profile.attention) == 2  # CPU: measured as eager runs
    assert all(s.flops_per_s > 0 for s in profile.gemm) and profile.memory.bandwidth_bytes_per_s > 0
    assert HardwareProfile.from_json(json.loads(profile.dumps())) == profile
    assert json.loads(path.read_text()) == profile.to_json()


def test_save_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "p.json"
    _profile().save(path)
    before = path.read_text()
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError):
        _profile(peak=2e15).save(path)
    assert path.read_text() == before and os.listdir(tmp_path) == ["p.json"]


def _write_edited(tmp_path, edit) -> str:
    data = _profile().to_json()
    edit(data)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))  # json writes NaN where an edit puts one
    return str(path)


@pytest.mark.parametrize(("edit", "message"), [
    (lambda d: d.update(version=99), r"version 99 is not supported.*reads version 1"),
    (lambda d: d.pop("memory"), r"missing keys \['memory'\]"),
    (lambda d: d.update(colour="red"), r"unknown keys \['colour'\]"),
    (lambda d: d["gemm"][0].update(time_s=float("nan")), r"gemm \(256, 256, 256\) time_s must be a finite number > 0, got nan"),
    (lambda d: d["memory"].update(time_s=-1.0), r"memory time_s must be a finite number > 0, got -1.0"),
    (lambda d: d["gemm"][1].update(m=0), r"gemm m must be a positive integer, got 0"),
    (lambda d: d.update(gemm=[]), r"at least one GEMM sample"),
    (lambda d: d.update(device_kind="tpu"), r"device_kind 'tpu' must be one of"),
])
def test_load_refuses_an_invalid_profile_naming_the_problem(tmp_path, edit, message):
    with pytest.raises(ProfileError, match=message):
        HardwareProfile.load(_write_edited(tmp_path, edit))


def test_load_refuses_corrupt_json_and_missing_files(tmp_path):
    path = tmp_path / "p.json"
    _profile().save(path)
    path.write_text(path.read_text()[:200])  # truncated mid-write by something else
    with pytest.raises(ProfileError, match="is not valid JSON"):
        HardwareProfile.load(path)
    with pytest.raises(ProfileError, match="does not exist"):
        HardwareProfile.load(tmp_path / "absent.json")


def test_load_refuses_another_devices_profile_naming_both(tmp_path):
    path = tmp_path / "h200.json"
    _profile().save(path)
    assert HardwareProfile.load(path, expect_device="nvidia  h200").device_name == "NVIDIA H200"
    with pytest.raises(ProfileError, match=r"measured on 'NVIDIA H200', but this run expects 'NVIDIA A100-SXM4-80GB'"):
        HardwareProfile.load(path, expect_device="NVIDIA A100-SXM4-80GB")


# ------------------------------------------------------------------------------ GEMM efficiency


def test_cpu_gemms_take_their_operands_in_turn_from_a_pool_beyond_the_cache():
    """Every pair a copy with its own storage, together at least COLD_POOL_BYTES (capped at MAX_POOL_PAIRS
    pairs for tiny shapes, at least 2 for huge ones), so a call does not read the operands the call before
    left in the cache."""
    from autoplan.profiler.gemm import COLD_POOL_BYTES, MAX_POOL_PAIRS, operand_pool

    a, b = torch.randn(256, 128), torch.randn(128, 512)
    pool = operand_pool(a, b)
    pair_bytes = (a.numel() + b.numel()) * 4
    assert len(pool) * pair_bytes >= COLD_POOL_BYTES > (len(pool) - 1) * pair_bytes
    assert len({x.data_ptr() for x, _ in pool} | {y.data_ptr() for _, y in pool}) == 2 * len(pool)
    assert all(torch.equal(x, a) and torch.equal(y, b) for x, y in pool)
    assert len(operand_pool(torch.randn(8, 8), torch.randn(8, 8))) == MAX_POOL_PAIRS
    assert len(operand_pool(torch.empty(2048, 4096), torch.empty(4096, 2048))) == 2


def test_cpu_sweep_keeps_each_shapes_median_pass(monkeypatch):
    """`sweep_gemms` on a CPU sweeps the grid CPU_PASSES times, one pass after another, and keeps each shape's
    median; `quick` sweeps once."""
    from autoplan.profiler import gemm

    readings = iter([1.0, 5.0, 3.0, 9.0, 2.0, 7.0])  # pass 1: shapes a, b; pass 2: a, b; pass 3: a, b
    monkeypatch.setattr(gemm, "time_gemm_s", lambda *args: next(readings))
    shapes = [(64, 64, 64), (256, 64, 64)]
    assert gemm.CPU_PASSES == 3
    samples = gemm.sweep_gemms(torch.device("cpu"), shapes=shapes)
    assert [s.time_s for s in samples] == [2.0, 7.0]  # a: median(1, 3, 2); b: median(5, 9, 7)
    monkeypatch.setattr(gemm, "time_gemm_s", lambda *args: 4.0)
    assert [s.time_s for s in gemm.sweep_gemms(torch.device("cpu"), shapes=shapes, quick=True)] == [4.0, 4.0]


def test_gemm_efficiency_reproduces_samples_and_interpolates_in_log_shape():
    eff = GemmEfficiency.from_profile(_profile(peak=1e15))  # no DeviceSpec: peak = best measured
    best = _linear_eff(4096, 4096, 4096)
    assert eff.peak_flops("bfloat16") == pytest.approx(1e15 * best)
    for shape in [(256, 1024, 4096), (4096, 256, 256)]:
        assert eff.efficiency(*shape, "bfloat16") == pytest.approx(_linear_eff(*shape) / best)
    for shape in [(512, 2048, 300), (3000, 700, 1500)]:  # between samples: linear in log2 is exact
        assert eff.efficiency(*shape, "bfloat16") == pytest.approx(_linear_eff(*shape) / best)


def test_gemm_efficiency_clamps_outside_the_sweep_and_is_monotone():
    eff = GemmEfficiency.from_profile(_profile(peak=1e15), preset("h200").device)  # datasheet peak
    peak = preset("h200").device.peak_flops_for("bfloat16")
    assert eff.efficiency(4096, 4096, 4096, "bfloat16") == pytest.approx(_linear_eff(4096, 4096, 4096) * 1e15 / peak)
    assert eff.efficiency(16, 16, 16, "bfloat16") == eff.efficiency(256, 256, 256, "bfloat16")
    assert eff.efficiency(2**20, 4096, 2**16, "bfloat16") == eff.efficiency(4096, 4096, 4096, "bfloat16")
    along_m = [eff.efficiency(m, 1024, 1024, "bfloat16") for m in (128, 256, 300, 700, 1024, 2000, 4096, 9000)]
    assert along_m == sorted(along_m) and all(0 < e <= 1 for e in along_m)


def test_gemm_efficiency_fills_an_unmeasured_grid_point_between_its_neighbours():
    eff = GemmEfficiency.from_profile(_profile(drop={(1024, 1024, 1024)}), preset("h200").device)
    neighbours = [eff.efficiency(*s, "bfloat16") for s in [(256, 1024, 1024), (4096, 1024, 1024), (1024, 256, 1024), (1024, 4096, 1024)]]
    assert min(neighbours) < eff.efficiency(1024, 1024, 1024, "bfloat16") < max(neighbours)


def test_default_efficiency_curve_matches_its_h200_anchors():
    """Sustained ceiling 703 / 989 (MSMF); the sweep's smallest shape at 325 / 789 of its largest."""
    h200 = preset("h200").device
    eff = GemmEfficiency.from_device_default(h200)
    assert eff.efficiency(16384, 16384, 16384, "bfloat16") == pytest.approx(E_MAX, rel=1e-3) == pytest.approx(703 / 989, rel=1e-3)
    assert eff.efficiency(2048, 1536, 1536, "bfloat16") == pytest.approx(E_MAX * 325 / 789, rel=0.01)
    a100 = GemmEfficiency.from_device_default(preset("a100").device)
    assert a100.efficiency(16384, 16384, 16384, "bfloat16") == pytest.approx(271.2 / 312 * 703 / 828, rel=1e-3)
    assert a100.max_efficiency("bfloat16") == pytest.approx(271.2 / 312 * 703 / 828)
    sizes = [eff.efficiency(s, s, s, "bfloat16") for s in (64, 256, 1024, 4096)]
    assert sizes == sorted(sizes) and 0 < sizes[0] < 0.01
    assert eff.gemm_time_s(4096, 4096, 4096, "bfloat16") == pytest.approx(2 * 4096**3 / (sizes[-1] * h200.peak_flops_for("bfloat16")))
    profiled = GemmEfficiency.from_profile(_profile(), h200)  # float16 was not profiled: the default curve
    assert profiled.efficiency(4096, 4096, 4096, "float16") == eff.efficiency(4096, 4096, 4096, "float16")


# ------------------------------------------------------------------------------ links and device specs


@pytest.mark.parametrize("kind", ["all_reduce", "all_gather", "reduce_scatter", "all_to_all"])
@pytest.mark.parametrize("group_size", [2, 4, 8])
def test_alpha_beta_fit_recovers_latency_and_bandwidth_exactly(kind, group_size):
    latency_s, bandwidth = 23e-6, 180e9
    factor = ring_byte_factor(kind, group_size)
    samples = [CollectiveSample(kind, group_size, b, latency_s + b * factor / bandwidth) for b in (4096 * 4**i for i in range(8))]
    fit = fit_alpha_beta(samples)
    assert fit.latency_s == pytest.approx(latency_s, rel=1e-9) and fit.bandwidth_bytes_per_s == pytest.approx(bandwidth, rel=1e-9)
    assert fit.max_rel_error < 1e-9 and fit.num_samples == 8


def test_alpha_beta_fit_keeps_latency_non_negative_and_refuses_flat_times():
    samples = [CollectiveSample("all_reduce", 2, b, b / 1e9 - 1e-6) for b in (2**20, 2**22, 2**24)]
    assert fit_alpha_beta(samples).latency_s == 0.0
    flat = [CollectiveSample("all_gather", 2, b, 1e-3 * (1 + (b == 2**20))) for b in (2**20, 2**22)]
    with pytest.raises(ProfileError, match="do not grow with message size"):
        fit_alpha_beta(flat)


def test_ring_factors_and_group_sizes():
    assert ring_byte_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    assert ring_byte_factor("reduce_scatter", 4) == pytest.approx(3 / 4)
    assert [group_sizes(w) for w in (1, 2, 3, 6, 8)] == [[], [2], [3], [2, 6], [2, 4, 8]]


def test_effective_link_uses_the_nearest_group_size_and_device_spec_takes_measured_bandwidth():
    fits = [CollectiveFit("all_reduce", g, 5e-6 * g, 100e9 * g, 15, 0.05) for g in (2, 8)]
    profile = _profile(fits=fits)
    assert effective_link(profile, "all_reduce", 8) == (800e9, 40e-6)
    assert effective_link(profile, "all_reduce", 4) == (800e9, 40e-6)  # tie in log2: the larger group
    assert effective_link(profile, "all_to_all", 8) is None
    spec = device_spec_from_profile(profile, preset("h200").device)
    assert spec.memory_bandwidth_bytes_per_s == pytest.approx(4.0e12) and spec.peak_flops == preset("h200").device.peak_flops
    with pytest.raises(ProfileError, match="cannot calibrate the cpu device"):
        device_spec_from_profile(profile, preset("cpu").device)
    with pytest.raises(ProfileError, match="measured on 'NVIDIA H200', not on a 'a100-80g'"):
        GemmEfficiency.from_profile(profile, preset("a100").device)


def test_cpu_device_spec_takes_the_measured_peak():
    profile = _profile(peak=1e11, kind="cpu", name="AMD EPYC")
    spec = device_spec_from_profile(profile, preset("cpu").device)
    assert spec.peak_flops_for("bfloat16") == pytest.approx(1e11 * _linear_eff(4096, 4096, 4096))
    eff = GemmEfficiency.from_profile(profile, spec)
    assert eff.efficiency(4096, 4096, 4096, "bfloat16") == pytest.approx(1.0)
    own = device_spec_from_profile(profile)
    assert own.name == "AMD EPYC" and own.memory_bytes == profile.memory_bytes
    assert GemmEfficiency.from_profile(profile, own).efficiency(4096, 4096, 4096, "bfloat16") == pytest.approx(1.0)


# ------------------------------------------------------------------------------ gloo, 2 ranks


def _gloo_worker(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    from autoplan.profiler.collectives import measure_collectives

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        cmd_profile(_parse(["--quick", "--device", "cpu", "-o", os.path.join(out_dir, "profile.json")]))
        samples, fits = measure_collectives(torch.device("cpu"), kinds=("all_gather",), sizes=(4096, 2**20))
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
            json.dump([vars(s) for s in samples] + [vars(f) for f in fits], handle)
        # rank r's GEMMs: (r + 1) ms then (2 - r) ms; its copy (2 - r) ms; its floor r + 1 us; its
        # attention (r + 1) ms forward, 1 ms backward; its eager dispatch (2 - r) us
        mine = {"gemm": tuple(GemmSample(64, 64, 64, "float32", t * 1e-3) for t in (rank + 1, 2 - rank)),
                "memory": MemorySample(2**20, (2 - rank) * 1e-3), "floor": (rank + 1) * 1e-6,
                "fresh_copies": (MemorySample(2**20, (rank + 1) * 1e-3),), "host": (2 - rank) * 1e-6,
                "attention": (AttentionSample(6, 256, 64, "float32", (rank + 1) * 1e-3, 1e-3),)}
        out = slowest_rank(mine)
        assert [s.time_s for s in out["gemm"]] == [2e-3, 2e-3] and out["memory"].time_s == 2e-3
        assert out["floor"] == 2e-6 and out["host"] == 2e-6 and out["fresh_copies"][0].time_s == 2e-3
        assert out["attention"][0].fwd_s == 2e-3
        dist.barrier()  # both ranks done before either tears the group down
    finally:
        dist.destroy_process_group()
    exit_now(0)  # as `python -m autoplan` ends a torchrun rank: gloo's threads can abort the teardown (SIGABRT)


@pytest.mark.gloo
def test_collectives_on_two_gloo_ranks_give_positive_fits(tmp_path, free_port):
    torch.multiprocessing.spawn(_gloo_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    profile = HardwareProfile.load(tmp_path / "profile.json")
    assert profile.collective_backend == "gloo"
    assert {(f.kind, f.group_size) for f in profile.fits} == {(k, 2) for k in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")}
    assert all(f.bandwidth_bytes_per_s > 0 and f.latency_s >= 0 for f in profile.fits)
    assert all(s.time_s > 0 for s in profile.collectives) and len(profile.collectives) == 12
    assert profile.fsdp_unit_s is None  # measured only with --fsdp-units
    assert 0 <= profile.host_kernel_s < 1e-3 and profile.fresh_copies and profile.attention  # one thread a rank
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert rank0 == rank1  # every rank gets the slowest rank's times
