"""Ed25519 signatures of evidence bundles (optional for a bundle, checked when present).

A signature covers the SHA-256 of the exact bytes of ``manifest.json`` (which holds the
SHA-256 of every other file and their digest), so it covers the whole bundle.  The signed
message is ``b"mxdb-manifest-sha256:" + <hex digest>``.  Signatures live in
``signatures/<key_id>.sig`` (outside the manifest), ``key_id`` being the first 16 hex digits
of the SHA-256 of the raw 32-byte public key.

Keys: ``keygen`` writes a private key (PKCS#8 PEM, mode 0600) and ``<file>.pub`` (PEM).
``--trusted-keys DIR`` holds ``*.pub`` files.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
from pathlib import Path

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from mxdb.audit.findings import Finding
from mxdb.errors import InvalidInputError, NotFoundError, UsageError
from mxdb.evidence.files import MANIFEST_NAME, SIGNATURES_DIR, atomic_write, dumps
from mxdb.evidence.models import SignatureDoc
from mxdb.fileio import MAX_SMALL_BYTES, load_json, read_bytes

PREFIX = b"mxdb-manifest-sha256:"


def _raw(pub: Ed25519PublicKey) -> bytes:
    return pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def key_id(pub: Ed25519PublicKey) -> str:
    return hashlib.sha256(_raw(pub)).hexdigest()[:16]


def keygen(out: Path) -> tuple[Path, Path]:
    """Write a new key pair: ``out`` (private PEM, 0600) and ``out.pub``; returns both paths."""
    out = Path(out)
    pub_path = out.with_name(out.name + ".pub")
    if out.exists() or pub_path.exists():
        raise UsageError(f"refusing to overwrite {out} or {pub_path}; choose another --out")
    key = Ed25519PrivateKey.generate()
    priv = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    pub = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(priv)
        fh.flush()
        os.fsync(fh.fileno())
    atomic_write(pub_path, pub)
    return out, pub_path


def _load_private(path: Path) -> Ed25519PrivateKey:
    try:
        if not Path(path).exists():
            raise NotFoundError(f"no key file {path}; make one with mxdb keygen --out FILE")
        data = read_bytes(path, limit=MAX_SMALL_BYTES, what="key file")
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise InvalidInputError(f"{path} is not an unencrypted PEM private key: {exc}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise InvalidInputError(f"{path} holds a {type(key).__name__}; an Ed25519 key is needed")
    return key


def load_trusted_keys(directory: Path) -> dict[str, Ed25519PublicKey]:
    """The Ed25519 public keys (``*.pub``, PEM) of a directory, by key id."""
    directory = Path(directory)
    if not directory.is_dir():
        raise UsageError(f"--trusted-keys {directory} is not a directory of *.pub files")
    keys: dict[str, Ed25519PublicKey] = {}
    for p in sorted(directory.glob("*.pub")):
        try:
            pub = serialization.load_pem_public_key(
                read_bytes(p, limit=MAX_SMALL_BYTES, what="trusted key")
            )
        except (ValueError, UnsupportedAlgorithm) as exc:
            raise InvalidInputError(f"trusted key {p} is not a PEM public key: {exc}") from None
        if not isinstance(pub, Ed25519PublicKey):
            raise InvalidInputError(f"trusted key {p} is not an Ed25519 key")
        keys[key_id(pub)] = pub
    if not keys:
        raise UsageError(f"--trusted-keys {directory} holds no *.pub key; add the signer's key")
    return keys


def manifest_sha256(bundle: Path) -> str:
    path = Path(bundle) / MANIFEST_NAME
    if not path.is_file():
        raise NotFoundError(f"no {MANIFEST_NAME} in {bundle}; sign a finished evidence bundle")
    return hashlib.sha256(path.read_bytes()).hexdigest()


def sign_bundle(bundle: Path, key_file: Path) -> Path:
    """Sign a bundle's manifest; writes (or replaces) ``signatures/<key_id>.sig``."""
    key = _load_private(key_file)
    digest = manifest_sha256(bundle)
    pub = key.public_key()
    doc = SignatureDoc(
        key_id=key_id(pub),
        public_key=base64.b64encode(_raw(pub)).decode(),
        manifest_sha256=digest,
        signature=base64.b64encode(key.sign(PREFIX + digest.encode())).decode(),
    )
    path = Path(bundle) / SIGNATURES_DIR / f"{doc.key_id}.sig"
    atomic_write(path, dumps(doc.to_json_dict()))
    return path


def check_signatures(
    bundle: Path, trusted: dict[str, Ed25519PublicKey] | None, *, label: str
) -> list[Finding]:
    """Verify every signature of a bundle; with ``trusted`` keys, require one by a trusted key.

    Reads only the signature files and the manifest's bytes (nothing is parsed before this).
    """
    from mxdb.schemas import validator

    findings: list[Finding] = []

    def add(check: str, file: str, field: str, expected: str, found: str, msg: str) -> None:
        findings.append(Finding(check, f"{label}/{file}", field, expected, found, msg))

    sig_dir = Path(bundle) / SIGNATURES_DIR
    sig_files = (
        sorted(p for p in sig_dir.iterdir() if p.name.endswith(".sig") and not p.is_symlink())
        if sig_dir.is_dir() and not sig_dir.is_symlink()
        else []
    )
    mpath = Path(bundle) / MANIFEST_NAME
    actual = (
        hashlib.sha256(mpath.read_bytes()).hexdigest()
        if mpath.is_file() and not mpath.is_symlink()
        else ""
    )
    seen: dict[str, str] = {}
    good: set[str] = set()
    val = validator("signature")
    for p in sig_files:
        rel = f"{SIGNATURES_DIR}/{p.name}"
        try:
            doc = load_json(p, what="signature file", limit=MAX_SMALL_BYTES)
            if not isinstance(doc, dict) or (val is not None and not val.is_valid(doc)):
                raise ValueError("not an mxdb.signature document")
            raw = base64.b64decode(doc["public_key"], validate=True)
            sig = base64.b64decode(doc["signature"], validate=True)
            pub = Ed25519PublicKey.from_public_bytes(raw)
        except (ValueError, KeyError, binascii.Error, InvalidInputError) as exc:
            add(
                "signature.malformed",
                rel,
                "",
                "an mxdb.signature document",
                str(exc)[:120],
                "signature file cannot be read",
            )
            continue
        kid = key_id(pub)
        if kid != doc["key_id"] or p.name != f"{kid}.sig":
            add(
                "signature.malformed",
                rel,
                "key_id",
                f"{kid} (and file {kid}.sig)",
                f"{doc['key_id']} in {p.name}",
                "key id does not belong to the public key",
            )
        if kid in seen:
            add(
                "signature.duplicate",
                rel,
                "key_id",
                "one signature per key",
                f"also {seen[kid]}",
                f"key {kid} signed this bundle twice",
            )
            continue
        seen[kid] = rel
        if doc["manifest_sha256"] != actual:
            add(
                "signature.invalid",
                rel,
                "manifest_sha256",
                actual or "a manifest.json",
                doc["manifest_sha256"],
                "signature is for another manifest (bundle changed)",
            )
            continue
        if trusted is not None and kid in trusted and _raw(trusted[kid]) != raw:
            add(
                "signature.invalid",
                rel,
                "public_key",
                "the trusted key",
                "another key",
                "public key differs from the trusted key of the same id",
            )
            continue
        try:
            pub.verify(sig, PREFIX + actual.encode())
        except InvalidSignature:
            add(
                "signature.invalid",
                rel,
                "signature",
                f"a valid Ed25519 signature by {kid}",
                "a signature that does not verify",
                "signature does not verify",
            )
            continue
        good.add(kid)
    if trusted is not None and not findings and not (good & set(trusted)):
        if not sig_files:
            add(
                "signature.missing",
                SIGNATURES_DIR,
                "",
                "a signature by a trusted key",
                "no signature",
                "bundle is not signed",
            )
        else:
            add(
                "signature.untrusted",
                SIGNATURES_DIR,
                "key_id",
                f"one of {sorted(trusted)}",
                ", ".join(sorted(good)) or "none",
                "bundle is signed only by untrusted keys",
            )
    return findings
