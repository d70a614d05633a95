"""A public dataset's rows, from a local file in the dataset's own columns or from the hub: what `opd prompt-pool`
and `opd suite build` read their sources with.

No machine of this project reaches the hub, so a local file (jsonl, json or parquet, downloaded elsewhere) must
always work; the hub is read through `datasets`, imported only then, at the commit the hub names at that moment,
and that commit is returned so a card can pin what was read.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from opd.errors import OpdError


def read_file_rows(path: str, command: str) -> list[dict]:
    """The rows of a local file by its suffix: .parquet, .json (an array of rows, or one object of columns as
    pandas' `to_json` writes), anything else JSONL; `command` prefixes the one-line error, which says which format
    was expected."""
    file = Path(path)
    if not file.is_file():
        raise OpdError(f"{command}: {path} not found")
    kind = {".parquet": "a parquet file", ".json": "a JSON array of rows or an object of columns"}.get(
        file.suffix, "JSONL, one JSON object per line")
    try:
        if file.suffix == ".parquet":
            import pyarrow.parquet as pq

            return pq.read_table(file).to_pylist()
        text = file.read_text()
        return _json(text) if file.suffix == ".json" else _jsonl(text)
    except (ValueError, OSError) as exc:  # JSON, Unicode and Arrow's ArrowInvalid errors are ValueErrors
        raise OpdError(f"{command}: {path}: unreadable ({str(exc).strip().splitlines()[0]}); expected {kind}") from None


def _json(text: str) -> list:
    """An array of rows as it is; an object of columns ({column: {index: value}} or {column: [values]}, pandas'
    `to_json` default and `orient="list"`) turned into rows in its index order."""
    data = json.loads(text)
    if isinstance(data, list):
        return data
    columns = list(data.values()) if isinstance(data, dict) else []
    if not columns or not all(isinstance(c, dict | list) for c in columns):
        raise ValueError("neither an array of rows nor an object whose values are columns")
    index = list(columns[0]) if isinstance(columns[0], dict) else range(len(columns[0]))
    if any(len(c) != len(index) for c in columns):
        raise ValueError("an object of columns of different lengths")
    return [{name: column[i] if isinstance(column, list) else column.get(i) for name, column in data.items()}
            for i in index]


def _jsonl(text: str) -> list:
    """One row per non-blank line; an error names the file's line, not the position inside that line."""
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"line {number}: {exc.msg}") from None
    return rows


def read_hub_rows(dataset: str, config: str | None, split: str, command: str, fix: str) -> tuple[list[dict], str]:
    """(rows, "hub:<id>@<commit>"): read at the commit the hub names now. `fix` is the offline way out, named in
    the one-line error when `datasets` is missing or the hub cannot be reached."""
    try:
        import datasets
        from huggingface_hub import HfApi
    except ImportError:
        raise OpdError(f"{command}: no local file for {dataset} and no `datasets` library to fetch it "
                       f"(pip install datasets, or {fix})") from None
    try:
        commit = HfApi().dataset_info(dataset).sha
        configs = [config]
        if dataset == "EleutherAI/hendrycks_math":  # one hub config per subject
            configs = datasets.get_dataset_config_names(dataset, revision=commit)
        parts = [datasets.load_dataset(dataset, c, split=split, revision=commit) for c in configs]
    except Exception as exc:  # network, auth or a moved dataset: one line, with the offline way out
        raise OpdError(f"{command}: reading {dataset} from the hub failed ({str(exc).strip().splitlines()[0]}); "
                       f"download it elsewhere and {fix}") from None
    return [row for part in parts for row in part], f"hub:{dataset}@{commit}"


def sha256_of(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()
