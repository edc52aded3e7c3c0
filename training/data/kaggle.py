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
             retries: int = 3) -> Path:
    """Download and extract a competition or dataset into `target` once; later calls reuse it.

    `target` gains a `.complete` marker only after the archive was fully downloaded, its size
    checked, and extracted; anything without the marker is discarded and fetched again.
    """
    target = Path(target)
    if (target / COMPLETE_MARKER).is_file():
        return target
    credentials = credentials or find_credentials()
    if credentials is None:
        raise DatasetError(MISSING_CREDENTIALS)
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():
        shutil.rmtree(target)  # an extraction that never completed
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}.download.", dir=target.parent))
    try:
        archive = _fetch_archive(kind, ref, work, credentials, retries)
        extract_zip(archive, target)
        (target / COMPLETE_MARKER).write_text(json.dumps({"source": f"kaggle:{kind}/{ref}"}))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def _fetch_archive(kind: str, ref: str, work: Path, credentials: KaggleCredentials,
                   retries: int) -> Path:
    import requests
    from kaggle.api.kaggle_api_extended import KaggleApi
    from kagglesdk import KaggleClient
    from kagglesdk.kaggle_env import get_env

    # KaggleApi.build_kaggle_client() picks PROD unless given CLI flags; building the SDK
    # client with get_env() honours KAGGLE_API_ENVIRONMENT (TEST is the loopback used by tests).
    client = KaggleClient(env=get_env(), username=credentials.username,
                          password=credentials.key, api_token=credentials.token)
    api = KaggleApi()
    partial = work / "download.zip.part"
    with client:
        try:
            response = _request_download(client, kind, ref)
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


def _request_download(client, kind: str, ref: str):
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
