"""scripts/precompile_gpu_matrix.py takes every option a device script passes on from a `tuner
refine` line (scripts/gpu_profile_specs.sh's REFINE compiles ahead with the same words it then
measures with): an option refine gained and precompile did not would fail the compile step."""

import importlib.util
from pathlib import Path

from drafter_attn.tuner import cli

ROOT = Path(__file__).resolve().parent.parent
# how a refine runs, not what it measures: nothing of its own to compile
RUN_ONLY = {"-h", "--help", "--db", "--timeout", "--retry-failed", "--dry-run", "--no-progress"}


def _options(parser) -> set[str]:
    return {o for action in parser._actions for o in action.option_strings}


def test_precompile_takes_every_option_of_tuner_refine(monkeypatch):
    monkeypatch.chdir(ROOT)  # the script puts the working directory on sys.path for `tests`
    spec = importlib.util.spec_from_file_location("precompile_gpu_matrix",
                                                  ROOT / "scripts" / "precompile_gpu_matrix.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    refine = cli.build_parser()._subparsers._group_actions[0].choices["refine"]
    missing = _options(refine) - RUN_ONLY - _options(script.build_parser())
    assert not missing, f"scripts/precompile_gpu_matrix.py lacks {sorted(missing)}"
