"""The manifest `tandem_bundle.json`: every other file's size and SHA-256, the format version, and provenance.

Contract:
- The manifest is also the marker that says "this folder is a Tandem bundle": only such a folder may be replaced
  (`write.check_bundle_target`).
- `write_manifest` lists every regular file of the folder (written last, after every file it lists);
  `read_manifest` returns its entries (None without a manifest; `BundleError` for an unknown format or an entry
  that is not a plain file name); `verify_bundle` checks every entry's size and SHA-256 and that every file the
  loader reads is listed; `manifest_mismatch` says why one file does not match its entry.
- `read_source` reads back the provenance `save_bundle(..., source=...)` recorded (None when there is none).
- `sha256_file` is the one file-hashing helper (lt_plugins' checkpoint manifest uses it too).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path

from shared_model.bundle.layout import (
    CONFIG_FILE,
    INDEX_FILE,
    MANIFEST_FILE,
    MANIFEST_FORMAT,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
    plain_name,
    read_json,
    weight_files,
    write_json,
)
from shared_model.errors import BundleError


# ------------------------------------------------------------------------------------------------ manifest
def sha256_file(path: str | Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def manifest_mismatch(
    root: Path, entries: Mapping[str, Mapping[str, object]], check_hashes: bool = True
) -> tuple[Path, str] | None:
    """The first file (in name order) that differs from its manifest entry `{"bytes", "sha256"}`, with how it
    differs: "missing", "size" or "sha256". None when every listed file matches. Shared by the bundle manifest
    and the checkpoint manifest (each names the problem in its own words)."""
    for name, meta in sorted(entries.items()):
        path = root / name
        if not path.is_file():
            return path, "missing"
        if path.stat().st_size != meta["bytes"]:
            return path, "size"
        if check_hashes and sha256_file(path) != meta["sha256"]:
            return path, "sha256"
    return None


def write_manifest(folder: Path, source: Mapping[str, object] | None = None) -> None:
    """Record every file of a freshly written bundle folder (written last, before the folder is renamed), with
    the optional provenance `source` (JSON values)."""
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.name != MANIFEST_FILE)
    entries = {p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in files}
    data: dict[str, object] = {"format": MANIFEST_FORMAT, "files": entries}
    if source is not None:
        data["source"] = dict(source)
    write_json(folder / MANIFEST_FILE, data)


def read_source(folder: str | Path) -> dict | None:
    """The provenance object of a folder's tandem_bundle.json; None without a manifest or without a source."""
    if read_manifest(folder) is None:  # validates the manifest
        return None
    source = read_json(Path(folder) / MANIFEST_FILE).get("source")
    return source if isinstance(source, dict) else None


def read_manifest(folder: str | Path) -> dict[str, dict] | None:
    """The `files` table of a folder's tandem_bundle.json, None when it has none; a malformed one is refused."""
    path = Path(folder) / MANIFEST_FILE
    if not path.exists() and not path.is_symlink():
        return None
    data = read_json(path)
    if data.get("format") != MANIFEST_FORMAT:
        raise BundleError(f"{path}: format is {data.get('format')!r}, this Tandem reads format {MANIFEST_FORMAT}")
    files = data.get("files")
    if not isinstance(files, dict):
        raise BundleError(f"{path}: 'files' must be an object of file name → {{bytes, sha256}}")
    for name, meta in files.items():
        if not plain_name(name) or name == MANIFEST_FILE:
            raise BundleError(f"{path}: files: {name!r} is not a plain file name of this folder")
        ok = isinstance(meta, dict) and isinstance(meta.get("bytes"), int) and isinstance(meta.get("sha256"), str)
        if not ok:
            raise BundleError(f"{path}: files: {name} must hold an integer 'bytes' and a string 'sha256'")
    return files


def verify_bundle(folder: str | Path) -> None:
    """Check every file against the folder's manifest (size, then SHA-256); every file the loader reads must be
    listed. BundleError naming the file on the first mismatch, or when there is no manifest."""
    folder = Path(folder)
    files = read_manifest(folder)
    if files is None:
        raise BundleError(
            f"{folder / MANIFEST_FILE}: missing, so there is no manifest to verify checksums against "
            "(bundles written by Tandem's save_bundle have one; load without checksum verification otherwise)"
        )
    bad = manifest_mismatch(folder, files)
    if bad is not None:
        path, how = bad
        if how == "missing":
            raise BundleError(f"{path}: listed in {MANIFEST_FILE} but missing")
        if how == "size":
            raise BundleError(
                f"{path}: {path.stat().st_size} bytes, {MANIFEST_FILE} says {files[path.name]['bytes']} "
                "(corrupt or replaced)"
            )
        raise BundleError(f"{path}: SHA-256 does not match {MANIFEST_FILE} (corrupt or altered file)")
    read = [folder / CONFIG_FILE, folder / INDEX_FILE, folder / TOKENIZER_FILE, folder / TOKENIZER_CONFIG_FILE]
    read += weight_files(folder)  # the very paths the loader reads (a shard outside the folder is refused there)
    unlisted = [p for p in read if p.is_file() and (p.parent != folder or p.name not in files)]
    if unlisted:
        raise BundleError(f"{unlisted[0]}: not listed in {MANIFEST_FILE}, so its checksum cannot be verified")
