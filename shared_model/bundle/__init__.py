"""Weight bundles: a Hugging Face–compatible folder written and read by Tandem, the only hand-off from training to
serving.

A bundle is `config.json`, `model.safetensors` (or shards with `model.safetensors.index.json`), the tokenizer files,
`generation_config.json` and Tandem's manifest `tandem_bundle.json` (every other file's size and SHA-256; also the
marker that says "this folder is a Tandem bundle"). The package, by job (each module states its contract):

- `layout`: the file names, the dtype names, reading a folder's config, dtype and weight files;
- `manifest`: the manifest (write, read, verify, provenance) and `sha256_file`;
- `checks`: the tensor, finite-value and tokenizer checks a bundle's contents get;
- `read`: `load_bundle` and `FolderTensors` (one tensor at a time);
- `write`: `save_bundle` (atomic) and `check_bundle_target` (what may be replaced).

Imports go one way: layout ← manifest, checks ← read, write; this file re-exports the names other packages use.
"""

from shared_model.bundle.checks import tokenizer_id_bound
from shared_model.bundle.layout import (
    COMPILE_CACHE_FOLDER,
    CONFIG_FILE,
    DEFAULT_MAX_SHARD_BYTES,
    DTYPES,
    INDEX_FILE,
    MANIFEST_FILE,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
    WEIGHTS_FILE,
    dtype_name,
    parse_dtype,
    read_config,
)
from shared_model.bundle.manifest import (
    manifest_mismatch,
    read_manifest,
    read_source,
    sha256_file,
    write_manifest,
)
from shared_model.bundle.read import Bundle, FolderTensors, load_bundle, read_state_dict
from shared_model.bundle.write import check_bundle_target, plan_shards, replace_dir, save_bundle

__all__ = [
    "COMPILE_CACHE_FOLDER",
    "CONFIG_FILE",
    "DEFAULT_MAX_SHARD_BYTES",
    "DTYPES",
    "INDEX_FILE",
    "MANIFEST_FILE",
    "TOKENIZER_CONFIG_FILE",
    "TOKENIZER_FILE",
    "WEIGHTS_FILE",
    "Bundle",
    "FolderTensors",
    "check_bundle_target",
    "dtype_name",
    "load_bundle",
    "manifest_mismatch",
    "parse_dtype",
    "plan_shards",
    "read_config",
    "read_manifest",
    "read_source",
    "read_state_dict",
    "replace_dir",
    "save_bundle",
    "sha256_file",
    "tokenizer_id_bound",
    "write_manifest",
]
