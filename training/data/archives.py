"""Safe zip extraction: nothing lands outside the target, no links, no zip bombs."""

from __future__ import annotations

import shutil
import stat
import tempfile
import zipfile
from pathlib import Path, PurePosixPath

# Image archives barely compress (JPEG/PNG are already compressed); a ratio far past this
# is a zip bomb, not a dataset.
MAX_COMPRESSION_RATIO = 200
MAX_ENTRIES = 2_000_000


class UnsafeArchiveError(ValueError):
    pass


def check_zip(archive: Path) -> list[zipfile.ZipInfo]:
    """Refuse the whole archive before anything is written if any entry is unsafe."""
    try:
        zf = zipfile.ZipFile(archive)
    except zipfile.BadZipFile as e:
        raise UnsafeArchiveError(f"{archive.name} is not a readable zip archive: {e}") from e
    with zf:
        entries = zf.infolist()
    if len(entries) > MAX_ENTRIES:
        raise UnsafeArchiveError(
            f"{archive.name} has {len(entries):,} entries, over the limit of {MAX_ENTRIES:,}"
        )
    total = 0
    for info in entries:
        name = info.filename
        parts = PurePosixPath(name.replace("\\", "/")).parts
        if name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":") or ".." in parts:
            raise UnsafeArchiveError(
                f"{archive.name} entry {name!r} would be written outside the target folder; "
                "refusing the archive"
            )
        mode = info.external_attr >> 16
        if stat.S_ISLNK(mode):
            raise UnsafeArchiveError(
                f"{archive.name} entry {name!r} is a symbolic link; refusing the archive"
            )
        total += info.file_size
    limit = max(archive.stat().st_size, 1 << 20) * MAX_COMPRESSION_RATIO
    if total > limit:
        raise UnsafeArchiveError(
            f"{archive.name} would expand to {total:,} bytes from {archive.stat().st_size:,} "
            f"(over {MAX_COMPRESSION_RATIO}x): refusing a likely zip bomb"
        )
    return entries


def extract_zip(archive: Path, target: Path, *, nested: bool = True) -> Path:
    """Extract `archive` into `target` (which must not exist yet), atomically.

    Zips found inside (Kaggle competitions ship train.zip inside the download) are
    extracted in place, with the same checks, into a folder named after them.
    """
    target = Path(target)
    check_zip(archive)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        with zipfile.ZipFile(archive) as zf:
            zf.extractall(staging)
        if nested:
            for inner in sorted(staging.rglob("*.zip")):
                inner_target = inner.with_suffix("")
                if inner_target.exists():
                    continue
                _extract_in_place(inner, inner_target)
                inner.unlink()
        staging.rename(target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _extract_in_place(archive: Path, target: Path) -> None:
    """train.zip holding train/... lands in train/, not train/train/."""
    entries = check_zip(archive)
    tops = {PurePosixPath(e.filename).parts[0] for e in entries if e.filename.strip("/")}
    destination = target.parent if tops == {target.name} else target
    with zipfile.ZipFile(archive) as zf:
        zf.extractall(destination)
