import amplituhedron_rs


def test_version_matches_cargo() -> None:
    import tomllib
    from pathlib import Path

    cargo = tomllib.loads((Path(__file__).parents[1] / "Cargo.toml").read_text())
    assert amplituhedron_rs.__version__ == cargo["package"]["version"]
