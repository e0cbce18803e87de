"""Request bodies built once, before any load: the generator only replays bytes.

Encoding a body per request would put client CPU on the same two cores the server uses and
bias every figure; so images are read (or multipart-encoded) and texts JSON-encoded up front.
"""

from __future__ import annotations

import json
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

PNG_MAGIC = b"\x89PNG"
IMAGE_TYPES = {
    ".jpg": "image/jpeg",
    ".jpeg": "image/jpeg",
    ".png": "image/png",
    ".webp": "image/webp",
    ".bmp": "image/bmp",
}


@dataclass(frozen=True)
class Payload:
    """One request body; `rows` is how many items (images, texts) it carries."""

    name: str
    body: bytes
    content_type: str
    rows: int = 1


class InputError(ValueError):
    """The inputs asked for cannot be read; the message says which and why."""


def read_image_folder(folder: Path) -> dict[str, bytes]:
    """Every image file in `folder` (by extension), name → bytes, sorted for a stable order."""
    if not folder.is_dir():
        raise InputError(f"{folder}: not a folder")
    files = {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.suffix.lower() in IMAGE_TYPES}
    if not files:
        raise InputError(f"{folder}: no image files ({', '.join(sorted(IMAGE_TYPES))})")
    return files


def sample_photo_files() -> dict[str, bytes]:
    """The project's default photos (scikit-image, scikit-learn) as file name → bytes."""
    try:
        from sample_inputs import sample_photos
    except ImportError as exc:
        raise InputError(
            f"default photos need scikit-image and scikit-learn ({exc}): pip install -e '.[pipeline]' or pass --images"
        ) from exc
    return {name + (".png" if data.startswith(PNG_MAGIC) else ".jpg"): data for name, data in sample_photos().items()}


def write_sample_photos(folder: Path | None = None) -> Path:
    """The default photos written as files, so they take the same path as a user's folder."""
    folder = folder or Path(tempfile.mkdtemp(prefix="loadtest-photos-"))
    for name, data in sample_photo_files().items():
        (folder / name).write_bytes(data)
    return folder


def image_payloads(
    files: dict[str, bytes], *, multipart_field: str | None = None, per_request: int = 1
) -> list[Payload]:
    """Raw bodies (one image), or multipart forms with `per_request` images under `multipart_field`."""
    names = sorted(files)
    if multipart_field is None:
        if per_request != 1:
            raise InputError("several images per request need a multipart field (--multipart-field)")
        return [Payload(name, files[name], IMAGE_TYPES[Path(name).suffix.lower()]) for name in names]
    payloads = []
    for start in range(len(names)):
        chosen = [names[(start + i) % len(names)] for i in range(per_request)]
        parts = [(multipart_field, n, files[n], IMAGE_TYPES[Path(n).suffix.lower()]) for n in chosen]
        body, content_type = multipart_body(parts)
        payloads.append(Payload("+".join(chosen), body, content_type, rows=per_request))
    return payloads


def multipart_body(parts: list[tuple[str, str, bytes, str]]) -> tuple[bytes, str]:
    """(field, filename, data, content type) parts as one multipart/form-data body and its header."""
    boundary = uuid.uuid4().hex
    chunks = []
    for field, filename, data, content_type in parts:
        chunks.append(
            f'--{boundary}\r\nContent-Disposition: form-data; name="{field}"; filename="{filename}"\r\n'
            f"Content-Type: {content_type}\r\n\r\n".encode()
        )
        chunks.extend([data, b"\r\n"])
    chunks.append(f"--{boundary}--\r\n".encode())
    return b"".join(chunks), f"multipart/form-data; boundary={boundary}"


def read_texts(path: Path) -> list[str]:
    """One text per non-blank line."""
    if not path.is_file():
        raise InputError(f"{path}: no such file")
    texts = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not texts:
        raise InputError(f"{path}: no non-blank line")
    return texts


def default_texts() -> list[str]:
    from sample_inputs import sample_texts

    return sample_texts()


def text_payloads(texts: list[str], *, per_request: int = 1, field: str = "texts") -> list[Payload]:
    """JSON bodies `{field: [...]}` of `per_request` texts each, cycling through `texts`."""
    if per_request < 1:
        raise InputError("texts per request must be at least 1")
    payloads = []
    for start in range(len(texts)):
        chosen = [texts[(start + i) % len(texts)] for i in range(per_request)]
        body = json.dumps({field: chosen}).encode()
        payloads.append(Payload(f"text[{start}]", body, "application/json", rows=per_request))
    return payloads
