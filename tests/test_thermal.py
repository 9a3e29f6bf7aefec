"""Telemetry readers on fake sysfs trees, NVML behind its pynvml calls, the sampling thread,
energy accounting and the thermal-aware background budget."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pynvml
import pytest

from edgeprefill.backends.sim import SimBackend
from edgeprefill.runtime.core.engine import Engine
from edgeprefill.runtime.policies import parse_policy
from edgeprefill.thermal import rapl
from edgeprefill.thermal.battery import BatterySensor
from edgeprefill.thermal.cpu import CpuFrequencySensor, CpuTemperatureSensor
from edgeprefill.thermal.energy import IterationSpan, energy_summary, throttle_intervals
from edgeprefill.thermal.guard import ThermalGuard, ThermalSettings
from edgeprefill.thermal.nvml import NvmlSensor, decode_reasons
from edgeprefill.thermal.rapl import RaplSensor
from edgeprefill.thermal.sampler import TelemetrySampler
from edgeprefill.thermal.sensor import Sensor, SensorStatus
from tests.helpers import drain
from tests.test_policies import CAP, COST, requests


def write(root: Path, rel: str, value: object) -> Path:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(f"{value}\n")
    return p


def rapl_domain(root: Path, domain: str, name: str, uj: int, max_uj: int = 262143328850):
    base = f"sys/class/powercap/{domain}"
    write(root, f"{base}/name", name)
    write(root, f"{base}/max_energy_range_uj", max_uj)
    return write(root, f"{base}/energy_uj", uj)


# --- RAPL -------------------------------------------------------------------------------
def test_rapl_one_package_counts_joules_since_start(tmp_path):
    energy = rapl_domain(tmp_path, "intel-rapl:0", "package-0", 5_000_000)
    s = RaplSensor(tmp_path)
    assert s.open() == SensorStatus(True, "rapl:package-0")
    energy.write_text("7500000\n")
    assert s.read(0.2) == {"energy_j": {"package-0": 2.5}}


def test_rapl_reads_packages_only_never_overlapping_domains(tmp_path):
    e0 = rapl_domain(tmp_path, "intel-rapl:0", "package-0", 0)
    e1 = rapl_domain(tmp_path, "intel-rapl:1", "package-1", 0)
    core = rapl_domain(tmp_path, "intel-rapl:0:0", "core", 0)
    psys = rapl_domain(tmp_path, "intel-rapl:2", "psys", 0)
    s = RaplSensor(tmp_path)
    assert s.open().source == "rapl:package-0+rapl:package-1"
    for path, uj in ((e0, 1_000_000), (e1, 2_000_000), (core, 900_000), (psys, 9_000_000)):
        path.write_text(f"{uj}\n")
    assert s.read(0.2) == {"energy_j": {"package-0": 1.0, "package-1": 2.0}}


def test_rapl_counter_wraparound_between_two_reads(tmp_path):
    energy = rapl_domain(tmp_path, "intel-rapl:0", "package-0", 999_000_000, max_uj=1_000_000_000)
    s = RaplSensor(tmp_path)
    s.open()
    energy.write_text("500000\n")  # wrapped: 1.0 J to the top, then 0.5 J
    assert s.read(0.2)["energy_j"]["package-0"] == pytest.approx(1.5)
    energy.write_text("1500000\n")
    assert s.read(0.4)["energy_j"]["package-0"] == pytest.approx(2.5)


def test_rapl_unreadable_counter_is_reported_as_permission_denied(tmp_path, monkeypatch):
    energy = rapl_domain(tmp_path, "intel-rapl:0", "package-0", 1)
    energy.chmod(0o000)
    real = rapl.read_int

    def kernel_permissions(path: Path) -> int:  # root reads anything: apply the mode
        if not os.stat(path).st_mode & 0o444:
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(rapl, "read_int", kernel_permissions)
    status = RaplSensor(tmp_path).open()
    assert not status.available
    assert "permission denied" in status.reason and "Linux 5.10" in status.reason


def test_rapl_absent(tmp_path):
    status = RaplSensor(tmp_path).open()
    assert not status.available and "no RAPL package domains" in status.reason


# --- CPU temperature, throttling, frequency ---------------------------------------------
def test_cpu_temperature_from_hwmon_package_sensor(tmp_path):
    write(tmp_path, "sys/class/hwmon/hwmon0/name", "nvme")
    write(tmp_path, "sys/class/hwmon/hwmon0/temp1_input", 99000)
    chip = "sys/class/hwmon/hwmon1"
    write(tmp_path, f"{chip}/name", "coretemp")
    write(tmp_path, f"{chip}/temp1_label", "Package id 0")
    write(tmp_path, f"{chip}/temp1_input", 71000)
    write(tmp_path, f"{chip}/temp2_label", "Core 0")
    write(tmp_path, f"{chip}/temp2_input", 80000)
    s = CpuTemperatureSensor(tmp_path)
    assert s.open().source == "hwmon:coretemp"
    assert s.read(0.0) == {"c": 71.0}  # the package sensor, not a core or the disk


def test_cpu_temperature_from_thermal_zone_and_throttle_events(tmp_path):
    write(tmp_path, "sys/class/thermal/thermal_zone0/type", "iwlwifi_1")
    write(tmp_path, "sys/class/thermal/thermal_zone0/temp", 40000)
    write(tmp_path, "sys/class/thermal/thermal_zone1/type", "x86_pkg_temp")
    zone = write(tmp_path, "sys/class/thermal/thermal_zone1/temp", 55000)
    count = write(
        tmp_path, "sys/devices/system/cpu/cpu0/thermal_throttle/package_throttle_count", 3
    )
    s = CpuTemperatureSensor(tmp_path)
    assert s.open().source == "thermal_zone:x86_pkg_temp"
    assert s.read(0.0) == {"c": 55.0, "throttle_events": 3, "throttled": False}
    zone.write_text("97000\n")
    count.write_text("5\n")
    assert s.read(0.2) == {"c": 97.0, "throttle_events": 5, "throttled": True}
    assert s.read(0.4)["throttled"] is False  # no new events since


def test_cpu_temperature_absent_says_why(tmp_path):
    status = CpuTemperatureSensor(tmp_path).open()
    assert not status.available and "no CPU temperature sensor" in status.reason


def test_cpu_frequency_live_or_flagged_static(tmp_path):
    for cpu, khz in ((0, 2_400_000), (1, 3_600_000)):
        write(tmp_path, f"sys/devices/system/cpu/cpu{cpu}/cpufreq/scaling_cur_freq", khz)
    live = CpuFrequencySensor(tmp_path)
    assert live.open().source == "cpufreq"
    assert live.read(0.0) == {"mean_mhz": 3000.0, "max_mhz": 3600.0, "live": True}

    vm = tmp_path / "vm"
    write(vm, "proc/cpuinfo", "processor\t: 0\ncpu MHz\t\t: 2599.998\n")
    static = CpuFrequencySensor(vm)
    assert static.open().source == "proc_cpuinfo_static"
    assert static.read(0.0)["live"] is False


# --- battery ----------------------------------------------------------------------------
def test_battery_discharging(tmp_path):
    bat = "sys/class/power_supply/BAT0"
    write(tmp_path, f"{bat}/type", "Battery")
    write(tmp_path, f"{bat}/status", "Discharging")
    write(tmp_path, f"{bat}/capacity", 63)
    write(tmp_path, f"{bat}/current_now", 1_500_000)  # µA
    write(tmp_path, f"{bat}/voltage_now", 12_000_000)  # µV; no power_now on this one
    write(tmp_path, "sys/class/power_supply/AC/type", "Mains")
    ac = write(tmp_path, "sys/class/power_supply/AC/online", 0)
    s = BatterySensor(tmp_path)
    assert s.open().source == "power_supply:BAT0"
    assert s.read(0.0) == {
        "percent": 63,
        "status": "Discharging",
        "plugged": False,
        "power_w": 18.0,
    }
    ac.write_text("1\n")
    assert s.read(0.2)["plugged"] is True


def test_no_battery(tmp_path):
    status = BatterySensor(tmp_path).open()
    assert not status.available and "no battery" in status.reason


# --- NVML -------------------------------------------------------------------------------
class FakeNvml:
    """Two GPUs: gpu0 (Ampere) has the energy counter, gpu1 (Pascal) does not."""

    def __init__(self) -> None:
        self.energy_mj = 1_000_000
        self.reasons = 0x1
        self.power_mw = [300_000, 150_000]

    def install(self, mp: pytest.MonkeyPatch) -> None:
        not_supported = pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

        def energy(h):
            if h == 1:
                raise not_supported
            return self.energy_mj

        def fields(h, ids):
            ok = [
                SimpleNamespace(nvmlReturn=pynvml.NVML_SUCCESS, value=SimpleNamespace(uiVal=w))
                for w in (self.power_mw[h], self.power_mw[h] - 10_000)
            ]
            if h == 1:
                raise not_supported
            return ok

        calls = {
            "nvmlInit": lambda: None,
            "nvmlShutdown": lambda: None,
            "nvmlDeviceGetCount": lambda: 2,
            "nvmlDeviceGetHandleByIndex": lambda i: i,
            "nvmlDeviceGetName": lambda h: ["NVIDIA A100", "Tesla P100"][h],
            "nvmlDeviceGetTotalEnergyConsumption": energy,
            "nvmlDeviceGetFieldValues": fields,
            "nvmlDeviceGetPowerUsage": lambda h: self.power_mw[h],
            "nvmlDeviceGetTemperature": lambda h, kind: 70 + h,
            "nvmlDeviceGetClockInfo": lambda h, c: 1410 if c == pynvml.NVML_CLOCK_SM else 1215,
            "nvmlDeviceGetCurrentClocksEventReasons": lambda h: self.reasons,
        }
        for name, fn in calls.items():
            mp.setattr(pynvml, name, fn)


def test_nvml_energy_counter_integration_and_throttle_reasons(monkeypatch):
    fake = FakeNvml()
    fake.install(monkeypatch)
    s = NvmlSensor()
    status = s.open()
    assert status.source == (
        "gpu0:nvml_energy (NVIDIA A100),gpu1:nvml_power_integrated (Tesla P100)"
    )
    first = s.read(0.0)["gpus"]
    assert first[0]["energy_j"] == 0 and first[1]["energy_j"] == 0
    assert first[0]["power_w"] == 300 and first[0]["power_avg_w"] == 290
    assert first[1]["power_w"] is None and first[1]["power_avg_w"] == 150
    assert first[0]["throttled"] is False  # idle is not throttling
    fake.energy_mj += 60_000  # 60 J by the counter
    fake.reasons = 0x4 | 0x40  # power cap and hardware thermal slowdown
    later = s.read(0.5)["gpus"]
    assert later[0]["energy_j"] == pytest.approx(60.0)
    assert later[1]["energy_j"] == pytest.approx(75.0)  # 150 W for 0.5 s, integrated
    assert later[0]["clock_reason_names"] == ["sw_power_cap", "hw_thermal_slowdown"]
    assert later[0]["throttled"] and later[0]["thermal_throttled"]
    assert (later[0]["sm_mhz"], later[0]["mem_mhz"]) == (1410, 1215)
    s.close()


def test_nvml_reason_decoding():
    assert decode_reasons(0) == []
    assert decode_reasons(0x1 | 0x20 | 0x100) == [
        "gpu_idle",
        "sw_thermal_slowdown",
        "display_clock_setting",
    ]


def test_nvml_without_a_driver_is_unavailable(monkeypatch):
    def no_library():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", no_library)
    status = NvmlSensor().open()
    assert not status.available and "no NVIDIA driver" in status.reason


# --- the sampling thread ----------------------------------------------------------------
class Scripted(Sensor):
    def __init__(self, name: str, values: list[object]) -> None:
        self.name, self.values, self.n = name, values, 0

    def open(self) -> SensorStatus:
        return SensorStatus(True, "script")

    def read(self, t_s: float) -> dict:
        v = self.values[min(self.n, len(self.values) - 1)]
        self.n += 1
        if isinstance(v, Exception):
            raise v
        return {"v": v}


def test_sampler_survives_a_sensor_failing_mid_run(tmp_path):
    clock = iter(np.arange(0, 100, 0.2))
    good = Scripted("good", [1, 2, 3])
    bad = Scripted("bad", [1, OSError("device unplugged"), 3])
    sampler = TelemetrySampler([good, bad], lambda: float(next(clock)), tmp_path / "t.jsonl", 0.01)
    sampler.open()
    for _ in range(4):
        sampler.sample_once()
    sampler.stop()
    recs = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert [r["t_s"] for r in recs] == pytest.approx([0.0, 0.2, 0.4, 0.6])
    assert [r.get("bad") for r in recs] == [{"v": 1}, None, None, None]
    assert [r["good"]["v"] for r in recs] == [1, 2, 3, 3]
    d = sampler.describe()["sensors"]
    assert "device unplugged" in d["bad"]["failed"] and "failed" not in d["good"]


def test_sampler_thread_runs_on_the_given_clock_and_stops(tmp_path):
    import time

    t0 = time.perf_counter()
    with TelemetrySampler(
        [Scripted("s", [1])], lambda: time.perf_counter() - t0, tmp_path / "t.jsonl", 0.02
    ) as sampler:
        time.sleep(0.2)
    n = len(sampler.samples)
    assert 5 <= n <= 15
    times = [s["t_s"] for s in sampler.samples]
    assert times == sorted(times) and times[-1] < time.perf_counter() - t0
    assert sampler.describe()["overhead_cpu_percent"] < 50


def test_a_servers_energy_is_a_running_total_over_samples_it_does_not_keep():
    """A server samples for days: it keeps the recent samples only, and /metrics adds the
    energy between consecutive samples as they come (RAPL counts microjoules)."""
    from edgeprefill.runtime.server.metrics import ServerMetrics

    clock = iter(np.arange(0, 100, 0.2))
    rapl = Scripted("rapl", [{"package-0": j} for j in (0.0, 1.0, 3.0, 6.0, 10.0)])
    rapl.read = lambda t, r=rapl, f=Scripted.read: {"energy_j": f(r, t)["v"]}  # type: ignore[method-assign]
    sampler = TelemetrySampler([rapl], lambda: float(next(clock)), keep=2)
    metrics = ServerMetrics()
    metrics.measure_energy(sampler, tdp_w=None)
    sampler.open()
    for _ in range(5):
        sampler.sample_once()
    assert len(sampler.samples) == 2  # bounded
    metrics._n_tokens = 4
    line = next(
        x
        for x in metrics.text().decode().splitlines()
        if x.startswith("edgeprefill_energy_joules_per_token{")
    )
    assert float(line.split()[-1]) == pytest.approx(10.0 / 4)  # all five samples' energy


# --- energy -----------------------------------------------------------------------------
def samples_at(watts: float, seconds: float, step: float = 0.2) -> list[dict]:
    return [
        {"t_s": t, "rapl": {"energy_j": {"package-0": watts * t}}}
        for t in np.arange(0, seconds + 1e-9, step)
    ]


def test_energy_per_class_adds_up_and_names_its_source():
    samples = samples_at(20.0, 10.0)
    spans = [
        IterationSpan(1.0, 2.0, foreground_tokens=1, background_tokens=3),
        IterationSpan(5.0, 6.0, foreground_tokens=2, background_tokens=0),
    ]
    reqs = [
        {"class": "foreground", "token_times_s": [2.0, 6.0, 6.0]},
        {"class": "background", "token_times_s": [2.0]},
    ]
    e = energy_summary(samples, spans, reqs)
    assert json.loads(json.dumps(e)) == e  # goes into summary.json as it is
    assert e["sources"] == {
        "cpu": "rapl:package-0",
        "gpu": {"source": "unavailable", "reason": "no samples"},
    }
    whole = e["whole_run"]
    assert whole["joules_total"] == pytest.approx(200.0)
    per = whole["j_per_output_token"]
    assert per["all"] == pytest.approx(50.0)
    # 20 J (iteration 1) split 1:3, 20 J (iteration 2) all foreground; scaled to 200 J
    assert per["foreground"] * 3 + per["background"] * 1 == pytest.approx(200.0)
    assert per["foreground"] * 3 == pytest.approx(200 * 25 / 40)
    assert e["steady_state"]["window_s"] == pytest.approx([1.0, 9.0])


def test_energy_unavailable_is_never_zero_and_tdp_estimate_is_labelled():
    e = energy_summary([], [], [], reasons={"cpu": "no RAPL", "gpu": "no NVIDIA driver"})
    assert e["whole_run"] is None
    assert e["sources"]["cpu"] == {"source": "unavailable", "reason": "no RAPL"}
    load = [{"t_s": t, "cpu_load": {"percent": 50.0}} for t in (0.0, 1.0, 2.0)]
    est = energy_summary(load, [], [], tdp_w=30.0)
    assert est["sources"]["cpu"].startswith("estimated:tdp=30W")
    assert est["whole_run"]["joules"]["cpu"] == pytest.approx(30.0)


def test_throttle_intervals_are_flagged():
    flags = [False, True, True, False, True]
    samples = [
        {"t_s": i * 0.2, "cpu_temp": {"c": 90.0, "throttled": f}} for i, f in enumerate(flags)
    ]
    assert throttle_intervals(samples) == [
        {"start_s": 0.2, "end_s": 0.6000000000000001, "reasons": ["cpu:thermal_throttle"]},
        {"start_s": 0.8, "end_s": 0.8, "reasons": ["cpu:thermal_throttle"]},
    ]


# --- the thermal-aware background budget ------------------------------------------------
def test_thermal_guard_scales_and_restores_the_background_budget():
    # Scripted sensors: cool and plugged in, then hot, then cooling through the hysteresis
    # band (still scaled), then cool, then unplugged.
    script = (
        [{"cpu_temp": {"c": 60.0}, "battery": {"plugged": True}}] * 10
        + [{"cpu_temp": {"c": 92.0}, "battery": {"plugged": True}}] * 10
        + [{"cpu_temp": {"c": 87.0}, "battery": {"plugged": True}}] * 10
        + [{"cpu_temp": {"c": 70.0}, "battery": {"plugged": True}}] * 10
        + [{"cpu_temp": {"c": 70.0}, "battery": {"plugged": False}}] * 1000
    )
    feed = iter(script)
    guard = ThermalGuard(lambda: next(feed), ThermalSettings(factor=0.25, max_temp_c=90))
    engine = Engine(SimBackend(COST, CAP), parse_policy("static:256"), guard=guard)
    its = drain(engine, requests(chats=0, docs=1, doc_len=12000))
    bg = [it.plan.n_prefill_background for it in its]
    thermal = [it.policy_state["thermal"] for it in its]
    assert bg[:10] == [256] * 10 and not any(t["active"] for t in thermal[:10])
    assert bg[10:30] == [64] * 20  # a quarter of the budget while hot and cooling
    assert thermal[10]["reasons"] == ["temperature 92 C"]
    assert bg[30:40] == [256] * 10  # restored once below 85 C
    assert bg[40] == 64 and thermal[40]["reasons"] == ["on battery"]
    assert its[40].plan.decision.background_cap == 64
    assert its[40].record()["decision"]["background_cap"] == 64


def test_thermal_guard_never_touches_the_foreground():
    feed = iter([{"cpu_temp": {"c": 99.0}}] * 1000)
    guard = ThermalGuard(lambda: next(feed), ThermalSettings(factor=0.25))
    engine = Engine(SimBackend(COST, CAP), parse_policy("static:512"), guard=guard)
    its = drain(engine, requests(chats=1, docs=1, doc_len=4000))
    assert (its[0].plan.n_prefill_foreground, its[0].plan.n_prefill_background) == (201, 128)
    assert its[0].plan.decision.background_cap == 128


def test_cpu_load_is_sampled_only_for_a_declared_tdp(tmp_path):
    from edgeprefill.thermal.telemetry import TelemetryConfig, default_sensors

    def names(cfg):
        return {s.name for s in default_sensors(cfg)}

    assert "cpu_load" not in names(TelemetryConfig(root=tmp_path))
    assert "cpu_load" in names(TelemetryConfig(tdp_w=28.0, root=tmp_path))
    with pytest.raises(ValueError, match="TDP must be positive"):
        TelemetryConfig(tdp_w=0)


def test_the_cpus_vector_extensions_are_named_so_results_compare_only_alike(tmp_path):
    from edgeprefill.thermal.machine import cpu_isa

    avx2 = tmp_path / "avx2"
    avx2.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx fma avx2 f16c\n")
    zen5 = tmp_path / "zen5"
    zen5.write_text("flags\t\t: fpu avx2 avx512f avx512_bf16 avx512vl\n")
    assert cpu_isa(avx2) == ["avx2"]
    assert cpu_isa(zen5) == ["avx2", "avx512f", "avx512_bf16"]
    assert cpu_isa(tmp_path / "missing") == []
