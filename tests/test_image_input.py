"""Images as cameras store them, read upright on every path; the served model on its device."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from trainflow_serving.images import ORIENTATION, load_resized
from trainflow_serving.images import load_resized_bytes as served_decode
from training.data.images import decode_image


def _photo() -> Image.Image:
    """Asymmetric, so that a rotation shows: a bright bar on the left, a dot top right."""
    pixels = np.zeros((48, 64, 3), dtype=np.uint8)
    pixels[:, :10] = (250, 40, 40)
    pixels[4:12, 50:58] = (40, 250, 40)
    return Image.fromarray(pixels)


def _saved(img: Image.Image, path, orientation: int | None = None):
    exif = Image.Exif()
    if orientation is not None:
        exif[ORIENTATION] = orientation
    img.save(path, "PNG", exif=exif)  # lossless: pixels compare exactly
    return path


def test_a_sideways_photo_with_its_tag_decodes_like_the_upright_one(tmp_path):
    upright = _saved(_photo(), tmp_path / "upright.png")
    # Orientation 6: "rotate 90 degrees clockwise to view", as phones store portrait shots.
    sideways = _saved(_photo().transpose(Image.Transpose.ROTATE_90), tmp_path / "sideways.png", 6)
    untagged = _saved(_photo().transpose(Image.Transpose.ROTATE_90), tmp_path / "untagged.png")
    for side in (32, 12):
        want = load_resized(upright, side, 3)
        assert np.array_equal(load_resized(sideways, side, 3), want)  # training's and serving's
        assert np.array_equal(decode_image(sideways, side)[0], want)  # the decode store's
        assert np.array_equal(served_decode(sideways.read_bytes(), side, 3), want)
        # Without the tag the stored pixels are what they are: nothing is guessed.
        assert not np.array_equal(load_resized(untagged, side, 3), want)
    with Image.open(io.BytesIO(sideways.read_bytes())) as img:
        assert img.size == (48, 64)  # it really is stored sideways


def test_the_served_model_picks_its_device(monkeypatch):
    """The rank's GPU when there is one (a stub stands in for CUDA here), the CPU otherwise,
    and what TRAINFLOW_SERVE_DEVICE says above both."""
    import torch

    from trainflow_serving.pyfunc_model import serving_device

    monkeypatch.delenv("TRAINFLOW_SERVE_DEVICE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert serving_device() == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert serving_device() == torch.device("cuda", 3)
    monkeypatch.setenv("TRAINFLOW_SERVE_DEVICE", "cpu")
    assert serving_device() == torch.device("cpu")
