"""The images a chat request refers to, and loading them under the server's media flags.

vLLM's semantics and flag names:

- content parts: Chat Completions' `{"type": "image_url", "image_url": {"url": ...}}` (or
  `"image_url": "<url>"`), and the Responses API's `{"type": "input_image", "image_url": "<url>"}`;
  `image_refs` lists them in prompt order, `check_limits` holds them to `--limit_mm_per_prompt`
  (JSON such as `{"image": 4}`; vLLM's default is 999 items of each modality).
- URLs: `data:image/<type>;base64,<data>` (strict base64, decoded size bounded);
  `http(s)://` only to a host named in `--allowed_media_domains` (unlike vLLM, none is allowed when
  the flag is empty); `file://` only under `--allowed_local_media_path` (symlinks resolved first).
  Plain paths and other schemes are refused, as vLLM does.
- Loopback, private, link-local and other non-public addresses: reachable only when the allow-list
  names the address itself (`127.0.0.1`) or `localhost`. A listed host *name* that resolves to such
  an address is refused, and the connection goes to the address that was checked.
- Fetching (aiohttp, as the server): bounded in bytes (`max_image_bytes`, counted after any
  content decoding) and in time (`fetch_timeout_s`, the whole fetch, redirects included; vLLM's
  VLLM_IMAGE_FETCH_TIMEOUT is 5 s); redirects are followed up to `max_redirects`, each hop checked
  like the first URL.
- Decoding (Pillow) is a plain function, `decode_image`, for the server to run in an executor
  (`image_size` reads the header alone): the pixel count is checked from the header before any
  pixel is decoded (`max_image_pixels`, with
  Pillow's own decompression-bomb guard as errors too), only raster formats Pillow reads itself
  are opened, and the result is RGB, transparency composited on white (as transformers and vLLM).

Every refusal is a `MediaError` (a ValueError) whose message starts with the image it is about,
"image 2 of message 1: ...", for the server to send as an HTTP 400 JSON error.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import dataclasses
import io
import ipaddress
import json
import pathlib
import socket
import urllib.parse
import urllib.request
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Executor
from typing import Any

import aiohttp
from aiohttp.abc import AbstractResolver
from PIL import Image, UnidentifiedImageError
from yarl import URL

MODALITIES = ("image", "video", "audio")
DEFAULT_LIMIT_PER_PROMPT = 999  # vLLM's default for each modality
DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024
DEFAULT_FETCH_TIMEOUT_S = 5.0  # vLLM's VLLM_IMAGE_FETCH_TIMEOUT
DEFAULT_MAX_IMAGE_PIXELS = 89_478_485  # Pillow's own Image.MAX_IMAGE_PIXELS, set here explicitly
# Raster formats Pillow decodes itself (no EPS: Ghostscript; no formats of other tools).
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF", "ICO")
_REDIRECTS = (301, 302, 303, 307, 308)
IMAGE_PART_TYPES = ("image_url", "input_image")  # Chat Completions' and the Responses API's image parts


class MediaError(ValueError):
    """A request's image refused: bad reference, flag not set, too many, too large, not an image.
    The message names the image ("image 2 of message 1: ..."); the server answers HTTP 400."""


@dataclasses.dataclass(frozen=True)
class ImageRef:
    """One image a request refers to. `index` is its place among the prompt's images (0-based);
    `message` and `number` are 1-based, as the error messages say them."""
    url: str
    index: int
    message: int  # which message, 1-based
    number: int  # which image of that message, 1-based

    @property
    def label(self) -> str:
        return f"image {self.number} of message {self.message}"


@dataclasses.dataclass(frozen=True)
class MediaPolicy:
    """The server's media flags and bounds (`from_flags` reads the flags' values)."""
    allowed_media_domains: tuple[str, ...] = ()
    allowed_local_media_path: str | None = None
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    fetch_timeout_s: float = DEFAULT_FETCH_TIMEOUT_S
    max_redirects: int = 3

    @classmethod
    def from_flags(cls, allowed_media_domains: str | Iterable[str] | None = None,
                   allowed_local_media_path: str | None = None, **bounds: Any) -> MediaPolicy:
        """`allowed_media_domains` as a comma-separated string or a list of host names;
        `allowed_local_media_path` must be an existing folder (or empty: no local files)."""
        if isinstance(allowed_media_domains, str):
            allowed_media_domains = allowed_media_domains.split(",")
        domains = tuple(d.strip().lower() for d in allowed_media_domains or () if d.strip())
        root = None
        if allowed_local_media_path:
            folder = pathlib.Path(allowed_local_media_path)
            if not folder.is_dir():
                raise ValueError(f"--allowed_local_media_path={allowed_local_media_path!r} is not a folder")
            root = str(folder.resolve())
        return cls(allowed_media_domains=domains, allowed_local_media_path=root, **bounds)


# ---- which images a request refers to ------------------------------------------------------------

def image_refs(messages: Sequence[Any]) -> list[ImageRef]:
    """The images of a chat (or Responses input) message list, in prompt order.

    A message is a dict whose "content" is a string (no images) or a list of parts; items without
    a list content (tool calls, tool results as strings) hold no images. Raises MediaError for an
    image part without a usable URL."""
    refs: list[ImageRef] = []
    for m, message in enumerate(messages, start=1):
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, list):
            continue
        number = 0
        for part in content:
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind not in IMAGE_PART_TYPES:
                continue
            number += 1
            label = f"image {number} of message {m}"
            refs.append(ImageRef(part_url(part, label), len(refs), m, number))
    return refs


def part_url(part: Mapping[str, Any], label: str) -> str:
    """The URL of an image part (IMAGE_PART_TYPES); MediaError naming `label` when it has none."""
    kind = part.get("type")
    value = part.get("image_url")
    if kind == "image_url" and isinstance(value, Mapping):
        value = value.get("url")
    if not isinstance(value, str) or not value:
        shape = ('{"type": "image_url", "image_url": {"url": "<url>"}}' if kind == "image_url"
                 else '{"type": "input_image", "image_url": "<url>"}')
        extra = " (file_id is not supported)" if kind == "input_image" and "file_id" in part else ""
        raise MediaError(f"{label}: an image part must be {shape}{extra}")
    return value


def parse_limit_mm_per_prompt(value: str | Mapping[str, Any] | None) -> dict[str, int]:
    """`--limit_mm_per_prompt` (JSON such as '{"image": 4}', or a dict) -> every modality's limit,
    the ones not given at vLLM's default (999). Raises ValueError naming the flag."""
    limits = dict.fromkeys(MODALITIES, DEFAULT_LIMIT_PER_PROMPT)
    if value is None or value == "":
        return limits
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"--limit_mm_per_prompt must be JSON such as '{{\"image\": 4}}': {e}") from None
    if not isinstance(value, Mapping):
        raise ValueError("--limit_mm_per_prompt must be a JSON object such as '{\"image\": 4}'")
    for key, limit in value.items():
        if key not in MODALITIES:
            raise ValueError(f"--limit_mm_per_prompt: unknown modality {key!r} (one of {', '.join(MODALITIES)})")
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError(f"--limit_mm_per_prompt: {key!r} must be a whole number >= 0, not {limit!r}")
        limits[key] = limit
    return limits


def check_limits(refs: Sequence[ImageRef], limits: Mapping[str, int]) -> None:
    """Raises MediaError when the prompt has more images than `--limit_mm_per_prompt` allows."""
    limit = limits.get("image", DEFAULT_LIMIT_PER_PROMPT)
    if len(refs) > limit:
        raise MediaError(f"{refs[limit].label}: at most {limit} image(s) per prompt are allowed "
                         f"(--limit_mm_per_prompt), this prompt has {len(refs)}")


# ---- loading the bytes ---------------------------------------------------------------------------

async def load_image_bytes(ref: ImageRef, policy: MediaPolicy, *,
                           resolver: AbstractResolver | None = None) -> bytes:
    """The encoded image `ref.url` names: a data URL, an allowed http(s) URL, or a file under the
    allowed folder. `resolver` replaces the system's name lookup (tests)."""
    url = ref.url
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return decode_data_url(url, ref.label, policy.max_image_bytes)
    if scheme in ("http", "https"):
        return await fetch_http(url, ref.label, policy, resolver=resolver)
    if scheme == "file":
        return await asyncio.to_thread(read_local_file, url, ref.label, policy)
    raise MediaError(f"{ref.label}: the URL must be a data:, http(s):// or file:// URL")


def decode_data_url(url: str, label: str, max_bytes: int) -> bytes:
    """The bytes of `data:image/<type>;base64,<data>`; strict base64 (no whitespace), at most
    `max_bytes` once decoded."""
    header, comma, payload = url.partition(",")
    params = header[len("data:"):].split(";")
    if not comma or params[-1].lower() != "base64" or not params[0].lower().startswith("image/"):
        raise MediaError(f"{label}: a data URL must be data:image/<type>;base64,<data>")
    if len(payload) // 4 * 3 > max_bytes + 2:
        raise MediaError(f"{label}: the image is over {max_bytes} bytes")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise MediaError(f"{label}: the data URL is not valid base64 ({e})") from None
    if len(data) > max_bytes:
        raise MediaError(f"{label}: the image is over {max_bytes} bytes")
    return data


def read_local_file(url: str, label: str, policy: MediaPolicy) -> bytes:
    """A `file://` URL's bytes, only from under `--allowed_local_media_path` (the path and the
    folder both resolved, symlinks included, before the check)."""
    if not policy.allowed_local_media_path:
        raise MediaError(f"{label}: file:// URLs are refused; start the server with "
                         "--allowed_local_media_path=<folder> to allow files under that folder")
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise MediaError(f"{label}: a file:// URL names no host (file:///path)")
    root = pathlib.Path(policy.allowed_local_media_path).resolve()
    try:
        path = pathlib.Path(urllib.request.url2pathname(parts.path)).resolve(strict=True)
    except (OSError, RuntimeError):
        raise MediaError(f"{label}: no such file under --allowed_local_media_path") from None
    if not path.is_relative_to(root):
        raise MediaError(f"{label}: the file is outside --allowed_local_media_path")
    if not path.is_file():
        raise MediaError(f"{label}: not a file")
    with open(path, "rb") as f:
        data = f.read(policy.max_image_bytes + 1)
    if len(data) > policy.max_image_bytes:
        raise MediaError(f"{label}: the image is over {policy.max_image_bytes} bytes")
    return data


def _check_host(url: str, label: str, policy: MediaPolicy) -> str:
    """The URL's host, lower case, once it is in the allow-list; an address literal that is not
    public must be listed as that address (it is, if it matched)."""
    try:
        parts = urllib.parse.urlsplit(url)
        host = (parts.hostname or "").lower()
        parts.port  # raises ValueError for a bad port
    except ValueError:
        raise MediaError(f"{label}: not a valid URL") from None
    if parts.scheme.lower() not in ("http", "https") or not host:
        raise MediaError(f"{label}: not a valid http(s) URL")
    if not policy.allowed_media_domains:
        raise MediaError(f"{label}: http(s) image URLs are refused; start the server with "
                         f"--allowed_media_domains={host} to allow images from that host")
    if host not in policy.allowed_media_domains:
        raise MediaError(f"{label}: the host {host!r} is not in --allowed_media_domains")
    return host


class _CheckedResolver(AbstractResolver):
    """Looks host names up, and refuses one whose addresses are not all public, unless the name
    is `localhost` (listed explicitly). aiohttp connects to the addresses returned here."""

    def __init__(self, base: AbstractResolver, label: str):
        self._base = base
        self._label = label
        self.refused: MediaError | None = None

    async def resolve(self, host: str, port: int = 0, family: int = socket.AF_INET):
        infos = await self._base.resolve(host, port, family)
        if host.lower() != "localhost":
            for info in infos:
                if not ipaddress.ip_address(info["host"]).is_global:
                    self.refused = MediaError(f"{self._label}: the host {host!r} resolves to a non-public "
                                              f"address; list the address itself in --allowed_media_domains")
                    raise self.refused
        return infos

    async def close(self) -> None:
        await self._base.close()


async def fetch_http(url: str, label: str, policy: MediaPolicy, *,
                     resolver: AbstractResolver | None = None) -> bytes:
    """GET an allowed http(s) URL: at most `max_image_bytes`, within `fetch_timeout_s` in all."""
    _check_host(url, label, policy)
    checked = _CheckedResolver(resolver or aiohttp.ThreadedResolver(), label)
    connector = aiohttp.TCPConnector(resolver=checked, use_dns_cache=False)
    try:
        async with asyncio.timeout(policy.fetch_timeout_s):
            async with aiohttp.ClientSession(connector=connector, trust_env=False) as session:
                return await _get_following_redirects(session, url, label, policy)
    except TimeoutError:
        raise MediaError(f"{label}: fetching the image took over {policy.fetch_timeout_s:g} s") from None
    except aiohttp.ClientError as e:
        if checked.refused is not None:  # the resolver's refusal, if aiohttp wrapped it
            raise checked.refused from None
        raise MediaError(f"{label}: fetching the image failed: {type(e).__name__}") from None


async def _get_following_redirects(session: aiohttp.ClientSession, url: str, label: str,
                                   policy: MediaPolicy) -> bytes:
    for _ in range(policy.max_redirects + 1):
        async with session.get(url, allow_redirects=False) as response:
            if response.status in _REDIRECTS and "Location" in response.headers:
                url = str(response.url.join(URL(response.headers["Location"])))
                _check_host(url, label, policy)
                continue
            if response.status != 200:
                raise MediaError(f"{label}: fetching the image got HTTP {response.status}")
            return await _read_bounded(response, label, policy.max_image_bytes)
    raise MediaError(f"{label}: more than {policy.max_redirects} redirects")


async def _read_bounded(response: aiohttp.ClientResponse, label: str, max_bytes: int) -> bytes:
    if response.content_length is not None and response.content_length > max_bytes:
        raise MediaError(f"{label}: the image is over {max_bytes} bytes")
    body = bytearray()
    async for chunk in response.content.iter_chunked(64 * 1024):
        body += chunk
        if len(body) > max_bytes:
            raise MediaError(f"{label}: the image is over {max_bytes} bytes")
    return bytes(body)


# ---- decoding ------------------------------------------------------------------------------------

def decode_image(data: bytes, label: str, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> Image.Image:
    """Encoded bytes -> an RGB PIL image (the first frame of an animation). Synchronous, for an
    executor. The size is checked from the header before decoding; Pillow's own bomb guard is an
    error too; corrupt, truncated and unsupported data raise MediaError."""
    with _opened(data, label, max_pixels) as image:
        image.load()
        return to_rgb(image)


def image_size(data: bytes, label: str, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> tuple[int, int]:
    """(width, height) of encoded bytes from the header alone, no pixel decoded, with
    decode_image's checks of the format and the size (MediaError)."""
    with _opened(data, label, max_pixels) as image:
        return image.size


@contextlib.contextmanager
def _opened(data: bytes, label: str, max_pixels: int) -> Iterator[Image.Image]:
    """The image opened (its header read) and its size checked; what Pillow raises meanwhile, in
    the body too, as MediaError."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as image:
                width, height = image.size
                if width < 1 or height < 1 or width * height > max_pixels:
                    raise MediaError(f"{label}: the image is {width}x{height} pixels, over the bound of "
                                     f"{max_pixels} pixels")
                yield image
    except MediaError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise MediaError(f"{label}: the image is too large to decode ({e})") from None
    except UnidentifiedImageError:
        raise MediaError(f"{label}: not an image in a supported format ({', '.join(IMAGE_FORMATS)})") from None
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise MediaError(f"{label}: the image data is corrupt or truncated ({e})") from None


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, any transparency composited onto white (transformers' and vLLM's rule)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


async def load_images(messages: Sequence[Any], policy: MediaPolicy, limits: Mapping[str, int], *,
                      executor: Executor | None = None,
                      resolver: AbstractResolver | None = None) -> list[Image.Image]:
    """A request's images in prompt order, RGB: listed, held to the limits, then `load_image_refs`."""
    refs = image_refs(messages)
    check_limits(refs, limits)
    return await load_image_refs(refs, policy, executor=executor, resolver=resolver)


async def load_image_refs(refs: Sequence[ImageRef], policy: MediaPolicy, *, executor: Executor | None = None,
                          resolver: AbstractResolver | None = None) -> list[Image.Image]:
    """The images `refs` name, in their order, RGB: fetched (`fetch_images`), then decoded in
    `executor` (None: the loop's default). Raises the first MediaError."""
    loop = asyncio.get_running_loop()
    encoded = await fetch_images(refs, policy, resolver=resolver)
    return [await loop.run_in_executor(executor, decode_image, data, ref.label, policy.max_image_pixels)
            for data, ref in zip(encoded, refs)]


async def fetch_images(refs: Sequence[ImageRef], policy: MediaPolicy, *,
                       resolver: AbstractResolver | None = None) -> list[bytes]:
    """The encoded bytes of the images `refs` name, in their order, fetched concurrently. Raises
    the first MediaError (the other fetches are cancelled)."""
    tasks = [asyncio.ensure_future(load_image_bytes(ref, policy, resolver=resolver)) for ref in refs]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:  # the first refusal answers the request: stop the other fetches
            task.cancel()
        raise
