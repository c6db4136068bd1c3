"""docs/config.md is what scripts/config_reference.py generates from the code: a new `inferscale serve` flag, a
ServiceConfig field, a limit, a chart value or an environment variable that the committed file lacks fails here,
named. Also, independently of the script's own scan: every environment variable the code reads (a plain regex over
the source) and every error reason the services raise is in the document, with its meaning. No Ray, no engine,
no model: the script imports the modules that define the settings and reads sources (about 5 s)."""
from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "config_reference.py"
DOC = REPO / "docs" / "config.md"
SCANNED = ("inferscale_core", "services", "inferscale_client")
REGENERATE = "python scripts/config_reference.py > docs/config.md"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("config_reference", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["config_reference"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def generated(script) -> str:
    return script.render()


def _section(text: str, title: str) -> str:
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else None]


def _sources() -> dict[str, str]:
    out = {}
    for top in SCANNED:
        for path in sorted((REPO / top).rglob("*.py")):
            if "_generated" not in path.parts and "__pycache__" not in path.parts:
                out[path.relative_to(REPO).as_posix()] = path.read_text()
    return out


def test_docs_config_md_is_what_the_script_generates(script, generated):
    committed = DOC.read_text()
    assert committed == generated, script.stale_report(committed, generated)


def test_the_check_flag_names_what_is_missing(script, generated, tmp_path, monkeypatch, capsys):
    """--check exits 1 and names the row the file lacks (here: a serve flag deleted from a copy of the doc)."""
    stale = tmp_path / "config.md"
    stale.write_text("".join(ln for ln in generated.splitlines(keepends=True) if "`--local-mooncake`" not in ln))
    monkeypatch.setattr(script, "DOC", stale)
    monkeypatch.setattr(script, "render", lambda: generated)  # the same text, not generated a second time
    assert script.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert "in the code, not in docs/config.md" in err and "--local-mooncake" in err and REGENERATE in err
    stale.write_text(generated)
    assert script.main(["--check"]) == 0


def test_the_sections_hold_what_the_code_defines(generated):
    """Spot checks against the code itself, so a broken generator cannot pass by writing an empty table."""
    import dataclasses

    from inferscale_server.app import ServiceConfig
    from inferscale_server.limits import Limits

    flags = _section(generated, "`inferscale serve` flags")
    for flag in ("--redis-url", "--kv-dir", "--local-mooncake", "--insecure-no-auth", "--max-model-len"):
        assert f"`{flag}" in flags, flag
    settings = _section(generated, "Application settings (`ServiceConfig`)")
    for f in dataclasses.fields(ServiceConfig):
        assert f"| `{f.name}` |" in settings, f.name
    limits = _section(generated, "API limits (`Limits`)")
    for f in dataclasses.fields(Limits):
        assert f"| `{f.name}` |" in limits, f.name
    assert "| `max_k` | `int` | `200` |" in limits
    chart = _section(generated, "Helm chart values")
    for key in ("redis.maxmemory", "model.admissionQueueFactor", "kvStore.diskBudgetGiB", "mooncake.segmentGiB",
                "deployments.EngineReplica.numGpus", "ray.gpuWorkers.nodeSelector.nvidia\\.com/gpu\\.present"):
        assert f"| `{key}` |" in chart, key
    for title in ("Supported / not supported", "Troubleshooting", "Upgrade notes"):
        assert f"\n## {title}\n" in generated, title


def test_every_environment_variable_the_code_reads_is_in_the_doc(script, generated):
    """A plain regex over the source (literal names, and names held in a module constant), not the script's AST
    scan: what either finds must be in the doc's environment section, described."""
    sources = _sources()
    literal = re.compile(r"""os\.(?:environ\.get|environ\.setdefault|environ\.pop|getenv)\(\s*["']([A-Z][A-Z0-9_]*)["']"""
                         r"""|os\.environ\[\s*["']([A-Z][A-Z0-9_]*)["']\s*\]""")
    through_name = re.compile(r"os\.(?:environ\.get|environ\.setdefault|getenv)\(\s*([A-Z][A-Z0-9_]*)\b"
                              r"|os\.environ\[\s*([A-Z][A-Z0-9_]*)\s*\]")
    constants: dict[str, str] = {}
    for text in sources.values():
        for m in re.finditer(r'^([A-Z][A-Z0-9_]*)\s*=\s*"([A-Z][A-Z0-9_]*)"', text, re.M):
            constants.setdefault(m.group(1), m.group(2))
        for m in re.finditer(r'^([A-Z][A-Z0-9_]*),\s*([A-Z][A-Z0-9_]*)\s*=\s*"([A-Z0-9_]+)",\s*"([A-Z0-9_]+)"', text,
                             re.M):
            constants.setdefault(m.group(1), m.group(3))
            constants.setdefault(m.group(2), m.group(4))
    read: dict[str, set[str]] = {}
    for path, text in sources.items():
        for m in literal.finditer(text):
            read.setdefault(m.group(1) or m.group(2), set()).add(path)
        for m in through_name.finditer(text):
            name = constants.get(m.group(1) or m.group(2))
            if name:
                read.setdefault(name, set()).add(path)
    assert {"INFERSCALE_CACHE", "INFERSCALE_TOKEN", "INFERSCALE_TARGET", "INFERSCALE_REDIS_PASSWORD",
            "INFERSCALE_GRPC_HOST", "INFERSCALE_ENGINE_KV_BUDGET_BYTES", "POD_IP"} <= set(read)  # the regex works
    scanned, _ = script.env_reads()
    assert set(read) <= set(scanned), f"the script's scan misses {sorted(set(read) - set(scanned))}"
    section = _section(generated, "Environment variables")
    missing = sorted(name for name in set(read) | set(scanned) if f"| `{name}` |" not in section)
    assert not missing, f"read by the code, not in docs/config.md's environment table: {missing}; {REGENERATE}"
    for name, files in read.items():
        row = next(ln for ln in section.splitlines() if ln.startswith(f"| `{name}` |"))
        assert all(f"`{f}`" in row for f in files), (name, files, row)
    undescribed = [ln.split("|")[1].strip() for ln in section.splitlines() if "(not described" in ln]
    assert not undescribed, f"environment variables without a meaning: {undescribed} (ENV_MEANINGS in {SCRIPT.name})"


def test_every_error_reason_is_in_the_troubleshooting_section(generated):
    raised = set()
    for path, text in _sources().items():
        if path.startswith("services/"):
            for m in re.finditer(r'reason="([A-Z][A-Z0-9_]+)"(?: if \w+ else "([A-Z][A-Z0-9_]+)")?', text):
                raised.update(n for n in m.groups() if n)
    assert {"ENGINE_AT_CAPACITY", "CALLER_RATE", "CALLER_CONCURRENCY", "EXTRACTION_QUEUE_FULL",
            "REGISTRY_FULL"} <= raised
    section = _section(generated, "Troubleshooting")
    missing = sorted(r for r in raised if f"| `{r}` |" not in section)
    assert not missing, f"raised by services/, not in docs/config.md: {missing}; {REGENERATE}"
    assert "(not described" not in section, "a reason without a meaning: REASON_MEANINGS in the script"


def test_the_readme_and_deploy_guide_link_the_reference():
    assert "docs/config.md" in (REPO / "README.md").read_text()
    assert "CHANGELOG.md" in (REPO / "README.md").read_text()
    assert "(config.md)" in (REPO / "docs" / "deploy.md").read_text()
