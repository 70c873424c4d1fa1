"""Images in conversations (issue #52): the shapes datasets and servers give them, read once and checked.

A turn's content may be a list of parts. Every shape becomes the same parts, OpenAI's, which vLLM and SGLang
accept as they are and a processor's chat template renders:

    {"type": "text", "text": ...}
    {"type": "image", "image": SOURCE}      SOURCE: a file path, a file:// URL or a data:image/...;base64 URL

Read: OpenAI content parts (`{"type": "image_url", "image_url": {"url": ...}}`), `{"type": "image", "path" |
"image" | "url": ...}`, and ShareGPT4V / LLaVA records whose human turns hold `<image>` markers with the images in
the record's `image` field (one path or a list). A relative path is read from the data file's directory.

Every image is opened and decoded once (`load_image`); a missing, unreadable or corrupt one is a `DataError` naming
the record and the image, which `data.bad_lines: skip` counts and skips like any bad line."""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
from pathlib import Path

IMAGE_MARKER = "<image>"  # ShareGPT4V / LLaVA
IMAGE_PART_TYPES = ("image", "image_url")


class ImageError(ValueError):
    """An image that cannot be used, naming the record and the image (a `DataError` where the data stage raises it)."""


def has_images(messages: list[dict]) -> bool:
    return any(isinstance(m.get("content"), list) and any(p.get("type") == "image" for p in m["content"]) for m in messages)


def images_of(messages: list[dict]) -> list[str]:
    """The image sources of a conversation, in the order the template renders them."""
    return [p["image"] for m in messages if isinstance(m.get("content"), list) for p in m["content"] if p.get("type") == "image"]


def text_of(content) -> str:
    """The text of a content (a string, or the text parts of a list joined)."""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if p.get("type") == "text")


def parts_of(content, where: str, base_dir: Path | None = None) -> list[dict] | str:
    """A turn's content as given -> a string (text only) or the canonical parts; sources resolved, not yet read."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ImageError(f"{where}: content must be a string or a list of parts, got {type(content).__name__}")
    out = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            out.append({"type": "text", "text": part["text"]})
        elif kind in IMAGE_PART_TYPES:
            out.append({"type": "image", "image": _resolve(_source_of(part, f"{where} part {i}"), base_dir)})
        else:
            raise ImageError(f"{where}: part {i} must be {{'type': 'text', 'text': ...}} or an image part "
                             f"({', '.join(IMAGE_PART_TYPES)}), got {part!r:.80}")
    return out


def _source_of(part: dict, where: str) -> str:
    if part["type"] == "image_url":
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
    else:
        url = next((part[k] for k in ("image", "path", "url") if isinstance(part.get(k), str)), None)
    if not isinstance(url, str) or not url:
        raise ImageError(f"{where}: an image part needs a path, a file:// URL or a data: URL")
    return url


def _resolve(source: str, base_dir: Path | None) -> str:
    if source.startswith("data:"):
        return source
    if source.startswith(("http://", "https://")):
        return source  # refused when read: nothing is downloaded
    path = Path(source.removeprefix("file://"))
    return str(path if path.is_absolute() or base_dir is None else (base_dir / path))


def llava_turns(record: dict, turns: list[dict], where: str, base_dir: Path | None) -> list[dict]:
    """ShareGPT4V / LLaVA: `<image>` markers in the turns' text and the images in `record["image"]`, in order; images
    without a marker go before the first user turn's text."""
    images = record.get("image") or record.get("images") or []
    images = [images] if isinstance(images, str) else list(images)
    markers = sum(text_of(t["content"]).count(IMAGE_MARKER) for t in turns)
    if markers and markers != len(images):
        raise ImageError(f"{where}: {markers} {IMAGE_MARKER} marker(s) for {len(images)} image(s) in 'image'")
    sources = iter(_resolve(str(image), base_dir) for image in images)
    out, placed = [], False
    for turn in turns:
        content = turn["content"]
        if isinstance(content, str) and IMAGE_MARKER in content:
            pieces = content.split(IMAGE_MARKER)
            parts = [{"type": "text", "text": pieces[0]}] if pieces[0].strip() else []
            for piece in pieces[1:]:
                parts.append({"type": "image", "image": next(sources)})
                if piece.strip():
                    parts.append({"type": "text", "text": piece.lstrip("\n")})
            turn, placed = {**turn, "content": parts}, True
        elif not markers and images and not placed and turn["role"] == "user":
            turn, placed = {**turn, "content": [{"type": "image", "image": s} for s in sources] + (
                [{"type": "text", "text": content}] if isinstance(content, str) and content else [])}, True
        out.append(turn)
    return out


def load_image(source: str, where: str):
    """The image, decoded and checked, as an RGB PIL image; a clear error naming `where` and the source otherwise."""
    from PIL import Image, UnidentifiedImageError
    shown = source if not source.startswith("data:") else f"{source[:30]}... (base64)"
    if source.startswith(("http://", "https://")):
        raise ImageError(f"{where}: image {shown}: remote URLs are not fetched; give a local path or a data: URL")
    try:
        raw = _bytes_of(source)
        with Image.open(io.BytesIO(raw)) as probe:
            probe.verify()  # structure and checksums; the image must be opened again to be used
        image = Image.open(io.BytesIO(raw))
        image.load()
        return image.convert("RGB")
    except FileNotFoundError:
        raise ImageError(f"{where}: image {shown} does not exist") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, binascii.Error) as exc:
        raise ImageError(f"{where}: image {shown} cannot be read ({type(exc).__name__}: {exc})") from None


def _bytes_of(source: str) -> bytes:
    if source.startswith("data:"):
        header, _, payload = source.partition(",")
        if ";base64" not in header:
            raise ValueError("a data: URL must be base64 (data:image/png;base64,...)")
        return base64.b64decode(payload, validate=True)
    return Path(source.removeprefix("file://")).read_bytes()


def image_digest(source: str) -> str:
    """What a store records of one image: its bytes' hash (the same image under two paths is one image)."""
    return hashlib.sha256(_bytes_of(source)).hexdigest()[:16]


def check_images(messages: list[dict], where: str) -> list:
    """Every image of a conversation read and checked, in order (what the processor will be given)."""
    return [load_image(source, where) for source in images_of(messages)]
