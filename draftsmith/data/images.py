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
# per-token inputs a processor may give that mark the image tokens with 1: Gemma 3's token types (its image tokens
# attend to each other both ways), Qwen-VL's multimodal token types (they place the mrope positions)
TOKEN_TYPES = ("token_type_ids", "mm_token_type_ids")


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


def data_url(source: str, where: str) -> str:
    """The image as a `data:image/...;base64,` URL: what every OpenAI-compatible server reads (vLLM reads local
    `file://` paths only under --allowed-local-media-path; a server elsewhere cannot read them at all)."""
    if source.startswith("data:"):
        return source
    from PIL import Image
    load_image(source, where)  # a missing or corrupt image is named here, as everywhere
    raw = _bytes_of(source)
    with Image.open(io.BytesIO(raw)) as probe:
        kind = (probe.format or "png").lower()
    return f"data:image/{kind};base64,{base64.b64encode(raw).decode()}"


def for_server(messages: list[dict], where: str) -> list[dict]:
    """The conversation as an OpenAI chat request carries it: image parts as `image_url` parts with data URLs."""
    return [{**m, "content": [{"type": "image_url", "image_url": {"url": data_url(p["image"], where)}}
                              if p.get("type") == "image" else p for p in m["content"]]}
            if isinstance(m.get("content"), list) else m for m in messages]


def image_digest(source: str) -> str:
    """What a store records of one image: its bytes' hash (the same image under two paths is one image)."""
    return hashlib.sha256(_bytes_of(source)).hexdigest()[:16]


def check_images(messages: list[dict], where: str) -> list:
    """Every image of a conversation read and checked, in order (what the processor will be given)."""
    return [load_image(source, where) for source in images_of(messages)]


def processor_of(tokenizer, where: str):
    """The image-text target's processor that `load_tokenizer` attached; a clear error for a text-only target."""
    processor = getattr(tokenizer, "draftsmith_processor", None)
    if processor is None:
        raise ImageError(f"{where}: the conversation holds images and the target reads text only (no processor)")
    return processor


def expand(tokenizer, text: str, ids: list[int], mask: list[int], sources: list[str], where: str) -> tuple[list[int], list[int]]:
    """The rendered `text` as the target reads it: the processor puts each image's tokens where the template put
    its placeholder. The loss mask of the template's tokens (`ids`, `mask`) carries over to the same tokens of the
    expanded sequence; image tokens are never under it."""
    from difflib import SequenceMatcher
    processor = processor_of(tokenizer, where)
    made = processor(text=[text], images=[load_image(s, where) for s in sources], add_special_tokens=False)
    full = made["input_ids"][0]
    full = list(full.tolist() if hasattr(full, "tolist") else full)
    image_ids = _image_token_ids(processor)
    unsupported = sorted(k for k in made if k not in ("input_ids", "attention_mask", *TOKEN_TYPES)
                         and not k.startswith(("pixel_", "image_")))
    for key in TOKEN_TYPES:
        if key in made and [int(t) for t in made[key][0]] != [int(t in image_ids) for t in full]:
            unsupported.append(f"{key} (other than 1 on the image tokens)")
    if unsupported:
        raise ValueError(f"{where}: {type(processor).__name__} also gives {unsupported}, which the capture and the runtime "
                         "do not carry yet (issue #52); supported: processors that give ids, mask, pixel inputs, and "
                         "token types that mark the image tokens (LLaVA-style, Gemma 3, Qwen-VL)")
    out = [0] * len(full)
    for a, b, size in SequenceMatcher(None, ids, full, autojunk=False).get_matching_blocks():
        out[b:b + size] = mask[a:a + size]
    out = [0 if token in image_ids else m for token, m in zip(full, out)]
    if sum(out) != sum(mask):
        raise ImageError(f"{where}: the processor's expansion of the images changed the assistant tokens "
                         f"({sum(mask)} before, {sum(out)} after)")
    return full, out


def _image_token_ids(processor) -> set[int]:
    """The token the model puts image features on (its config's, `load_processor`), or the processor's own."""
    chosen = getattr(processor, "draftsmith_image_token_id", None)
    if chosen is not None:
        return {chosen}
    return {getattr(processor, name, None) for name in ("image_token_id", "image_token_index")} - {None}


def _probe(processor) -> dict:
    """What the processor gives the model for one image, learned once: the image inputs it keeps (Gemma 3's image
    processor also returns `num_crops`, which its processor drops) and the token types it gives."""
    if not hasattr(processor, "_draftsmith_probe"):
        from PIL import Image
        made = processor(text=[getattr(processor, "image_token", None) or IMAGE_MARKER], images=[Image.new("RGB", (32, 32))])
        processor._draftsmith_probe = {"image_keys": sorted(k for k in made if k not in ("input_ids", "attention_mask", *TOKEN_TYPES)),
                                       "token_types": [k for k in TOKEN_TYPES if k in made]}
    return processor._draftsmith_probe


def on_model(inputs: dict, model) -> dict:
    """Processor outputs on the model's device, floating ones (pixel values) in its dtype."""
    return {k: v.to(model.device, model.dtype if v.is_floating_point() else v.dtype) for k, v in inputs.items()}


def pixel_inputs(tokenizer, rows: list[list[str]], where: str, ids_BT=None, model=None) -> dict:
    """The image inputs of a batch (rows' images in order, as the model scatters them over its image tokens), from the
    target's own image processor, with the token types that mark the image tokens of `ids_BT` where the model reads
    them (on `model`'s device and dtype, given one); empty for a batch without images."""
    sources = [s for row in rows for s in row]
    if not sources:
        return {}
    processor = processor_of(tokenizer, where)
    made = processor.image_processor(images=[load_image(s, where) for s in sources], return_tensors="pt")
    out = {k: made[k] for k in _probe(processor)["image_keys"]}
    for key in _probe(processor)["token_types"] if ids_BT is not None else ():
        out[key] = (ids_BT[..., None] == ids_BT.new_tensor(sorted(_image_token_ids(processor)))).any(-1).long()
    return out if model is None else on_model(out, model)
