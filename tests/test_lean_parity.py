"""Lean ↔ Rust parity: every one-line oracle in lean/**/*.lean against the kernel (F5).

The oracles are parsed at collection time, so a new oracle line becomes a new test case with
no change here; an oracle without a kernel counterpart fails. The modules built into the
extension must be exactly the repository's, so an installed wheel checks the same text.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import amplituhedron_rs as ar
from amplituhedron_rs import _core
from amplituhedron_rs.oracle.lean import (
    KERNEL,
    LEAN_DIR_ENV,
    PENTAD,
    LeanOracle,
    check_oracle,
    embedded_sources,
    lean_equal,
    lean_sources,
    parse_lean_literal,
    parse_oracle_line,
    read_oracles,
)
from amplituhedron_rs.oracle.lean import parity as oracle_parity

REPO_LEAN_DIR = Path(__file__).resolve().parents[1] / "lean"
ORACLES = read_oracles(REPO_LEAN_DIR)

#: The shared oracle notes list 35; the project's Lean adds the fan-1 and diagonal-point ones.
MIN_ORACLES = 35


@pytest.mark.parametrize("oracle", ORACLES, ids=[o.name for o in ORACLES])
def test_kernel_matches_lean_oracle(oracle: LeanOracle) -> None:
    result = check_oracle(oracle)
    assert result.ok, f"{oracle.file}:{oracle.line} {oracle.name}: {result.detail}"


def test_at_least_the_documented_oracles_are_found() -> None:
    assert len(ORACLES) >= MIN_ORACLES
    files = {o.file for o in ORACLES}
    assert files == {
        "Gnosis/AmplituhedronFalsifiability.lean",
        "Gnosis/TopologicalAmplituhedron.lean",
        "Gnosis/TopologicalGrassmannianCompiler.lean",
    }


def test_the_pentad_is_present_and_passes() -> None:
    by_name = {r.name: r for r in oracle_parity(REPO_LEAN_DIR)}
    for name in PENTAD:
        assert name in by_name, f"seed 001's F5 contract {name} is missing from lean/"
        assert by_name[name].ok, by_name[name].detail


def test_registry_has_no_stale_entries() -> None:
    # A registry entry whose oracle was renamed or deleted would silently check nothing.
    assert set(KERNEL) - {o.name for o in ORACLES} == set()


def test_the_extension_embeds_exactly_the_repository_lean_modules() -> None:
    embedded = embedded_sources()
    assert embedded == lean_sources(REPO_LEAN_DIR)
    assert "Gnosis/AmplituhedronFalsifiability.lean" in embedded


def test_parity_by_default_checks_the_embedded_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(LEAN_DIR_ENV, raising=False)
    results = ar.oracle.parity()
    assert [r.name for r in results] == [o.name for o in ORACLES]
    assert all(r.ok for r in results), [r.detail for r in results if not r.ok]
    amplitude = next(r for r in results if r.name == "vandermonde_runtime_oracle_amplitude")
    assert (amplitude.expected, amplitude.actual, amplitude.detail) == ((4, 1), (4, 1), "")
    assert amplitude.file == "Gnosis/AmplituhedronFalsifiability.lean"


def test_env_var_overrides_the_lean_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "Extra.lean").write_text(
        "theorem swerve_prefix_has_volume : admitsVolume clinamen_swerve = true := by decide\n",
        encoding="utf-8",
    )
    monkeypatch.setenv(LEAN_DIR_ENV, str(tmp_path))
    results = oracle_parity()
    assert [(r.name, r.ok) for r in results] == [("swerve_prefix_has_volume", True)]
    monkeypatch.setenv(LEAN_DIR_ENV, str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match=LEAN_DIR_ENV):
        oracle_parity()


def test_a_directory_without_lean_files_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no \.lean files"):
        oracle_parity(tmp_path)


# --- the parser ------------------------------------------------------------------------


def test_a_new_oracle_line_is_picked_up(tmp_path: Path) -> None:
    sub = tmp_path / "Gnosis"
    sub.mkdir()
    (sub / "New.lean").write_text(
        "namespace Gnosis\n"
        "theorem brand_new_oracle : execution_volume 10 = 55 := by decide\n"
        "end Gnosis\n",
        encoding="utf-8",
    )
    [oracle] = read_oracles(tmp_path)
    assert (oracle.name, oracle.file, oracle.line) == ("brand_new_oracle", "Gnosis/New.lean", 2)
    assert (oracle.expression, oracle.expected) == ("execution_volume 10", 55)
    # Without a kernel counterpart it fails: never a skip.
    [result] = oracle_parity(tmp_path)
    assert not result.ok
    assert result.actual is None
    assert "no kernel counterpart" in result.detail
    # With one it is checked like any other.
    registry = {"brand_new_oracle": lambda: _core.oracle_execution_volume(10)}
    assert check_oracle(oracle, registry).ok


def test_multi_line_theorems_and_expression_rhs_are_not_oracles(tmp_path: Path) -> None:
    (tmp_path / "Proofs.lean").write_text(
        "theorem multi_line :\n"
        "    execution_volume 10 = 55 := by decide\n"
        "theorem expression_rhs : fib 5 = fib 4 + fib 3 := by decide\n"
        "theorem name_rhs : qnorm (amplitudeAt cOnes) = qnorm (amplitudeAtFan2 c) := by decide\n"
        "theorem by_rfl : execution_volume 10 = 55 := rfl\n"
        "theorem float_rhs : someFloat = 1.5 := by decide\n"
        'theorem string_rhs : someString = "abc" := by decide\n'
        "  theorem indented : execution_volume 10 = 55 := by decide\n"
        "-- theorem commented : execution_volume 10 = 55 := by decide\n"
        "theorem trailing_comment : execution_volume 10 = 55 := by decide -- no\n"
        "theorem the_one : [0, 1].map admitsVolume = [false, true] := by decide\n",
        encoding="utf-8",
    )
    assert [o.name for o in read_oracles(tmp_path)] == ["the_one"]


def test_a_literal_the_kernel_disagrees_with_fails(tmp_path: Path) -> None:
    (tmp_path / "Wrong.lean").write_text(
        "theorem vandermonde_runtime_oracle_amplitude : amplitudeAt cOnes = (5, 1) := by decide\n"
        "theorem vandermonde_runtime_oracle_positive : totallyPositive v24 = 1 := by decide\n"
        "theorem amplitude_point_oracle : (yOf cOnes zMoment).toTriple = [4, 10, 30] := by decide\n"
        "theorem zMoment_minors_oracle : zMinors zMoment = [2, 6, 6, 2] := by decide\n",
        encoding="utf-8",
    )
    results = {r.name: r for r in oracle_parity(tmp_path)}
    amplitude = results["vandermonde_runtime_oracle_amplitude"]
    assert (amplitude.ok, amplitude.expected, amplitude.actual) == (False, (5, 1), (4, 1))
    assert "Lean says (5, 1), the kernel gives (4, 1)" in amplitude.detail
    # `true` is not `1`, and a tuple is not a list, even though Python says they are equal.
    assert not results["vandermonde_runtime_oracle_positive"].ok
    assert not results["amplitude_point_oracle"].ok
    assert results["zMoment_minors_oracle"].ok


def test_a_kernel_error_is_a_failed_result_not_an_exception(tmp_path: Path) -> None:
    (tmp_path / "Pole.lean").write_text(
        "theorem fan2_at_the_diagonal : qnorm (amplitudeAtFan2 cDiagonal) = (16, 3) := by decide\n",
        encoding="utf-8",
    )
    [oracle] = read_oracles(tmp_path)
    z = _core.oracle_moment_curve([1, 2, 3, 4])
    registry = {
        oracle.name: lambda: _core.oracle_fan_form(z, 1, _core.oracle_y_of([1, 2, 3, 4], z))
    }
    result = check_oracle(oracle, registry)
    assert not result.ok
    assert "InputError" in result.detail and "spurious pole" in result.detail


def test_duplicate_oracle_names_are_rejected(tmp_path: Path) -> None:
    line = "theorem twice : execution_volume 10 = 55 := by decide\n"
    (tmp_path / "A.lean").write_text(line, encoding="utf-8")
    (tmp_path / "B.lean").write_text(line, encoding="utf-8")
    with pytest.raises(ValueError, match="duplicate oracle 'twice'"):
        read_oracles(tmp_path)


def test_hidden_build_directories_are_ignored(tmp_path: Path) -> None:
    (tmp_path / "A.lean").write_text(
        "theorem visible : execution_volume 10 = 55 := by decide\n", encoding="utf-8"
    )
    build = tmp_path / ".lake" / "build"
    build.mkdir(parents=True)
    (build / "Copy.lean").write_text(
        "theorem visible : execution_volume 10 = 55 := by decide\n", encoding="utf-8"
    )
    assert [o.name for o in read_oracles(tmp_path)] == ["visible"]


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("0", 0),
        ("-4", -4),
        ("19740274219868223167", 19740274219868223167),
        ("true", True),
        ("false", False),
        ("[]", []),
        ("[5, 6, 3, -4]", [5, 6, 3, -4]),
        ("(false, true, 5)", (False, True, 5)),
        ("⟨4, 10, 30⟩", (4, 10, 30)),
        ("⟨⟩", ()),
        ("[(1, 2), (3, -4)]", [(1, 2), (3, -4)]),
        ("[true, false]", [True, False]),
    ],
)
def test_lean_literals(text: str, value: object) -> None:
    parsed = parse_lean_literal(text)
    assert lean_equal(value, parsed), (text, parsed)


@pytest.mark.parametrize(
    "text",
    ["fib 5", "qnorm (4, 1)", "x", "1.5", '"abc"', "None", "1 + 2", "some 1", "#[1, 2]", "truex"],
)
def test_non_literals(text: str) -> None:
    assert parse_lean_literal(text) is None


def test_parse_oracle_line_splits_at_the_last_equals() -> None:
    line = (
        "theorem grassmannian_soundness_bounded : (List.range 9).all (fun p => "
        "(List.range 9).all (fun l => !wellFormedPrefix p l || Nat.ble 1 "
        "(compile_cfg_to_grassmannian p l).volume)) = true := by decide"
    )
    parsed = parse_oracle_line(line)
    assert parsed is not None
    name, expression, expected = parsed
    assert name == "grassmannian_soundness_bounded"
    assert expression.endswith(".volume))")
    assert expected is True


def test_lean_equal_is_strict_about_bool_and_sequence_kinds() -> None:
    assert lean_equal([1, (True, 2)], [1, (True, 2)])
    assert not lean_equal(True, 1)
    assert not lean_equal(1, True)
    assert not lean_equal((1, 2), [1, 2])
    assert not lean_equal([1, 2], [1, 2, 3])
    assert not lean_equal(4, None)
