"""Ed25519 signing of bundles: keygen, sign, and the audit's signature checks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

import mxdb.cli  # noqa: F401
from mxdb.audit import AuditOptions, audit_paths
from mxdb.cli.app import cli
from mxdb.evidence.synthetic import synthetic_bundle


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("keys")
    for name in ("alice", "mallory"):
        res = CliRunner().invoke(cli, ["keygen", "--out", str(d / name / "key.pem")])
        assert res.exit_code == 0, res.output
    (d / "trusted").mkdir()
    shutil.copy(d / "alice" / "key.pem.pub", d / "trusted" / "alice.pub")
    assert (d / "alice" / "key.pem").stat().st_mode & 0o777 == 0o600
    return d


@pytest.fixture
def bundle(tmp_path: Path) -> Path:
    return synthetic_bundle(tmp_path / "b", groups=1, runs_per_group=4)


def checks(bundle: Path, keys: Path | None) -> list[str]:
    opts = AuditOptions(trusted_keys=keys / "trusted" if keys else None)
    return [f.check for f in audit_paths([bundle], opts).findings]


def sign(bundle: Path, key: Path) -> None:
    res = CliRunner().invoke(cli, ["sign", str(bundle), "--key", str(key)])
    assert res.exit_code == 0, res.output


def test_signed_bundle_passes_with_trusted_key(bundle: Path, keys: Path) -> None:
    sign(bundle, keys / "alice" / "key.pem")
    assert checks(bundle, keys) == []
    assert checks(bundle, None) == []  # a present signature is checked without keys too
    res = CliRunner().invoke(cli, ["audit", str(bundle), "--trusted-keys", str(keys / "trusted")])
    assert res.exit_code == 0, res.output


def test_missing_signature(bundle: Path, keys: Path) -> None:
    assert checks(bundle, keys) == ["signature.missing"]


def test_untrusted_signature(bundle: Path, keys: Path) -> None:
    sign(bundle, keys / "mallory" / "key.pem")
    assert checks(bundle, keys) == ["signature.untrusted"]


def test_wrong_signature_bytes(bundle: Path, keys: Path) -> None:
    sign(bundle, keys / "alice" / "key.pem")
    (sig,) = (bundle / "signatures").iterdir()
    doc = json.loads(sig.read_text())
    doc["signature"] = doc["signature"][:-8] + ("A" * 6 + "==")
    sig.write_text(json.dumps(doc))
    assert checks(bundle, keys) == ["signature.invalid"]


def test_signature_stops_the_audit_before_parsing(bundle: Path, keys: Path) -> None:
    sign(bundle, keys / "alice" / "key.pem")
    (bundle / "summary.json").write_text("{ truncated")
    (bundle / "manifest.json").write_text((bundle / "manifest.json").read_text() + " ")
    # the manifest changed after signing: only the signature is reported, nothing parsed
    assert checks(bundle, keys) == ["signature.invalid"]
    assert "json.invalid" in checks(bundle, None)


def test_duplicated_signature(bundle: Path, keys: Path) -> None:
    sign(bundle, keys / "alice" / "key.pem")
    (sig,) = (bundle / "signatures").iterdir()
    shutil.copy(sig, bundle / "signatures" / "copy.sig")
    assert "signature.duplicate" in checks(bundle, keys)


def test_keygen_refuses_to_overwrite(keys: Path) -> None:
    res = CliRunner().invoke(cli, ["keygen", "--out", str(keys / "alice" / "key.pem")])
    assert res.exit_code == 2 and "refusing to overwrite" in res.stderr
