"""docs/operations.md against the code: it lists exactly the ``HOTPOOL_*`` variables hotpool
reads, each with its true default, and exactly the metrics the control plane exports, each
with its type and labels. A setting or metric added without a line there fails here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from deploy_files import REPO, SETTINGS_PY, hotpool_env_names, settings_names

from hotpool.settings import Settings, load_settings

DOC = REPO / "docs" / "operations.md"
METRICS_PY = REPO / "platform" / "metrics.py"
CODE = re.compile(r"`([^`]*)`")
CONSTRUCTORS = {
    "Counter": "counter",
    "CounterMetricFamily": "counter",
    "Gauge": "gauge",
    "GaugeMetricFamily": "gauge",
    "Histogram": "histogram",
    "Summary": "summary",
}


def section(title: str) -> str:
    """The text of the ``## title`` section."""
    text = DOC.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else None]


def tables(text: str) -> list[list[list[str]]]:
    """Each markdown table of ``text`` as rows of cells, header and rule left out."""
    found: list[list[list[str]]] = []
    rows: list[list[str]] = []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif rows:
            found.append(rows[2:])
            rows = []
    return found


def first_code(cell: str) -> str:
    match = CODE.match(cell)
    assert match, f"expected `...` at the start of {cell!r}"
    return match.group(1)


def settings_rows() -> dict[str, str]:
    """Setting name -> its default cell, from the first table of the Settings section."""
    settings_table = tables(section("Settings"))[0]
    return {first_code(row[0]): row[1] for row in settings_table}


def test_the_settings_tables_list_exactly_what_hotpool_reads() -> None:
    settings_tables = tables(section("Settings"))
    assert set(settings_rows()) == settings_names()
    # The second table: variables read outside settings.py (the CPU kernels').
    others = {first_code(row[0]) for row in settings_tables[1]}
    assert others == hotpool_env_names() - settings_names()


def settings_fields() -> dict[str, str]:
    """Setting name -> the Settings field it fills, from ``field=...("HOTPOOL_X"...)``
    keywords of settings.py (a name found in no keyword is its field's upper-case twin)."""
    fields: dict[str, str] = {}
    for node in ast.walk(ast.parse(SETTINGS_PY.read_text())):
        if isinstance(node, ast.keyword) and node.arg:
            for sub in ast.walk(node.value):
                if isinstance(sub, ast.Constant) and sub.value in settings_names():
                    fields[str(sub.value)] = node.arg
    for name in settings_names() - set(fields):
        fields[name] = name.removeprefix("HOTPOOL_").lower()
    assert set(fields.values()) <= set(Settings.__dataclass_fields__)
    return fields


def test_documented_defaults_are_the_defaults(tmp_path: Path) -> None:
    home = str(tmp_path)
    fields = settings_fields()
    checked = 0
    for name, cell in settings_rows().items():
        if cell.startswith("unset"):
            # An unset setting leaves its field empty: hotpool decides at run time.
            assert getattr(load_settings({}), fields[name]) is None, name
            continue
        default = first_code(cell)
        # Setting the documented default explicitly must change nothing.
        base = {} if name == "HOTPOOL_HOME" else {"HOTPOOL_HOME": home}
        explicit = {**base, name: default.replace("$HOTPOOL_HOME", home)}
        assert load_settings(explicit) == load_settings(base), f"{name}: `{default}`"
        checked += 1
    assert checked >= 20


def exported_metrics() -> dict[str, tuple[str, list[str]]]:
    """Name -> (type, labels) of every metric platform/metrics.py defines, as Prometheus
    shows it (counters with ``_total``)."""
    found: dict[str, tuple[str, list[str]]] = {}
    for node in ast.walk(ast.parse(METRICS_PY.read_text())):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        kind = CONSTRUCTORS.get(node.func.id)
        if kind is None or not node.args or not isinstance(node.args[0], ast.Constant):
            continue
        name = str(node.args[0].value)
        labels_node = next((k.value for k in node.keywords if k.arg == "labels"), None)
        if labels_node is None and len(node.args) > 2:
            labels_node = node.args[2]
        labels = ast.literal_eval(labels_node) if labels_node is not None else []
        found[name + ("_total" if kind == "counter" else "")] = (kind, list(labels))
    return found


def test_every_metric_is_explained() -> None:
    exported = exported_metrics()
    assert "hotpool_requests_total" in exported and len(exported) >= 20
    (table,) = tables(section("Metrics"))
    documented = {
        first_code(row[0]): (row[1], [label.strip() for label in row[2].split(",") if label])
        for row in table
    }
    assert documented == exported
    for row in table:
        assert len(row[3]) > 20, f"{row[0]} needs a real explanation"
