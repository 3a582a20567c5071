"""A run directory never makes fxquant import or run code: each tampered RUN_DIR exits 2 with one line, and the
marker file its code would write never appears. A run moved elsewhere works again once the user names its model.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import stat
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from cli_testing import error_line, main_cli, run_cli, snapshot, trusted_copy

from fxquant.artifacts.manifest import MAX_MANIFEST_BYTES, checksum
from fxquant.cli import trust

MODEL = "fxquant.models:digits_cnn"
MARKER = "code-ran"
# Modules a hostile run directory names: importing the first, or calling a function of the second, writes MARKER.
EVIL_IMPORT = "from pathlib import Path\nPath(__file__).with_name('code-ran').write_text('import')\n"
EVIL_CALL = ("from pathlib import Path\n\ndef make():\n    Path(__file__).with_name('code-ran').write_text('call')\n\n"
             "def inputs():\n    Path(__file__).with_name('code-ran').write_text('call')\n")


@pytest.fixture(scope="module")
def converted_run(tmp_path_factory: pytest.TempPathFactory, digits_weights: Path) -> Path:
    run = tmp_path_factory.mktemp("trust") / "run"
    for args in (("prepare", "--model", MODEL, "--weights", str(digits_weights), "--example-inputs", "1x1x8x8",
                  "-o", str(run)),
                 ("calibrate", str(run), "--data", "cli_helpers:calib_batches", "--batches", "1"),
                 ("convert", str(run), "--backend", "reference")):
        assert main_cli(*args).returncode == 0, args
    return run


@pytest.fixture
def shared(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder someone handed over: hostile helper modules, importable (like the current directory is)."""
    (tmp_path / "evil_import.py").write_text(EVIL_IMPORT)
    (tmp_path / "evil_call.py").write_text(EVIL_CALL)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def _resign(run: Path, change: Callable[[dict], None]) -> None:
    """Edit the manifest and recompute its checksum, as a deliberate tamperer would."""
    data = json.loads((run / "manifest.json").read_text())
    data.pop("checksum")
    change(data)
    (run / "manifest.json").write_text(json.dumps({**data, "checksum": checksum(data)}))


def _refile(run: Path, role: str) -> None:
    """Make the manifest's hash and size of ``role``'s file match its (replaced) content."""
    path = run / json.loads((run / "manifest.json").read_text())["files"][role]["name"]
    data = path.read_bytes()
    _resign(run, lambda m: m["files"][role].update(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data)))


class _Payload:
    """Unpickling this would create MARKER: proof that code from the file ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Callable[..., object], tuple[str]]:
        return os.mkdir, (str(self.marker),)


def _role_file(run: Path, role: str) -> Path:
    return run / json.loads((run / "manifest.json").read_text())["files"][role]["name"]


def _module_spec(run: Path) -> None:
    _resign(run, lambda m: m["source"].update(model="evil_import:make"))


def _factory_spec(run: Path) -> None:
    _resign(run, lambda m: m["source"].update(model="evil_call:make"))


def _example_input_factory(run: Path) -> None:
    _role_file(run, "inputs").unlink()
    _resign(run, lambda m: (m["source"].update(example_inputs="evil_call:inputs"), m["files"].pop("inputs")))


def _weights_outside(run: Path) -> None:
    torch.save({"fc1.weight": _Payload(run.parent / MARKER)}, run.parent / "payload.pt")
    digest = hashlib.sha256((run.parent / "payload.pt").read_bytes()).hexdigest()
    _resign(run, lambda m: m["source"].update(weights="../payload.pt", weights_sha256=digest))


def _symlinked_tensor_file(run: Path) -> None:
    observers = _role_file(run, "observers")
    outside = run.parent / "observers-elsewhere.pt"
    outside.write_bytes(observers.read_bytes())  # same bytes, same hash: only the link itself is wrong
    observers.unlink()
    observers.symlink_to(outside)


def _file_entry_outside(run: Path) -> None:
    observers = _role_file(run, "observers")
    observers.rename(run.parent / observers.name)
    _resign(run, lambda m: m["files"]["observers"].update(name=f"../{observers.name}"))


def _oversized_json(run: Path) -> None:
    with open(run / "manifest.json", "r+b") as handle:
        handle.truncate(MAX_MANIFEST_BYTES + 1)  # sparse: no disk space used


def _deeply_nested_json(run: Path) -> None:
    (run / "manifest.json").write_text("[" * 200_000)


def _zip_bomb(run: Path) -> None:
    observers = _role_file(run, "observers")
    with zipfile.ZipFile(observers, "w", zipfile.ZIP_DEFLATED) as archive, archive.open("archive/data/0", "w") as f:
        for _ in range(64):  # 64 MiB of zeros in a ~64 KiB file
            f.write(bytes(1 << 20))
    _refile(run, "observers")


def _pickle_payload(run: Path) -> None:
    torch.save({"example_inputs": (_Payload(run.parent / MARKER),)}, _role_file(run, "inputs"))
    _refile(run, "inputs")


TAMPERED = [  # (how, extra command-line arguments, the error says)
    (_module_spec, (), "changed since you prepared it here from 'fxquant.models:digits_cnn'"),
    (_factory_spec, (), "it names the model 'evil_call:make'"),
    (_example_input_factory, (), "changed since you prepared it here"),
    (_example_input_factory, ("--model", MODEL), "also names the example-input factory 'evil_call:inputs'"),
    (_weights_outside, ("--model", MODEL), "pass it with --weights FILE"),
    (_symlinked_tensor_file, (), "is a symbolic link"),
    (_file_entry_outside, (), "is not a file name inside the directory"),
    (_oversized_json, (), f"more than the {MAX_MANIFEST_BYTES} fxquant reads"),
    (_deeply_nested_json, (), "nested too deeply"),
    (_zip_bomb, (), "a zip bomb?"),
    (_pickle_payload, (), "refused to load; it holds objects other than tensors"),
]


@pytest.mark.parametrize(("tamper", "extra", "needle"), TAMPERED, ids=[f"{t[0].__name__[1:]}{len(t[1])}"
                                                                         for t in TAMPERED])
def test_a_tampered_run_directory_runs_nothing(converted_run: Path, shared: Path, tamper: Callable[[Path], None],
                                               extra: tuple[str, ...], needle: str) -> None:
    run = trusted_copy(converted_run, shared / "run")  # as if this user had prepared it here
    tamper(run)
    before = snapshot(run)
    outcome = main_cli("convert", str(run), *extra)
    assert outcome.returncode == 2, outcome.stderr
    assert needle in error_line(outcome, "convert")
    assert not (shared / MARKER).exists(), "code named by the run directory ran"
    assert snapshot(run) == before


def test_a_shared_folder_runs_nothing_even_from_its_own_directory(converted_run: Path, tmp_path: Path) -> None:
    """The reported case: ``cd shared && python -m fxquant report run`` with ``helpers.py`` next to ``run/``."""
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "helpers.py").write_text(EVIL_IMPORT)
    run = trusted_copy(converted_run, shared / "run")
    _resign(run, lambda m: m["source"].update(model="helpers:make"))
    result = run_cli("report", "run", "--data", "cli_helpers:calib_batches", cwd=shared)
    assert result.returncode == 2
    assert "pass --model helpers:make --weights FILE" in error_line(result, "report")
    inspected = run_cli("inspect", "run", cwd=shared)  # looking at a run directory is always safe
    assert inspected.returncode == 0, inspected.stderr
    assert "trusted here   no: later stages need --model helpers:make --weights FILE" in inspected.stdout
    assert not (shared / MARKER).exists()


def test_a_moved_run_works_once_the_user_names_its_model(converted_run: Path, tmp_path: Path,
                                                         digits_weights: Path) -> None:
    moved = Path(shutil.copytree(converted_run, tmp_path / "elsewhere" / "run"))  # a copy: not in the trust record
    line = error_line(main_cli("convert", str(moved)), "convert")
    assert f"was not prepared by you here: it names the model '{MODEL}' with weights 'digits.pt'" in line
    assert f"pass --model {MODEL} --weights FILE" in line
    outcome = main_cli("convert", str(moved), "--model", MODEL, "--weights", str(digits_weights))
    assert outcome.returncode == 0, outcome.stderr
    record = trust.lookup(moved)
    assert record is not None and record.weights == str(digits_weights.resolve())
    assert main_cli("graph", str(moved)).returncode == 0  # remembered: later stages need no flags


def test_model_and_weights_must_be_the_runs(converted_run: Path, tmp_path: Path, digits_weights: Path) -> None:
    moved = Path(shutil.copytree(converted_run, tmp_path / "run"))
    other = tmp_path / "other.pt"
    torch.save({"fc1.weight": torch.zeros(1)}, other)
    cases = [(("--model", "fxquant.models:mlp_net"), "--model 'fxquant.models:mlp_net' is not the model"),
             (("--model", MODEL), "was prepared with the weights file 'digits.pt'"),
             (("--model", MODEL, "--weights", str(other)), "is not the weights file"),
             (("--weights", str(digits_weights)), "was not prepared by you here")]
    for args, needle in cases:
        assert needle in error_line(main_cli("convert", str(moved), *args), "convert"), args
    assert trust.lookup(moved) is None


def test_trust_model_spec_says_what_it_imports_first(converted_run: Path, tmp_path: Path,
                                                     digits_weights: Path) -> None:
    moved = Path(shutil.copytree(converted_run, tmp_path / "run"))
    outcome = main_cli("graph", str(moved), "--trust-model-spec", "--weights", str(digits_weights))
    assert outcome.returncode == 0, outcome.stderr
    notice = outcome.stderr.splitlines()[0]
    assert "importing module 'fxquant.models'" in notice and "calling digits_cnn()" in notice, outcome.stderr
    assert f"{moved}/manifest.json" in notice
    assert trust.lookup(moved) is None  # a one-off: the next stage asks again


def test_prepare_records_no_path_outside_the_run(converted_run: Path) -> None:
    manifest = json.loads((converted_run / "manifest.json").read_text())
    assert manifest["source"]["weights"] == "digits.pt"  # a name for people; the file is found via the trust record
    assert all("/" not in entry["name"] for entry in manifest["files"].values())
    assert set(manifest["files"]) == {"inputs", "observers", "quantized"}


def test_an_unsafe_trust_record_vouches_for_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    record = tmp_path / "trusted-runs.json"
    monkeypatch.setenv(trust.TRUST_FILE_ENV, str(record))
    run = tmp_path / "run"
    assert main_cli("prepare", "--model", MODEL, "--example-inputs", "1x1x8x8", "-o", str(run)).returncode == 0
    assert trust.lookup(run) is not None and stat.S_IMODE(record.stat().st_mode) == 0o600
    record.chmod(0o666)
    with caplog.at_level(logging.WARNING, logger="fxquant"):
        outcome = main_cli("calibrate", str(run), "--data", "cli_helpers:calib_batches")
    assert "was not prepared by you here" in error_line(outcome, "calibrate")
    assert "ignoring the trust record" in caplog.text and "writable by other users" in caplog.text


def test_the_trust_record_lives_outside_every_run_directory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(trust.TRUST_FILE_ENV)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    assert trust.trust_file() == tmp_path / "state" / "fxquant" / "trusted-runs.json"
    monkeypatch.delenv("XDG_STATE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert trust.trust_file() == tmp_path / ".local" / "state" / "fxquant" / "trusted-runs.json"


def test_a_symlinked_calibration_checkpoint_is_not_followed(converted_run: Path, tmp_path: Path) -> None:
    run = trusted_copy(converted_run, tmp_path / "run")
    torch.save({"observers": _Payload(tmp_path / MARKER)}, tmp_path / "elsewhere.pt")
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "calibration.pt").symlink_to(tmp_path / "elsewhere.pt")
    outcome = main_cli("calibrate", str(run), "--data", "cli_helpers:calib_batches", "--resume")
    assert outcome.returncode == 2 and "is a symbolic link" in error_line(outcome, "calibrate")
    assert not (tmp_path / MARKER).exists()


def test_inspect_prints_a_hostile_manifest_without_driving_the_terminal(converted_run: Path, tmp_path: Path) -> None:
    run = trusted_copy(converted_run, tmp_path / "run")
    _resign(run, lambda m: m["source"].update(model="\x1b]0;owned\x07x:y"))
    outcome = main_cli("inspect", str(run))
    assert outcome.returncode == 0, outcome.stderr
    assert "\x1b" not in outcome.stdout and "\\x1b]0;owned\\x07x:y" in outcome.stdout
    assert "BAD:" in outcome.stdout  # the trusted-here line: not a PKG.MODULE:NAME spec
    line = error_line(main_cli("convert", str(run)), "convert")
    assert "not PKG.MODULE:NAME or transformers:FOLDER specs" in line and "\x1b" not in line
    _resign(run, lambda m: m["source"].update(model="transformers:\x1b]0;owned\x07/x"))  # a folder spec too
    line = error_line(main_cli("convert", str(run)), "convert")
    assert "not PKG.MODULE:NAME or transformers:FOLDER specs" in line and "\x1b" not in line
