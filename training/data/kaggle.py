"""Kaggle downloads through the official client, cached, atomic and safely extracted.

`import kaggle` authenticates when imported and, in some versions, exits the process when
no credentials are found, so the client is imported here only after credentials were found.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from training.data.archives import extract_zip
from training.data.labels import DatasetError
from training.storage import file_lock

COMPLETE_MARKER = ".complete"


@dataclass(frozen=True, repr=False)
class KaggleCredentials:
    """Either a legacy username/key pair or an API token. Never printed: repr hides it."""

    username: str | None = None
    key: str | None = None
    token: str | None = None

    def __repr__(self) -> str:
        return f"KaggleCredentials(username={self.username!r}, key=***, token=***)"


def find_credentials() -> KaggleCredentials | None:
    """Look in the standard places the official client reads, in its order of preference."""
    if os.environ.get("KAGGLE_API_TOKEN"):
        return KaggleCredentials(token=os.environ["KAGGLE_API_TOKEN"])
    if os.environ.get("KAGGLE_USERNAME") and os.environ.get("KAGGLE_KEY"):
        return KaggleCredentials(os.environ["KAGGLE_USERNAME"], os.environ["KAGGLE_KEY"])
    for folder in _config_dirs():
        token_file = folder / "access_token"
        if token_file.is_file() and token_file.read_text().strip():
            return KaggleCredentials(token=token_file.read_text().strip())
        config = folder / "kaggle.json"
        if config.is_file():
            try:
                data = json.loads(config.read_text())
                return KaggleCredentials(data["username"], data["key"])
            except (ValueError, KeyError, TypeError) as e:
                raise DatasetError(
                    f"{config} is not a kaggle.json with username and key ({type(e).__name__}); "
                    "download a fresh one from https://www.kaggle.com/settings/api"
                ) from None
    return None


def _config_dirs() -> list[Path]:
    dirs = []
    if os.environ.get("KAGGLE_CONFIG_DIR"):
        dirs.append(Path(os.environ["KAGGLE_CONFIG_DIR"]))
    dirs += [Path("~/.kaggle").expanduser(), Path("~/.config/kaggle").expanduser()]
    return dirs


MISSING_CREDENTIALS = (
    "no Kaggle credentials found: set KAGGLE_USERNAME and KAGGLE_KEY, or KAGGLE_API_TOKEN, or "
    "save kaggle.json (from https://www.kaggle.com/settings/api) as ~/.kaggle/kaggle.json, "
    "or store them in a Prefect Secret block named by KAGGLE_SECRET_BLOCK"
)


def download(kind: str, ref: str, target: Path, credentials: KaggleCredentials | None,
             retries: int = 3, version: str | int = "latest", warn=None) -> Path:
    """The dataset's copy for `version`, downloaded and extracted once into a folder of its own.

    Each run asks Kaggle which version is current (for a competition, its file list with sizes
    and dates; for a dataset, the same of its latest or pinned version), so a scheduled retrain
    sees new data. A version downloads into `target/versions/<key>/` beside the older copies,
    which stay. Kaggle unreachable: the newest complete copy is used, with a warning; none:
    an error. A folder gains `.complete` only after the archive was fully downloaded and
    extracted; anything without it is discarded and fetched again.
    """
    target = Path(target)
    credentials = credentials or find_credentials()
    try:
        if credentials is None:
            raise KaggleUnreachable("no Kaggle credentials here")
        key = current_version(kind, ref, credentials, version)
    except KaggleUnreachable as e:
        copies = complete_copies(target)
        if not copies:
            if credentials is None:
                raise DatasetError(MISSING_CREDENTIALS) from None
            raise DatasetError(f"cannot reach Kaggle to check kaggle:{kind}/{ref} ({e}) and no "
                               f"complete copy is under {target}; run again when it is "
                               "reachable") from None
        (warn or print)(f"cannot ask Kaggle for the current version ({e}); using the newest "
                        f"complete copy of kaggle:{kind}/{ref}, {copies[0]}")
        return copies[0]
    folder = target / "versions" / key
    if (folder / COMPLETE_MARKER).is_file():
        return folder
    # First runs at once on a fresh home: one downloads, the others wait and take its copy
    # (a second one would remove the first one's extraction under it).
    with file_lock(folder.parent / f".{key}.lock"):
        if not (folder / COMPLETE_MARKER).is_file():
            _download_into(folder, kind, ref, credentials, retries, version)
    return folder


def _download_into(folder: Path, kind: str, ref: str, credentials: KaggleCredentials,
                   retries: int, version: str | int) -> None:
    key = folder.name
    folder.parent.mkdir(parents=True, exist_ok=True)
    if folder.exists():
        shutil.rmtree(folder)  # an extraction that never completed
    work = Path(tempfile.mkdtemp(prefix=f".{key}.download.", dir=folder.parent))
    try:
        archive = _fetch_archive(kind, ref, work, credentials, retries, version)
        extract_zip(archive, folder)
        (folder / COMPLETE_MARKER).write_text(json.dumps({"source": f"kaggle:{kind}/{ref}",
                                                          "version": key}))
    finally:
        shutil.rmtree(work, ignore_errors=True)


class KaggleUnreachable(Exception):
    pass


def complete_copies(target: Path) -> list[Path]:
    """The complete downloads of a source, newest first."""
    done = [p.parent for p in (Path(target) / "versions").glob(f"*/{COMPLETE_MARKER}")]
    return sorted(done, key=lambda p: (p / COMPLETE_MARKER).stat().st_mtime, reverse=True)


def current_version(kind: str, ref: str, credentials: KaggleCredentials,
                    version: str | int = "latest") -> str:
    """A key naming the version Kaggle serves now: a digest of its files' names, sizes and
    dates (a pinned dataset version is its number)."""
    import hashlib

    import requests

    if version != "latest":
        return f"v{int(version)}"
    client = _client(credentials)
    files, token = [], None
    try:
        with client:
            while True:
                page, token = _list_files(client, kind, ref, token)
                files += page
                if not token:
                    break
    except requests.exceptions.HTTPError as e:
        raise _explain(e, kind, ref) from None
    except requests.exceptions.ConnectionError as e:
        raise KaggleUnreachable(str(e).split(":")[0] or "connection refused") from None
    listing = json.dumps(sorted(files), default=str)
    return "files-" + hashlib.sha256(listing.encode()).hexdigest()[:12]


def _list_files(client, kind: str, ref: str, token: str | None) -> tuple[list, str | None]:
    if kind == "competitions":
        from kagglesdk.competitions.types.competition_api_service import ApiListDataFilesRequest

        request = ApiListDataFilesRequest()
        request.competition_name = ref
        if token:
            request.page_token = token
        response = client.competitions.competition_api_client.list_data_files(request)
        found = response.files
    else:
        from kagglesdk.datasets.types.dataset_api_service import ApiListDatasetFilesRequest

        request = ApiListDatasetFilesRequest()
        request.owner_slug, request.dataset_slug = ref.split("/", 1)
        if token:
            request.page_token = token
        response = client.datasets.dataset_api_client.list_dataset_files(request)
        found = response.dataset_files
    return ([(f.name, f.total_bytes, str(f.creation_date)) for f in found],
            response.next_page_token or None)


def _client(credentials: KaggleCredentials):
    from kagglesdk import KaggleClient
    from kagglesdk.kaggle_env import get_env

    # KaggleApi.build_kaggle_client() picks PROD unless given CLI flags; building the SDK
    # client with get_env() honours KAGGLE_API_ENVIRONMENT (TEST is the loopback used by tests).
    return KaggleClient(env=get_env(), username=credentials.username,
                        password=credentials.key, api_token=credentials.token)


def _fetch_archive(kind: str, ref: str, work: Path, credentials: KaggleCredentials,
                   retries: int, version: str | int = "latest") -> Path:
    import requests
    from kaggle.api.kaggle_api_extended import KaggleApi

    client = _client(credentials)
    api = KaggleApi()
    partial = work / "download.zip.part"
    with client:
        try:
            response = _request_download(client, kind, ref, version)
        except requests.exceptions.HTTPError as e:
            raise _explain(e, kind, ref) from None
        except requests.exceptions.ConnectionError as e:
            raise DatasetError(f"cannot reach Kaggle to download {kind}/{ref}: {e}") from None
        try:
            api.download_file(response, str(partial), client.http_client(), quiet=True,
                              resume=False, max_retries=retries)
        except (requests.exceptions.RequestException, ValueError, OSError) as e:
            raise DatasetError(
                f"download of kaggle:{kind}/{ref} did not complete ({type(e).__name__}: {e}); "
                "nothing was kept, run again to retry"
            ) from None
    archive = work / "download.zip"
    partial.rename(archive)
    return archive


def _request_download(client, kind: str, ref: str, version: str | int = "latest"):
    if kind == "competitions":
        from kagglesdk.competitions.types.competition_api_service import (
            ApiDownloadDataFilesRequest,
        )

        request = ApiDownloadDataFilesRequest()
        request.competition_name = ref
        return client.competitions.competition_api_client.download_data_files(request)
    from kagglesdk.datasets.types.dataset_api_service import ApiDownloadDatasetRequest

    owner, slug = ref.split("/", 1)
    request = ApiDownloadDatasetRequest()
    request.owner_slug = owner
    request.dataset_slug = slug
    if version != "latest":
        request.dataset_version_number = int(version)
    return client.datasets.dataset_api_client.download_dataset(request)


def _explain(error, kind: str, ref: str) -> DatasetError:
    status = error.response.status_code if error.response is not None else None
    page = (f"https://www.kaggle.com/competitions/{ref}" if kind == "competitions"
            else f"https://www.kaggle.com/datasets/{ref}")
    if status == 401:
        return DatasetError(
            "Kaggle rejected the credentials (401): check KAGGLE_USERNAME/KAGGLE_KEY, "
            "KAGGLE_API_TOKEN or ~/.kaggle/kaggle.json"
        )
    if status == 403:
        return DatasetError(
            f"Kaggle refused the download of {kind}/{ref} (403): accept the competition rules "
            f"on {page}/rules with the account whose key is used, then run again"
        )
    if status == 404:
        return DatasetError(
            f"Kaggle has no {kind[:-1]} {ref!r} (404): check the slug in dataset.source, e.g. "
            '"kaggle:competitions/dogs-vs-cats-redux-kernels-edition"'
        )
    return DatasetError(f"Kaggle answered {status} for {kind}/{ref}: {error}")
