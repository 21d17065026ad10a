"""The Nsight Systems layer without a GPU or nsys: finding nsys (fake install folders), the
missing-library message, the capture-range command line and target, the parser on the real H200
exports under tests/data/nsys, `nsys stats` text, the layer end to end through a fake nsys, and
the syncing reference store (`reference-syncing`): selectable, never exported."""

from __future__ import annotations

import json
import lzma
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from drafter_attn.kernels.presets import get_preset
from drafter_attn.kernels.spec import Problem
from drafter_attn.tuner import nsys, syncs
from drafter_attn.tuner.spec import Candidate

DATA = Path(__file__).resolve().parent / "data" / "nsys"


def _exe(path: Path, text: str = "#!/bin/sh\nexit 0\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def _env(tmp_path, **extra) -> dict:
    """An environment with nothing on PATH but an empty folder (and the given variables)."""
    empty = tmp_path / "empty-bin"
    empty.mkdir(exist_ok=True)
    return {"PATH": str(empty), **extra}


def _installs(tmp_path) -> tuple:
    """Fake /opt/nvidia: nsight-systems 2024.6.2 and 2025.1.1 (bin/nsys), nsight-compute
    2025.3.1 (host/target-linux-x64/nsys, with its importer in a sibling folder)."""
    root = tmp_path / "opt" / "nvidia"
    for v in ("2024.6.2", "2025.1.1"):
        _exe(root / "nsight-systems" / v / "bin" / "nsys")
    ncu = root / "nsight-compute" / "2025.3.1" / "host"
    _exe(ncu / "target-linux-x64" / "nsys")
    _exe(ncu / "linux-desktop-glibc_2_11_3-x64" / "QdstrmImporter")
    globs = (str(root / "nsight-systems" / "*" / "bin"),
             str(root / "nsight-compute" / "*" / "host" / "target-linux-x64"))
    return root, globs


# ---------------------------------------------------------------------------------------------
# Finding nsys


def test_find_nsys_order_path_then_env_then_newest_install(tmp_path):
    root, globs = _installs(tmp_path)
    # nothing on PATH, no $NSYS: the newest install (nsight-compute 2025.3.1 here), and its importer
    found = nsys.find_nsys(_env(tmp_path), globs, check_libraries=False)
    assert found.path == str(root / "nsight-compute/2025.3.1/host/target-linux-x64/nsys")
    assert (found.found_via, found.version, found.usable, found.note) == ("install folder", "2025.3.1", True, None)
    assert found.importer == str(root / "nsight-compute/2025.3.1/host/linux-desktop-glibc_2_11_3-x64/QdstrmImporter")
    # $NSYS, an executable or its folder, comes before the install folders
    older = root / "nsight-systems/2024.6.2/bin"
    for given in (older / "nsys", older):
        found = nsys.find_nsys(_env(tmp_path, NSYS=str(given)), globs, check_libraries=False)
        assert (found.path, found.found_via, found.version) == (str(older / "nsys"), "$NSYS", "2024.6.2")
    # a wrong $NSYS is said, and the search goes on
    found = nsys.find_nsys(_env(tmp_path, NSYS=str(tmp_path / "nope")), globs, check_libraries=False)
    assert found.found_via == "install folder" and any("not an executable nsys" in s for s in found.searched)
    # PATH first of all
    on_path = _exe(tmp_path / "bin" / "nsys")
    found = nsys.find_nsys({"PATH": str(on_path.parent), "NSYS": str(older)}, globs, check_libraries=False)
    assert (found.path, found.found_via) == (str(on_path), "PATH")


def test_find_nsys_nowhere_says_where_it_looked(tmp_path):
    pattern = str(tmp_path / "none" / "*" / "bin")
    found = nsys.find_nsys(_env(tmp_path), (pattern,))
    assert found.path is None and not found.usable
    assert found.note.startswith(f"nsys not found (PATH: no nsys; $NSYS: not set; {pattern}: 0 found)")
    assert "the Nsight Systems layer did not run" in found.note
    assert syncs.nsys_syncs({"problem": {}}, install=found).note == found.note
    assert found.as_dict()["usable"] is False


def test_missing_library_is_named(tmp_path):
    """An nsys whose importer lacks libdw.so.1 and libelf.so.1 (as on the H200 image): ldd says
    which, and the note names them and the Debian packages."""
    root, globs = _installs(tmp_path)
    ldd = _exe(tmp_path / "tools" / "ldd", textwrap.dedent("""\
        #!/bin/sh
        case "$1" in
          *QdstrmImporter) printf '\\tlinux-vdso.so.1 (0x00007ffd)\\n\\tlibdw.so.1 => not found\\n'
                           printf '\\tlibelf.so.1 => not found\\n\\tlibc.so.6 => /lib/libc.so.6 (0x1)\\n' ;;
          *) printf '\\tlibc.so.6 => /lib/libc.so.6 (0x1)\\n' ;;
        esac
        """))
    found = nsys.find_nsys({"PATH": str(ldd.parent)}, globs)
    assert found.path.endswith("2025.3.1/host/target-linux-x64/nsys") and not found.usable
    assert found.missing_libraries == ["libdw.so.1", "libelf.so.1"]
    assert "cannot import its captures: QdstrmImporter needs libdw.so.1, libelf.so.1, not found" in found.note
    assert "(2025.3.1)" in found.note and "libdw1, libelf1" in found.note and "LD_LIBRARY_PATH" in found.note
    # the layer does not try to run it
    assert syncs.nsys_syncs({"problem": {}}, install=found).note == found.note


def test_missing_library_from_a_failed_run():
    text = ("Generating '/tmp/nsys-report-3e00.qdstrm'\n/opt/nvidia/nsight-compute/2025.3.1/host/linux-desktop-"
            "glibc_2_11_3-x64/QdstrmImporter: error while loading shared libraries: libdw.so.1: cannot open "
            "shared object file: No such file or directory\n")
    missing = nsys.missing_from_output(text)
    assert missing == [("/opt/nvidia/nsight-compute/2025.3.1/host/linux-desktop-glibc_2_11_3-x64/QdstrmImporter",
                        "libdw.so.1")]
    note = nsys.missing_note("/x/nsys", "2025.3.1", missing)
    assert "QdstrmImporter needs libdw.so.1" in note and "libdw1" in note
    assert nsys.missing_from_output("all fine") == []


def test_real_ldd_on_a_real_binary_finds_nothing_missing():
    assert nsys.ldd_missing(sys.executable) == []


# ---------------------------------------------------------------------------------------------
# The capture: only the timed steps


def test_profile_command_captures_the_timed_steps_only():
    cmd = nsys.profile_command("/x/nsys", "/tmp/r/step", ["python", "-m", "t", "--runs", "3"])
    assert cmd[:2] == ["/x/nsys", "profile"] and cmd[-5:] == ["python", "-m", "t", "--runs", "3"]
    assert "--trace=cuda,nvtx" in cmd and "--export=sqlite" in cmd
    assert "--capture-range=cudaProfilerApi" in cmd and "--capture-range-end=stop" in cmd
    assert cmd[cmd.index("-o") + 1] == "/tmp/r/step"
    whole = nsys.profile_command("/x/nsys", "r", ["t"], capture_range="none")
    assert not any(a.startswith("--capture-range") for a in whole)
    with pytest.raises(ValueError):
        nsys.profile_command("/x/nsys", "r", ["t"], capture_range="nvtx")
    assert nsys.stats_command("/x/nsys", "a.sqlite") == [
        "/x/nsys", "stats", "--report", "cuda_api_sum,nvtx_sum,cuda_gpu_mem_time_sum", "--format", "csv",
        "--output", "-", "a.sqlite"]


def test_target_wraps_only_the_timed_steps_in_the_capture_range(monkeypatch):
    """Warm-up outside cudaProfilerStart/Stop; inside, the runs back to back, each an NVTX range,
    and a wait that makes no blocking call."""
    import torch

    from drafter_attn.tuner import step as step_mod

    log = []

    class FakeStep:
        def __init__(self, problem, impl, params, accepted=None):
            log.append(("build", impl))

        def run(self):
            log.append("run")

    class Range:
        def __init__(self, name):
            self.name = name

        def __enter__(self):
            log.append(("range", self.name))

        def __exit__(self, *exc):
            log.append("end range")

    class Event:
        polls = 0

        def record(self):
            log.append("record")

        def query(self):
            Event.polls += 1
            return Event.polls > 2

    monkeypatch.setattr(step_mod, "DecodeStep", FakeStep)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: log.append("sync"))
    monkeypatch.setattr(torch.cuda.profiler, "start", lambda: log.append("start"))
    monkeypatch.setattr(torch.cuda.profiler, "stop", lambda: log.append("stop"))
    monkeypatch.setattr(torch.cuda.nvtx, "range", Range)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    problem = Problem(get_preset("qwen3-8b-dflash-b16"), "paged", 64, 2, 1024)
    wire = Candidate(problem, "reference-syncing", ()).to_wire()
    assert syncs.main(["--candidate", json.dumps(wire), "--runs", "2"]) == 0
    timed = [("range", syncs.MARKER), "run", "end range"]
    assert log == [("build", "reference-syncing"), "run", "run", "sync", "start", *timed, *timed,
                   "record", "stop", "sync"]


# ---------------------------------------------------------------------------------------------
# Reading real exports (H200, nsys 2025.3.1) without nsys


def _real_export(tmp_path, name: str) -> Path:
    out = tmp_path / f"{name}.sqlite"
    out.write_bytes(lzma.decompress((DATA / f"{name}.sqlite.xz").read_bytes()))
    return out


def test_parser_on_the_real_exports(tmp_path):
    """4 layers, 3 steps: the syncing store blocks once per layer per step (cudaStreamSynchronize
    after its device-to-host copy); the suite's own store never."""
    bad = nsys.parse_nsys_sqlite(_real_export(tmp_path, "step_bad"))
    assert (bad.count, bad.dtoh_copies, bad.steps) == (4, 4, 3)
    assert bad.by_call == {"cudaStreamSynchronize": 4}
    assert bad.host_us == pytest.approx(9.586, abs=1e-3)
    good = nsys.parse_nsys_sqlite(_real_export(tmp_path, "step_good"))
    assert (good.count, good.host_us, good.dtoh_copies, good.by_call, good.steps) == (0, 0.0, 0, {}, 3)
    # the same through the name tuner.syncs has always had
    assert syncs.parse_nsys_sqlite(_real_export(tmp_path, "step_bad"), runs=3).count == 4
    with pytest.raises(ValueError, match="no NVTX range 'other'"):
        nsys.parse_nsys_sqlite(_real_export(tmp_path, "step_good"), marker="other")


def test_stats_reports_of_the_real_exports():
    """`nsys stats` counts the whole capture. These exports hold the whole process (no capture
    range), so set-up syncs and the synchronise between steps are counted too: why the layer
    now captures the timed steps alone, where the two agree."""
    good = nsys.parse_stats((DATA / "step_good.stats.txt").read_text())
    bad = nsys.parse_stats((DATA / "step_bad.stats.txt").read_text())
    assert set(bad) == {"cuda_api_sum", "nvtx_sum"}
    api = {r["Name"]: int(r["Num Calls"]) for r in bad["cuda_api_sum"]}
    assert api["cudaStreamSynchronize"] == 29 and api["cudaDeviceSynchronize"] == 4
    assert bad["nvtx_sum"][0]["Range"] == ":drafter_step" and bad["nvtx_sum"][0]["Instances"] == "3"
    whole_bad = nsys.syncs_from_stats(bad)
    assert (whole_bad.count, whole_bad.steps) == (11, 3)  # (29 + 4) / 3 steps
    assert nsys.syncs_from_stats(good).count == 4  # (9 + 4) / 3: none of them inside a step


def test_stats_of_a_capture_range_agree_with_the_export():
    """What a capture of the timed steps alone looks like to `nsys stats` (3 steps x 5 layers)."""
    text = textwrap.dedent("""\
        Processing [/tmp/x.sqlite] with [/opt/n/reports/cuda_api_sum.py]...
        Time (%),Total Time (ns),Num Calls,Avg (ns),Med (ns),Min (ns),Max (ns),StdDev (ns),Name
        60.0,150000,45,3333.3,3000.0,2000,9000,100.0,cuLaunchKernel
        30.0,90000,15,6000.0,6000.0,5000,7000,10.0,cudaStreamSynchronize
        10.0,30000,18,1666.7,1500.0,1000,3000,10.0,cudaMemcpyAsync

        Processing [/tmp/x.sqlite] with [/opt/n/reports/nvtx_sum.py]...
        Time (%),Total Time (ns),Instances,Avg (ns),Med (ns),Min (ns),Max (ns),StdDev (ns),Style,Range
        100.0,1000000,3,333333.3,330000.0,320000,350000,1000.0,PushPop,:drafter_step

        Processing [/tmp/x.sqlite] with [/opt/n/reports/cuda_gpu_mem_time_sum.py]...
        Time (%),Total Time (ns),Count,Avg (ns),Med (ns),Min (ns),Max (ns),StdDev (ns),Operation
        70.0,7000,15,466.7,460.0,400,600,10.0,[CUDA memcpy Device-to-Host]
        30.0,3000,3,1000.0,1000.0,900,1100,10.0,[CUDA memcpy Device-to-Device]
        """)
    r = nsys.syncs_from_stats(nsys.parse_stats(text))
    assert (r.count, r.dtoh_copies, r.steps, r.by_call) == (5, 5, 3, {"cudaStreamSynchronize": 5.0})
    assert r.host_us == pytest.approx(30.0)
    # without nsys's 'Processing' lines the headers tell the reports apart
    bare = "\n".join(line for line in text.splitlines() if not line.startswith("Processing"))
    assert nsys.syncs_from_stats(nsys.parse_stats(bare)) == r
    with pytest.raises(ValueError, match="no NVTX range"):
        nsys.syncs_from_stats(nsys.parse_stats(text.replace("drafter_step", "other")))


# ---------------------------------------------------------------------------------------------
# The layer end to end through a fake nsys


FAKE_NSYS = """\
#!{python}
import os, shutil, sys
args = sys.argv[1:]
with open(os.environ["FAKE_NSYS_LOG"], "a") as f:
    f.write(repr(args) + "\\n")
if args[0] == "profile":
    if os.environ.get("FAKE_NSYS_MISSING"):
        sys.stderr.write("Generating '/tmp/nsys-report-1.qdstrm'\\n/opt/nvidia/x/QdstrmImporter: error while loading "
                         "shared libraries: libdw.so.1: cannot open shared object file: No such file or directory\\n")
        sys.exit(1)
    report = args[args.index("-o") + 1]
    shutil.copy(os.environ["FAKE_NSYS_EXPORT"], report + ".sqlite")
elif args[0] == "stats":
    sys.stdout.write(open(os.environ["FAKE_NSYS_STATS"]).read())
"""


@pytest.fixture
def fake_nsys(tmp_path, monkeypatch):
    exe = _exe(tmp_path / "fake" / "nsys", FAKE_NSYS.format(python=sys.executable))
    log = tmp_path / "nsys.log"
    monkeypatch.setenv("FAKE_NSYS_LOG", str(log))
    monkeypatch.setenv("FAKE_NSYS_EXPORT", str(_real_export(tmp_path, "step_bad")))
    monkeypatch.setenv("FAKE_NSYS_STATS", str(DATA / "step_bad.stats.txt"))
    return nsys.NsysInstall(str(exe), "$NSYS", "2025.3.1"), log


def test_nsys_layer_end_to_end(fake_nsys, tmp_path):
    install, log = fake_nsys
    wire = Candidate(Problem(get_preset("qwen3-8b-dflash-b16").with_(num_layers=4), "paged", 64, 2, 1024),
                     "reference-syncing", ()).to_wire()
    r = syncs.nsys_syncs(wire, runs=3, install=install, keep=tmp_path / "kept", name="bad")
    assert (r.syncs.count, r.syncs.dtoh_copies, r.syncs.steps) == (4, 4, 3)
    assert r.stats.count == 11  # the whole-process stats of this export: said, not hidden
    assert "nsys stats counts 11 blocking calls per step over the whole capture, the export 4" in r.note
    assert Path(r.export) == tmp_path / "kept" / "bad.sqlite" and (tmp_path / "kept" / "bad-stats.txt").exists()
    calls = [eval(line) for line in log.read_text().splitlines()]  # noqa: S307 (our own repr lines)
    profile = calls[0]
    assert profile[0] == "profile" and "--capture-range=cudaProfilerApi" in profile
    target = profile[profile.index(sys.executable):]
    assert target[:3] == [sys.executable, "-m", "drafter_attn.tuner.syncs"]
    assert json.loads(target[target.index("--candidate") + 1]) == wire and target[-2:] == ["--runs", "3"]
    assert calls[1][0] == "stats"


def test_nsys_layer_names_the_library_a_run_lacked(fake_nsys, monkeypatch):
    install, _ = fake_nsys
    monkeypatch.setenv("FAKE_NSYS_MISSING", "1")
    r = syncs.nsys_syncs({"problem": {}}, runs=1, install=install)
    assert r.syncs is None and "QdstrmImporter needs libdw.so.1" in r.note and "libdw1" in r.note


def test_report_keeps_every_layer_side_by_side():
    per = nsys.RuntimeSyncs(5, 50.0, 5, {"cudaStreamSynchronize": 5}, 3)
    r = syncs.SyncReport(debug_syncs=5, profiler=nsys.RuntimeSyncs(5, 40.0, 5), nsys=per, nsys_stats=per,
                         graph_tried=True, graph_error="RuntimeError: operation not permitted when stream is capturing")
    assert r.counts == {"debug": 5, "profiler": 5, "nsys": 5} and r.agree is True and r.syncs == 5
    row = r.as_row()
    assert (row["syncs_nsys"], row["sync_host_us_nsys"], row["graph_capturable"]) == (5, 50.0, False)
    d = syncs.layers_dict(r)
    assert d["nsys"]["syncs"] == 5 and d["nsys"]["steps"] == 3 and d["agree"] is True
    assert syncs.SyncReport(debug_syncs=5, profiler=nsys.RuntimeSyncs(4, 1.0, 4)).agree is False
    assert syncs.SyncReport().agree is None


# ---------------------------------------------------------------------------------------------
# reference-syncing: selectable by name, labelled, never exported or picked


def test_reference_syncing_is_a_labelled_selectable_reference(tmp_path):
    from drafter_attn.bench import decode
    from drafter_attn.kernels import registry
    from drafter_attn.tuner.spec import parse_spec

    assert "reference-syncing" in registry.names()
    assert registry.reference_only("reference-syncing").startswith("a reference that stalls the host")
    assert registry.reference_only("cupy") is None and registry.reference_only("reference") is None
    g = get_preset("qwen3-8b-dflash-b16")
    p = decode.plan("decode", g, "qwen3-8b-dflash-b16", "qwen3-8b-dflash-b16", pages=[64], batches=[2],
                    ctxs=[1024], impls=["cupy", "reference-syncing"], baseline="none")
    assert sorted({j.impl_option for j in p.jobs}) == ["cupy", "reference-syncing"] and len(p.jobs) == 4
    assert any(n.startswith("reference-syncing: a reference that stalls the host") for n in p.notes)
    pick = decode.resolve_impl("reference-syncing", Problem(g, "paged", 64, 2, 1024))
    assert (pick.impl, pick.params) == ("reference-syncing", {})
    spec = parse_spec({"sweep": {"name": "s", "backends": ["cupy", "reference-syncing"], "presets": [
        "qwen3-8b-dflash-b16"], "page_sizes": [64], "arena": False, "batches": [2], "ctx_lens": [1024]}})
    cands = {c.impl: c for c in spec.candidates()}
    assert cands["reference-syncing"].params == () and cands["cupy"].params != ()


def test_reference_syncing_is_never_exported_nor_picked(tmp_path, caplog):
    from profile_fakes import H200, MAIN, build_db

    from drafter_attn.kernels import tuned_table
    from drafter_attn.kernels.dispatch import Dispatcher
    from drafter_attn.tuner import export

    db = tmp_path / "p.db"
    rows = [dict(params={"tile_n": 64}, median_us=100.0, syncs_debug=0),
            # faster on paper, as an eagerly timed step can be: still never a candidate
            dict(impl="reference-syncing", median_us=50.0, syncs_debug=5, syncs_profiler=5, syncs_nsys=5)]
    build_db(db, {"h": (H200, rows)})
    table = export.export_table(db, [90], resolve_commits=False)
    assert [(e["impl"], e["candidates"]) for e in table["entries"]] == [("cupy", 1)]
    pick = Dispatcher.load(db).pick(Problem(MAIN, "paged", 64, 8, 2048), 90)
    assert pick.impl == "cupy" and pick.tier == "exact"
    # a hand-edited table naming it: that entry is left out, with a warning saying why
    entry = dict(table["entries"][0], impl="reference-syncing", params={})
    with pytest.warns(RuntimeWarning, match="reference-syncing' is never a tuned pick"):
        kept = tuned_table.parse_entries([entry, table["entries"][0]], "t.json")
    assert [e.winner.impl for e in kept] == ["cupy"]


def test_bench_syncs_all_refuses_an_nsys_that_cannot_import(tmp_path, monkeypatch, capsys):
    from drafter_attn.bench import cli, gpu
    from test_bench_cli import H200

    monkeypatch.setattr(gpu, "probe", lambda: [H200])  # a GPU: the nsys check is what refuses
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    broken = nsys.NsysInstall("/opt/nvidia/nsight-compute/2025.3.1/host/target-linux-x64/nsys", "install folder",
                              "2025.3.1", "/opt/q/QdstrmImporter", (("/opt/q/QdstrmImporter", "libdw.so.1"),))
    monkeypatch.setattr(nsys, "find_nsys", lambda *a, **k: broken)
    argv = ["decode", "--impl", "reference-syncing", "--syncs", "all", "--batch", "2", "--ctx", "1k", "--page", "64",
            "--baseline", "none", "--db", str(tmp_path / "p.db"), "--out", str(tmp_path / "out")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("--syncs all: nsys at /opt/nvidia/nsight-compute/2025.3.1/host/target-linux-x64/nsys "
                          "(2025.3.1) cannot import its captures")
    assert "QdstrmImporter needs libdw.so.1" in err and "libdw1" in err
    assert not (tmp_path / "p.db").exists()  # refused before anything was measured


def test_bench_decode_syncs_all_faked(tmp_path, monkeypatch, capsys):
    """bench decode --syncs all with the GPU, nsys and the measurement faked: the measure
    function is asked for nsys, every layer is printed side by side, the rows land in the
    database, and tuner export leaves the syncing reference out."""
    from test_bench_cli import _apply_fakes

    from drafter_attn.bench import cli
    from drafter_attn.tuner import export

    _apply_fakes(monkeypatch)
    monkeypatch.setattr(nsys, "find_nsys", lambda *a, **k: nsys.NsysInstall("/x/nsys", "$NSYS", "2025.3.1"))
    asked = []

    def fake_measure(wire, reps=0, nsys=False):
        asked.append((wire["impl"], nsys))
        n = wire["problem"]["num_layers"] if wire["impl"] == "reference-syncing" else 0
        return dict(status="ok", median_us=20.0 + 10 * bool(n), p10_us=19.0, p90_us=31.0, attention_median_us=15.0,
                    store_median_us=5.0, syncs_debug=n, syncs_profiler=n, sync_host_us=9.5 * n, dtoh_copies=n,
                    syncs_nsys=n, sync_host_us_nsys=9.9 * n, graph_capturable=not n, rel_err=1e-3)

    from drafter_attn.bench import decode

    monkeypatch.setattr(decode, "default_measures", lambda: (fake_measure, None, None))
    db, out = tmp_path / "p.db", tmp_path / "out"
    argv = ["decode", "--sm", "90", "--impl", "cupy,reference-syncing", "--syncs", "all", "--batch", "2", "--ctx",
            "1k", "--page", "64", "--baseline", "none", "--db", str(db), "--out", str(out)]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert set(asked) == {("cupy", True), ("reference-syncing", True)}
    assert "nsys layer: /x/nsys (2025.3.1), found via $NSYS" in text
    assert ("syncs per step, reference-syncing paged 64 B=2 ctx=1024: sync-debug 5, profiler 5, nsys 5 (agree); "
            "host blocked per step: profiler 47.5 us, nsys 49.5 us") in text
    assert "syncs per step, cupy arena B=2 ctx=1024: sync-debug 0, profiler 0, nsys 0 (agree)" in text
    assert "2 row(s) with blocking host syncs" in text
    doc = json.loads((out / "decode.json").read_text())
    assert doc["settings"]["nsys"] is True
    bad = [r for r in doc["rows"] if r["impl"] == "reference-syncing"]
    assert {(r["syncs_debug"], r["syncs_profiler"], r["syncs_nsys"]) for r in bad} == {(5, 5, 5)}
    table = export.export_table(db, [90], resolve_commits=False)
    assert {e["impl"] for e in table["entries"]} == {"cupy"} and len(table["entries"]) == 2


def test_tuner_show_puts_every_layer_beside_syncs_when_nsys_measured(tmp_path, capsys, monkeypatch):
    from profile_fakes import H200, build_db

    from drafter_attn.tuner.cli import main

    monkeypatch.setenv("COLUMNS", "250")
    db = tmp_path / "p.db"
    build_db(db, {"h": (H200, [dict(median_us=100.0, syncs_debug=0, syncs_profiler=0, sync_host_us=0.0)])})
    assert main(["show", "--db", str(db)]) == 0
    assert "s_nsys" not in capsys.readouterr().out  # no row has nsys figures: the usual columns
    build_db(db, {"h": (H200, [dict(impl="reference-syncing", median_us=130.0, syncs_debug=5, syncs_profiler=5,
                                     sync_host_us=47.5, syncs_nsys=5, sync_host_us_nsys=49.5)])})
    assert main(["show", "--db", str(db)]) == 0
    out = capsys.readouterr().out
    assert all(h in out for h in ("s_debug", "s_prof", "s_nsys", "blocked_us", "blocked_us_nsys"))


def test_bench_report_shows_every_layer_where_nsys_measured(tmp_path):
    from profile_fakes import H200, build_db

    from drafter_attn.bench import report

    db = tmp_path / "p.db"
    build_db(db, {"h": (H200, [
        dict(median_us=100.0, syncs_debug=0, syncs_profiler=0, sync_host_us=0.0),  # no nsys, no syncs: not listed
        dict(layout="arena", median_us=99.0, syncs_debug=0, syncs_profiler=0, sync_host_us=0.0, syncs_nsys=0,
             sync_host_us_nsys=0.0),
        dict(impl="reference-syncing", median_us=130.0, syncs_debug=5, syncs_profiler=5, sync_host_us=47.5,
             syncs_nsys=5, sync_host_us_nsys=49.5)])})
    path, _ = report.build(report.load(db), tmp_path / "rep", db)
    md = path.read_text()
    assert "Host syncs per step, every layer that ran" in md
    assert "| decode | cupy | arena | 8 | 2048 | 0 | 0 | 0 | 0 | 0 |" in md
    assert "| decode | reference-syncing | paged 64 | 8 | 2048 | 5 | 5 | 5 | 47.5 | 49.5 |" in md
    assert "| decode | cupy | paged 64 |" not in md.split("Host syncs per step")[1]


@pytest.mark.parametrize("name,per_step", [("range_reference-syncing", 5), ("range_cupy", 0)])
def test_real_capture_range_exports_agree_with_their_stats(tmp_path, name, per_step):
    """Real H200 captures of the timed steps alone (5 layers, 3 steps): the per-range parser of
    the export and `nsys stats` over the whole capture give the same syncs per step."""
    parsed = nsys.parse_nsys_sqlite(_real_export(tmp_path, name))
    stats = nsys.syncs_from_stats(nsys.parse_stats((DATA / f"{name}.stats.txt").read_text()))
    assert parsed.steps == stats.steps == 3
    assert parsed.count == stats.count == per_step
    if per_step:
        assert parsed.by_call == {"cudaStreamSynchronize": per_step}
        assert parsed.dtoh_copies == per_step and parsed.host_us > 0
