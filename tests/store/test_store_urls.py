"""Opening the job store: default locations, and a clear StoreError for every kind of bad database URL."""

from __future__ import annotations

from pathlib import Path

import pytest

from layerbus.storage.engine import default_db_url, default_results_dir
from layerbus.storage.errors import StoreError, mask_url
from layerbus.storage.store import JobStore


def test_default_locations_live_under_layerbus_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    monkeypatch.setenv("LAYERBUS_HOME", str(home))
    assert default_db_url() == f"sqlite:///{home / 'layerbus.db'}"
    assert default_results_dir() == home / "results" and (home / "results").is_dir()
    with JobStore.open(default_db_url()) as store:
        assert store.latest_job_id() is None


def test_default_home_is_under_local_share(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("LAYERBUS_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_db_url() == f"sqlite:///{tmp_path}/.local/share/layerbus/layerbus.db"


def test_sqlite_file_in_a_missing_folder_is_created(tmp_path: Path) -> None:
    with JobStore.open(f"sqlite:///{tmp_path / 'a' / 'b' / 'store.db'}"):
        pass
    assert (tmp_path / "a" / "b" / "store.db").is_file()


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        (
            "mysql://root:hunter2@db/layerbus",
            r"'mysql://root:\*\*\*@db/layerbus': layerbus stores jobs in SQLite or PostgreSQL, not 'mysql'",
        ),
        ("postgresql+nosuch://u@h/d", r"unknown driver 'postgresql\+nosuch'; use sqlite:///"),
        (
            "postgresql+psycopg2://u:hunter2@h/d",
            r"'postgresql\+psycopg2://u:\*\*\*@h/d': its driver is not installed .*pip install 'psycopg\[binary\]'",
        ),
        ("not a url", r"cannot read database URL 'not a url'; use sqlite:///"),
        (
            "postgresql+psycopg://layerbus:hunter2@127.0.0.1:1/nowhere",
            r"cannot connect to 'postgresql\+psycopg://layerbus:\*\*\*@127.0.0.1:1/nowhere': "
            r".*check that the server is running",
        ),
    ],
)
def test_bad_urls_say_what_is_wrong_without_the_password(url: str, expected: str) -> None:
    with pytest.raises(StoreError, match=expected) as raised:
        JobStore.open(url)
    assert "hunter2" not in str(raised.value)


def test_sqlite_path_under_a_file_names_the_folder(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("not a folder")
    url = f"sqlite:///{tmp_path / 'afile' / 'store.db'}"
    with pytest.raises(StoreError, match=f"cannot create the folder '{tmp_path / 'afile'}' for SQLite database"):
        JobStore.open(url)


def test_sqlite_path_that_is_a_folder_is_refused(tmp_path: Path) -> None:
    expected = rf"cannot open SQLite database 'sqlite:///{tmp_path}': .*is a file \(not a folder\)"
    with pytest.raises(StoreError, match=expected):
        JobStore.open(f"sqlite:///{tmp_path}")


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        ("postgresql+psycopg://u:p@ss@h/d", "postgresql+psycopg://u:***@h/d"),
        ("postgresql://u:pw@h/d?sslcert=a@b", "postgresql://u:***@h/d?sslcert=a@b"),
        ("postgresql://user:secret@host:5432/db", "postgresql://user:***@host:5432/db"),
        ("postgresql://user@host/db", "postgresql://user@host/db"),
        ("sqlite:////tmp/x.db", "sqlite:////tmp/x.db"),
    ],
)
def test_mask_url(url: str, masked: str) -> None:
    assert mask_url(url) == masked
