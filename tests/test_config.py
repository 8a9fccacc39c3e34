"""Settings: precedence, types, and documentation that cannot go stale."""

from __future__ import annotations

from pathlib import Path

import pytest

from metanode import config
from metanode.errors import InvalidRequest

DOC = Path(__file__).parents[1] / "docs" / "configuration.md"


def test_every_setting_is_documented_with_its_default() -> None:
    text = DOC.read_text(encoding="utf-8")
    for name, default, _help in config.describe():
        assert f"| `{name}` | `METANODE_{name.upper()}` | `{default}` |" in text, name


def test_defaults_need_no_configuration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    settings = config.load(env={})
    assert (settings.host, settings.port, settings.data_dir) == ("127.0.0.1", 9000, Path("data"))
    assert settings.accept_unknown_signers is False


def test_precedence_file_then_env_then_flags(tmp_path: Path) -> None:
    file = tmp_path / "m.toml"
    file.write_text('port = 9100\nhost = "0.0.0.0"\naccept_unknown_signers = true\n')
    env = {"METANODE_PORT": "9200", "METANODE_ACCEPT_UNKNOWN_SIGNERS": "off"}
    settings = config.load(file, env=env, overrides={"host": "::1", "port": None})
    assert (settings.port, settings.host, settings.accept_unknown_signers) == (9200, "::1", False)
    assert config.load(env={"METANODE_CONFIG": str(file)}).port == 9100


@pytest.mark.parametrize(
    ("env", "fragment"),
    [
        ({"METANODE_PORT": "nine"}, "port"),
        ({"METANODE_ACCEPT_UNKNOWN_SIGNERS": "maybe"}, "accept_unknown_signers"),
    ],
)
def test_bad_values_name_the_setting(env: dict[str, str], fragment: str) -> None:
    with pytest.raises(InvalidRequest, match=fragment):
        config.load(env=env)


def test_unknown_file_keys_and_broken_toml_are_errors(tmp_path: Path) -> None:
    typo = tmp_path / "typo.toml"
    typo.write_text("prot = 1\n")
    with pytest.raises(InvalidRequest, match="prot"):
        config.load(typo, env={})
    broken = tmp_path / "broken.toml"
    broken.write_text("port = \n")
    with pytest.raises(InvalidRequest, match="cannot read"):
        config.load(broken, env={})
