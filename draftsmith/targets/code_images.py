"""Images of stdlib source for the image-text demo target (issue #52): the start of a function (its signature and
the first line of its docstring) drawn one token a patch on a grid, and the conversations that ask the target to
write the function the image begins.

One token of the target's own vocabulary a patch keeps reading learnable on a CPU budget: a patch holds one whole
token at one place, so the tower's patch embedding sees each token alone, and writing the function starts by
copying the tokens the image holds (drawn one character a patch, the target must also learn to merge characters
into its tokens, which it did not on this budget). The images travel inside the conversations as PNG data URLs,
so a dataset of them needs no files beside it."""
from __future__ import annotations

import base64
import functools
import hashlib
import io

from draftsmith.recipe import EmbeddedVisionConfig

IMAGE_TOKEN = "<image>"  # LLaVA's placeholder, expanded by the processor into grid x grid image tokens
IMAGE_PROMPT = "Write the function this image begins."


def image_size(cfg: EmbeddedVisionConfig) -> int:
    return cfg.grid * cfg.patch_size


def layout(text: str, cfg: EmbeddedVisionConfig, tokenizer) -> list[int | None]:
    """The token of each grid cell, row by row (None: an empty cell): `text` in the target's tokens, one a cell; a
    token ending a line starts the next row; a full row wraps; what does not fit is cut."""
    cells: list[int | None] = [None] * (cfg.grid * cfg.grid)
    at = 0
    for token in tokenizer(text, add_special_tokens=False)["input_ids"]:
        if at >= len(cells):
            break
        cells[at] = token
        at += 1
        if tokenizer.decode([token]).endswith("\n") and at % cfg.grid:
            at += cfg.grid - at % cfg.grid
    return cells


def _shown(piece: str) -> str:
    """A token's text as drawn: spaces, tabs and newlines as visible marks (" self" and "self" differ)."""
    return piece.replace(" ", "\u00b7").replace("\t", "\u2192").replace("\n", "\u00b6")


@functools.lru_cache(maxsize=64)
def _font(size: int):
    from PIL import ImageFont
    return ImageFont.load_default(size=size)


def render(text: str, cfg: EmbeddedVisionConfig, tokenizer):
    """`text` drawn black on white, one token a grid cell (`layout`), each in the largest font that fits its cell."""
    from PIL import Image, ImageDraw
    size, cell = image_size(cfg), cfg.patch_size
    image = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(image)
    for i, token in enumerate(layout(text, cfg, tokenizer)):
        if token is None:
            continue
        shown, font_size = _shown(tokenizer.decode([token])), cell - 1
        while font_size > 4 and _font(font_size).getlength(shown) > cell - 1:
            font_size -= 1
        font = _font(font_size)
        row, col = divmod(i, cfg.grid)
        draw.text((col * cell + cell // 2, row * cell + cell // 2), shown, fill="black", font=font, anchor="mm")
    return image


def data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def drawn_text(conversation: dict) -> str:
    """What the image of a function conversation shows: the signature, then the docstring's first line."""
    prompt = conversation["messages"][0]["content"]
    fields = dict(line.split(": ", 1) for line in prompt.splitlines()[1:] if ": " in line)
    return f"{fields.get('Signature', '')}\n{fields.get('Docstring', '')}"


def as_image_conversation(conversation: dict, cfg: EmbeddedVisionConfig, tokenizer) -> dict:
    """The same function asked with its start in an image instead of in words."""
    image = data_url(render(drawn_text(conversation), cfg, tokenizer))
    user = [{"type": "image", "image": image}, {"type": "text", "text": IMAGE_PROMPT}]
    return {"id": conversation["id"] + ":image", "messages": [{"role": "user", "content": user}, *conversation["messages"][1:]]}


def is_image_item(conversation_id: str) -> bool:
    """`data.builtin: stdlib-images`: half the functions, fixed by their id, are asked with an image (the same split on every machine)."""
    return int(hashlib.sha256(conversation_id.encode()).hexdigest()[:8], 16) % 2 == 0

