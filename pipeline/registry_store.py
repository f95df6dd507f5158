"""Where the model registry lives and how it is opened: one writer at a time on a SQLite file.

MLflow's SQLite stores are not safe for several processes on a fresh or older file: the first use of a database
creates its tables and runs every alembic migration, unguarded, from each process that opens it (two at once fail
with `table ... already exists` or a half-migrated schema). Its checks-then-creates (the experiment, the
registered model) and the next version number (max + 1) race the same way. So every process that opens a
SQLite registry holds `<file>.lock` (an OS lock through `filelock`, released however the process ends) while the
store opens, and a writer holds it until its writes are done. A tracking server (MLFLOW_TRACKING_URI=http://...)
serializes its own writers; nothing is locked for one. The lock is per host: several hosts need a server.
"""

from __future__ import annotations

import os
import sqlite3
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from filelock import FileLock, Timeout

from quantize.errors import UserError

PROJECT_DIR = Path(__file__).resolve().parent.parent
DEFAULT_DIR = PROJECT_DIR / "registry"
EXPERIMENT = "quantize"
LOCK_TIMEOUT_S = 600  # a writer holds the lock while it copies an artifact (at most the copy limit, 2 GiB)


class RegistryError(UserError, ValueError):
    """An artifact the registry must refuse, or a registry that cannot be used; the message says why."""


def tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{DEFAULT_DIR / 'mlflow.db'}"


def registry_uri() -> str:
    return os.environ.get("MLFLOW_REGISTRY_URI") or tracking_uri()


def sqlite_files() -> list[Path]:
    """The SQLite database files behind the tracking and registry URIs, in a fixed order (none for a server)."""
    uris = {tracking_uri(), registry_uri()}
    return sorted(Path(u.removeprefix("sqlite:///")) for u in uris if u.startswith("sqlite:///"))


@contextmanager
def registry_errors() -> Iterator[None]:
    """A registry database or server that cannot be used -> RegistryError saying which and what to do."""
    from mlflow.exceptions import MlflowException
    from sqlalchemy.exc import SQLAlchemyError

    try:
        yield
    except (MlflowException, SQLAlchemyError, sqlite3.Error) as e:
        uri = tracking_uri()
        what = (f"move {uri.removeprefix('sqlite:///')} aside (a new one is created) or restore it from a backup"
                if uri.startswith("sqlite:///") else "check the server, or set MLFLOW_TRACKING_URI to another one")
        first = " ".join(str(e).split())[:200]
        raise RegistryError(f"the model registry {uri} cannot be used ({type(e).__name__}: {first}); {what}") from None


@contextmanager
def _locked(db: Path) -> Iterator[None]:
    """Hold `<db>.lock` for the block, waiting for another writer; RegistryError after LOCK_TIMEOUT_S."""
    db.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(f"{db}.lock", timeout=float(os.environ.get("QUANTIZE_REGISTRY_LOCK_TIMEOUT", LOCK_TIMEOUT_S)))
    try:
        lock.acquire()
    except Timeout:
        raise RegistryError(f"the model registry {db} stayed locked by another register for {lock.timeout:.0f} s "
                            f"(lock file {db}.lock, released when that process ends); wait for it, or set "
                            f"QUANTIZE_REGISTRY_LOCK_TIMEOUT to wait longer") from None
    try:
        yield
    finally:
        lock.release()


@contextmanager
def opened(write: bool = False) -> Iterator[tuple]:
    """(mlflow, client) on a registry whose schema is complete. A SQLite file is locked while its stores open
    (creating or migrating its tables) and, for a writer, until the block ends; a reader then reads unlocked."""
    with registry_errors(), ExitStack() as held:
        for db in sqlite_files():
            held.enter_context(_locked(db))
        mlflow, client = _client()
        if sqlite_files():
            # each call opens one of MLflow's two stores, which creates or migrates the tables it finds missing
            client.search_experiments(max_results=1)
            client.search_registered_models(max_results=1)
        if not write:
            held.close()
        yield mlflow, client


def _client():
    import mlflow
    from mlflow import MlflowClient

    uri = tracking_uri()
    for db in sqlite_files():
        db.parent.mkdir(parents=True, exist_ok=True)
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(registry_uri())
    return mlflow, MlflowClient(tracking_uri=uri, registry_uri=registry_uri())


def experiment_id(client) -> str:
    """The `quantize` experiment's id, created on first use (artifacts beside a SQLite file, never in the
    working directory; a tracking server decides for itself)."""
    exp = client.get_experiment_by_name(EXPERIMENT)
    if exp is not None:
        return exp.experiment_id
    uri, location = tracking_uri(), None
    if uri.startswith("sqlite:///"):
        location = (Path(uri.removeprefix("sqlite:///")).parent / "artifacts").as_uri()
    try:
        return client.create_experiment(EXPERIMENT, artifact_location=location)
    except Exception as e:
        if not already_exists(e):
            raise
        return client.get_experiment_by_name(EXPERIMENT).experiment_id


def already_exists(e: Exception) -> bool:
    """Another writer created it between our look and our create: a tracking server's writers on several
    hosts share no lock, and the database's unique name is what decides."""
    return getattr(e, "error_code", None) == "RESOURCE_ALREADY_EXISTS"


def ui_command(host: str, port: int) -> list[str]:
    """The command that serves MLflow's own web UI (and REST API) on the registry: `mlflow server` on its SQLite
    store, its artifacts where `register` copies them. RegistryError when the registry is a server already."""
    uri = tracking_uri()
    if not uri.startswith("sqlite:///"):
        raise RegistryError(f"the registry {uri} is not a local SQLite file: open its own server in a browser "
                            f"instead (unset MLFLOW_TRACKING_URI to browse registry/mlflow.db)")
    db = Path(uri.removeprefix("sqlite:///"))
    if not db.is_file():
        raise RegistryError(f"no registry at {db} yet: register an artifact first (make register RECIPE=...)")
    return [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", uri,
            "--default-artifact-root", (db.parent / "artifacts").as_uri(), "--host", host, "--port", str(port),
            "--workers", "1"]
