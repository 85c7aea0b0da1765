"""Environment fingerprints: collect the current one, compare two, load a recorded one.

A fingerprint names everything that can change a kernel config's speed or
correctness (DESIGN section 6).  On a machine without a GPU, ``collect`` fills
what it can know from installed distributions (versions via
``importlib.metadata``, the FlagGems fused-MoE source located with
``importlib.util.find_spec``, which does not import the package) and leaves
the device components absent (``None``); the GPU layer passes the device facts
it read in ``live``.  Nothing here imports torch, triton or flag_gems; this host's fingerprint
(live on a GPU host) and its description are in ``mxdb.hostinfo``.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as metadata
import importlib.util
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from mxdb.errors import InvalidInputError, NotFoundError, UsageError
from mxdb.models import FINGERPRINT_COMPONENTS, Fingerprint
from mxdb.version import __version__

#: Recorded facts of the environment that are data, not code: written beside the fingerprint
#: (``fingerprint_document``, an evidence bundle's ``fingerprint.json``), never part of its
#: hash or of a match policy.  ``flaggems_moe_table``: SHA-256 (16 hex digits) of the config
#: table FlagGems reads.  Installing a table changes FlagGems' own choice (the baseline of
#: later tunes), not the code a stored config runs, so it must not make entries stale.
FINGERPRINT_DATA: tuple[str, ...] = ("flaggems_moe_table",)

#: Components the GPU layer may pass to ``collect(live=...)``: the device's own, from
#: ``vendor`` to ``toolkit`` (the software stack follows them in the component order).
LIVE_COMPONENTS: tuple[str, ...] = FINGERPRINT_COMPONENTS[: FINGERPRINT_COMPONENTS.index("torch")]

#: Distributions that provide Triton, in the order they are looked for.  MetaX
#: ships its Triton as mcTriton; FlagTree is FlagOpen's multi-backend Triton.  A
#: vendor fork installed beside stock Triton is the one the vendor's torch uses,
#: so the forks are looked for first.
TRITON_DISTRIBUTIONS: tuple[str, ...] = ("mctriton", "mc-triton", "flagtree", "triton")
#: Distributions that only exist on MetaX software stacks.
METAX_DISTRIBUTIONS: frozenset[str] = frozenset({"mctriton", "mc-triton"})
FLAG_GEMS_DISTRIBUTIONS: tuple[str, ...] = ("flag_gems", "flag-gems")

#: File names, anywhere inside the flag_gems package, whose bytes make up the
#: fused-MoE kernel source: the kernel and its launch heuristics, the alignment
#: and sum kernels, and the config tables vendor backends ship with their kernels.
KERNEL_SOURCE_NAMES: frozenset[str] = frozenset(
    {"fused_moe.py", "moe_align_block_size.py", "moe_sum.py", "fused_moe_config.yaml"}
)
#: The config table FlagGems' main fused-MoE path reads (``get_embedded_moe_configs``),
#: relative to the package: data, not kernel source.  The 5.0.2 wheel does not ship it; mxdb
#: installs its export there (``mxdb export --format flaggems --install``).  It is left out of
#: the kernel-source hash and recorded as the fingerprint's ``flaggems_moe_table`` instead,
#: so installing a table does not make the host's stored entries stale.
MOE_TABLE_PATH = "utils/configs/fused_moe_config.yaml"

Policy = Literal["strict", "device"]

#: Match policies: the components that must be equal for two fingerprints to match.
#:
#: - ``strict``: every component.  A new driver, toolkit, torch or mxdb version
#:   makes stored entries stale.
#: - ``device``: the same device and the same compiler and kernel: vendor,
#:   device_name, arch, smem_per_block, warp_size, triton, flag_gems and
#:   kernel_source_hash.  driver, toolkit, torch, mxdb and sm_count may differ:
#:   they do not change the code Triton generates for a config (sm_count only
#:   varies between SKUs of one device name, which device_name already pins).
POLICIES: dict[str, tuple[str, ...]] = {
    "strict": FINGERPRINT_COMPONENTS,
    "device": (
        "vendor",
        "device_name",
        "arch",
        "smem_per_block",
        "warp_size",
        "triton",
        "flag_gems",
        "kernel_source_hash",
    ),
}


class ComponentChange(BaseModel):
    """One component that differs between two fingerprints (``None``: absent)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    component: str
    old: Any = None
    new: Any = None

    def describe(self) -> str:
        old = "absent" if self.old is None else self.old
        new = "absent" if self.new is None else self.new
        return f"{self.component}: {old} -> {new}"


def _dist_version(names: Sequence[str]) -> tuple[str, str] | None:
    for name in names:
        try:
            return name, metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def triton_version() -> tuple[str, str] | None:
    """(distribution, version) of the installed Triton flavour, or None."""
    return _dist_version(TRITON_DISTRIBUTIONS)


def _find_package_dir(package: str) -> Path | None:
    # find_spec of a top-level name locates the package without executing it.
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        path = Path(location)
        if path.is_dir():
            return path
    return None


def kernel_source_hash(root: str | os.PathLike[str] | None = None) -> str | None:
    """SHA-256 (16 hex digits) of FlagGems' fused-MoE source files under ``root``.

    ``root`` is the flag_gems package directory; by default it is located with
    ``find_spec`` (without importing flag_gems).  Each file contributes its
    path relative to ``root`` and the SHA-256 of its bytes, in sorted path
    order, so the hash does not depend on where the package is installed.
    Returns None when flag_gems is not installed or has none of the files.
    """
    base = Path(root) if root is not None else _find_package_dir("flag_gems")
    if base is None or not base.is_dir():
        return None
    files = sorted(
        p
        for p in base.rglob("*")
        if p.name in KERNEL_SOURCE_NAMES
        and p.is_file()
        and p.relative_to(base).as_posix() != MOE_TABLE_PATH
    )
    if not files:
        return None
    digest = hashlib.sha256()
    for path in files:
        rel = path.relative_to(base).as_posix()
        digest.update(rel.encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).hexdigest().encode() + b"\n")
    return digest.hexdigest()[:16]


def moe_table_hash(root: str | os.PathLike[str] | None = None) -> str | None:
    """SHA-256 (16 hex digits) of the config table FlagGems reads (``MOE_TABLE_PATH``).

    ``root`` is the flag_gems package directory (located with ``find_spec`` by default).
    None when flag_gems or the table is absent (the 5.0.2 wheel ships none).
    """
    base = Path(root) if root is not None else _find_package_dir("flag_gems")
    if base is None:
        return None
    table = base / MOE_TABLE_PATH
    if not table.is_file():
        return None
    return hashlib.sha256(table.read_bytes()).hexdigest()[:16]


def environment_data() -> dict[str, str]:
    """This environment's ``FINGERPRINT_DATA`` that is present (read without imports)."""
    table = moe_table_hash()
    return {"flaggems_moe_table": table} if table else {}


def collect(live: Mapping[str, Any] | None = None) -> Fingerprint:
    """The fingerprint of this environment.

    Software components come from installed distribution metadata; device
    components (see ``LIVE_COMPONENTS``) only from ``live``.  The GPU layer may
    also pass the software components it read from the loaded modules; those
    take precedence over the metadata (they are what this process runs).  A component that
    cannot be known here stays ``None`` (absent).  ``vendor`` is inferred as
    ``metax`` from a MetaX-only distribution (mcTriton) or a torch build tagged
    ``metax`` when ``live`` does not say.
    """
    facts: dict[str, Any] = {}
    allowed = [c for c in FINGERPRINT_COMPONENTS if c != "mxdb"]
    if live:
        unknown = sorted(set(live) - set(allowed))
        if unknown:
            raise UsageError(
                f"unknown live fingerprint components {unknown}; "
                f"the GPU layer may pass: {', '.join(allowed)}"
            )

    torch = _dist_version(("torch",))
    if torch:
        facts["torch"] = torch[1]
    triton = triton_version()
    if triton:
        dist, version = triton
        # Plain Triton is recorded as its version; a fork also names itself,
        # since "3.1.0" of mcTriton and of Triton are different compilers.
        facts["triton"] = version if dist == "triton" else f"{dist} {version}"
    gems = _dist_version(FLAG_GEMS_DISTRIBUTIONS)
    if gems:
        facts["flag_gems"] = gems[1]
    source_hash = kernel_source_hash()
    if source_hash:
        facts["kernel_source_hash"] = source_hash
    facts["mxdb"] = __version__
    if live:
        facts.update({k: v for k, v in live.items() if v is not None})

    if "vendor" not in facts:
        metax = (triton is not None and triton[0] in METAX_DISTRIBUTIONS) or (
            torch is not None and "metax" in torch[1].lower()
        )
        if metax:
            facts["vendor"] = "metax"
    try:
        return Fingerprint(**facts)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err.get("loc", ()))
        raise UsageError(f"invalid live fingerprint value for {loc}: {err.get('msg')}") from None


def diff(old: Fingerprint, new: Fingerprint) -> list[ComponentChange]:
    """The components whose values differ, in ``FINGERPRINT_COMPONENTS`` order."""
    a, b = old.components(), new.components()
    return [
        ComponentChange(component=name, old=a[name], new=b[name])
        for name in FINGERPRINT_COMPONENTS
        if a[name] != b[name]
    ]


def _policy_components(policy: str) -> tuple[str, ...]:
    try:
        return POLICIES[policy]
    except KeyError:
        raise UsageError(
            f"unknown fingerprint match policy {policy!r}; known: {', '.join(POLICIES)}"
        ) from None


def mismatches(a: Fingerprint, b: Fingerprint, policy: str = "strict") -> list[ComponentChange]:
    """The changes between ``a`` and ``b`` that the policy does not tolerate."""
    required = set(_policy_components(policy))
    return [change for change in diff(a, b) if change.component in required]


def matches(a: Fingerprint, b: Fingerprint, policy: str = "strict") -> bool:
    """Whether ``a`` and ``b`` match under ``policy`` (see ``POLICIES``).

    Absent components compare like values: absent equals absent, and absent
    never equals a present value.
    """
    return not mismatches(a, b, policy)


def fingerprint_document(fp: Fingerprint) -> dict[str, Any]:
    """The JSON form ``mxdb fingerprint --json`` prints and ``load_fingerprint`` reads."""
    return {**fp.components(), "hash": fp.hash}


def parse_fingerprint(data: Any, *, source: str = "fingerprint") -> Fingerprint:
    """A fingerprint from its JSON object (components, optionally with ``hash``).

    A ``{"fingerprint": {...}}`` wrapper is accepted too, as is an evidence
    bundle's ``fingerprint.json`` document (``schema: mxdb.fingerprint``, whose
    ``hash`` is checked the same way).  When ``hash`` is present it must equal
    the hash of the components: a hand-edited file fails.
    """
    if isinstance(data, dict) and set(data) == {"fingerprint"}:
        data = data["fingerprint"]
    elif isinstance(data, dict) and data.get("schema") == "mxdb.fingerprint":
        inner = data.get("fingerprint")
        if isinstance(inner, dict):
            data = {**inner, **({"hash": data["hash"]} if "hash" in data else {})}
    if not isinstance(data, dict):
        raise InvalidInputError(
            f"{source}: a fingerprint must be a JSON object of components "
            f"({', '.join(FINGERPRINT_COMPONENTS)}), got {type(data).__name__}"
        )
    body = dict(data)
    claimed = body.pop("hash", None)
    if not any(v is not None for v in body.values()):
        raise InvalidInputError(
            f"{source}: the fingerprint names no component; record one with "
            f"`mxdb fingerprint --json` (components: {', '.join(FINGERPRINT_COMPONENTS)})"
        )
    body.pop("data", None)  # recorded facts outside the hash (FINGERPRINT_DATA)
    unknown = sorted(set(body) - set(FINGERPRINT_COMPONENTS))
    if unknown:
        raise InvalidInputError(
            f"{source}: unknown fingerprint components {unknown}; "
            f"known: {', '.join(FINGERPRINT_COMPONENTS)}"
        )
    try:
        fp = Fingerprint(**body)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err.get("loc", ()))
        raise InvalidInputError(f"{source}: invalid value for {loc}: {err.get('msg')}") from None
    if claimed is not None and claimed != fp.hash:
        raise InvalidInputError(
            f"{source}: recorded hash {claimed} does not match its components (hash {fp.hash}); "
            "the file was edited or damaged: re-record it with `mxdb fingerprint --json`"
        )
    return fp


def recorded_fingerprint(components: Mapping[str, Any]) -> Fingerprint:
    """The fingerprint of a benchmark's raw file from its recorded components.  Raw files
    written before benchmarks recorded ``mxdb`` (the first perf-sweep and perf-check runs)
    ran this checkout's version, which is filled in."""
    from mxdb.version import __version__

    return Fingerprint(**{"mxdb": __version__, **components})


def load_fingerprint(path: str | os.PathLike[str]) -> Fingerprint:
    """Read a fingerprint JSON file (the output of ``mxdb fingerprint --json``)."""
    from mxdb.fileio import MAX_SMALL_BYTES, parse_json, read_bytes

    p = Path(path)
    if not p.exists() and not p.is_symlink():
        raise NotFoundError(f"fingerprint file {str(p)!r} does not exist")
    raw = read_bytes(p, limit=MAX_SMALL_BYTES, what="fingerprint file")
    data = parse_json(raw, what=f"fingerprint file {str(p)!r}")
    return parse_fingerprint(data, source=str(p))


# Recorded environments (DESIGN sections 6 and 9), for tests and comparisons.

#: The C500 M0 milestone host: MXMACA 3.5.3.20, PyTorch 2.8.0+metax3.5.3.9,
#: FlagGems 5.0.2, 64 KiB shared memory per block, warp size 64.  Components
#: the milestone did not record stay absent.
C500_M0: dict[str, Any] = {
    "vendor": "metax",
    "device_name": "MetaX C500",
    "arch": None,
    "sm_count": None,
    "smem_per_block": 65536,
    "warp_size": 64,
    "driver": None,
    "toolkit": "MXMACA 3.5.3.20",
    "torch": "2.8.0+metax3.5.3.9",
    "triton": None,
    "flag_gems": "5.0.2",
    "kernel_source_hash": None,
    "mxdb": None,
}

#: FlagGems 5.0.2's fused-MoE source files (``KERNEL_SOURCE_NAMES``, without the table at
#: ``MOE_TABLE_PATH``) as the flag_gems-5.0.2-py3-none-any.whl wheel installs them, hashed with
#: ``kernel_source_hash``: the value the H200 host recorded live (its shipped store's
#: fingerprint).  Before the table was left out, the source tree of tag v5.0.2, which has
#: that table, hashed to b254b85a91cfc180.
FLAG_GEMS_5_0_2_KERNEL_SOURCE_HASH = "1505c6288d4b55f5"

#: The lent H200 host: torch 2.11.0+cu130, Triton 3.6.0, driver 580.159.04,
#: CUDA 13.0, FlagGems 5.0.2.
H200: dict[str, Any] = {
    "vendor": "nvidia",
    "device_name": "NVIDIA H200",
    "arch": "sm_90",
    "sm_count": 132,
    "smem_per_block": 232448,
    "warp_size": 32,
    "driver": "580.159.04",
    "toolkit": "CUDA 13.0",
    "torch": "2.11.0+cu130",
    "triton": "3.6.0",
    "flag_gems": "5.0.2",
    "kernel_source_hash": FLAG_GEMS_5_0_2_KERNEL_SOURCE_HASH,
    "mxdb": "0.1.0",
}

RECORDED: dict[str, dict[str, Any]] = {"c500-m0": C500_M0, "h200": H200}


def recorded(name: str) -> Fingerprint:
    """A recorded fingerprint by name: ``c500-m0`` or ``h200``."""
    try:
        return Fingerprint(**RECORDED[name])
    except KeyError:
        raise UsageError(
            f"no recorded fingerprint {name!r}; recorded: {', '.join(RECORDED)}"
        ) from None
