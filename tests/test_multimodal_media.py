"""jaxserve.multimodal.media: which images a request names, the limits, and loading them under the
media flags -- data URLs, http(s) from a local aiohttp host (127.0.0.1 allowed explicitly), files
under the allowed folder -- and every refusal a MediaError naming the image."""
from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import os
import socket
import struct
import zlib

import numpy as np
import pytest
from aiohttp import web
from aiohttp.abc import AbstractResolver
from PIL import Image

from jaxserve.multimodal import media
from jaxserve.multimodal.media import ImageRef, MediaError, MediaPolicy

SEED = 7


def png_bytes(height=5, width=7, mode="RGB", seed=SEED) -> bytes:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)  # [H, W, 3]
    buffer = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(data: bytes, media_type="image/png") -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode()


def chat(*urls: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": u}} for u in urls]}]


def load(messages, policy=MediaPolicy(), limits=None, **kwargs):
    return asyncio.run(media.load_images(messages, policy, limits or media.parse_limit_mm_per_prompt(None), **kwargs))


def ref(url: str) -> ImageRef:
    return ImageRef(url, 0, 1, 1)


# ---- which images, and how many ------------------------------------------------------------------

def test_image_refs_in_prompt_order_from_chat_and_responses_parts():
    messages = [
        {"role": "system", "content": "plain text"},
        {"role": "user", "content": [{"type": "text", "text": "look"},
                                     {"type": "image_url", "image_url": {"url": "data:a", "detail": "low"}},
                                     {"type": "image_url", "image_url": "data:b"}]},
        {"type": "function_call", "name": "f", "arguments": "{}"},
        {"role": "user", "content": [{"type": "input_text", "text": "and"},
                                     {"type": "input_image", "image_url": "data:c", "detail": "auto"}]},
    ]
    refs = media.image_refs(messages)
    assert [(r.url, r.index, r.label) for r in refs] == [
        ("data:a", 0, "image 1 of message 2"), ("data:b", 1, "image 2 of message 2"),
        ("data:c", 2, "image 1 of message 4")]


@pytest.mark.parametrize("part", [{"type": "image_url"}, {"type": "image_url", "image_url": {"url": 3}},
                                  {"type": "input_image", "file_id": "file-1"}])
def test_an_image_part_without_a_url_is_refused(part):
    with pytest.raises(MediaError, match="^image 1 of message 1: an image part must be"):
        media.image_refs([{"role": "user", "content": [part]}])


def test_limit_mm_per_prompt_parsing():
    assert media.parse_limit_mm_per_prompt(None) == {"image": 999, "video": 999, "audio": 999}
    assert media.parse_limit_mm_per_prompt('{"image": 4}')["image"] == 4
    assert media.parse_limit_mm_per_prompt({"image": 0, "video": 1}) == {"image": 0, "video": 1, "audio": 999}
    for bad, message in [("{image: 4}", "must be JSON"), ("[4]", "JSON object"), ('{"images": 4}', "unknown modality"),
                         ('{"image": -1}', ">= 0"), ('{"image": true}', ">= 0"), ('{"image": 2.5}', ">= 0")]:
        with pytest.raises(ValueError, match=message):
            media.parse_limit_mm_per_prompt(bad)


def test_too_many_images_name_the_limit():
    messages = chat(*[data_url(png_bytes())] * 3)
    with pytest.raises(MediaError, match=r"^image 3 of message 1: at most 2 image\(s\).*--limit_mm_per_prompt.*has 3"):
        load(messages, limits=media.parse_limit_mm_per_prompt('{"image": 2}'))
    with pytest.raises(MediaError, match="at most 0"):
        media.check_limits(media.image_refs(messages), {"image": 0})
    assert len(load(messages, limits={"image": 3})) == 3


# ---- data URLs and decoding ----------------------------------------------------------------------

def test_a_data_url_decodes_to_the_same_rgb_pixels():
    data = png_bytes(9, 11)
    [image] = load(chat(data_url(data)))
    assert image.mode == "RGB" and image.size == (11, 9)
    assert np.array_equal(np.asarray(image), np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))


@pytest.mark.parametrize("url, message", [
    ("data:image/png;base64,iVBORw0KGgo!!!!", "not valid base64"),
    ("data:image/png;base64,iVBORw0KGgoAAA", "not valid base64"),  # bad padding
    ("data:image/png;base64,iVBO Rw0K", "not valid base64"),  # whitespace is not strict base64
    ("data:text/plain;base64,aGVsbG8=", "must be data:image/"),
    ("data:image/png,rawbytes", "must be data:image/"),
])
def test_bad_data_urls_are_refused(url, message):
    with pytest.raises(MediaError, match=f"^image 1 of message 1: .*{message}"):
        load(chat(url))


def test_non_image_and_corrupt_bytes_are_refused():
    with pytest.raises(MediaError, match="not an image in a supported format"):
        load(chat(data_url(b"%PDF-1.4 definitely not an image" * 10)))
    truncated = png_bytes(64, 64)[:200]
    with pytest.raises(MediaError, match="corrupt or truncated"):
        load(chat(data_url(truncated)))
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n"
    with pytest.raises(MediaError, match="not an image in a supported format"):  # no Ghostscript, ever
        media.decode_image(eps, "image 1 of message 1")


def test_data_url_size_bound():
    data = png_bytes(40, 40)
    with pytest.raises(MediaError, match=f"over {len(data) - 1} bytes"):
        load(chat(data_url(data)), MediaPolicy(max_image_bytes=len(data) - 1))
    assert len(load(chat(data_url(data)), MediaPolicy(max_image_bytes=len(data)))) == 1


def png_header_only(width: int, height: int) -> bytes:
    """A 57-byte PNG whose header claims width x height (8-bit RGB) and whose data is one byte."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0")) + chunk(b"IEND", b""))


def test_decompression_bombs_are_refused_before_decoding():
    with pytest.raises(MediaError, match="^image 1 of message 1: .*(pixels|too large)"):
        load(chat(data_url(png_header_only(30000, 30000))))
    with pytest.raises(MediaError, match="too large to decode.*exceeds limit of 89478485"):  # Pillow's guard
        media.decode_image(png_header_only(12000, 12000), "image 1 of message 1")
    buffer = io.BytesIO()
    Image.new("L", (2000, 2000)).save(buffer, format="PNG")  # a real all-zero image: 4 MB of pixels, ~4 KB of PNG
    assert len(buffer.getvalue()) < 50_000
    with pytest.raises(MediaError, match="2000x2000 pixels, over the bound of 1000000"):
        load(chat(data_url(buffer.getvalue())), MediaPolicy(max_image_pixels=1_000_000))


# ---- http(s) -------------------------------------------------------------------------------------

def test_http_is_refused_without_allowed_domains():
    with pytest.raises(MediaError, match=r"^image 1 of message 1: http\(s\) image URLs are refused.*"
                                         r"--allowed_media_domains=images\.example\.com"):
        load(chat("https://images.example.com/cat.png"))


@pytest.mark.parametrize("url", ["http://127.0.0.1:9/x.png", "http://localhost:9/x.png", "http://[::1]:9/x.png",
                                 "http://10.0.0.1/x.png", "http://169.254.169.254/latest/meta-data"])
def test_loopback_and_private_hosts_are_refused_unless_listed(url):
    # Refused before any connection: not in the allow-list.
    with pytest.raises(MediaError, match="is not in --allowed_media_domains"):
        load(chat(url), MediaPolicy(allowed_media_domains=("images.example.com",)))


class FakeDNS(AbstractResolver):
    """Answers every name with one address (no network)."""

    def __init__(self, address: str):
        self.address = address

    async def resolve(self, host, port=0, family=socket.AF_INET):
        return [{"hostname": host, "host": self.address, "port": port, "family": socket.AF_INET,
                 "proto": 0, "flags": socket.AI_NUMERICHOST}]

    async def close(self):
        pass


@contextlib.asynccontextmanager
async def image_host(routes):
    """A local aiohttp app on 127.0.0.1 serving `routes` {path: handler}; yields its port."""
    app = web.Application()
    for path, handler in routes.items():
        app.router.add_get(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield site._server.sockets[0].getsockname()[1]
    finally:
        await runner.cleanup()


async def _png(request):
    return web.Response(body=png_bytes(6, 4), content_type="image/png")


async def _big(request):
    return web.Response(body=b"\0" * 300_000, content_type="image/png")


async def _big_streamed(request):  # no Content-Length: the bound is counted while reading
    response = web.StreamResponse()
    await response.prepare(request)
    for _ in range(10):
        await response.write(b"\0" * 50_000)
    return response


async def _slow(request):
    await asyncio.sleep(1.0)
    return await _png(request)


async def _trickle(request):  # headers at once, then a body too slow to finish in time
    response = web.StreamResponse()
    await response.prepare(request)
    for _ in range(20):
        await response.write(b"\0" * 10)
        await asyncio.sleep(0.05)
    return response


async def _missing(request):
    return web.Response(status=404)


def _redirect_to(location):
    async def handler(request):
        raise web.HTTPFound(location.format(port=request.url.port))
    return handler


ROUTES = {"/cat.png": _png, "/big": _big, "/big-streamed": _big_streamed, "/slow": _slow, "/trickle": _trickle,
          "/missing": _missing, "/hop": _redirect_to("/cat.png"),
          "/away": _redirect_to("http://images.example.com/cat.png"), "/loop": _redirect_to("/loop")}


def fetch(path: str, host="127.0.0.1", resolver=None, **policy) -> tuple[list[Image.Image] | None, MediaError | None]:
    async def go():
        async with image_host(ROUTES) as port:
            p = MediaPolicy(**{"allowed_media_domains": ("127.0.0.1",), "max_image_bytes": 200_000,
                               "fetch_timeout_s": 0.5, **policy})
            try:
                return await media.load_images(chat(f"http://{host}:{port}{path}"), p, {"image": 9},
                                               resolver=resolver), None
            except MediaError as e:
                return None, e
    return asyncio.run(go())


def test_fetch_from_an_explicitly_allowed_loopback_host():
    images, error = fetch("/cat.png")
    assert error is None and images[0].size == (4, 6) and images[0].mode == "RGB"
    images, error = fetch("/hop")  # a redirect to the same allowed host
    assert error is None and images[0].size == (4, 6)


@pytest.mark.parametrize("path, message", [
    ("/big", "over 200000 bytes"), ("/big-streamed", "over 200000 bytes"),
    ("/slow", "took over 0.5 s"), ("/trickle", "took over 0.5 s"),
    ("/missing", "got HTTP 404"), ("/away", "'images.example.com' is not in --allowed_media_domains"),
    ("/loop", "more than 3 redirects"),
])
def test_fetch_bounds_and_failures(path, message):
    images, error = fetch(path)
    assert images is None and error is not None
    assert str(error).startswith("image 1 of message 1: ") and message in str(error), str(error)


def test_an_allowed_name_that_resolves_to_a_private_address_is_refused():
    """DNS rebinding: the name is listed, its address is loopback: refused, though the host is up."""
    images, error = fetch("/cat.png", host="images.example.com", resolver=FakeDNS("127.0.0.1"),
                          allowed_media_domains=("images.example.com",))
    assert error is not None and "resolves to a non-public address" in str(error), error
    images, error = fetch("/cat.png", host="localhost", resolver=FakeDNS("127.0.0.1"),
                          allowed_media_domains=("localhost",))  # localhost listed: allowed
    assert error is None and images[0].size == (4, 6)


# ---- local files ---------------------------------------------------------------------------------

def test_local_files_only_under_the_allowed_folder(tmp_path):
    allowed, outside = tmp_path / "media", tmp_path / "secret"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "cat.png").write_bytes(png_bytes(3, 8))
    (outside / "key.png").write_bytes(png_bytes(3, 8))
    os.symlink(outside / "key.png", allowed / "link.png")
    policy = MediaPolicy.from_flags("", str(allowed))
    [image] = load(chat(f"file://{allowed}/cat.png"), policy)
    assert image.size == (8, 3)
    for url in [f"file://{outside}/key.png", f"file://{allowed}/../secret/key.png", f"file://{allowed}/link.png"]:
        with pytest.raises(MediaError, match="^image 1 of message 1: the file is outside --allowed_local_media_path"):
            load(chat(url), policy)
    with pytest.raises(MediaError, match="no such file"):
        load(chat(f"file://{allowed}/nope.png"), policy)
    with pytest.raises(MediaError, match="file:// URLs are refused.*--allowed_local_media_path"):
        load(chat(f"file://{allowed}/cat.png"))
    with pytest.raises(MediaError, match="must be a data:, http"):  # a plain path is not a URL (vLLM too)
        load(chat(str(allowed / "cat.png")), policy)
    with pytest.raises(ValueError, match="not a folder"):
        MediaPolicy.from_flags(None, str(tmp_path / "missing"))


def test_policy_from_flags():
    policy = MediaPolicy.from_flags("Images.Example.com, 127.0.0.1,", None)
    assert policy.allowed_media_domains == ("images.example.com", "127.0.0.1")
    assert policy.allowed_local_media_path is None
    assert MediaPolicy.from_flags(["a.test"]).allowed_media_domains == ("a.test",)


def test_errors_name_the_image_among_several():
    messages = chat(data_url(png_bytes())) + chat(data_url(png_bytes()), "data:image/png;base64,@@@@")
    with pytest.raises(MediaError, match="^image 2 of message 2: "):
        load(messages)
    assert isinstance(MediaError("x"), ValueError)


@pytest.mark.parametrize("fmt", ["JPEG", "GIF", "WEBP", "BMP", "TIFF"])
def test_common_formats_decode_to_rgb(fmt):
    buffer = io.BytesIO()
    Image.open(io.BytesIO(png_bytes(10, 12))).save(buffer, format=fmt)
    image = media.decode_image(buffer.getvalue(), "image 1 of message 1")
    assert image.mode == "RGB" and image.size == (12, 10)
