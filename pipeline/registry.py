"""Hand artifacts to an MLflow model registry: only verified, evaluated, passing ones.

Default: an embedded registry, a SQLite file in the project (`registry/mlflow.db`, artifacts under
`registry/artifacts/`), nothing to start; writers on one host take turns (registry_store). Any sqlite:///
tracking URI keeps its artifacts beside its file. Any tracking server: set MLFLOW_TRACKING_URI (and, if the model
registry lives elsewhere, MLFLOW_REGISTRY_URI). One registered model per artifact name; each registration is a
new version whose run holds params = the resolved recipe, metrics = the report, tags = base model, method,
group size, and the artifact directory itself - or, above a size limit or with `by_reference`, only its URI.
The variants of a comparison (or a sweep) are registered as versions of one registered model, each tagged with
its variant name and group size; an MLflow alias (`champion`) marks the chosen one, and `resolve` turns
`models:/<name>@<alias>` or `models:/<name>/<version>` back into a verified local directory to serve.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from urllib.parse import unquote, urlparse

from quantize.errors import did_you_mean
from quantize.files import sha256_file
from quantize.manifest import MANIFEST, ArtifactError, files_fingerprint, read, read_report, verify
from quantize.paths import child
from quantize.records import Manifest, Report

from .registry_store import (RegistryError, already_exists, experiment_id, opened, tracking_uri,  # noqa: F401
                             ui_command)  # ui_command: the CLI reads it here

log = logging.getLogger(__name__)

COPY_LIMIT_BYTES = 2 * 2**30  # larger artifacts are registered by reference (their URI), not copied


def _snapshot(artifact: Path, m: Manifest, into: Path) -> None:
    """Copy the files the manifest lists (never following a symlink) and verify the copy: what is registered
    is exactly what was verified, even if the directory changes meanwhile."""
    names = [*m.files, *(m.report.hashes() if m.report else {}), MANIFEST]
    for name in names:
        (into / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(artifact / name, into / name, follow_symlinks=False)
    try:
        verify(into)
    except ArtifactError as e:
        raise RegistryError(f"{artifact} changed while it was being registered: {e}") from None


def check_artifact(artifact: Path) -> tuple[Manifest, Report]:
    """Refuse anything not fit for a registry -> (manifest, report). Raises RegistryError naming the cause."""
    artifact = Path(artifact)
    if not (artifact / MANIFEST).is_file():
        raise RegistryError(f"{artifact}: no {MANIFEST}; only artifacts written by `make quantize` can be registered")
    try:
        verify(artifact)
        m = read(artifact)
        report = read_report(artifact) if m.report is not None else None  # verified: its hash is the manifest's
    except ArtifactError as e:
        raise RegistryError(str(e)) from None
    if report is None:
        raise RegistryError(f"{artifact}: not evaluated; run `make eval RECIPE={m.artifact}` first")
    if not report.passed or not m.report.passed:
        raise RegistryError(f"{artifact}: refused, its eval failed: {'; '.join(report.failures) or 'see report.md'}")
    if report.files_scored != files_fingerprint(m):
        raise RegistryError(f"{artifact}: refused, its report scored other files than the artifact holds now (it was "
                            f"re-made after that eval); run `make eval RECIPE={m.artifact}` again")
    never = never_loaded(report)
    if never:
        raise RegistryError(f"{artifact}: refused, vLLM never loaded it ({never}); "
                            f"run the eval where vLLM is installed, with eval.vllm.enabled: true")
    return m, report


def never_loaded(report: Report) -> str | None:
    """Why the report's vLLM smoke never ran (the reason it was skipped), or None when vLLM loaded the artifact."""
    return report.vllm_smoke.skipped


def _flat(d: dict, prefix: str = "") -> dict[str, str]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, f"{key}."))
        else:
            out[key] = json.dumps(v) if isinstance(v, (list, tuple)) else str(v)
    return out


def _metrics(m: Manifest, report: Report) -> dict[str, float]:
    p, s = report.perplexity, report.vllm_smoke
    out = {"ppl_fp16": p.fp16.ppl, "ppl": p.quantized.ppl, "ppl_delta": p.delta,
           "ppl_delta_pct": p.delta_pct, "ppl_windows": p.protocol.windows,
           "vllm_smoke_passed": float(bool(s.passed)),
           "artifact_bytes": sum(f.bytes for f in m.files.values())}
    d = report.distribution
    out.update({k: getattr(d, k) for k in ("kl_mean", "kl_median", "kl_p99", "top1")
                if d is not None and isinstance(getattr(d, k), (int, float))})
    lm = report.lm_eval
    for side in ("reference", "quantized"):
        scores = getattr(lm, side) if lm is not None else None
        for task, metrics in (scores.scores if scores else {}).items():
            out.update({f"lm_eval_{side}_{task}_{m}": v for m, v in metrics.items() if "stderr" not in m})
    for task, metrics in (lm.paired if lm is not None else {}).items():
        for metric, p in metrics.items():
            key = f"{task}_{metric}"
            out.update({f"lm_eval_delta_{key}": p.delta, f"lm_eval_delta_stderr_{key}": p.stderr,
                        f"lm_eval_delta_distinguishable_{key}": float(p.distinguishable)})
    for key in ("token_agreement", "load_s", "tokens_per_s"):
        if isinstance(getattr(s, key), (int, float)):
            out[f"vllm_{key}"] = getattr(s, key)
    out.update({f"quantize_{k}_s": v for k, v in (m.timings_s or {}).items()})
    return out


def register(artifact: Path, by_reference: bool | None = None, storage_uri: str | None = None,
             model_name: str | None = None, alias: str | None = None) -> dict:
    """Register a verified, passing artifact as a new model version -> {name, version, run_id, source}.

    by_reference: None = copy when the artifact is under COPY_LIMIT_BYTES (env QUANTIZE_REGISTRY_COPY_LIMIT),
    else record only its location (`storage_uri`, default the directory's file:// URI).
    """
    artifact = Path(artifact).resolve()
    m, report = check_artifact(artifact)
    size = sum(f.bytes for f in m.files.values())
    limit = int(os.environ.get("QUANTIZE_REGISTRY_COPY_LIMIT", COPY_LIMIT_BYTES))
    if by_reference is None:
        by_reference = size > limit or storage_uri is not None
    with tempfile.TemporaryDirectory(prefix=".register-") as snap:
        if not by_reference:  # copied and verified before the registry is locked: other writers wait less
            _snapshot(artifact, m, Path(snap))
        with opened(write=True) as (mlflow, client):
            res = _register(mlflow, client, artifact, m, report, storage_uri, Path(snap) if not by_reference
                            else None, model_name or m.artifact)
            if alias:
                client.set_registered_model_alias(res["name"], alias, str(res["version"]))
                res["alias"] = alias
        return res


def register_many(artifacts: list[Path], model_name: str | None, by_reference: bool | None = None,
                  storage_uri: str | None = None, alias: str | None = None, chosen: Path | None = None) -> list[dict]:
    """Register several artifacts as versions of one registered model (`model_name`; one artifact alone keeps
    its own name when None); `alias` goes to `chosen`'s version (the only artifact when there is one).
    Every artifact is checked before any is registered: a refused one leaves the registry unchanged."""
    _check_alias(alias)
    for artifact in artifacts:
        check_artifact(artifact)
    chosen = Path(chosen or artifacts[0]).resolve() if alias else None
    return [register(a, by_reference, storage_uri, model_name,
                     alias if chosen is not None and Path(a).resolve() == chosen else None) for a in artifacts]


def _check_alias(alias: str | None) -> None:
    if alias is not None and (not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_-]*", alias) or re.fullmatch(r"[vV]\d+", alias)
                              or alias == "latest"):
        raise RegistryError(f"alias {alias!r}: use a name of letters, digits, '_' and '-' that starts with a letter "
                            f"(MLflow reserves `latest` and v<number>), e.g. --alias champion")


def chosen(artifacts: list[Path], variant: str | None) -> Path:
    """The artifact an alias marks: the only one, or the one named `variant` (its directory name)."""
    if variant is None:
        if len(artifacts) > 1:
            names = [a.name for a in artifacts]
            raise RegistryError(f"--alias with {len(artifacts)} artifacts: say which version it marks with "
                                f"--variant NAME (one of {names}; make register ... VARIANT=NAME)")
        return artifacts[0]
    for a in artifacts:
        if a.name == variant:
            return a
    raise RegistryError(f"--variant {variant!r} is not one of the artifacts being registered "
                        f"({[a.name for a in artifacts]}){did_you_mean(variant, [a.name for a in artifacts])}")


def comparison_artifacts(out_root: Path, name: str) -> list[Path]:
    """Our artifact directories of `<out_root>/compare-<name>.json` (written by `compare`), in its order."""
    doc_path = child(out_root, f"compare-{name}.json", "--comparison")
    if not doc_path.is_file():
        found = sorted(p.stem.removeprefix("compare-") for p in Path(out_root).glob("compare-*.json"))
        raise RegistryError(f"no comparison {name!r} in {out_root} (no {doc_path.name}); run make compare first"
                            + (f" or use one of {found}" if found else ""))
    try:
        rows = json.loads(doc_path.read_text())["rows"]
        return [Path(r["artifact"]) for r in rows if not r.get("external")]  # other tools' rows: not ours to register
    except (ValueError, KeyError, TypeError) as e:
        raise RegistryError(f"{doc_path} is not a comparison written by `compare` ({type(e).__name__}: {e}); "
                            f"run make compare again") from None


def _register(mlflow, client, artifact: Path, m: Manifest, report: Report, storage_uri: str | None,
              snap: Path | None, name: str) -> dict:
    """One new version of `name` whose run holds the recipe, the report and `snap` (the verified copy; None
    registers the artifact by reference). Call it holding the writer's lock (registry_store.opened)."""
    r, by_reference = m.recipe, snap is None
    tags = {"base_model": m.model.spec, "method": r.method, "w_bit": str(r.w_bit),
            "group_size": m.group_text(), "format": m.format.name, "variant": m.artifact,
            "manifest_sha256": sha256_file(artifact / MANIFEST), "git_commit": str((m.git or {}).get("commit")),
            "artifact_path": str(artifact), "by_reference": str(by_reference).lower(),
            **{f"vllm_kernel_cc{cap}_tp{tp}": text  # pre-flight's deployability table, one tag per cell
               for cap, row in (m.deploy.kernels if m.deploy else {}).items() for tp, text in row.items()}}
    with mlflow.start_run(experiment_id=experiment_id(client), run_name=m.artifact) as run:
        params = _flat(r.to_json())
        items = list(params.items())
        for i in range(0, len(items), 90):  # MLflow caps a batch at 100 params
            mlflow.log_params(dict(items[i : i + 90]))
        mlflow.log_metrics(_metrics(m, report))
        mlflow.set_tags(tags)
        mlflow.log_dict(report.to_json(), "report.json")
        if by_reference:
            source = storage_uri or artifact.as_uri()
        else:
            mlflow.log_artifacts(str(snap), "model")
            source = f"{run.info.artifact_uri}/model"
    if not client.search_registered_models(filter_string=f"name = '{name}'"):
        what = (f"{r.method} w{r.w_bit} g{m.group_text()}" if name == m.artifact
                else "4-bit variants (one version each; tags variant, method, group_size)")
        try:
            client.create_registered_model(name, description=f"{what} of {m.model.spec}, made by quantize")
        except Exception as e:
            if not already_exists(e):
                raise
    mv = client.create_model_version(name, source=source, run_id=run.info.run_id, tags=tags)
    log.info("registered %s version %s (%s) in %s", name, mv.version, source, tracking_uri())
    return {"name": name, "version": int(mv.version), "run_id": run.info.run_id, "source": source,
            "tracking_uri": tracking_uri(), "variant": m.artifact, "group_size": r.q_group_size}


def resolve(uri: str, into: Path) -> Path:
    """`models:/<name>@<alias>` or `models:/<name>/<version>` -> a local directory holding that version's artifact,
    its manifest verified and equal to the one registered (the version's manifest_sha256 tag). The copy is
    downloaded through MLflow into `into` (a version registered by reference is read where it lives)."""
    name, alias, version = parse_models_uri(uri)
    db = tracking_uri().removeprefix("sqlite:///")
    if tracking_uri().startswith("sqlite:///") and not Path(db).is_file():  # reading must not create a registry
        raise RegistryError(f"no model registry at {db}: register a version first (make register ...), or set "
                            f"MLFLOW_TRACKING_URI to the registry that holds {name!r}")
    with opened() as (mlflow, client):
        mv = _model_version(client, name, alias, version)  # the alias is read once: the version is pinned
        local = Path(_download(mlflow, mv, into))
    if not (local / MANIFEST).is_file():
        raise RegistryError(f"{uri} (version {mv.version}, source {mv.source}) holds no {MANIFEST}; it was not "
                            f"registered by quantize")
    try:
        verify(local)
    except ArtifactError as e:
        raise RegistryError(f"{uri} (version {mv.version}, source {mv.source}): {e}") from None
    want = dict(mv.tags).get("manifest_sha256")
    if want and sha256_file(local / MANIFEST) != want:
        raise RegistryError(f"{uri} (version {mv.version}): {mv.source} holds another artifact than the one "
                            f"registered (manifest sha256 differs from the version's tag); register it again")
    log.info("%s -> version %s of %s, manifest verified (%s)", uri, mv.version, name, local)
    return local


def parse_models_uri(uri: str) -> tuple[str, str | None, str | None]:
    m = re.fullmatch(r"models:/([^/@]+)(?:@([A-Za-z0-9_-]+)|/(\d+))", uri)
    if not m:
        raise RegistryError(f"{uri!r} is not a registered version: write models:/<name>@<alias> (e.g. "
                            f"models:/smollm2-awq-sweep@champion) or models:/<name>/<version number>")
    return m.group(1), m.group(2), m.group(3)


def _model_version(client, name: str, alias: str | None, version: str | None):
    from mlflow.exceptions import MlflowException

    if not client.search_registered_models(filter_string=f"name = '{name}'"):
        known = [x.name for x in client.search_registered_models()]
        raise RegistryError(f"no registered model {name!r} in {tracking_uri()}{did_you_mean(name, known)} "
                            f"(make registry lists them)")
    try:
        return client.get_model_version_by_alias(name, alias) if alias else client.get_model_version(name, version)
    except MlflowException:
        have = client.get_registered_model(name)
        what = (f"alias @{alias}; its aliases: {sorted(have.aliases) or 'none'}" if alias
                else f"version {version}")
        raise RegistryError(f"registered model {name!r} has no {what}; set one with make register ... "
                            f"ALIAS=<alias>, or name a version (make registry lists them)") from None


def _download(mlflow, mv, into: Path) -> str:
    """The version's files as a local directory: its run's copy downloaded, or a file:// reference read in place."""
    if mv.source.startswith("file://"):
        local = Path(unquote(urlparse(mv.source).path))
        if dict(mv.tags).get("by_reference") == "true" and local.is_dir():  # the artifact where it lives
            return str(local)
    return mlflow.artifacts.download_artifacts(artifact_uri=f"models:/{mv.name}/{mv.version}", dst_path=str(into))


def versions(name: str | None = None) -> list[dict]:
    """Every registered version (of `name`, or all) with its tags and metrics, newest first."""
    rows, aliases = [], {}
    with opened() as (_, client):
        for mv in client.search_model_versions(f"name = '{name}'" if name else ""):
            run = client.get_run(mv.run_id)
            if mv.name not in aliases:  # search results carry no aliases: the registered model holds them
                aliases[mv.name] = dict(client.get_registered_model(mv.name).aliases or {})
            rows.append({"name": mv.name, "version": int(mv.version), "created": mv.creation_timestamp,
                         "source": mv.source,
                         "aliases": sorted(a for a, v in aliases[mv.name].items() if str(v) == str(mv.version)),
                         "serve": f"models:/{mv.name}/{mv.version}", "tags": dict(mv.tags),
                         "metrics": dict(run.data.metrics)})
    return sorted(rows, key=lambda x: (x["name"], -x["version"]))


def table(rows: list[dict]) -> str:
    head = (f"{'model':32s} {'ver':>3s} {'method':6s} {'g':>4s} {'ppl':>9s} {'Δ%':>7s} {'KL':>7s} {'top1':>6s} "
            f"{'smoke':6s} {'aliases':10s} serve with")
    lines = [head, "-" * len(head)]
    for x in rows:
        mt, tg = x["metrics"], x["tags"]
        lines.append(f"{x['name']:32s} {x['version']:>3d} {tg.get('method', '?'):6s} {tg.get('group_size', '?'):>4s} "
                     f"{mt.get('ppl', float('nan')):9.4f} {mt.get('ppl_delta_pct', float('nan')):+7.2f} "
                     f"{mt.get('kl_mean', float('nan')):7.4f} {mt.get('top1', float('nan')):6.3f} "
                     f"{'ok' if mt.get('vllm_smoke_passed') else 'FAIL':6s} "
                     f"{' '.join('@' + a for a in x.get('aliases', [])) or '-':10s} make serve MODEL={x['serve']}")
        lines.append(f"{'':37s}source {x['source']}")
    return "\n".join(lines) if rows else f"no registered versions in {tracking_uri()}"
