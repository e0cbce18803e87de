"""Hostile and odd inputs against the real service: each gets a clear 4xx JSON (or a correct 200),
never a 5xx; no error body leaks a path, a class name or a traceback; the next normal request
is served."""

from __future__ import annotations

import gzip
import io
import os
import re
import resource
import socket
import struct
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest import BODY_TIMEOUT_S, REPO, own_home
from PIL import Image
from test_monitoring import samples

from bench.processes import OPTISERVE, on_free_port
from sample_inputs import encode, sample_photos

pytestmark = pytest.mark.slow

JSON_TYPE, PNG = "application/json", "image/png"
JSON = {"content-type": JSON_TYPE}
JPEG = {"content-type": "image/jpeg"}
LEAKS = re.compile(r"Traceback|<class |object at 0x|\.py\b|/usr/|/work/|/home/|site-packages|Error\(")


def image_bytes(image: Image.Image, image_format: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=image_format, **options)
    return buffer.getvalue()


def chelsea() -> bytes:
    return sample_photos()["chelsea"]


def photo() -> Image.Image:
    return Image.open(io.BytesIO(chelsea())).convert("RGB")


def jpeg_declaring(width: int, height: int) -> bytes:
    """A small JPEG whose frame header claims `width`×`height`."""
    data = bytearray(image_bytes(Image.new("RGB", (8, 8)), "JPEG"))
    frame = data.index(b"\xff\xc0")
    data[frame + 5 : frame + 9] = struct.pack(">HH", height, width)
    return bytes(data)


def bmp_declaring(width: int, height: int) -> bytes:
    data = bytearray(image_bytes(Image.new("RGB", (8, 8)), "BMP"))
    data[18:26] = struct.pack("<ii", width, height)
    return bytes(data)


def webp_declaring(width: int, height: int) -> bytes:
    """A small lossless WebP whose VP8L header claims `width`×`height` (at most 16384 each)."""
    data = bytearray(image_bytes(Image.new("RGB", (8, 8)), "WEBP", lossless=True))
    header = data.index(b"VP8L") + 9
    bits = int.from_bytes(data[header : header + 4], "little")
    bits = (bits & ~((1 << 28) - 1)) | (width - 1) | ((height - 1) << 14)
    data[header : header + 4] = bits.to_bytes(4, "little")
    return bytes(data)


def exif_rotated_jpeg() -> bytes:
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90° clockwise to display
    return image_bytes(photo(), "JPEG", exif=exif.tobytes())


def animated_webp() -> bytes:
    frames = [photo(), photo().rotate(90)]
    return image_bytes(frames[0], "WEBP", save_all=True, append_images=frames[1:], duration=100)


def palette_with_alpha_png() -> bytes:
    image = photo().convert("P", palette=Image.Palette.ADAPTIVE)
    image.info["transparency"] = 0
    return image_bytes(image, "PNG", transparency=0)


def sixteen_bit_png() -> bytes:
    return image_bytes(Image.fromarray((np.arange(64 * 64).reshape(64, 64) * 16).astype(np.uint16)), "PNG")


FORM_HEAD = b'--b\r\nContent-Disposition: form-data; name="image"; filename="x.jpg"\r\nContent-Type: image/jpeg\r\n\r\n'


def raw(data: bytes, content_type: str = "image/jpeg") -> dict:
    return {"content": data, "headers": {"content-type": content_type}}


def form(*files: tuple, **fields: str) -> dict:
    return {"files": list(files), "data": fields}


# name: (path, the request's arguments, made when its test runs, expected status)
HOSTILE: dict[str, tuple[str, Callable[[], dict], int]] = {
    "PNG decompression bomb": (
        "/classify",
        lambda: raw(image_bytes(Image.new("L", (12_000, 12_000)), "PNG"), "image/png"),
        413,
    ),
    "JPEG header claiming 60000x60000": ("/classify", lambda: raw(jpeg_declaring(60_000, 60_000)), 413),
    "WebP header claiming 16384x16384": ("/classify", lambda: raw(webp_declaring(16_384, 16_384), "image/webp"), 413),
    "BMP header claiming 30000x30000": ("/classify", lambda: raw(bmp_declaring(30_000, 30_000), "image/bmp"), 413),
    "PNG 40000x1": ("/classify", lambda: raw(image_bytes(Image.new("RGB", (40_000, 1)), "PNG"), "image/png"), 200),
    "PNG 1x30000": ("/classify", lambda: raw(image_bytes(Image.new("RGB", (1, 30_000)), "PNG"), "image/png"), 200),
    "CMYK JPEG": ("/classify", lambda: raw(image_bytes(photo().convert("CMYK"), "JPEG")), 200),
    "16-bit grey PNG": ("/classify", lambda: raw(sixteen_bit_png(), "image/png"), 200),
    "palette PNG with alpha": ("/classify", lambda: raw(palette_with_alpha_png(), "image/png"), 200),
    "EXIF-rotated JPEG": ("/classify", lambda: raw(exif_rotated_jpeg()), 200),
    "animated WebP": ("/classify", lambda: raw(animated_webp(), "image/webp"), 200),
    "truncated PNG": ("/classify", lambda: raw(image_bytes(photo(), "PNG")[:5000], "image/png"), 422),
    "JPEG with a ZIP appended (polyglot)": ("/classify", lambda: raw(chelsea() + b"PK\x03\x04" + b"\x00" * 64), 200),
    "ZIP declared as JPEG": ("/classify", lambda: raw(b"PK\x03\x04" + b"\x00" * 256), 422),
    "TIFF bytes as octet-stream": (
        "/classify",
        lambda: raw(image_bytes(photo(), "TIFF"), "application/octet-stream"),
        422,
    ),
    "SVG": ("/classify", lambda: raw(b"<svg xmlns='http://www.w3.org/2000/svg'/>", "image/svg+xml"), 415),
    "no content type": ("/classify", lambda: {"content": chelsea()}, 415),
    "JSON to /classify": ("/classify", lambda: {"json": {"image": "http://127.0.0.1:9/cat.jpg"}}, 415),
    "path-like filename": ("/classify", lambda: form(("image", ("../../etc/passwd", chelsea()))), 200),
    "unicode filename": ("/classify", lambda: form(("image", ("猫" * 300 + ".jpg", chelsea()))), 200),
    "filename with a NUL and a quote": ("/classify", lambda: form(("image", ('x\x00y"z.jpg', chelsea()))), 200),
    "10 000-character filename": ("/classify", lambda: form(("image", ("a" * 10_000 + ".jpg", chelsea()))), 422),
    "a thousand file parts": ("/classify_batch", lambda: form(*[("images", ("x.jpg", b"x"))] * 1000), 413),
    "empty multipart body": ("/classify_batch", lambda: raw(b"--b--\r\n", "multipart/form-data; boundary=b"), 422),
    "file path in a form field": ("/classify_batch", lambda: form(("other", ("x", b"x")), images="/etc/passwd"), 422),
    "top_k as a superscript digit": ("/classify", lambda: form(("image", ("c.jpg", chelsea())), top_k="²"), 422),
    "top_k as Arabic-Indic digits": ("/classify?top_k=%D9%A3", lambda: raw(chelsea()), 422),
    "top_k 0": ("/classify?top_k=0", lambda: raw(chelsea()), 422),
    "top_k 1e3": ("/classify?top_k=1e3", lambda: raw(chelsea()), 422),
    "X-Deadline-Ms in superscript digits": (
        "/classify",
        lambda: {
            "content": chelsea(),
            "headers": {"content-type": "image/jpeg", "X-Deadline-Ms": "²³".encode("latin-1")},
        },
        422,
    ),
    "texts of nothing but a zero-width space, a soft hyphen": (
        "/embed",
        lambda: {"json": {"texts": ["a cat", "\u200b\u00ad"]}},
        422,
    ),
    "truncate as the string yes": ("/embed", lambda: {"json": {"texts": ["a cat"], "truncate": "yes"}}, 422),
    "a gzip-encoded JSON body": (
        "/embed",
        lambda: {"content": gzip.compress(b'{"texts": ["a cat"]}'), "headers": {**JSON, "content-encoding": "gzip"}},
        415,
    ),
    "a gzip-encoded image": (
        "/classify",
        lambda: {"content": gzip.compress(chelsea()), "headers": {**JPEG, "content-encoding": "gzip"}},
        415,
    ),
    "NUL bytes inside a text": ("/embed", lambda: {"json": {"texts": ["a\x00b", "\x00 cat"]}}, 200),
    "invalid UTF-8 in JSON": ("/embed", lambda: raw(b'{"texts": ["\xc3\x28"]}', "application/json"), 422),
    "JSON nested 100 000 deep": ("/embed", lambda: raw(b"[" * 100_000 + b"]" * 100_000, "application/json"), 422),
    "JSON nested 10 000 deep": (
        "/embed",
        lambda: raw(b'{"texts": ' + b"[" * 10_000 + b"]" * 10_000 + b"}", "application/json"),
        422,
    ),
    "10 000 texts": ("/embed", lambda: {"json": {"texts": ["a cat"] * 10_000}}, 413),
    "one 1 MB text": ("/embed", lambda: {"json": {"texts": ["word " * 200_000]}}, 413),
    "a 5 MB body": ("/embed", lambda: {"json": {"texts": ["x" * 1000] * 5000}}, 413),
    "numbers as texts": ("/embed", lambda: {"json": {"texts": [1, 2]}}, 422),
    "unknown encoding": ("/embed", lambda: {"json": {"texts": ["a"], "encoding_format": "binary"}}, 422),
    "texts as a JSON string": ("/embed", lambda: {"json": '{"texts": ["a"]}'}, 422),
    "chunked body without a length": (
        "/embed",
        lambda: {"content": iter([b'{"texts": ', b'["a cat"]}']), "headers": JSON},
        200,
    ),
    "form body to /embed": ("/embed", lambda: {"data": {"texts": "a cat"}}, 415),
}


def multipart_photo(boundary: str, *, closed: bool) -> bytes:
    head = f'--{boundary}\r\nContent-Disposition: form-data; name="image"; filename="c.jpg"\r\n'
    body = head.encode() + b"Content-Type: image/jpeg\r\n\r\n" + chelsea()
    return body + f"\r\n--{boundary}--\r\n".encode() if closed else body


def test_a_multipart_body_cut_short_is_refused_as_such_not_as_a_missing_field(server) -> None:
    with server.client() as client:
        cut = client.post("/classify", content=multipart_photo("xx", closed=False), headers=form_type("xx"))
        whole = client.post("/classify", content=multipart_photo("q y", closed=True), headers=form_type('"q y"'))
    assert cut.status_code == 422
    assert cut.json()["error"] == "malformed form body: it ends without its closing boundary '--xx--' (cut short?)"
    assert whole.status_code == 200, whole.text  # a quoted boundary, closed as RFC 2046 says


def form_type(boundary: str) -> dict[str, str]:
    return {"content-type": f"multipart/form-data; boundary={boundary}"}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_input_gets_a_clear_answer_and_the_service_keeps_serving(server, case: str) -> None:
    path, request, status = HOSTILE[case]
    with server.client() as client:
        response = client.post(path, **request())
        normal = client.post("/classify", content=chelsea(), headers=JPEG)
    assert response.status_code == status, response.text[:500]
    body = response.json()
    if status >= 400:
        assert set(body) >= {"error", "type"} and body["error"], body
        assert not LEAKS.search(response.text), response.text[:500]
    assert normal.status_code == 200


@pytest.mark.parametrize(
    ("method", "path"), [("GET", "/classify"), ("HEAD", "/embed"), ("PUT", "/models/digits-classifier/classify")]
)
def test_a_model_endpoint_called_with_another_method_says_so_in_json(server, method: str, path: str) -> None:
    with server.client() as client:
        response = client.request(method, path)
    assert response.status_code == 405 and response.headers["allow"] == "POST"
    if method != "HEAD":
        assert response.json() == {"error": f"{method} {path}: the endpoint takes POST", "type": "method_not_allowed"}


def test_an_exif_rotated_photo_is_classified_as_displayed(server) -> None:
    """The orientation tag is applied: a phone photo stored sideways is seen upright."""
    upright = photo()
    exif = Image.Exif()
    exif[0x0112] = 6
    stored_sideways = image_bytes(upright.rotate(90, expand=True), "JPEG", exif=exif.tobytes(), quality=95)
    with httpx.Client(base_url=server.url, timeout=60) as client:
        seen = client.post("/classify?top_k=1", content=stored_sideways, headers=JPEG)
        original = client.post("/classify?top_k=1", content=encode(np.asarray(upright), "JPEG"), headers=JPEG)
    assert seen.json()["predictions"][0]["label"] == original.json()["predictions"][0]["label"]


@pytest.mark.parametrize("path", ["/embed", "/classify"])
def test_a_body_that_trickles_in_is_timed_out_with_a_408(server, path: str) -> None:
    """The server fixture allows a body 3 s (OPTISERVE_BODY_TIMEOUT_S); this one never finishes."""
    host, port = server.url.removeprefix("http://").split(":")
    timeouts_before = timeouts_counted(server, path)
    content_type = "application/json" if path == "/embed" else "image/jpeg"
    head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: {content_type}\r\nContent-Length: 1000\r\n\r\n"
    started = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=30) as connection:
        connection.sendall(head.encode() + b'{"texts": ')
        answer = ""
        while not answer.endswith("}"):
            answer += connection.recv(65536).decode("latin-1")
    assert answer.startswith("HTTP/1.1 408"), answer[:300]
    assert '"type":"body_timeout"' in answer
    assert BODY_TIMEOUT_S <= time.monotonic() - started < BODY_TIMEOUT_S + 10
    assert timeouts_counted(server, path) == timeouts_before + 1  # optiserve_errors_total's class
    with server.client() as client:
        assert client.post("/classify", content=chelsea(), headers=JPEG).status_code == 200


@pytest.mark.parametrize(
    "request_args",
    [
        lambda: raw(b"\xff\xd8" + b"\0" * 21 * 2**20),  # declared
        lambda: {  # chunked
            "content": iter([FORM_HEAD, *[b"\0" * 2**20] * 21, b"\r\n--b--\r\n"]),
            "headers": {"content-type": "multipart/form-data; boundary=b"},
        },
    ],
    ids=["raw", "form"],
)
def test_a_body_over_what_its_one_image_may_weigh_is_refused_as_it_comes(server, request_args) -> None:
    """/classify takes one image of up to 20 MB: a larger body is refused before it is all read
    (it was read whole up to 1.28 GB, and the worker held twice that)."""
    with server.client() as client:
        response = client.post("/classify", **request_args())
    assert response.status_code == 413 and response.json()["error"].startswith("request body"), response.text


@pytest.mark.parametrize(
    ("path", "headers", "status"),
    [
        ("/embed", "Content-Type: application/json\r\nContent-Length: 5000000\r\n", "413"),
        ("/classify", "Content-Type: image/jpeg\r\nContent-Length: 30000000\r\n", "413"),
        ("/classify", "Content-Type: text/plain\r\nContent-Length: 40000\r\n", "415"),
        ("/embed", "Content-Type: application/json\r\nX-Deadline-Ms: soon\r\nContent-Length: 40000\r\n", "422"),
    ],
)
def test_an_error_before_a_body_awaiting_100_continue_closes_its_connection(
    server, path: str, headers: str, status: str
) -> None:
    """The client sends its body only when asked; refused first, it never does, so the connection
    cannot carry its next request (which would be read as this one's body)."""
    host, port = server.url.removeprefix("http://").split(":")
    head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\n{headers}Expect: 100-continue\r\n\r\n"
    with socket.create_connection((host, int(port)), timeout=30) as connection:
        connection.sendall(head.encode())
        answer = b""
        while chunk := connection.recv(65536):  # the server closes the connection after its answer
            answer += chunk
    head_lines = answer.decode("latin-1").split("\r\n\r\n")[0].lower().splitlines()
    assert head_lines[0].startswith(f"http/1.1 {status}") and "connection: close" in head_lines, head_lines


def timeouts_counted(server, path: str) -> float:
    with server.client() as client:
        found = samples(client, "optiserve_errors_total")
    return sum(v for labels, v in found if labels["class"] == "timeout" and labels["api"] == path.strip("/"))


def request_series(client: httpx.Client) -> list[dict[str, str]]:
    """The labels of every HTTP request series on /metrics (BentoML's names)."""
    return [labels for labels, _ in samples(client, "bentoml_service_request_total")] + [
        labels for labels, _ in samples(client, "bentoml_service_request_in_progress")
    ]


def test_a_scan_of_unknown_paths_adds_no_series_to_metrics(server) -> None:
    """Every path a scanner tries is counted as `other`: /metrics keeps as many series as the
    service has paths (BentoML's own middleware added some twenty a path: 5 000 paths took
    /metrics to 19.5 MB and 3.8 s a scrape), while the service's paths keep their own."""
    with server.client() as client:
        before = request_series(client)
        others = sum(v for s, v in samples(client, "bentoml_service_request_total") if s["endpoint"] == "other")
        for index in range(40):
            assert client.get(f"/wp-admin/{index}.php").status_code == 404
            assert client.post(f"/cgi-bin/{index}", content=b"x").status_code == 404
        assert client.post("/embed", json={"texts": ["a scan went by"]}).status_code == 200
        after = request_series(client)
        counted = {
            (s["endpoint"], s["http_response_code"]): v for s, v in samples(client, "bentoml_service_request_total")
        }
    assert not [s for s in after if "wp-admin" in s["endpoint"] or "cgi-bin" in s["endpoint"]]
    assert len(after) <= len(before) + 4, "at most /embed's 200 and other's 404, counted and in progress"
    assert counted[("other", "404")] == others + 80
    assert counted[("/embed", "200")] >= 1 and counted[("/readyz", "200")] >= 1


HALF_OPEN = 1100  # past the soft limit on open files that containers get (containerd 2.x, Docker 29)


@contextmanager
def half_open_connections(port: int, count: int) -> Iterator[None]:
    """`count` connections that each send the start of a request's headers and never the rest."""
    held = []
    try:
        for _ in range(count):
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            held.append(sock)
            sock.sendall(b"POST /embed HTTP/1.1\r\nHost: x\r\n")
        yield
    finally:
        for sock in held:
            sock.close()


def test_connections_that_never_finish_their_headers_leave_other_clients_served(
    manifest_file: Path, tmp_path: Path
) -> None:
    """uvicorn times out no request's headers, so each such connection holds an open file for good:
    at a soft limit of 1 024, 1 100 of them from one client left everyone else unanswered, until
    the worker raised its soft limit to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = 2 * HALF_OPEN  # the worker's and this process's ends of each connection
    if hard != resource.RLIM_INFINITY and hard < needed:
        pytest.skip(f"the hard limit on open files ({hard}) is below {needed}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, needed), hard))
    command = ["bash", "-c", 'ulimit -S -n 1024 && exec "$@"', "bash", *OPTISERVE]
    env = {**os.environ, "OPTISERVE_MANIFEST": str(manifest_file), "BENTOML_HOME": own_home(tmp_path / "home")}
    log = tmp_path / "bentoml.log"
    try:
        with (
            on_free_port(command, env=env, cwd=REPO, log=log) as started,
            half_open_connections(int(started.url.rsplit(":", 1)[1]), HALF_OPEN),
        ):
            answer = httpx.post(f"{started.url}/embed", json={"texts": ["anyone there?"]}, timeout=10)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert answer.status_code == 200
    assert "open files: the soft limit raised from 1024 to " in log.read_text()
